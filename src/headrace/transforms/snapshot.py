"""Moved to :mod:`headrace.persist.snapshot`; this name still imports it."""

from headrace.persist.snapshot import SnapshotNode

__all__ = ["SnapshotNode"]
