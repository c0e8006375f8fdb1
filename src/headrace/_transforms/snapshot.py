"""Moved to :mod:`headrace._persist.snapshot`; this name still imports it."""

from headrace._persist.snapshot import SnapshotNode

__all__ = ["SnapshotNode"]
