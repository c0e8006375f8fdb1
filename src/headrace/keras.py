"""Keras 3 helpers: ``MemoryMonitor`` for any ``model.fit``, the dataset adapter, and
``IteratorCheckpoint`` (the input's position saved with the model's checkpoint).

``import headrace.keras`` imports Keras (the ``headrace[keras]`` extra); the
implementation is :mod:`headrace.adapters.keras`. ``to_keras`` is reached as
``Dataset.to_keras()``; ``headrace.keras.to_keras`` still works but is deprecated.
"""

from __future__ import annotations

from headrace._warn import deprecated_attributes
from headrace.adapters.keras import (
    IteratorCheckpoint,
    KerasAdapter,
    MemoryGrowthWarning,
    MemoryMonitor,
    MemoryTrend,
)

__all__ = [
    "IteratorCheckpoint",
    "KerasAdapter",
    "MemoryGrowthWarning",
    "MemoryMonitor",
    "MemoryTrend",
]

__getattr__ = deprecated_attributes(
    __name__, {"to_keras": ("headrace.adapters.keras:to_keras", "Dataset.to_keras()")}
)
