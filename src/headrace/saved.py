"""Moved to :mod:`headrace.persist.saved`; this name still imports it."""

from headrace.persist.saved import (
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
