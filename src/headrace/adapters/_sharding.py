"""Splitting one pipeline among the workers of one host (DataLoader workers, Ray tasks).

Two ways, both giving each worker a disjoint part and all workers together
every element exactly once:

``"source"`` shards the pipeline's *sources* (an array's rows, a range, the
list of files an ``interleave`` or ``TFRecordDataset`` reads): each worker
reads and transforms only its own data. Allowed when every stage between the
sources and the output treats elements one at a time or by content (map,
filter, batch, shuffle, prefetch, repeat, interleave, zip, concatenate...),
so that the union over workers is the single-process stream; batches are then
formed per worker (each may end with a partial batch) and the order differs.

``"output"`` keeps the whole pipeline in every worker and lets worker ``i``
deliver elements ``i, i + n, i + 2n, ...``: with PyTorch's round-robin over
workers the result is *exactly* the single-process stream, batch for batch,
but each worker runs the stages below the shard for every element (cheap on a
random-access source, where only indices are skipped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from headrace._rewrite import with_files, with_inputs
from headrace.core.node import Node
from headrace.errors import InvalidArgumentError
from headrace.options import Options
from headrace.sources.files import FileRecordsNode
from headrace.sources.tfrecord import IndexedTFRecordNode
from headrace.transforms.batch import BatchNode
from headrace.transforms.filter import FilterNode
from headrace.transforms.interleave import InterleaveNode
from headrace.transforms.map import MapNode
from headrace.transforms.padded_batch import PaddedBatchNode
from headrace.transforms.prefetch import PrefetchNode
from headrace.transforms.repeat import RepeatNode
from headrace.transforms.shard import ShardNode
from headrace.transforms.shuffle import ShuffleNode
from headrace.transforms.unbatch import RebatchNode, UnbatchNode
from headrace.transforms.zip import ConcatenateNode, ZipNode

if TYPE_CHECKING:
    from headrace.dataset import Dataset

__all__ = ["WorkerSharding", "resolve_sharding", "shard_for_worker", "source_blocker"]

WorkerSharding = Literal["auto", "source", "output"]

#: Stages under which sharding the sources keeps "every element exactly once":
#: they see each element alone (or by content), never by its position in the stream.
_POSITION_FREE: tuple[type[Node], ...] = (
    MapNode,
    FilterNode,
    BatchNode,
    PaddedBatchNode,
    UnbatchNode,
    RebatchNode,
    ShuffleNode,
    PrefetchNode,
    RepeatNode,
    InterleaveNode,
    ZipNode,
    ConcatenateNode,
)


def source_blocker(node: Node) -> Node | None:
    """The first stage that forbids sharding at the sources (take, skip, enumerate...)."""
    if not node.inputs:
        return None
    if not isinstance(node, _POSITION_FREE):
        return node
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
            f"worker_sharding='source': the {blocker.stage!r} stage counts elements by "
            "position, so sharding the sources would change what it does; use "
            "worker_sharding='output'"
        )
    return "output"


def _shard_sources(node: Node, num_shards: int, index: int) -> Node:
    if not node.inputs:
        if isinstance(node, (FileRecordsNode, IndexedTFRecordNode)) and (
            len(node.filenames) >= num_shards
        ):
            return with_files(node, node.filenames[index::num_shards])  # only its own files
        return ShardNode(node, num_shards, index)
    return with_inputs(
        node, tuple(_shard_sources(child, num_shards, index) for child in node.inputs)
    )


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
