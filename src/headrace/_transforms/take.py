"""``take(count)`` and ``skip(count)`` with tf.data's meaning of negative counts.

Any negative count means "all": ``take(-2)`` takes everything, ``skip(-2)``
skips everything, as in tf.data. On a
random-access input both act on indices, so skipped elements are never read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace._memory.buffer import Buffer, Reservation
from headrace.core.indexing import (
    IndexMap,
    IndexStream,
    Indices,
    MappedIterator,
    RandomAccess,
    Reach,
    Refusal,
    mapped_access,
    mapped_indices,
)
from headrace.core.iterator import Context, Iterator
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits, UnaryNode
from headrace.core.state import INT64_MAX, StateReader

__all__ = ["SkipNode", "TakeNode", "Window"]


def _check_count(name: str, count: Any) -> int:
    """An int count (NumPy integers too); negative ones all mean "all", as in tf.data."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise InvalidArgumentError(f"{name}: count must be an int, got {count!r}")
    return -1 if count < 0 else int(count)


class Window(IndexMap):
    """Input positions ``[start, stop)`` (``stop`` None: to the end): take and skip.

    ``take(n)`` is ``Window(0, n)``, ``skip(k)`` is ``Window(k, None)``, and ``skip``
    of everything is ``Window(0, 0)``: its stream then reads no index at all.
    """

    def __init__(self, start: int, stop: int | None, call: str) -> None:
        super().__init__(call, keeps_from=start)
        self.start, self.stop = start, stop

    def length(self, size: int) -> int:
        low = min(self.start, size)
        high = size if self.stop is None else min(self.stop, size)
        return max(high - low, 0)

    def position(self, indices: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
        return indices + min(self.start, size)

    def want(self, consumed: int, count: int) -> int:
        stop = self.stop
        if consumed < self.start:  # still dropping: those first, then up to count
            dropped = self.start - consumed
            return dropped + (count if stop is None else min(count, stop - self.start))
        if stop is None:
            return count
        left = stop - consumed
        return count if count < left else max(left, 0)

    def select(self, consumed: int, block: Indices) -> Indices:
        # want() never reads past stop: only the dropped head is ever cut
        return block if consumed >= self.start else block[self.start - consumed :]

    def consumed_limit(self) -> int:
        return INT64_MAX if self.stop is None else self.stop

    def old_state(self, reader: StateReader) -> tuple[int | None, int] | None:
        # take(n) and skip of everything wrote what remained to take, skip(k) what
        # remained to skip; past the skip, how many more it read does not matter here
        if "remaining" in reader.state and self.stop is not None:
            count = self.stop - self.start
            return self.stop - reader.integer("remaining", high=count, why=self.call), 0
        if "to_skip" in reader.state and self.stop is None:
            return self.start - reader.integer("to_skip", high=self.start, why=self.call), 0
        return None


def reads_batches(source: Node, ctx: Context) -> bool:
    """Whether ``source``'s iterator makes whole batches itself (a complete cache file
    decoded column by column); see :meth:`headrace._persist.cache.CacheNode.reads_batches`."""
    reads = getattr(source, "reads_batches", None)
    return reads is not None and bool(reads(ctx))


def _window_batches(
    node: TakeNode | SkipNode, ctx: Context, batch_size: int, drop_remainder: bool,
    account: Buffer,
) -> Iterator | None:
    """``cache(f).skip(k).batch(n)``, ``take``: the batches the reader below makes itself,
    through the window (:meth:`MappedIterator.pull_batch`), so a skip or a take between
    a cache and its batch keeps the column-by-column path and its memory: the rows are
    read into the batch, no element is made beside it. None for any other input."""
    if node.index_plan() is not None:
        return None  # (a random-access input is gathered by index instead)
    if node.index_map() is None:  # take(-1): every element, the input's own batches
        return node.inputs[0].batched_iterator(ctx, batch_size, drop_remainder, account)
    if not reads_batches(node.inputs[0], ctx):
        return None
    iterator = node.make_iterator(ctx)
    assert isinstance(iterator, MappedIterator)  # (a stream input: see stream_iterator)
    from headrace._transforms.batch import ColumnarBatchIterator

    return ColumnarBatchIterator(
        iterator, ctx, account, batch_size, drop_remainder, iterator.pull_batch
    )


class TakeNode(UnaryNode):
    stage = "take"

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # counts elements

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return mapped_access(self.index_map(), reach(self.inputs[0]))

    def index_map(self) -> Window | None:
        """Which input positions come (None: all of them)."""
        return None if self.count < 0 else Window(0, self.count, f"take({self.count})")

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, count: int) -> None:
        super().__init__(source)
        self.count = _check_count("take", count)

    def params(self) -> tuple[Any, ...]:
        return (self.count,)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if self.count < 0:
            return inner
        if inner == UNKNOWN:
            return UNKNOWN
        return self.count if inner == INFINITE else min(inner, self.count)

    def wrap_indices(
        self, make_inner: Callable[[Context], IndexStream], ctx: Context
    ) -> IndexStream | None:
        return mapped_indices(self.index_map(), make_inner, ctx)

    def stream_iterator(self, inner: Iterator, ctx: Context) -> Iterator:
        index_map = self.index_map()
        return inner if index_map is None else MappedIterator(inner, index_map)

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator | None:
        return _window_batches(self, ctx, batch_size, drop_remainder, account)

    def reads_batches(self, ctx: Context) -> bool:
        """Whether its input makes whole batches itself (so batches pass through)."""
        return reads_batches(self.inputs[0], ctx)


class SkipNode(UnaryNode):
    stage = "skip"

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # counts elements

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return mapped_access(self.index_map(), reach(self.inputs[0]))

    def index_map(self) -> Window:
        """Which input positions come: all past the first ``count``, or none."""
        if self.count < 0:
            return Window(0, 0, f"skip({self.count})")  # skip everything, read nothing
        return Window(self.count, None, f"skip({self.count})")

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, count: int) -> None:
        super().__init__(source)
        self.count = _check_count("skip", count)

    def params(self) -> tuple[Any, ...]:
        return (self.count,)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if self.count < 0:
            # tf.data's number: INFINITE for an infinite input (its kernel tests check it),
            # though skip(-1) yields nothing there either
            return inner if inner in (INFINITE, UNKNOWN) else 0
        if inner in (INFINITE, UNKNOWN):
            return inner
        return max(inner - self.count, 0)

    def wrap_indices(
        self, make_inner: Callable[[Context], IndexStream], ctx: Context
    ) -> IndexStream | None:
        return mapped_indices(self.index_map(), make_inner, ctx)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.count < 0:
            return _EmptyIterator()  # never read the input, as tf.data
        return super().make_iterator(ctx)

    def stream_iterator(self, inner: Iterator, ctx: Context) -> Iterator:
        return MappedIterator(inner, self.index_map())

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator | None:
        if self.count < 0:
            return None  # (everything skipped: read nothing, as make_iterator)
        return _window_batches(self, ctx, batch_size, drop_remainder, account)

    def reads_batches(self, ctx: Context) -> bool:
        """Whether its input makes whole batches itself (so batches pass through)."""
        return self.count >= 0 and reads_batches(self.inputs[0], ctx)


class _EmptyIterator(Iterator):
    stage = "skip"

    def pull(self) -> tuple[Any, Reservation]:
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        StateReader(state, "skip")  # nothing to restore, but it must be a state
