"""Copies of recipe nodes with other inputs or other files: how sharding rewrites a pipeline.

Shared by :mod:`headrace.distribute` (hosts) and the framework adapters
(DataLoader workers); imports no facade, so either may use it.
"""

from __future__ import annotations

import copy

from headrace.core.node import Node
from headrace.sources.files import FileRecordsNode
from headrace.sources.tfrecord import IndexedTFRecordNode
from headrace.structure import pack_as
from headrace.transforms.zip import ZipNode

__all__ = ["with_files", "with_inputs"]


def with_inputs(node: Node, inputs: tuple[Node, ...]) -> Node:
    """``node`` reading ``inputs`` instead of its own (its fingerprint recomputed)."""
    clone = copy.copy(node)
    clone.__dict__.pop("_fingerprint", None)
    clone.inputs = inputs
    if isinstance(clone, ZipNode):  # zip also keeps its inputs inside the user's nesting
        clone.structure = pack_as(clone.structure, list(inputs))
    return clone


def with_files(node: FileRecordsNode | IndexedTFRecordNode, files: list[str]) -> Node:
    """The same file source over ``files`` only (indexes must already exist)."""
    if isinstance(node, IndexedTFRecordNode):
        return IndexedTFRecordNode(
            files,
            build_missing=False,
            verify_crc=node.verify_crc,
            max_record_bytes=node.max_record_bytes,
        )
    clone = copy.copy(node)
    clone.__dict__.pop("_fingerprint", None)
    clone.filenames = files
    return clone
