"""Deprecated: write shards with ``Dataset.save_tfrecords(...)``.

The implementation moved to an internal module; importing this name still works
but warns (:class:`DeprecationWarning`), and will be removed.
"""

import warnings

from headrace._persist.writers import ProgressBar, ProgressSetting, save_tfrecords, shard_paths

warnings.warn(
    "headrace.writers is deprecated and will be removed; use Dataset.save_tfrecords(...) instead",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ProgressBar", "ProgressSetting", "save_tfrecords", "shard_paths"]
