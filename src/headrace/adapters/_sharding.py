"""Splitting one pipeline among the workers of one host (DataLoader workers, Ray tasks).

Two ways, both giving each worker a disjoint part and all workers together
every element exactly once:

``"source"`` shards the pipeline's *sources* (an array's rows, a range, the
list of files an ``interleave`` or ``TFRecordDataset`` reads): each worker
reads and transforms only its own data. Allowed when every stage between the
sources and the output treats elements one at a time or by content (map,
filter, shuffle, prefetch, repeat, interleave, concatenate, batch keeping its
remainder...; each node says so in :meth:`~headrace.core.Node.shard_role`),
so that the union over workers is the single-process stream; batches are then
formed per worker (each may end with a partial batch) and the order differs.
A ``zip`` is sharded as *one* stream, never branch by branch: where its
branches are one stream read twice (``zip(ds, ds.map(f))``, or readers of the
same files) reached through one-to-one stages (map, prefetch), that stream is
sharded once, the same way for every branch; where each branch reaches a
source through such stages, every source is sharded at the same positions;
else the zip's output is. Either way every tuple stays intact. A stage that counts positions (take, skip, enumerate, a batch with
``drop_remainder=True``, which would drop a partial batch in every worker)
forbids it: ``"auto"`` then falls back to ``"output"``, ``"source"`` refuses
naming the stage.

``"output"`` keeps the whole pipeline in every worker and lets worker ``i``
deliver elements ``i, i + n, i + 2n, ...``: with PyTorch's round-robin over
workers the result is *exactly* the single-process stream, batch for batch,
but each worker runs the stages below the shard for every element (cheap on a
random-access source, where only indices are skipped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from headrace._errors import InvalidArgumentError
from headrace._options import Options
from headrace._rewrite import (
    aligned_roots,
    alike,
    blocker_text,
    with_inputs,
    with_roots,
)
from headrace._transforms.shard import ShardNode
from headrace.core.node import Node, ShardRole

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = ["WorkerSharding", "resolve_sharding", "shard_for_worker", "source_blocker"]

WorkerSharding = Literal["auto", "source", "output"]

def source_blocker(node: Node) -> Node | None:
    """The first stage that forbids sharding at the sources (take, skip, enumerate...)."""
    if not node.inputs:
        return None
    role = node.shard_role()
    if role is ShardRole.POSITIONAL:
        return node
    if role is ShardRole.PAIRS:
        return None  # at worst sharded as one stream: nothing below it sees a part
    for child in node.inputs:
        blocker = source_blocker(child)
        if blocker is not None:
            return blocker
    return None


def resolve_sharding(dataset: Dataset, policy: str) -> Literal["source", "output"]:
    """``policy`` made concrete for this pipeline ("auto": source when it is allowed)."""
    if policy not in ("auto", "source", "output"):
        raise InvalidArgumentError(
            f"worker_sharding must be 'auto', 'source' or 'output', got {policy!r}"
        )
    if policy == "output":
        return "output"
    blocker = source_blocker(dataset.node)
    if blocker is None:
        return "source"
    if policy == "source":
        raise InvalidArgumentError(
            f"worker_sharding='source': {blocker_text(blocker)}, so sharding the sources "
            "would change what it delivers; use worker_sharding='output'"
        )
    return "output"


def _shard_sources(node: Node, num_shards: int, index: int) -> Node:
    if not node.inputs:
        files = node.read_files()
        if files is not None and len(files) >= num_shards:
            return node.with_files(files[index::num_shards])  # only its own files
        return ShardNode(node, num_shards, index)
    if node.shard_role() is ShardRole.PAIRS:
        return _shard_pairs(node, num_shards, index)
    return with_inputs(
        node, tuple(_shard_sources(child, num_shards, index) for child in node.inputs)
    )


def _shard_pairs(node: Node, num_shards: int, index: int) -> Node:
    """A zip's part: the same positions of every input, so no element meets another's pair."""
    roots = aligned_roots(node)
    if alike(roots) and source_blocker(roots[0]) is None:  # one stream: the same part of it
        return with_roots(node, lambda root: _shard_sources(root, num_shards, index))
    if all(not root.inputs for root in roots):
        return with_roots(node, lambda source: ShardNode(source, num_shards, index))
    return ShardNode(node, num_shards, index)  # the combined stream, as one


def shard_for_worker(
    dataset: Dataset, policy: str, num_workers: int, worker: int, *, split_budget: bool = True
) -> Dataset:
    """Worker ``worker`` of ``num_workers``'s part of ``dataset``.

    With ``split_budget`` an explicit memory budget is divided among the
    workers, so that all of them together stay within the one the user set.
    """
    if num_workers == 1:
        return dataset
    if resolve_sharding(dataset, policy) == "source":
        part = dataset.derive(_shard_sources(dataset.node, num_workers, worker))
    else:
        part = dataset.shard(num_workers, worker)
    budget = dataset.options.budget_bytes
    if split_budget and budget is not None:
        part = part.with_options(Options(memory_budget=max(budget // num_workers, 1)))
    return part
