"""Moved to :mod:`headrace.persist.writers`; this name still imports it."""

from headrace.persist.writers import ProgressBar, ProgressSetting, save_tfrecords, shard_paths

__all__ = ["ProgressBar", "ProgressSetting", "save_tfrecords", "shard_paths"]
