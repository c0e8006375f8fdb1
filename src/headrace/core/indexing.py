"""Index streams over random-access sources, and the iterators that gather by index.

Transformations that only choose *which* elements come and in what order
(take, skip, shard, repeat, shuffle) act on a stream of indices when their
input is random-access: nothing is read for the elements they drop, shuffle
buffers hold 8-byte indices instead of elements, and resuming is O(1) or an
index-only replay.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace.core.iterator import BatchToken, Iterator
from headrace.core.stack import stack_elements
from headrace.core.state import EPOCH, INNER, POSITION, PRODUCED, StateReader
from headrace.errors import Origin
from headrace.memory.buffer import NO_RESERVATION, Reservation

if TYPE_CHECKING:
    from headrace.core.iterator import Context
    from headrace.core.node import Node

__all__ = [
    "BatchedAccess",
    "GatherBatchIterator",
    "GatherIterator",
    "IndexPlan",
    "IndexStream",
    "Indices",
    "OffsetAccess",
    "RandomAccess",
    "Reach",
    "Refusal",
    "ReindexedAccess",
    "RepeatIndices",
    "RepeatedAccess",
    "SequentialIndices",
    "ShardIndices",
    "SkipIndices",
    "StridedAccess",
    "TakeIndices",
    "reached",
]


Indices = range | np.ndarray  # a block of indices; a range means "consecutive"
"""A block of indices: a ``range`` (consecutive) or an int64 array."""


class RandomAccess:
    """Element ``i`` of a dataset, fetched directly.

    ``get_many`` returns the *batched* element for a block of indices; the
    default stacks ``get`` results, sources override it with one gather.
    """

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, index: int) -> Any:
        raise NotImplementedError

    def get_many(self, indices: Indices) -> Any:
        return stack_elements([self.get(int(i)) for i in indices], stage="batch")

    def gathers_batches(self) -> bool:
        """Whether :meth:`get_many` makes a batch without holding its rows first.

        True for sources that slice or gather (a batch costs only itself). The
        default ``get_many`` gets every row, then stacks them — a batch of
        inputs plus its output, allocated before the budget could see it — so
        ``batch`` assembles such rows in place instead, booked first.
        """
        return type(self).get_many is not RandomAccess.get_many

    def origin(self, index: int) -> Origin | None:
        """Where element ``index`` comes from (file, record, byte offset), or None where
        this access cannot say; asked only when a user function failed on it."""
        return None

    def prepare(self, ctx: Context) -> None:
        """Called once per run: register pre-existing memory with the context."""

    def close(self) -> None:
        """Release what the run opened (files), when the iterator closes."""


class Refusal:
    """Why a pipeline is not addressable by ``global_shuffle``: the stage that is not.

    What :meth:`~headrace.core.node.Node.element_access` answers where a stage
    has no element ``i`` (it depends on other elements, or never ends).
    """

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


#: How a stage asks for its inputs' element access (recursively, through their stages).
Reach = Callable[["Node"], "RandomAccess | Refusal"]


def reached(reach: Reach, inputs: tuple[Node, ...]) -> list[RandomAccess] | Refusal:
    """Every input's element access, or the first input's refusal."""
    accesses = []
    for child in inputs:
        part = reach(child)
        if isinstance(part, Refusal):
            return part
        accesses.append(part)
    return accesses


class ReindexedAccess(RandomAccess):
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


class OffsetAccess(ReindexedAccess):
    """``take`` (offset 0, shorter) and ``skip`` (offset ``count``)."""

    def __init__(self, inner: RandomAccess, offset: int, length: int) -> None:
        super().__init__(inner, length)
        self.offset = offset

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return indices + self.offset


class StridedAccess(ReindexedAccess):
    """``shard(num_shards, index)``: positions ``index, index + num_shards, ...``."""

    def __init__(self, inner: RandomAccess, num_shards: int, index: int) -> None:
        size = len(inner)
        super().__init__(inner, size // num_shards + (index < size % num_shards))
        self.num_shards, self.index = num_shards, index

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return indices * self.num_shards + self.index


class RepeatedAccess(ReindexedAccess):
    """A finite ``repeat(count)``: position ``i % len(input)``."""

    def __init__(self, inner: RandomAccess, count: int) -> None:
        self.period = len(inner)
        super().__init__(inner, self.period * count)

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return indices % self.period


class BatchedAccess(RandomAccess):
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


class IndexStream:
    """A resumable stream of indices into a :class:`RandomAccess` (iterator side)."""

    def next_index(self) -> int:
        """The next index; ``StopIteration`` at the end."""
        block = self.take(1)
        if len(block) == 0:
            raise StopIteration
        return int(block[0])

    def take(self, count: int) -> Indices:
        """Up to ``count`` next indices (fewer only at the end, empty when done)."""
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release any budget the stream's own buffers hold."""


#: (random access, factory of a fresh index stream for one run)
IndexPlan = tuple[RandomAccess, Callable[["Context"], IndexStream]]


class SequentialIndices(IndexStream):
    """0, 1, ..., size-1."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.position = 0

    def next_index(self) -> int:
        position = self.position
        if position >= self.size:
            raise StopIteration
        self.position = position + 1
        return position

    def take(self, count: int) -> Indices:
        start = self.position
        stop = start + count
        if stop > self.size:  # the last block (no min/max calls on the per-batch path)
            stop = max(self.size, start)
        self.position = stop
        return range(start, stop)

    def get_state(self) -> dict[str, Any]:
        return {POSITION: self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position = StateReader(state, "source").integer(
            POSITION, high=self.size, why=f"the source has {self.size} elements"
        )


def _concat(blocks: list[Indices]) -> Indices:
    if len(blocks) == 1:
        return blocks[0]
    if all(isinstance(block, range) for block in blocks):
        first, last = blocks[0], blocks[-1]
        assert isinstance(first, range) and isinstance(last, range)
        if all(
            isinstance(a, range) and isinstance(b, range) and a.stop == b.start
            for a, b in itertools.pairwise(blocks)
        ):
            return range(first.start, last.stop)
    return np.concatenate([np.asarray(block, dtype=np.int64) for block in blocks])


def take_all(stream: IndexStream, count: int) -> Indices:
    """Pull ``count`` indices from ``stream`` even across its internal blocks."""
    first = stream.take(count)
    if len(first) == count:  # the common case: one block was enough (no list, no concat)
        return first
    if len(first) == 0:
        return range(0)
    blocks: list[Indices] = [first]
    needed = count - len(first)
    while needed > 0:
        block = stream.take(needed)
        if len(block) == 0:
            break
        blocks.append(block)
        needed -= len(block)
    return _concat(blocks)


class _CountingIndices(IndexStream):
    """An index stream over another, plus one counter: what take/skip/shard keep.

    The counter only counts down from its start (take, skip); a restored one
    must lie between 0 and that start. ``limit`` None: it counts up, unbounded.
    """

    counter = "count"
    stage = "index"

    def __init__(self, inner: IndexStream, value: int) -> None:
        self.inner, self.value = inner, value
        self.limit: int | None = value

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), self.counter: self.value}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.value = (
            reader.integer(self.counter)
            if self.limit is None
            else reader.integer(self.counter, high=self.limit, why=f"{self.stage}({self.limit})")
        )
        self.inner.set_state(reader.child(INNER))

    def close(self) -> None:
        self.inner.close()


class TakeIndices(_CountingIndices):
    """The first ``count`` indices of the inner stream."""

    counter = "remaining"
    stage = "take"

    def take(self, count: int) -> Indices:
        block = self.inner.take(min(count, self.value))
        self.value -= len(block)
        return block


class SkipIndices(_CountingIndices):
    """The inner stream without its first ``count`` indices (read nothing for them)."""

    counter = "to_skip"
    stage = "skip"

    def take(self, count: int) -> Indices:
        while self.value:
            skipped = self.inner.take(min(self.value, 1 << 16))
            if len(skipped) == 0:
                self.value = 0
                break
            self.value -= len(skipped)
        return self.inner.take(count)


class ShardIndices(_CountingIndices):
    """Every ``num_shards``-th index starting at ``index`` (tf.data's ``shard``)."""

    counter = "seen"  # indices consumed from the inner stream
    stage = "shard"

    def __init__(self, inner: IndexStream, num_shards: int, index: int) -> None:
        super().__init__(inner, 0)
        self.limit = None
        self.num_shards, self.index = num_shards, index

    def take(self, count: int) -> Indices:
        block = take_all(self.inner, count * self.num_shards)
        offset = (self.index - self.value) % self.num_shards
        self.value += len(block)
        return block[offset :: self.num_shards]


class RepeatIndices(IndexStream):
    """The inner stream again and again (a fresh inner stream per epoch)."""

    def __init__(self, make_inner: Callable[[int], IndexStream], count: int) -> None:
        self.make_inner, self.count = make_inner, count  # count < 0: forever
        self.initial_count = count
        self.epoch = 0
        self.inner = make_inner(0)
        self.produced_this_epoch = 0

    def take(self, count: int) -> Indices:
        while self.count < 0 or self.epoch < self.count:
            block = self.inner.take(count)
            if len(block):
                self.produced_this_epoch += len(block)
                return block
            if self.produced_this_epoch == 0:  # an empty epoch: end, do not spin
                self.epoch = self.count if self.count >= 0 else 0
                self.count = 0
                break
            self._next_epoch()
        return range(0)

    def _next_epoch(self) -> None:
        self.inner.close()
        self.epoch += 1
        self.produced_this_epoch = 0
        self.inner = self.make_inner(self.epoch)

    def get_state(self) -> dict[str, Any]:
        return {
            EPOCH: self.epoch,
            "count": self.count,
            PRODUCED: self.produced_this_epoch,
            INNER: self.inner.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, "repeat")
        count = self.initial_count
        # an empty input ends the repetition by setting count to 0
        saved_count = reader.integer("count", low=-1, high=max(count, 0))
        if saved_count not in (count, 0):
            raise reader.error("count", f"= {saved_count}, but this repeat has count={count}")
        epoch = (
            reader.integer(EPOCH)
            if saved_count < 0
            else reader.integer(EPOCH, high=max(count, 0), why=f"repeat({count})")
        )
        produced = reader.integer(PRODUCED)
        inner_state = reader.child(INNER)
        self.inner.close()
        self.count, self.epoch, self.produced_this_epoch = saved_count, epoch, produced
        self.inner = self.make_inner(self.epoch)
        self.inner.set_state(inner_state)

    def close(self) -> None:
        self.inner.close()


class _Gather(Iterator):
    """Reads a random-access source at the positions an index stream gives: the stream
    is the whole state, and closing closes both."""

    def __init__(self, access: RandomAccess, stream: IndexStream) -> None:
        super().__init__()
        self.access, self.stream = access, stream

    def get_state(self) -> dict[str, Any]:
        return {"indices": self.stream.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.set_state(StateReader(state, self.stage).child("indices"))

    def close(self) -> None:
        self.stream.close()
        self.access.close()


class GatherIterator(_Gather):
    """Elements of a random-access source, in the order of an index stream."""

    stage = "gather"

    def __init__(self, access: RandomAccess, stream: IndexStream) -> None:
        super().__init__(access, stream)
        self.get = access.get
        self.next_index = stream.next_index
        self.last = -1  # the index of the element returned last (for its origin)

    def pull(self) -> tuple[Any, Reservation]:
        index = self.last = self.next_index()
        return self.get(index), NO_RESERVATION

    def origin(self) -> Origin | None:
        return self.origin_of(self.last)

    def origin_token(self) -> int:
        return self.last

    def origin_of(self, token: Any) -> Origin | None:
        return None if token < 0 else self.access.origin(token)


class GatherBatchIterator(_Gather):
    """Batches of a random-access source: one slice or one gather per batch, no per-row work."""

    stage = "batch"

    def __init__(
        self, access: RandomAccess, stream: IndexStream, batch_size: int, drop_remainder: bool
    ) -> None:
        super().__init__(access, stream)
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self.get_many = access.get_many  # bound once: this runs per batch
        self.last: Any = ()  # the indices of the batch returned last (for its origin)

    def pull(self) -> tuple[Any, Reservation]:
        indices = self.last = take_all(self.stream, self.batch_size)
        count = len(indices)
        if count < self.batch_size and (count == 0 or self.drop_remainder):
            raise StopIteration
        return self.get_many(indices), NO_RESERVATION

    def origin(self) -> Origin | None:
        return self.origin_of(self.origin_token())

    def origin_token(self) -> BatchToken:
        return BatchToken(self._origin_at, self.last)

    def origin_of(self, token: Any) -> Origin | None:
        return token.origin() if isinstance(token, BatchToken) else None

    def _origin_at(self, index: Any) -> Origin | None:
        return self.access.origin(int(index))

