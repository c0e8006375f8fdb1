"""``interleave(..., workers="processes")``: each slot's inner pipeline runs in a worker process.

Why: headrace's readers and parsers hold the GIL (a Python-heavy inner
pipeline does too), so threads read shards on one core. Here the slots of an
interleave run in ``num_parallel_calls`` worker processes (a
:class:`~headrace._workers.processes.ProcessPool`: forkserver/spawn, the
function pickled once per worker, results through pooled shared memory,
errors with their worker's traceback, a killed worker a
:class:`~headrace._errors.WorkerError` within a second).

How a slot reads. The consumer's slot is a :class:`RemoteSlotIterator`, bound
to one worker for its life (the worker with the fewest slots when it opened).
It asks that worker for *chunks* of its inner pipeline: the first request
carries the input element, the inner iterator's state before the chunk (None:
from the start) and how many elements to skip after restoring it; the worker
answers with up to :data:`CHUNK_ELEMENTS` elements (no more than
:data:`CHUNK_BYTES`, nor a share of the slot's budget, in bytes), the inner
state after them, and the error that ended the chunk, if any (a slot's first
chunk is one element: the cycle waits for a new slot, so it comes back fast). Up to
:data:`READ_AHEAD` further requests are queued behind it before its answer is
in: such a *follow* request names only the chunk's position (which restore of
the slot, which chunk since), and the worker, which serves its requests in
order, continues the iterator it kept standing exactly there. So a worker
never waits for the consumer to ask again, and a file boundary in one slot
does not idle the workers of the others. A worker keeps the iterators of the
slots it serves; a request that finds none at its position (evicted, or the
slot was restored) rebuilds the inner pipeline from the state it carries — a
follow request carries none, so it answers *lost*, and the consumer asks again
with the state it has by then: correct either way, only slower. When a
slot's last chunk is in, the interleave opens the next input's slot ahead of
its turn on the same worker (see :class:`ProcessInterleaveIterator`).

Data. A chunk's elements come back through the worker's pooled shared-memory
segments (see :mod:`headrace._workers.shm`): arrays as views of the segment,
object arrays of ``bytes`` (a batch's ids or records) as one column each, so
nothing crosses per record; a chunk of parsed batches costs the consumer one
message, one unpickling and one booking.

Order, errors, state. The order is the sequential interleave's (tf.data's)
whatever the timing: a slot's chunks are handed out in order, and the cycle
visits slots exactly as :mod:`headrace._transforms.interleave` does
(``deterministic=False`` does not change that here). An error of an inner
pipeline is raised at its element's place, with the worker's traceback as its
``__cause__``; the next pull goes on with the same slot, as with threads. A
slot's state is the inner state before its current chunk plus how many of
that chunk's elements were handed out: small, JSON-able, exact (G4). An inner
dataset that cannot be built (the interleave function raises in the worker, on
the slot's first request) is raised as the sequential interleave raises a failed
open: the slot is dropped without taking a visit of the cycle.

Memory. A slot's part of the stage's share is split in two halves. Each
inner pipeline runs in its worker under a budget of the first half, so its own
buffers are capped there. The slot's chunks in flight are sized to the other
half (see :class:`RemoteSlotIterator`): the two never hold the same bytes
twice, and chunks are asked for ahead only while the first half stays free on the
slot's account (the worker's half is its own budget, not booked here). Chunks are
booked on the slot's account in this process — each chunk asked for at its
largest size from the request on (its byte cap, or the largest element the slots
have received where elements are larger: a chunk holds one element at least), the
chunk being handed out at its elements'
sizes plus the part of its segment that no element views (alignment, the
bytes columns' buffers, the unused end of a reused segment), shared equally.
Result segments the consumer is done with wait for reuse booked on the
stage's account (or are dropped when it has no room). A chunk is bounded by
bytes as well as elements: the worker packs each element into shared memory as
it reads it (so it holds one at a time), and stops before an element that, at the
largest size it has read, would pass what the consumer booked for the chunk. A
chunk booked below that size is not read at all (the slot asks again, booked at
it) unless the slot waits for it; then, or when an element is larger than any
before, a chunk holds one element beyond its booking. An element that no slot
could ever hold (past the pipeline's whole budget divided among the slots) is
dropped in the worker before it is copied out, and its slot raises :class:`~headrace._errors.MemoryBudgetError` in its
place. The workers' own memory
is reported by ``stats().workers`` and counted by the measured bound (see
:mod:`headrace._workers.memory`).
"""

from __future__ import annotations

import contextlib
import copy
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from headrace._errors import MemoryBudgetError, add_note
from headrace._memory.allocator import tune_allocator
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.system import live_runs
from headrace._memory.units import format_bytes
from headrace._options import AUTOTUNE, Options
from headrace._sources.files import file_limiter
from headrace._transforms._interleave_cycle import CycleIterator, Slot, SlotNotBuilt
from headrace._workers.processes import ProcessPool, portable, unsendable
from headrace.core.handoff import drop_frames
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node
from headrace.core.state import StateReader
from headrace.io.filepool import FileLimiter, get_default_pool, opening_under

if TYPE_CHECKING:
    from headrace._transforms.interleave import InterleaveNode

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_ELEMENTS",
    "READ_AHEAD",
    "BuildFailed",
    "ElementTooLarge",
    "ProcessInterleaveIterator",
    "RemoteSlotIterator",
    "SlotReader",
    "kept_iterators",
    "slot_pool",
]

#: Elements a worker reads for a slot per request (fewer when they pass the byte cap).
CHUNK_ELEMENTS = 64
#: Bytes a chunk stops at (besides a share of the slot's budget): large enough that a
#: chunk's message and booking are a small part of its cost, small enough that chunks
#: flow (the consumer starts on one while the next is read) and stay in cache.
CHUNK_BYTES = 1 << 20
#: Requests a slot keeps queued at its worker beyond the one it waits for.
READ_AHEAD = 2
#: Iterators a worker keeps for slots it may be asked to continue (at least; a pool
#: keeps as many as the interleave has slots).
_KEPT_ITERATORS = 8


class ElementTooLarge(Exception):
    """An element no slot can ever hold, left in the worker (see :class:`SlotReader`).

    The consumer turns it into the :class:`MemoryBudgetError` its slot would raise.
    """

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


class BuildFailed(Exception):
    """The interleave function raised building a slot's inner dataset in the worker
    (``error``, ``text``: its traceback there). The consumer raises it as the
    sequential interleave raises a failed open (see :class:`SlotNotBuilt`)."""

    def __init__(self, error: Exception, text: str) -> None:
        super().__init__(error, text)
        self.error, self.text = error, text


class SlotReader:
    """The worker's handler: a request for a slot's next chunk -> the chunk.

    A request is ``(token, position, element, state, skip, max_elements, max_bytes,
    iteration, epochs, follow, forced)``. The chunk's elements are packed one by one
    as they are read (``emit``), so the worker holds one at a time; then the answer
    ``(count, state_after, ended, error, lost, largest)``, where ``count`` is how
    many elements came before it, ``error`` is ``(exception, traceback text)`` or
    None and ``largest`` the largest element this worker has read. ``position``
    names the chunk asked for (the slot's restores so far, its chunks asked for
    since). A ``follow`` request was sent before the previous chunk's answer: it
    carries no state, and when no iterator stands at its position the answer is
    ``lost`` (nothing read; the consumer asks again with the state).

    ``max_bytes`` is what the consumer booked for the chunk (its allowance). The
    chunk stops before an element that, at ``largest``, would pass it, so only an
    element larger than any before passes it, by that element at most. A request
    booked below ``largest`` is answered ``lost`` without reading, unless it is
    ``forced`` (the consumer waits for it): asked ahead before sizes jumped, each
    would otherwise hold one large element past its booking. An
    element larger than ``ceiling`` can never enter a slot: it is dropped here,
    before it is copied into shared memory, and the chunk ends with
    :class:`ElementTooLarge` in its place.
    """

    def __init__(
        self,
        node: Node,
        options: Options,
        share: int,
        keep: int = _KEPT_ITERATORS,
        ceiling: int | None = None,
        max_open_files: int | None = None,
    ) -> None:
        self.node, self.options, self.share, self.keep = node, options, share, keep
        self.ceiling = ceiling
        # token -> the slot's iterator, its budget, the position of the chunk it reads next
        self.kept: OrderedDict[int, tuple[Iterator, MemoryBudget, Any]] = OrderedDict()
        #: This worker's part of the pipeline's descriptor cap, shared by every slot it
        #: reads (each slot's own Context would give each slot the whole cap).
        self.max_open_files = max_open_files
        self._files: FileLimiter | None = None
        #: The largest element this worker has read for any slot (the slots of one
        #: interleave read the same kind of shards): what the next one may be.
        self.largest = 0

    def __getstate__(self) -> dict[str, Any]:
        # Only the interleave function travels: the recipe upstream of the interleave is
        # read in the consumer's process, and need not pickle (a from_generator of a local
        # generator cannot).
        bare = copy.copy(self.node)
        bare.inputs = ()
        return {
            "node": bare, "options": self.options, "share": self.share, "keep": self.keep,
            "ceiling": self.ceiling, "max_open_files": self.max_open_files,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["node"], state["options"], state["share"], state["keep"], state["ceiling"],
            state["max_open_files"],
        )

    def _iterator(self, request: tuple[Any, ...]) -> Iterator | None:
        token, position, element, state, skip, _, _, iteration, epochs, follow, _ = request
        kept = self.kept.get(token)
        if kept is not None and kept[2] == position:  # it stands exactly there
            self.kept.move_to_end(token)
            return kept[0]
        if follow:  # no state to rebuild from (and nothing to undo): the consumer asks again
            return None
        if kept is not None:  # stale (the slot was restored, or moved on elsewhere)
            self._close(self.kept.pop(token))
        iterator, budget = self._build(element, iteration, epochs)
        self.kept[token] = (iterator, budget, position)
        while len(self.kept) > self.keep:
            self._close(self.kept.popitem(last=False)[1])
        if state is not None:
            iterator.set_state(state)
        for _ in range(skip):
            with contextlib.suppress(Exception):  # an error in its place counts as handed out
                iterator.pull()[1].release()  # (kept, its booking would fill the budget)
        return iterator

    def _build(self, element: Any, iteration: Any, epochs: Any
               ) -> tuple[Iterator, MemoryBudget]:
        """A new inner pipeline for ``element`` under a budget of its own (the slot's
        share), its opens counted against the worker's file cap; BuildFailed carries
        the error of one that cannot open to the consumer."""
        budget = MemoryBudget(self.share)
        if self.options.tune_allocator:  # (the worker's heap is trimmed as a pipeline's is)
            tune_allocator()
        live_runs.start(budget)
        ctx = Context(self.options, budget, iteration)
        ctx.epochs = tuple(epochs)
        if self.max_open_files is not None:
            if self._files is None:
                self._files = get_default_pool().limiter(self.max_open_files)
            ctx.run.file_limiter = self._files
        try:
            with opening_under(file_limiter(ctx)):  # (its opens count against the cap: G2)
                iterator: Iterator = self.node.inner_node(element).make_iterator(ctx)  # type: ignore[attr-defined]
        except Exception as raised:  # the slot's open failed: the consumer says so in its turn
            live_runs.stop(budget)
            budget.close()
            text = traceback.format_exc()
            raise BuildFailed(cast(Exception, portable(drop_frames(raised))), text) from None
        budget.allot()
        return iterator, budget

    @staticmethod
    def _close(kept: tuple[Iterator, MemoryBudget, Any]) -> None:
        try:
            kept[0].close()
        finally:
            live_runs.stop(kept[1])
            kept[1].close()

    #: Called as ``reader(request, emit)``: each element is packed by ``emit`` as it is
    #: read (see :func:`headrace._workers.processes._run_streaming`).
    streams = True

    def __call__(  # noqa: C901
        self, request: tuple[Any, ...], emit: Callable[[Any, int], Any]
    ) -> tuple[int, Any, bool, Any, bool, int]:
        from headrace._memory.sizeof import sizeof

        max_elements, max_bytes, forced = request[5], request[6], request[10]
        if not forced and self.largest > max_bytes:
            # Its booking cannot hold one element like the largest this worker has read:
            # nothing is read, and the consumer asks again booked at that size (or, when
            # it waits for this chunk, forced). Otherwise each chunk asked for ahead
            # before a jump in sizes held one large element past its booking.
            return 0, None, False, None, True, self.largest
        try:
            iterator = self._iterator(request)
        except BuildFailed as failed:
            return 0, None, True, (failed, ""), False, self.largest
        if iterator is None:
            return 0, None, False, None, True, self.largest
        token, (restores, chunks) = request[0], request[1]
        count = held = 0
        ended, error = False, None
        ceiling = self.ceiling
        # Stop before an element that, at the largest size read so far, would pass the
        # chunk's booking: a chunk passes it only by an element larger than any before.
        while count < max_elements and (not count or held + self.largest <= max_bytes):
            try:
                element, reservation = iterator.pull()
            except StopIteration:
                ended = True
                break
            except Exception as raised:  # ends the chunk; raised in the consumer in its place
                # the text first: the frames go (they would hold this slot's elements until
                # the chunk is sent); portable: the consumer must be able to unpickle it
                text = traceback.format_exc()
                error = (portable(drop_frames(raised)), text)
                break
            reservation.release()  # it leaves this process's pipeline with the chunk
            size = sizeof(element)
            if ceiling is not None and size > ceiling:  # never copied out: refused in place
                del element  # (nor the size of the next: it never enters a slot)
                error = (ElementTooLarge(size), "")
                break
            if size > self.largest:
                self.largest = size
            try:
                emit(element, max_elements - count)
            except Exception as refused:  # it cannot be sent: its error in its place
                del element
                error = unsendable(refused)
                break
            del element
            count += 1
            held += size
        state = None if ended else iterator.get_state()
        if ended:
            self._close(self.kept.pop(token))
        else:  # where it stands now: the slot's next chunk
            kept = self.kept[token]
            self.kept[token] = (kept[0], kept[1], (restores, chunks + 1))
        return count, state, ended, error, False, self.largest


def kept_iterators(node: Node) -> int:
    """How many slots' iterators a worker keeps: every slot of the interleave (a slot
    always reads on the same worker), at least :data:`_KEPT_ITERATORS`."""
    return max(_KEPT_ITERATORS, int(getattr(node, "cycle_length", 0) or 0))


def slot_pool(
    node: Node,
    options: Options,
    share: int,
    count: int,
    stage: str,
    account: Buffer,
    ceiling: int | None = None,
    files: FileLimiter | None = None,
) -> ProcessPool:
    """The worker processes that read an interleave's slots.

    Result segments the consumer is done with go back to their worker for the next
    chunks (a fresh segment per chunk cost its pages' first touch on both sides,
    more than the copy into it), each booked on the stage's ``account`` while it
    waits; when the account has no room the segment is dropped instead.
    ``ceiling``: elements past it are refused in the worker (see :class:`SlotReader`).
    ``files``: the pipeline's cap on descriptors, which the workers' pipes count against.
    """
    cap = options.max_open_files  # split between the workers: each reads under its part
    reader = SlotReader(node, options, share, kept_iterators(node), ceiling,
                        None if cap is None else max(1, cap // count))

    def book_idle(nbytes: int) -> Reservation | None:
        return account.admit(nbytes) if account.room() >= nbytes else None

    # A slot's chunks in circulation: READ_AHEAD + 1 asked for, the one being handed out,
    # and the one whose last element the consumer still holds. Keeping fewer idle made a
    # fresh segment for ~40% of benchmark 2's chunks (3.9 -> 4.5 M records/s with these).
    slots = -(-int(getattr(node, "cycle_length", 1) or 1) // count)
    return ProcessPool(
        reader, count, stage, what="the interleave function", book_idle=book_idle,
        idle_segments=(READ_AHEAD + 3) * slots, files=files,
    )


_tokens = iter(range(1, 1 << 62))


class Largest:
    """The largest element (bytes, as booked) that an interleave's slots have received:
    what a chunk asked for from now on will hold at least, shared by the slots (a new
    slot reads the same kind of shards)."""

    __slots__ = ("nbytes",)

    def __init__(self) -> None:
        self.nbytes = 0


class RemoteSlotIterator(Iterator):
    """A slot whose inner pipeline runs in a worker: chunks in, elements out, in order."""

    stage = "interleave slot"

    def __init__(
        self,
        pool: ProcessPool,
        element: Any,
        ctx: Context,
        account: Buffer,
        share: int,
        stage: str,
        *,
        prefer: int | None = None,
        worker_share: int = 0,
        largest: Largest | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.pool, self.element, self.ctx, self.account = pool, element, ctx, account
        self.index = index  # of the input element (named when its dataset cannot be built)
        # The inner pipeline holds up to ``worker_share`` in its worker: this slot's
        # chunks in flight get the rest of its part. Its account is the whole part, so
        # that half is kept free on it when chunks are asked for ahead (see _room_for).
        self.inner_reserve = min(worker_share, share // 2)
        self.worker_share = worker_share
        share -= self.inner_reserve
        #: Called with this slot's worker when its last chunk has come in (the interleave
        #: opens the next input's slot ahead then).
        self.on_ended: Callable[[int | None], None] | None = None
        # a chunk asked for, one handed out and READ_AHEAD queued fit the slot's share
        self.max_bytes = max(min(share // (READ_AHEAD + 2), CHUNK_BYTES), 1)
        self.largest = Largest() if largest is None else largest
        self.stage = stage
        self.token = next(_tokens)
        self.worker: int | None = pool.assign(prefer)  # every chunk of this slot is read there
        self.ready: deque[tuple[Any, Reservation]] = deque()
        self.error: BaseException | None = None  # raised after the ready elements
        self.ended = False
        # the inner state before the chunk being handed out, and how many of it are out
        self.state_before: dict[str, Any] | None = None
        self.handed = 0
        self.next_state: dict[str, Any] | None = None  # where the next chunk starts
        self.next_skip = 0
        self.restores = 0  # set_state calls: a chunk's position is (restores, chunks)
        self.chunks = 0  # chunks received since the last restore
        self.asked = 0  # chunks asked for since the last restore
        self.pending: deque[tuple[Future[Any], Reservation]] = deque()

    # -- requests ---------------------------------------------------------------------------
    def chunk_bytes(self) -> int:
        """What a chunk asked for now is booked at, and may hold before the worker stops
        it: :attr:`max_bytes`, or the largest element so far where elements are larger.

        The worker stops a chunk once its elements reach this, so a chunk holds one
        element past it at most. Booked at ``max_bytes`` alone, each chunk of elements
        larger than it held an element's bytes unbooked (inner batches of 2 MiB:
        1 MiB booked per chunk, 2 MiB held, in every chunk asked for ahead)."""
        return max(self.max_bytes, self.largest.nbytes)

    def _room_for(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` may be asked for ahead: it fits the slot's
        account beside what the slot holds and the part its inner pipeline may hold in
        the worker (not booked here: it is the worker's own budget). Without that, the
        chunks took the whole part and the worker its half again (1.5 parts a slot)."""
        return self.account.fits(nbytes, pending=self.inner_reserve)

    def _request(self, *, forced: bool = False) -> bool:
        """Ask for the next chunk (booked at its largest); False when there is no room.

        ``forced``: the consumer waits for this chunk (nothing of the slot is ready or
        in flight). Without room it is still asked for, one element booked as an
        overdraft, which holds back read-ahead until it drains.
        """
        follow = bool(self.pending)  # sent before the answer it continues
        nbytes = self.chunk_bytes()
        # A slot's first chunk is one element: the cycle waits for a new slot, so its
        # first answer should be quick; the follow requests behind it read full chunks.
        elements = 1 if self.asked == 0 else CHUNK_ELEMENTS
        if self._room_for(nbytes):
            booking = self.account.admit(nbytes)
        elif forced:
            booking, elements = self.account.overdraw(nbytes), 1
        else:
            return False  # no room to read ahead: the next chunk is asked for on demand
        request = (
            self.token, (self.restores, self.asked), self.element,
            None if follow else self.next_state, 0 if follow else self.next_skip,
            elements, nbytes, self.ctx.run.iteration, list(self.ctx.epochs), follow, forced,
        )
        try:
            future = self.pool.submit([request], worker=self.worker)
        except BaseException:
            booking.release()
            raise
        self.pending.append((future, booking))
        self.asked += 1
        return True

    def _receive(self) -> None:  # noqa: C901
        """The next chunk (asked for now if none is in flight): into ``ready``."""
        while True:
            if not self.pending:
                self._request(forced=True)
                self._top_up()  # queued behind it before its answer is in
            future, booking = self.pending.popleft()
            try:
                outputs, failed, _, slack = future.result()
            finally:
                booking.release()
            if failed:
                # The reply could not travel (an element that cannot be pickled), or the
                # request killed two workers (see ProcessPool._replace): asked again, it
                # would fail again, so the rest of this slot is given up, in its place.
                self._cancel_pending()
                self.ended = True
                error = failed[0]
                add_note(error, "headrace: the rest of this interleave slot's inner "
                                "pipeline is skipped")
                if self.on_ended is not None:
                    self.on_ended(self.worker)
                raise error
            *elements, (count, state_after, ended, error, lost, largest) = outputs
            assert len(elements) == count, "a chunk's elements come back before its answer"
            if largest > self.largest.nbytes:  # the next chunks are booked at it
                self.largest.nbytes = largest
            if not lost:
                break
            # its worker kept no iterator at that position, or it was booked below the
            # largest element read so far: ask again, with the state
            self._cancel_pending()
        self.state_before, self.handed = self.next_state, self.next_skip
        self.next_state, self.next_skip = state_after, 0
        self.chunks += 1
        self.ended = ended
        if ended:  # what was queued behind it reads nothing
            self._cancel_pending()
        admit = self.ctx.admit
        sizes, kept = [], []
        # the segment's bytes no element views ride on the elements in equal parts
        part, extra = divmod(slack, len(elements)) if elements else (0, 0)
        for element in elements:
            element, size = admit(element)
            kept.append(element)
            sizes.append(size + part + extra)
            extra = 0
        if sizes:
            self.largest.nbytes = max(self.largest.nbytes, *sizes)
        for element, reservation in zip(kept, self.account.admit_existing(sizes), strict=True):
            self.ready.append((element, reservation))
        if error is not None:
            raised, text = error
            if isinstance(raised, ElementTooLarge):
                self.error = self._refusal(raised.nbytes)
            elif isinstance(raised, BuildFailed):  # its inner dataset could not be built
                built = raised.error
                # the user's chain is kept (as on threads); the worker's traceback is a note
                add_note(built, f"headrace: raised building {self.stage}'s inner dataset, in "
                                f"a worker process; its traceback there:\n{raised.text}")
                fresh = self.restores == 0 and self.chunks == 1
                # a new slot: no visit of the cycle taken (the sequential open failed);
                # a restored one raises it in its place, and ends
                self.error = SlotNotBuilt(built, self.index) if fresh else built
            else:
                # the user's chain is kept (as on threads); the worker's traceback is a note
                add_note(raised, f"headrace: raised in {self.stage}'s inner pipeline, in a "
                                 f"worker process; its traceback there:\n{text}")
                if isinstance(raised, MemoryBudgetError):  # (it names the worker's budget)
                    add_note(raised, self._worker_budget_note())
                self.error = raised
        self._top_up()  # the worker reads the next chunks while this one is handed out
        if ended and self.on_ended is not None:
            self.on_ended(self.worker)

    def _worker_budget_note(self) -> str:
        return (
            "headrace: the budget above is a worker's: a process interleave reads each inner "
            f"dataset in a worker process under {format_bytes(self.worker_share)}, half of "
            "one slot's part of the interleave's share of the pipeline's budget. Raise "
            "Options(memory_budget=...) or lower cycle_length."
        )

    def _refusal(self, nbytes: int) -> MemoryBudgetError:
        """The error this slot's buffer gives an element of ``nbytes`` (one that no
        slot can hold: the worker refused it before copying it out)."""
        try:
            self.account.fits(nbytes)
        except MemoryBudgetError as error:
            error.__traceback__ = None
            return error
        return MemoryBudgetError(  # (the ceiling makes the buffer refuse it: not reached)
            f"stage {self.stage!r}: an element of {format_bytes(nbytes)}, more than the "
            "pipeline's memory budget can hold in each slot of the interleave"
        )

    def start(self) -> None:
        """Ask for the first chunks now, as far as the budget has room (a slot opened
        ahead of its turn: nothing is booked past the share for it)."""
        if (self.pending or self.ready or self.ended
                or not self._room_for(self.chunk_bytes())):
            return
        with contextlib.suppress(Exception):  # asked again on demand, raising there
            self._request()
        self._top_up()

    def _top_up(self) -> None:
        """Queue follow requests up to :data:`READ_AHEAD` (as the budget allows). One
        that fails here (a broken pool) is made again on demand, after the elements
        already received, and raises there in its place."""
        with contextlib.suppress(Exception):
            while not self.ended and len(self.pending) <= READ_AHEAD and self._request():
                pass

    def pull(self) -> tuple[Any, Reservation]:
        if not self.ready and self.error is None:
            if self.ended:
                raise StopIteration
            self._receive()
        if self.ready:
            self.handed += 1
            return self.ready.popleft()
        if self.error is not None:
            error, self.error = self.error, None
            self.handed += 1
            raise error
        raise StopIteration

    # -- state ----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        if self.ended and not self.ready and self.error is None:
            return {"state": None, "skip": 0, "ended": True}
        return {"state": self.state_before, "skip": self.handed, "ended": False}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        saved = reader.optional_child("state") if "state" in state else None
        skip = reader.integer("skip")
        ended = reader.flag("ended")
        self._drop()
        self.state_before, self.handed = saved, skip
        self.next_state, self.next_skip = saved, skip
        self.restores, self.chunks, self.asked = self.restores + 1, 0, 0
        self.ended = ended

    def _cancel_pending(self) -> None:
        """Forget the requests in flight (their answers, if any, are dropped unread)."""
        while self.pending:
            future, booking = self.pending.popleft()
            future.cancel()
            booking.release()
        self.asked = self.chunks

    def _drop(self) -> None:
        while self.ready:
            self.ready.popleft()[1].release()
        self.error = None
        self._cancel_pending()

    def close(self) -> None:
        self._drop()
        if self.worker is not None:
            self.pool.unassign(self.worker)
            self.worker = None
        super().close()


class ProcessInterleaveIterator(CycleIterator):
    """workers="processes": the same order and state, slots in worker processes.

    Always in order (``deterministic=False`` changes nothing here). A slot whose
    last chunk has come in opens the next input element's slot *ahead* of its
    turn, on the same worker. So the new slot's first chunks are read while the
    ending slot hands out the rest of its own. Otherwise every file boundary
    would stall the cycle for a chunk's read (tf.data's parallel interleave
    prefetches input elements too). Slots opened ahead enter the cycle in input
    order, exactly where the sequential interleave would open them. Until then
    the state names the input from before them, so a checkpoint reopens them,
    and an error opening one is raised in its turn.
    """

    def __init__(
        self, node: InterleaveNode, inner: Iterator, ctx: Context, account: Buffer
    ) -> None:
        self.processes: ProcessPool | None = None  # started with the first slot
        #: The workers' own memory, booked when they start (see process_map.book_workers).
        self.workers_booking: Reservation = NO_RESERVATION
        self.worker_share = 0  # each inner pipeline's budget in its worker
        self.largest = Largest()  # the slots' largest element so far (chunks are booked at it)
        super().__init__(node, inner, ctx, account)

    def _reset(self) -> None:
        super()._reset()
        self.worker_hint: int | None = None
        self.opening_index: int | None = None  # of the element open_ahead opens

    def _open_slot(self, element: Any, input_before: dict[str, Any], *, start: bool) -> Slot:
        """A slot whose inner pipeline runs in a worker process."""
        node = self.node
        part = self.parts.open()
        inner_ctx = self.ctx.with_budget(part.budget)
        if self.processes is None:
            parallel = node.num_parallel_calls
            # AUTOTUNE: a worker per CPU, but no more than there are slots (each slot
            # reads on one worker, so a worker past cycle_length would never get work)
            from headrace._transforms.process_map import book_workers, cpu_count

            wanted = min(cpu_count(), node.cycle_length) if parallel == AUTOTUNE else int(parallel or 1)
            # the workers' own memory, booked on the stage's share (fewer start if it cannot)
            count, self.workers_booking, _ = book_workers(self.account, wanted, self._stage_name())
            # the inner pipelines' budget: half of a slot's part (see the module text)
            self.worker_share = part.size() // 2
            self.processes = slot_pool(
                node, self.ctx.options, self.worker_share, count, self._stage_name(), self.account,
                ceiling=self.parts.ceiling(), files=file_limiter(self.ctx),
            )
        account = part.budget.account("interleave slot", weight=1)
        part.budget.allot()
        iterator = RemoteSlotIterator(
            self.processes, element, inner_ctx, account, part.size(), "interleave slot",
            prefer=self.worker_hint, worker_share=self.worker_share, largest=self.largest,
            index=self.input_index - 1 if self.opening_index is None else self.opening_index,
        )
        iterator.on_ended = self.open_ahead
        return Slot(iterator, part, input_before, inner_ctx, account)

    def open_ahead(self, worker: int | None = None) -> None:
        """Open the next input element's slot now, on ``worker`` if it can (a slot's last
        chunk is in: that worker is about to be free)."""
        self.worker_hint = worker
        try:
            super().open_ahead()
        finally:
            self.worker_hint = None

    def _open_ahead_slot(self, element: Any, before: dict[str, Any], index: int) -> Slot:
        self.opening_index = index
        try:
            slot = self._open_slot(element, before, start=True)
        finally:
            self.opening_index = None
        try:
            slot.iterator.start()  # type: ignore[attr-defined]
        except BaseException:
            slot.close()
            raise
        return slot

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.processes is not None:
                self.processes.shutdown()
            self.workers_booking.release()
            self.workers_booking = NO_RESERVATION

    def worker_stats(self) -> Any:
        """What the slots run on, and the worker processes' memory now."""
        from headrace._workers.memory import WorkerStats

        node = self.node
        reason = "workers='processes'"
        if node.num_parallel_calls == AUTOTUNE:
            reason += f", AUTOTUNE: one per CPU, at most cycle_length ({node.cycle_length})"
        if self.processes is None:
            return WorkerStats(self.stage, "processes", 0, reason)
        traffic = self.processes.traffic
        with traffic.lock:  # chunks are the slots' requests; elements, the same count
            return WorkerStats(
                self.stage, "processes", self.processes.count, reason, self.processes.memory(),
                chunks=traffic.chunks, elements=traffic.elements,
                compute_seconds=traffic.compute_seconds,
                transfer_seconds=traffic.transfer_seconds, sent_bytes=traffic.sent_bytes,
                received_bytes=traffic.received_bytes, segments=traffic.segments,
            )
