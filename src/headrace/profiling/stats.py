"""Frozen snapshots of a run (:class:`RunStats`); defined in :mod:`headrace.core.stats`,
since ``DatasetIterator.stats()`` returns one and core imports nothing above it."""

from __future__ import annotations

from headrace.core.stats import RunStats

__all__ = ["RunStats"]
