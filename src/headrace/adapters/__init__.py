"""Hand a headrace dataset to a training framework: TensorFlow, PyTorch, Keras 3, JAX, Ray.

Each adapter imports its framework only when called, so ``import headrace``
stays free of them; each framework is an optional extra (``headrace[torch]``,
``[keras]``, ``[jax]``, ``[tf]``, ``[ray]``).
"""

from __future__ import annotations

__all__: list[str] = []
