"""``interleave(..., workers="processes")``: each slot's inner pipeline runs in a worker process.

Why: headrace's readers and parsers hold the GIL (a Python-heavy inner
pipeline does too), so threads read shards on one core. Here the slots of an
interleave run in ``num_parallel_calls`` worker processes (a
:class:`~headrace.workers.processes.ProcessPool`: forkserver/spawn, the
function pickled once per worker, results through pooled shared memory,
errors with their worker's traceback, a killed worker a
:class:`~headrace.errors.WorkerError` within a second).

How a slot reads. The consumer's slot is a :class:`RemoteSlotIterator`. It
asks a worker for a *chunk* of its inner pipeline: the request carries the
input element, the inner iterator's state before the chunk (None: from the
start) and how many elements to skip after restoring it; the worker answers
with up to :data:`CHUNK_ELEMENTS` elements (no more than a quarter of the
slot's share in bytes), the inner state after them, and the error that ended
the chunk, if any. While the consumer hands out one chunk the next one is
already being read, so every open slot reads ahead in a process of its own.
A worker keeps the iterators it served (a few per worker), each with the
position it reached (which restore of the slot, how many chunks): a request
for exactly that position reuses it; any other (a restore, a slot whose
previous chunk another worker read) rebuilds the inner pipeline from the
state — correct either way, only slower.

Order, errors, state. The order is the sequential interleave's (tf.data's)
whatever the timing: a slot's chunks are handed out in order, and the cycle
visits slots exactly as :mod:`headrace.transforms.interleave` does
(``deterministic=False`` does not change that here). An error of an inner
pipeline is raised at its element's place, with the worker's traceback as its
``__cause__``; the next pull goes on with the same slot, as with threads. A
slot's state is the inner state before its current chunk plus how many of
that chunk's elements were handed out: small, JSON-able, exact (G4).

Memory. Each inner pipeline runs in its worker under a budget of its slot's
part of the stage's share, so its own buffers are capped there; chunks are
booked on the slot's account in this process — the chunk being read at its
largest size (a quarter of the share) from the request on, the chunk being
handed out at its elements' sizes. The workers' own memory is reported by
``stats().workers`` and counted by the measured bound (see
:mod:`headrace.workers.memory`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any

from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node
from headrace.core.state import StateReader
from headrace.errors import add_note
from headrace.memory.budget import MemoryBudget, Reservation, StageAccount
from headrace.options import Options
from headrace.workers.processes import ProcessPool, _RemoteTraceback

__all__ = ["CHUNK_ELEMENTS", "RemoteSlotIterator", "SlotReader", "slot_pool"]

#: Elements a worker reads for a slot per request (fewer when they pass the byte cap).
CHUNK_ELEMENTS = 64
#: Iterators a worker keeps for slots it may be asked to continue.
_KEPT_ITERATORS = 8


class SlotReader:
    """The worker's handler: a request for a slot's next chunk -> the chunk.

    A request is ``(token, position, element, state, skip, max_elements, max_bytes,
    iteration, epochs)``; the answer ``(elements, state_after, ended, error)`` where
    ``error`` is ``(exception, traceback text)`` or None. ``position`` names the
    chunk asked for (the slot's restores so far, its chunks received since).
    """

    def __init__(self, node: Node, options: Options, share: int) -> None:
        self.node, self.options, self.share = node, options, share
        # token -> the slot's iterator, its budget, the position of the chunk it reads next
        self.kept: OrderedDict[int, tuple[Iterator, MemoryBudget, Any]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"node": self.node, "options": self.options, "share": self.share}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["node"], state["options"], state["share"])  # type: ignore[misc]

    def _iterator(self, request: tuple[Any, ...]) -> Iterator:
        token, position, element, state, skip, _, _, iteration, epochs = request
        kept = self.kept.pop(token, None)
        if kept is not None and kept[2] == position:  # it stands exactly there
            self.kept[token] = kept
            return kept[0]
        if kept is not None:  # stale (the slot was restored, or moved on elsewhere)
            self._close(kept)
        budget = MemoryBudget(self.share)
        ctx = Context(self.options, budget, iteration)
        ctx.epochs = tuple(epochs)
        iterator: Iterator = self.node.inner_node(element).make_iterator(ctx)  # type: ignore[attr-defined]
        budget.allot()
        self.kept[token] = (iterator, budget, position)
        while len(self.kept) > _KEPT_ITERATORS:
            self._close(self.kept.popitem(last=False)[1])
        if state is not None:
            iterator.set_state(state)
        for _ in range(skip):
            with contextlib.suppress(Exception):  # an error in its place counts as handed out
                iterator.pull()
        return iterator

    @staticmethod
    def _close(kept: tuple[Iterator, MemoryBudget, Any]) -> None:
        try:
            kept[0].close()
        finally:
            kept[1].close()

    def __call__(self, request: tuple[Any, ...]) -> tuple[list[Any], Any, bool, Any]:
        from headrace.memory.sizeof import sizeof

        iterator = self._iterator(request)
        token, (restores, chunks) = request[0], request[1]
        max_elements, max_bytes = request[5], request[6]
        elements: list[Any] = []
        held, ended, error = 0, False, None
        while len(elements) < max_elements and (not elements or held < max_bytes):
            try:
                element, reservation = iterator.pull()
            except StopIteration:
                ended = True
                break
            except Exception as raised:  # ends the chunk; raised in the consumer in its place
                error = (raised, traceback.format_exc())
                break
            reservation.release()  # it leaves this process's pipeline with the chunk
            elements.append(element)
            held += sizeof(element)
        state = None if ended else iterator.get_state()
        if ended:
            self._close(self.kept.pop(token))
        else:  # where it stands now: the slot's next chunk
            kept = self.kept[token]
            self.kept[token] = (kept[0], kept[1], (restores, chunks + 1))
        return elements, state, ended, error


def slot_pool(node: Node, options: Options, share: int, count: int, stage: str) -> ProcessPool:
    """The worker processes that read an interleave's slots."""
    return ProcessPool(SlotReader(node, options, share), count, stage, what="the interleave function")


_tokens = iter(range(1, 1 << 62))


class RemoteSlotIterator(Iterator):
    """A slot whose inner pipeline runs in a worker: chunks in, elements out, in order."""

    stage = "interleave slot"

    def __init__(
        self,
        pool: ProcessPool,
        element: Any,
        ctx: Context,
        account: StageAccount,
        share: int,
        stage: str,
    ) -> None:
        super().__init__()
        self.pool, self.element, self.ctx, self.account = pool, element, ctx, account
        self.max_bytes = max(share // 4, 1)
        self.stage = stage
        self.token = next(_tokens)
        self.ready: deque[tuple[Any, Reservation]] = deque()
        self.error: BaseException | None = None  # raised after the ready elements
        self.ended = False
        # the inner state before the chunk being handed out, and how many of it are out
        self.state_before: dict[str, Any] | None = None
        self.handed = 0
        self.next_state: dict[str, Any] | None = None  # where the next request starts
        self.next_skip = 0
        self.restores = 0  # set_state calls: a chunk's position is (restores, chunks)
        self.chunks = 0  # chunks received since the last restore
        self.pending: tuple[Future[Any], Reservation] | None = None

    # -- requests ---------------------------------------------------------------------------
    def _request(self) -> None:
        booking = (
            self.account.charge(self.max_bytes)
            if self.account.fits(self.max_bytes) or not self.ready
            else None
        )
        if booking is None:  # no room to read ahead: the next chunk is asked for on demand
            return
        request = (
            self.token, (self.restores, self.chunks), self.element, self.next_state,
            self.next_skip, CHUNK_ELEMENTS, self.max_bytes, self.ctx.run.iteration,
            list(self.ctx.epochs),
        )
        self.pending = (self.pool.submit([request]), booking)

    def _receive(self) -> None:
        """The chunk in flight (asked for now if none is): into ``ready``."""
        if self.pending is None:
            self._request()
        assert self.pending is not None
        future, booking = self.pending
        self.pending = None
        try:
            outputs, failed, _, _ = future.result()
        finally:
            booking.release()
        if failed:
            raise failed[0]  # the reply could not travel (e.g. an unpicklable element)
        elements, state_after, ended, error = outputs[0]
        self.state_before, self.handed = self.next_state, self.next_skip
        self.next_state, self.next_skip = state_after, 0
        self.chunks += 1
        self.ended = ended
        admit = self.ctx.admit
        sizes, kept = [], []
        for element in elements:
            element, size = admit(element)
            kept.append(element)
            sizes.append(size)
        for element, reservation in zip(kept, self.account.book_existing(sizes), strict=True):
            self.ready.append((element, reservation))
        if error is not None:
            raised, text = error
            raised.__cause__ = _RemoteTraceback(text)
            add_note(raised, "headrace: raised in an interleave slot in a worker process")
            self.error = raised
        if not ended:
            self._request()  # read the next chunk while this one is handed out

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
        self.restores, self.chunks = self.restores + 1, 0
        self.ended = ended

    def _drop(self) -> None:
        while self.ready:
            self.ready.popleft()[1].release()
        self.error = None
        if self.pending is not None:
            future, booking = self.pending
            self.pending = None
            future.cancel()
            booking.release()

    def close(self) -> None:
        self._drop()
        super().close()

