"""Index streams over random-access sources, and the iterators that gather by index.

Transformations that only choose *which* elements come and in what order
(take, skip, shard, repeat, shuffle) act on a stream of indices when their
input is random-access: nothing is read for the elements they drop, shuffle
buffers hold 8-byte indices instead of elements, and resuming is O(1) or an
index-only replay.

Take, skip, shard and repeat each describe how they map positions with one
:class:`IndexMap` (in their own modules); the random access ``global_shuffle``
reads (:class:`MappedAccess`), the run's index stream (:class:`MappedIndices`)
and, over an input without random access, the element stream
(:class:`MappedIterator`) are all derived from it here, by code they share.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from headrace._errors import Origin
from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace.core.iterator import BatchToken, Iterator
from headrace.core.stack import stack_elements
from headrace.core.state import EPOCH, INNER, INT64_MAX, POSITION, StateReader

if TYPE_CHECKING:
    from headrace.core.iterator import Context
    from headrace.core.node import Node

__all__ = [
    "CONSUMED",
    "BatchedAccess",
    "GatherBatchIterator",
    "GatherIterator",
    "IndexMap",
    "IndexPlan",
    "IndexStream",
    "Indices",
    "MappedAccess",
    "MappedIndices",
    "MappedIterator",
    "RandomAccess",
    "Reach",
    "Refusal",
    "SequentialIndices",
    "mapped_access",
    "mapped_indices",
    "reached",
]


Indices = range | np.ndarray  # a block of indices; a range means "consecutive"
"""A block of indices: a ``range`` (consecutive) or an int64 array."""

#: How many input indices an index-only stage's stream has consumed (its state's counter).
CONSUMED = "consumed"


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


class IndexMap:
    """How an index-only stage (take, skip, shard, repeat) maps its positions onto its
    input's: the one description both uses of such a stage derive from.

    :class:`MappedAccess` reads it backwards, for ``global_shuffle`` and the
    adapters: element ``i`` is the input's element ``position(i)``.
    :class:`MappedIndices` reads it forwards, at run time: of the input's next
    indices, which to keep, counting how many it consumed (its whole state);
    :class:`MappedIterator` does the same with the elements of an input without
    random access. A new stage of this kind writes one subclass next to its node
    and nothing here; its uses cannot then disagree about which elements it gives.
    """

    #: Whether the input starts again, as a fresh stream, where it ends (repeat).
    cycles: ClassVar[bool] = False

    def __init__(self, call: str, keeps_from: int = INT64_MAX) -> None:
        #: The stage as the user wrote it (``"take(10)"``), named in checkpoint errors.
        self.call = call
        self.stage = call.partition("(")[0]
        #: From this input position on, the stage keeps every index :meth:`want` reads
        #: (the stream then skips :meth:`select`, per element); INT64_MAX: never.
        self.keeps_from = keeps_from

    def length(self, size: int) -> int:
        """How many elements the stage gives over an input of ``size`` elements."""
        raise NotImplementedError

    def position(self, indices: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
        """The input positions of the stage's elements ``indices`` (each < ``length(size)``)."""
        raise NotImplementedError

    def want(self, consumed: int, count: int) -> int:
        """How many input indices to read, ``consumed`` having been read, for the stage's
        next ``count``: exactly enough where the input has them; 0 once it has ended."""
        raise NotImplementedError

    def select(self, consumed: int, block: Indices) -> Indices:
        """The indices the stage keeps of ``block``, the input's from position ``consumed`` on."""
        raise NotImplementedError

    def another_epoch(self, epoch: int) -> bool:
        """Whether the input starts again after its epoch ``epoch`` ended (it gave something)."""
        return False

    def consumed_limit(self) -> int:
        """The most input indices a checkpoint of this stage can have consumed."""
        return INT64_MAX

    def epoch_limit(self) -> int:
        """The highest epoch a checkpoint of a cycling stage can be in (one past its
        last: it had ended, whatever its input's state says)."""
        return 0

    def old_state(self, reader: StateReader) -> tuple[int | None, int] | None:
        """``(consumed, epoch)`` from a state in the layout this stage's stream wrote
        before the shared one (format version 3), checked; None where it has none.

        ``consumed`` None: the old state says the stage had ended, without a count
        the shared layout can use; it then reads nothing more.
        """
        return None


class MappedAccess(RandomAccess):
    """An index-only stage's random access: element ``i`` is the input's element
    ``index_map.position(i)``."""

    def __init__(self, inner: RandomAccess, index_map: IndexMap) -> None:
        self.inner, self.map = inner, index_map
        self.size = len(inner)
        self.length = index_map.length(self.size)

    def position(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return self.map.position(indices, self.size)

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


def mapped_access(
    index_map: IndexMap | None, inner: RandomAccess | Refusal
) -> RandomAccess | Refusal:
    """An index-only stage's ``element_access`` over its input's (``index_map`` None: the
    stage passes every element through)."""
    if index_map is None or isinstance(inner, Refusal):
        return inner
    return MappedAccess(inner, index_map)


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


def _read_counters(reader: StateReader, index_map: IndexMap) -> tuple[int | None, int]:
    """``(consumed, epoch)`` of an index-only stage's state, in the shared layout or in
    the one its stage wrote before (see :meth:`IndexMap.old_state`)."""
    old = None if CONSUMED in reader.state else index_map.old_state(reader)
    if old is not None:
        return old
    consumed = reader.integer(CONSUMED, high=index_map.consumed_limit(), why=index_map.call)
    if not index_map.cycles:
        return consumed, 0
    return consumed, reader.integer(EPOCH, high=index_map.epoch_limit(), why=index_map.call)


def _nothing_more(consumed: int, count: int) -> int:
    """The ``want`` of a stage that has ended: no more input."""
    return 0


#: How many input indices one read of :class:`MappedIndices` asks for at most while it
#: drops them (a skip of 10**9 over a shuffle's stream: blocks, not one 8 GB array).
_READ_LIMIT = 1 << 16


class MappedIndices(IndexStream):
    """An index-only stage's index stream: of the input stream's indices, those its
    :class:`IndexMap` keeps. Its state is the input's plus how many input indices it
    consumed (and, where the input starts again, in which epoch)."""

    def __init__(self, index_map: IndexMap, make_inner: Callable[[int], IndexStream]) -> None:
        self.map, self.make_inner = index_map, make_inner
        self.want, self.select = index_map.want, index_map.select  # bound once: per element
        self.keeps_from = index_map.keeps_from
        self.epoch = self.consumed = 0
        self.run = 0  # how many of the next input indices are all kept (no want() each)
        self.inner = make_inner(0)

    def take(self, count: int) -> Indices:
        run, start = self.run, self.consumed
        if run < count and start >= self.keeps_from:
            run = self.run = self.want(start, INT64_MAX)
        if run >= count > 0:  # the common case: inside a take, past a skip, a repeat
            block = self.inner.take(count)
            self.consumed = start + len(block)
            if len(block) == count:
                self.run = run - count
                return block
            return self._more(count - len(block), [block])  # fewer: the long way
        self.run = 0
        want = self.want(start, count)
        if 0 < want <= _READ_LIMIT:  # one read gives them all
            block = self.inner.take(want)
            if len(block):
                self.consumed = start + len(block)
                kept = block if start >= self.keeps_from else self.select(start, block)
                if len(kept) == count:
                    return kept
                return self._more(count - len(kept), [kept])
        return self._more(count, [])  # (an empty read: the end, or the next epoch)

    def _more(self, count: int, parts: list[Indices]) -> Indices:
        """``parts`` and up to ``count`` more: across blocks, epochs and the end."""
        self.run = 0
        while count > 0:
            start = self.consumed
            want = self.want(start, count)
            if want <= 0:
                break
            limit = count if count > _READ_LIMIT else _READ_LIMIT
            block = self.inner.take(want if want <= limit else limit)
            if len(block) == 0:
                if start and self.map.another_epoch(self.epoch):
                    self._next_epoch()
                    continue
                break  # the end (an epoch that gave nothing ends a repeat: no spinning)
            self.consumed = start + len(block)
            kept = self.select(start, block)
            if len(kept):
                parts.append(kept)
                count -= len(kept)
        parts = [part for part in parts if len(part)]
        return _concat(parts) if parts else range(0)

    def _next_epoch(self) -> None:
        self.inner.close()
        self.epoch += 1
        self.consumed = self.run = 0
        self.inner = self.make_inner(self.epoch)

    def get_state(self) -> dict[str, Any]:
        state = {INNER: self.inner.get_state(), CONSUMED: self.consumed}
        if self.map.cycles:
            state[EPOCH] = self.epoch
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        index_map = self.map
        reader = StateReader(state, index_map.stage)
        consumed, epoch = _read_counters(reader, index_map)
        inner_state = reader.child(INNER)
        if epoch != self.epoch:  # that epoch's own stream (a shuffle below draws anew)
            self.inner.close()
            self.inner = self.make_inner(epoch)
        self.epoch, self.run = epoch, 0
        self.inner.set_state(inner_state)
        self.consumed = 0 if consumed is None else consumed
        # Past its last epoch (or an old state that said so) it had ended, whatever its
        # input's state: it reads nothing more (and reading that input out could hang).
        ended = consumed is None or (epoch and not index_map.another_epoch(epoch - 1))
        self.want = _nothing_more if ended else index_map.want

    def close(self) -> None:
        self.inner.close()


def mapped_indices(
    index_map: IndexMap | None, make_inner: Callable[[Context], IndexStream], ctx: Context
) -> IndexStream | None:
    """An index-only stage's ``wrap_indices`` (``index_map`` None: it passes every index
    through). Each epoch of a cycling map reads its input in a context of its own."""
    if index_map is None:
        return None
    if index_map.cycles:
        return MappedIndices(index_map, lambda epoch: make_inner(ctx.with_epoch(epoch)))
    return MappedIndices(index_map, lambda epoch: make_inner(ctx))


class MappedIterator(Iterator):
    """An index-only stage over an input without random access: of the input's
    elements, those its (non-cycling) :class:`IndexMap` keeps, read and dropped in
    order. Its state is the input's plus how many elements it consumed, the layout
    of :class:`MappedIndices`. Once the map has ended (a take), the input is closed
    (a generator's ``finally`` runs, files close, as tf.data releases it)."""

    passes_origin = True
    counts_positions = True

    def __init__(self, inner: Iterator, index_map: IndexMap) -> None:
        super().__init__(inner)
        self.inner, self.map = inner, index_map
        self.stage = index_map.stage
        self.want = index_map.want  # bound once: per element
        self.consumed = 0
        self.run = 0  # how many of the next input elements are all kept (no want() each)
        # where the input stood when it was closed at the end (None: still open)
        self.released: dict[str, Any] | None = None

    def pull(self) -> tuple[Any, Reservation]:
        # (no call of self.pull here: a profiler counts each call of it as an element)
        if not self.run and self.consumed >= self.map.keeps_from:
            self.run = self.want(self.consumed, INT64_MAX)
        if self.run > 0:  # the common case: inside a take, past a skip
            pair = self.inner.pull()
            self.run -= 1
            self.consumed += 1
            return pair
        consumed = self.consumed
        # want() is exact: of the next ``want`` input elements only the last is kept
        want = self.want(consumed, 1)
        if want <= 0:
            if self.released is None:
                self.released = self.inner.get_state()
                self.inner.close()
            raise StopIteration
        pull = self.inner.pull
        while want > 1:
            _, reservation = pull()
            self.consumed += 1
            reservation.release()
            want -= 1
        pair = pull()
        self.consumed += 1
        return pair

    def pull_batch(
        self, count: int, account: Any, *, whole: bool = False
    ) -> tuple[Any, Reservation, int] | None:
        """Internal: the next ``count`` kept elements as one batch the input's reader
        makes itself (a cache file's column by column: ``cache(f).skip(k).batch(n)``),
        or None having kept nothing, where the input makes none or the batch would span
        elements this stage drops; the caller then batches element by element. The
        dropped head (a skip) is read and dropped first, as :meth:`pull` does (a
        damaged element there raises in its place). Fewer than ``count`` come only at
        the stage's end, and never under ``whole``."""
        fetch = getattr(self.inner, "pull_batch", None)
        if fetch is None or self.released is not None:
            return None
        if self.consumed < self.map.keeps_from:
            want = self.want(self.consumed, 1)  # of these, only the last is kept
            while want > 1 and self.consumed < self.map.keeps_from:
                try:
                    _, reservation = self.inner.pull()
                except StopIteration:
                    return None  # (the input is shorter: pull() ends the stage)
                self.consumed += 1
                reservation.release()
                want -= 1
            if self.consumed < self.map.keeps_from:
                return None
        # past keeps_from every element want() reads is kept, and fewer than asked
        # means the stage ends after them
        kept = self.want(self.consumed, count)
        if kept <= 0 or (whole and kept < count):
            return None
        found: tuple[Any, Reservation, int] | None = fetch(kept, account, whole=whole)
        if found is not None:
            self.consumed += found[2]
            self.run = 0
        return found

    def get_state(self) -> dict[str, Any]:
        inner = self.released if self.released is not None else self.inner.get_state()
        return {INNER: inner, CONSUMED: self.consumed}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.map.stage)
        consumed, _ = _read_counters(reader, self.map)
        assert consumed is not None  # (only a cycling map's old state has no count)
        self.consumed, self.run = consumed, 0
        self.inner.set_state(reader.child(INNER))  # a closed input reopens as it restores
        self.released = None


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

