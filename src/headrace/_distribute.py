"""Sharding a pipeline across workers and hosts, in the spirit of tf.data's AutoShardPolicy.

``FILE`` sharding splits the *list of files* before anything is read, so a
worker never opens (or even lists records of) another worker's files;
``DATA`` sharding keeps every file and takes every n-th element, the
fallback when there are fewer files than workers. Either way a worker's part
is never made by sharding a zip's inputs apart: sharding only passes stages
whose :meth:`~headrace.core.Node.shard_role` allows it. ``(num_shards, index)``
comes from the environment of the job — torch.distributed's ``WORLD_SIZE`` /
``RANK``, TensorFlow's ``TF_CONFIG``, JAX's process index — or is given.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headrace._errors import InvalidArgumentError
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


def shard_files(node: Node, info: ShardInfo, *, names: bool = False) -> Node:
    """``node`` reading only this worker's files; a clear refusal where that would not
    deliver, over all workers, exactly the unsharded elements with every tuple intact.

    ``names``: ``node`` feeds an interleave, so a list of strings is a list of files.
    """
    files = node.read_files()
    if files is not None:
        _check_enough(len(files), info)
        return node.with_files(files[info.index :: info.num_shards])
    if not node.inputs:
        if names and node.names_files():
            _check_enough(node.cardinality(), info)
            return ShardNode(node, info.num_shards, info.index)
        raise _refusal(
            f"the {node.stage!r} source reads no list of files (FILE shards TFRecordDataset, "
            "TextLineDataset, or list_files(...).interleave(...)), so every worker would "
            "read all of it"
        )
    role = node.shard_role()
    if role is ShardRole.POSITIONAL:
        raise _refusal(
            f"{blocker_text(node)}, so splitting the files below it would change what it "
            "delivers (call auto_shard before that stage)"
        )
    if role is ShardRole.PAIRS:
        roots = aligned_roots(node)
        if not alike(roots):
            raise _refusal(
                f"the {node.stage!r} stage pairs its inputs by position, and they do not "
                "all read the same files the same way through one-to-one stages (map, "
                "prefetch), so splitting their files would pair elements of different "
                "positions"
            )
        return with_roots(node, lambda root: shard_files(root, info, names=names))
    names = names or node.traits().opens_named_files
    return with_inputs(node, tuple(shard_files(child, info, names=names) for child in node.inputs))


def _refusal(reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"cannot apply FILE sharding: {reason}; use policy=AutoShardPolicy.DATA"
    )


def _shard_rows(node: Node, info: ShardInfo) -> Node | None:
    """``node`` with the source below it reading only this worker's rows, where the
    source can filter them itself (``from_sql`` with a key: ``WHERE key % n = i``).

    The rows are split by content, not position, so only stages that see elements
    one at a time or by content may lie between (not take, skip, enumerate...).
    """
    shard_rows = getattr(node, "shard_rows", None)
    if shard_rows is not None and getattr(node, "key", None) is not None:
        sharded: Node = shard_rows(info.num_shards, info.index)
        return sharded
    if len(node.inputs) == 1 and node.shard_role() in (ShardRole.ONE_TO_ONE, ShardRole.BY_CONTENT):
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


def refuse_unseeded(node: Node) -> None:
    """Each worker of a DATA split runs the whole pipeline and keeps every n-th element:
    a random stage without a seed draws another order in each worker's process, so
    together they would repeat some elements and lose others, silently."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current.traits().unseeded:
            raise InvalidArgumentError(
                f"auto_shard(DATA): stage {current.stage!r} has no seed, so each worker "
                "would draw another order and the workers together would repeat some "
                "elements and lose others; give it a seed (the same in every worker), "
                "or shard by FILE")
        pending.extend(current.inputs)


def auto_shard(
    dataset: Dataset,
    policy: AutoShardPolicy | str = AutoShardPolicy.FILE,
    *,
    num_shards: int | None = None,
    index: int | None = None,
) -> Dataset:
    """This worker's share of ``dataset``: all workers together deliver exactly the
    unsharded pipeline's elements, each once and whole (a zip's parts stay paired).

    ``FILE``: the file lists feeding the pipeline (``TFRecordDataset``/
    ``TextLineDataset`` files, or the names an ``interleave`` reads, e.g. from
    ``list_files``) are split round-robin, so each worker opens only its own
    files; an error if there are fewer files than shards. Every source must read
    files, and the stages above them must treat elements one at a time or by
    content (map, filter, shuffle, interleave, concatenate, repeat, batch: each
    worker then batches its own part). Refused, with an error naming the stage:
    a stage counting positions (take, skip, enumerate, or a batch with
    ``drop_remainder=True``, which would drop a partial batch in *every* worker
    and so lose elements the unsharded pipeline delivers: shard before batching),
    and a ``zip`` whose inputs do not read the same files record by record.

    ``DATA``: every ``num_shards``-th element of the output; over a batched
    pipeline, every ``num_shards``-th batch, so the workers together deliver
    exactly the unsharded batches (``drop_remainder`` drops what it drops
    unsharded). A ``from_sql`` source with a ``key`` reads only its rows
    (``WHERE key % n = i``) where no positional stage lies above it. Each worker
    runs the whole pipeline, so every random stage in it needs a seed (the same in
    every worker): one without is refused. With one shard the dataset is returned
    unchanged.
    """
    chosen = AutoShardPolicy(policy.lower() if isinstance(policy, str) else policy)
    info = shard_info(num_shards, index)
    if info.num_shards == 1:
        return dataset
    if chosen is AutoShardPolicy.DATA:
        refuse_unseeded(dataset._node)
        by_key = _shard_rows(dataset._node, info)  # a SQL source: a WHERE on its key
        if by_key is not None:
            return type(dataset)(by_key, dataset.options)
        return dataset.shard(info.num_shards, info.index)
    # type(dataset), not Dataset: this module sits below the facade, which imports it
    return type(dataset)(shard_files(dataset._node, info), dataset.options)
