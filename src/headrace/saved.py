"""Deprecated: save and load with ``Dataset.save(path)`` and ``Dataset.load(path)``.

The implementation moved to an internal module; importing this name still works
but warns (:class:`DeprecationWarning`), and will be removed.
"""

import warnings

from headrace._persist.saved import (
    MANIFEST_NAME,
    PROGRESS_NAME,
    DecodeRecord,
    LoadNode,
    SavedEmpty,
    ShardsAsDatasets,
    SpecCheck,
    load_plan,
    save,
)

warnings.warn(
    "headrace.saved is deprecated and will be removed; use Dataset.save(path) and "
    "Dataset.load(path) instead",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "MANIFEST_NAME",
    "PROGRESS_NAME",
    "DecodeRecord",
    "LoadNode",
    "SavedEmpty",
    "ShardsAsDatasets",
    "SpecCheck",
    "load_plan",
    "save",
]
