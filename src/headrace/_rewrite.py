"""Copies of recipe nodes with other inputs or other files: how sharding rewrites a pipeline.

Shared by :mod:`headrace._distribute` (hosts) and the framework adapters
(DataLoader workers); imports no facade, so either may use it.
"""

from __future__ import annotations

from collections.abc import Callable

from headrace.core.node import Node, ShardRole

__all__ = [
    "aligned_roots",
    "alike",
    "blocker_text",
    "is_file_source",
    "with_inputs",
    "with_roots",
]


def with_inputs(node: Node, inputs: tuple[Node, ...]) -> Node:
    """``node`` reading ``inputs`` instead of its own (see :meth:`Node.with_inputs`)."""
    return node.with_inputs(inputs)


def is_file_source(node: Node) -> bool:
    """Whether ``node`` reads records from a list of files it holds (shardable by file)."""
    return node.read_files() is not None


def aligned_roots(node: Node) -> list[Node]:
    """Where ``node``'s positions stop being its inputs' positions: the stages feeding it
    through one-to-one stages (map, prefetch) and zips, or sources.

    Below a zip, element ``k`` is made of element ``k`` of every input; through
    one-to-one stages and nested zips that is element ``k`` of each root. Sharding
    every root at the same positions therefore shards the zip at those positions
    with every tuple intact, and so does sharding *alike* roots the same way
    (see :func:`alike`).
    """
    if node.inputs and node.shard_role() in (ShardRole.ONE_TO_ONE, ShardRole.PAIRS):
        return [root for child in node.inputs for root in aligned_roots(child)]
    return [node]


def alike(roots: list[Node]) -> bool:
    """Whether ``roots`` give the same stream, so that one way of sharding them keeps it so.

    The same node (``zip(ds, ds.map(f))``), or file readers of the same kind with the
    same arguments over the same files (a text reader and a TFRecord reader of one
    file do not agree on what record ``k`` is): the same fingerprint. Other equal
    fingerprints are not enough, as a fingerprint does not see every input's content.
    """
    first = roots[0]
    if all(root is first for root in roots):
        return True
    return all(is_file_source(r) and r.fingerprint() == first.fingerprint() for r in roots)


def with_roots(node: Node, rewrite: Callable[[Node], Node]) -> Node:
    """``node`` with every one of its :func:`aligned_roots` replaced by ``rewrite(root)``."""
    if node.inputs and node.shard_role() in (ShardRole.ONE_TO_ONE, ShardRole.PAIRS):
        return with_inputs(node, tuple(with_roots(child, rewrite) for child in node.inputs))
    return rewrite(node)


def blocker_text(node: Node) -> str:
    """Why sharding cannot go below ``node`` (a POSITIONAL stage), for an error message."""
    text = f"the {node.stage!r} stage counts elements by position"
    if getattr(node, "drop_remainder", False):
        text += " (drop_remainder=True: every worker would drop a partial batch of its own part)"
    return text
