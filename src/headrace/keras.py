"""Keras 3 helpers: ``MemoryMonitor`` for any ``model.fit``, and the dataset adapter.

``import headrace.keras`` imports Keras (the ``headrace[keras]`` extra); the
implementation is :mod:`headrace.adapters.keras`.
"""

from __future__ import annotations

from headrace.adapters.keras import (
    KerasAdapter,
    MemoryGrowthWarning,
    MemoryMonitor,
    MemoryTrend,
    to_keras,
)

__all__ = ["KerasAdapter", "MemoryGrowthWarning", "MemoryMonitor", "MemoryTrend", "to_keras"]
