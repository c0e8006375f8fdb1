"""Sharding a pipeline across workers and hosts, in the spirit of tf.data's AutoShardPolicy.

``FILE`` sharding splits the *list of files* before anything is read, so a
worker never opens (or even lists records of) another worker's files;
``DATA`` sharding keeps every file and takes every n-th element, the
fallback when there are fewer files than workers. ``(num_shards, index)``
comes from the environment of the job — torch.distributed's ``WORLD_SIZE`` /
``RANK``, TensorFlow's ``TF_CONFIG``, JAX's process index — or is given.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from headrace._rewrite import with_files, with_inputs
from headrace.core.node import Node
from headrace.dataset import Dataset
from headrace.errors import InvalidArgumentError
from headrace.sources.arrays import TensorSlicesNode
from headrace.sources.files import FileRecordsNode
from headrace.sources.tfrecord import IndexedTFRecordNode
from headrace.transforms.interleave import InterleaveNode
from headrace.transforms.shard import ShardNode
from headrace.transforms.shuffle import ShuffleNode

__all__ = ["AutoShardPolicy", "ShardInfo", "auto_shard", "shard_info"]


class AutoShardPolicy(enum.Enum):
    """How :func:`auto_shard` splits a pipeline among workers."""

    FILE = "file"
    DATA = "data"


@dataclass(frozen=True)
class ShardInfo:
    """This worker's place in the job: ``index`` of ``num_shards``, and where that came from."""

    num_shards: int
    index: int
    source: str


def _from_tf_config(raw: str) -> ShardInfo:
    config = json.loads(raw)
    cluster, task = config.get("cluster", {}), config.get("task", {})
    chiefs = len(cluster.get("chief", []))
    workers = len(cluster.get("worker", []))
    kind, number = task.get("type"), int(task.get("index", 0))
    if kind not in ("chief", "worker"):
        raise InvalidArgumentError(
            f"TF_CONFIG: task type {kind!r} does not read input (expected chief or worker)"
        )
    index = number if kind == "chief" else chiefs + number
    return ShardInfo(chiefs + workers, index, "TF_CONFIG")


def shard_info(num_shards: int | None = None, index: int | None = None) -> ShardInfo:
    """Which shard this process should read.

    Given arguments win; otherwise, in order: ``WORLD_SIZE``/``RANK`` (set by
    torchrun and torch.distributed launchers), ``TF_CONFIG`` (chief and
    workers count, chief first), JAX's ``process_count()``/``process_index()``
    when JAX is already imported; otherwise a single shard.
    """
    if (num_shards is None) != (index is None):
        raise InvalidArgumentError("give both num_shards and index, or neither")
    if num_shards is not None and index is not None:
        info = ShardInfo(num_shards, index, "given")
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        info = ShardInfo(
            int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), "WORLD_SIZE/RANK"
        )
    elif os.environ.get("TF_CONFIG"):
        info = _from_tf_config(os.environ["TF_CONFIG"])
    elif "jax" in sys.modules:
        jax: Any = sys.modules["jax"]
        info = ShardInfo(int(jax.process_count()), int(jax.process_index()), "jax")
    else:
        info = ShardInfo(1, 0, "single process")
    if info.num_shards < 1 or not 0 <= info.index < info.num_shards:
        raise InvalidArgumentError(
            f"invalid shard {info.index} of {info.num_shards} (from {info.source})"
        )
    return info


def _shard_files(node: Node, info: ShardInfo) -> Node | None:
    """``node`` with its file list sharded, or None if no file list is found below it."""
    if isinstance(node, (FileRecordsNode, IndexedTFRecordNode)):
        _check_enough(len(node.filenames), info)
        return with_files(node, node.filenames[info.index :: info.num_shards])
    if isinstance(node, InterleaveNode):
        file_list = _file_list_below(node.inputs[0], info)
        if file_list is not None:
            return with_inputs(node, (file_list,))
    for position, child in enumerate(node.inputs):
        sharded = _shard_files(child, info)
        if sharded is not None:
            inputs = list(node.inputs)
            inputs[position] = sharded
            return with_inputs(node, tuple(inputs))
    return None


def _file_list_below(node: Node, info: ShardInfo) -> Node | None:
    """Shard the list of names an interleave reads (before any shuffle of the list)."""
    if isinstance(node, ShuffleNode):
        inner = _file_list_below(node.inputs[0], info)
        return None if inner is None else with_inputs(node, (inner,))
    if isinstance(node, TensorSlicesNode) and len(node.leaves) == 1:
        leaf = node.leaves[0]
        if leaf.dtype == object and all(isinstance(name, (str, bytes)) for name in leaf[:8]):
            _check_enough(node.length, info)
            return ShardNode(node, info.num_shards, info.index)
    return None


def _shard_rows(node: Node, info: ShardInfo) -> Node | None:
    """``node`` with the source below it reading only this worker's rows, where the
    source can filter them itself (``from_sql`` with a key: ``WHERE key % n = i``)."""
    shard_rows = getattr(node, "shard_rows", None)
    if shard_rows is not None and getattr(node, "key", None) is not None:
        sharded: Node = shard_rows(info.num_shards, info.index)
        return sharded
    if len(node.inputs) == 1:
        inner = _shard_rows(node.inputs[0], info)
        return None if inner is None else with_inputs(node, (inner,))
    return None


def _check_enough(files: int, info: ShardInfo) -> None:
    if files < info.num_shards:
        raise InvalidArgumentError(
            f"cannot apply FILE sharding: the dataset has only {files} file(s), fewer than "
            f"the {info.num_shards} shards; use policy=AutoShardPolicy.DATA, or write the "
            "data into at least as many files as workers"
        )


def auto_shard(
    dataset: Dataset,
    policy: AutoShardPolicy | str = AutoShardPolicy.FILE,
    *,
    num_shards: int | None = None,
    index: int | None = None,
) -> Dataset:
    """This worker's share of ``dataset``.

    ``FILE``: the file list feeding the pipeline (``TFRecordDataset``/
    ``TextLineDataset`` files, or the names an ``interleave`` reads, e.g. from
    ``list_files``) is split round-robin, so each worker opens only its own
    files; an error if there are fewer files than shards. ``DATA``: every
    ``num_shards``-th element of the output. With one shard the dataset is
    returned unchanged.
    """
    chosen = AutoShardPolicy(policy.lower() if isinstance(policy, str) else policy)
    info = shard_info(num_shards, index)
    if info.num_shards == 1:
        return dataset
    if chosen is AutoShardPolicy.DATA:
        by_key = _shard_rows(dataset._node, info)  # a SQL source: a WHERE on its key
        if by_key is not None:
            return Dataset(by_key, dataset.options)
        return dataset.shard(info.num_shards, info.index)
    sharded = _shard_files(dataset._node, info)
    if sharded is None:
        raise InvalidArgumentError(
            "cannot apply FILE sharding: no list of files found in this pipeline "
            "(TFRecordDataset, TextLineDataset, or list_files(...).interleave(...)); "
            "use policy=AutoShardPolicy.DATA"
        )
    return Dataset(sharded, dataset.options)
