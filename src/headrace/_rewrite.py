"""Copies of recipe nodes with other inputs or other files: how sharding rewrites a pipeline.

Shared by :mod:`headrace.distribute` (hosts) and the framework adapters
(DataLoader workers); imports no facade, so either may use it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeGuard

from headrace.core.node import Node, ShardRole
from headrace.sources.files import FileRecordsNode
from headrace.sources.tfrecord import IndexedTFRecordNode
from headrace.structure import pack_as
from headrace.transforms.zip import ZipNode

__all__ = [
    "aligned_sources",
    "blocker_text",
    "is_file_source",
    "same_files",
    "with_files",
    "with_inputs",
    "with_sources",
]


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


def is_file_source(node: Node) -> TypeGuard[FileRecordsNode | IndexedTFRecordNode]:
    """Whether ``node`` reads records from a list of files it holds (shardable by file)."""
    return isinstance(node, (FileRecordsNode, IndexedTFRecordNode))


def aligned_sources(node: Node) -> list[Node] | None:
    """The sources whose positions are ``node``'s positions, or None if some are not.

    Below a zip, element ``k`` is made of element ``k`` of every input; through
    one-to-one stages (map, prefetch) and nested zips that is element ``k`` of
    every source. Sharding each of those sources at the same positions (or by
    the same files, where they read the same files the same way) then shards
    the zip at those positions, with every tuple intact. Any other stage on the
    way (filter, repeat, shuffle, batch...) moves positions: then None.
    """
    if not node.inputs:
        return [node]
    if node.shard_role() not in (ShardRole.ONE_TO_ONE, ShardRole.PAIRS):
        return None
    sources: list[Node] = []
    for child in node.inputs:
        below = aligned_sources(child)
        if below is None:
            return None
        sources.extend(below)
    return sources


def same_files(sources: list[Node]) -> list[str] | None:
    """The file list every one of ``sources`` reads, record for record the same way, or None.

    Two file sources are read alike only if they are the same kind of reader with
    the same arguments (a text reader and a TFRecord reader over one file do not
    agree on what record ``k`` is): the same fingerprint.
    """
    first = sources[0]
    if not is_file_source(first):
        return None
    if not all(is_file_source(s) and s.fingerprint() == first.fingerprint() for s in sources):
        return None
    return list(first.filenames)


def with_sources(node: Node, rewrite: Callable[[Node], Node]) -> Node:
    """``node`` with every source below it replaced by ``rewrite(source)``."""
    if not node.inputs:
        return rewrite(node)
    return with_inputs(node, tuple(with_sources(child, rewrite) for child in node.inputs))


def blocker_text(node: Node) -> str:
    """Why sharding cannot go below ``node`` (a POSITIONAL stage), for an error message."""
    text = f"the {node.stage!r} stage counts elements by position"
    if getattr(node, "drop_remainder", False):
        text += " (drop_remainder=True: every worker would drop a partial batch of its own part)"
    return text
