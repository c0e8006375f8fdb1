"""Element ``i`` of a pipeline, for ``global_shuffle``: what tf.data calls random access.

``Node.random_access`` answers for the stages that *are* addressable as they
run (sources, per-element maps, zip, concatenate, enumerate). ``global_shuffle``
reaches further, as tf.data 2.21's does: it addresses through stages that only
choose or regroup elements by position — ``take``, ``skip``, ``shard``, a
finite ``repeat``, ``batch(drop_remainder=True)`` — and through stages that
change nothing but timing — ``prefetch``, ``cache``, a parallel ``map`` (each
element is computed when it is fetched), and an inner ``global_shuffle`` (a
uniformly random permutation composed with any other is again uniformly
random, so the inner one is skipped). Those stages run as they always do
anywhere else; only ``global_shuffle`` reads through them.

Stages whose elements depend on other elements (filter, shuffle, interleave,
unbatch, padded_batch, ...), an infinite ``repeat`` and ``batch`` keeping a
partial last batch are refused, as tf.data refuses them, with the stage named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from headrace.core.indexing import Indices, RandomAccess
from headrace.core.node import Node
from headrace.errors import Origin
from headrace.persist.cache import CacheNode
from headrace.transforms.batch import BatchNode
from headrace.transforms.enumerate import EnumerateNode, _EnumeratedAccess
from headrace.transforms.map import MapNode, _MappedAccess
from headrace.transforms.prefetch import PrefetchNode
from headrace.transforms.repeat import RepeatNode
from headrace.transforms.shard import ShardNode
from headrace.transforms.take import SkipNode, TakeNode
from headrace.transforms.zip import ConcatenateNode, ZipNode, _ConcatAccess, _ZipAccess

if TYPE_CHECKING:
    from headrace.core.iterator import Context

__all__ = ["Refusal", "element_access"]


class Refusal:
    """Why a pipeline is not addressable: the first stage (from the source) that is not."""

    def __init__(self, node: Node, why: str = "") -> None:
        self.stage, self.why = node.stage, why

    def message(self) -> str:
        why = f" ({self.why})" if self.why else ""
        return (
            f"global_shuffle needs random access to every element of its input, through "
            f"every stage before it; {self.stage} does not support random access{why}. tf.data refuses "
            "it too. Stages that do: sources with random access (from_tensor_slices, "
            "from_tensors, range, from_npy, TFRecordDataset(..., indexed=True)), map, zip, "
            "concatenate, enumerate, take, skip, shard, repeat(count >= 0), "
            "batch(drop_remainder=True), prefetch, cache. Apply global_shuffle before "
            f"{self.stage}, or use shuffle(buffer_size) after it."
        )


class _Reindexed(RandomAccess):
    """Element ``i`` is element ``position(i)`` of the input."""

    def __init__(self, inner: RandomAccess, length: int) -> None:
        self.inner, self.length = inner, length

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.length

    def get(self, index: int) -> Any:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self.inner.get(int(self.position(np.asarray([index], dtype=np.int64))[0]))

    def get_many(self, indices: Indices) -> Any:
        return self.inner.get_many(self.position(np.asarray(indices, dtype=np.int64)))

    def origin(self, index: int) -> Origin | None:
        return self.inner.origin(int(self.position(np.asarray([index], dtype=np.int64))[0]))

    def gathers_batches(self) -> bool:
        return self.inner.gathers_batches()

    def prepare(self, ctx: Context) -> None:
        self.inner.prepare(ctx)

    def close(self) -> None:
        self.inner.close()


class _Offset(_Reindexed):
    """``take`` (offset 0, shorter) and ``skip`` (offset ``count``)."""

    def __init__(self, inner: RandomAccess, offset: int, length: int) -> None:
        super().__init__(inner, length)
        self.offset = offset

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return indices + self.offset


class _Strided(_Reindexed):
    """``shard(num_shards, index)``: positions ``index, index + num_shards, ...``."""

    def __init__(self, inner: RandomAccess, num_shards: int, index: int) -> None:
        size = len(inner)
        super().__init__(inner, size // num_shards + (index < size % num_shards))
        self.num_shards, self.index = num_shards, index

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return indices * self.num_shards + self.index


class _Repeated(_Reindexed):
    """A finite ``repeat(count)``: position ``i % len(input)``."""

    def __init__(self, inner: RandomAccess, count: int) -> None:
        self.period = len(inner)
        super().__init__(inner, self.period * count)

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return indices % self.period


class _Batched(RandomAccess):
    """``batch(size, drop_remainder=True)``: element ``i`` is rows ``[i*size, (i+1)*size)``."""

    def __init__(self, inner: RandomAccess, size: int) -> None:
        self.inner, self.size = inner, size

    def __len__(self) -> int:
        return len(self.inner) // self.size

    def get(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.inner.get_many(range(index * self.size, (index + 1) * self.size))

    def prepare(self, ctx: Context) -> None:
        self.inner.prepare(ctx)

    def close(self) -> None:
        self.inner.close()


def element_access(node: Node, transparent: tuple[type[Node], ...] = ()) -> RandomAccess | Refusal:
    """Random access to ``node``'s elements in their order, or why there is none.

    ``transparent``: further node classes read straight through (``global_shuffle``
    passes its own class: this module cannot import it without an import cycle).
    """
    if isinstance(node, (PrefetchNode, CacheNode, *transparent)):
        return element_access(node.inputs[0], transparent)
    if isinstance(node, (ZipNode, ConcatenateNode, EnumerateNode, MapNode)):
        parts = [element_access(child, transparent) for child in node.inputs]
        for part in parts:
            if isinstance(part, Refusal):
                return part
        accesses = [part for part in parts if isinstance(part, RandomAccess)]
        if isinstance(node, ZipNode):
            return _ZipAccess(node.structure, accesses)
        if isinstance(node, ConcatenateNode):
            return _ConcatAccess(*accesses)
        if isinstance(node, EnumerateNode):
            return _EnumeratedAccess(accesses[0], node.start)
        return _MappedAccess(accesses[0], node.fn, node.stage)
    chooses = (TakeNode, SkipNode, ShardNode, RepeatNode, BatchNode)
    if not isinstance(node, chooses):
        direct = node.random_access()
        return Refusal(node) if direct is None else direct
    if isinstance(node, RepeatNode) and node.count < 0:
        return Refusal(node, "an infinite repeat has no element i to shuffle to")
    if isinstance(node, BatchNode) and not node.drop_remainder:
        return Refusal(node, "only with drop_remainder=True: a partial last batch")
    inner = element_access(node.inputs[0], transparent)
    if isinstance(inner, Refusal):
        return inner
    size = len(inner)
    if isinstance(node, TakeNode):
        return _Offset(inner, 0, size if node.count < 0 else min(size, node.count))
    if isinstance(node, SkipNode):
        skipped = size if node.count < 0 else min(size, node.count)
        return _Offset(inner, skipped, size - skipped)
    if isinstance(node, ShardNode):
        return _Strided(inner, node.num_shards, node.index)
    if isinstance(node, RepeatNode):
        return _Repeated(inner, node.count)
    assert isinstance(node, BatchNode)
    return _Batched(inner, node.batch_size)
