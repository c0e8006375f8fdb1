"""Keras 3 helpers: ``MemoryMonitor`` for any ``model.fit``, the dataset adapter, and
``IteratorCheckpoint`` (the input's position saved with the model's checkpoint).

``import headrace.keras`` imports Keras (the ``headrace[keras]`` extra); the
implementation is :mod:`headrace.adapters.keras`.
"""

from __future__ import annotations

from headrace.adapters.keras import (
    IteratorCheckpoint,
    KerasAdapter,
    MemoryGrowthWarning,
    MemoryMonitor,
    MemoryTrend,
    to_keras,
)

__all__ = [
    "IteratorCheckpoint",
    "KerasAdapter",
    "MemoryGrowthWarning",
    "MemoryMonitor",
    "MemoryTrend",
    "to_keras",
]
