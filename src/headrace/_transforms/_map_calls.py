"""The calls of a parallel map: what one call runs, and the calls in flight.

A call runs ``fn`` over a chunk of inputs (:func:`apply_chunk`) within an
allowance: the bytes the in-flight ledger booked for its outputs
(:mod:`headrace._memory.inflight`). Past it, with inputs left, the call stops and
the inputs it did not run go on in a new call (:meth:`Calls.hand_on`), booked by
what is left of the ticket, so that a call holds at most one output past its
booking. Out of order, a call whose element runs long gives the elements after it
to a new call too (:class:`Progress`, :meth:`Calls.split_slow`), so that one slow
element holds back no later one.

:class:`Calls` keeps the calls in input order, started or waiting for room; which
call is collected next is the delivery order's choice
(:mod:`headrace._transforms._map_order`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from collections.abc import Iterator as PyIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from headrace._memory.inflight import InFlight, Ticket
from headrace.core.handoff import unpin
from headrace.core.position import CURRENT_POSITION as _POSITION

if TYPE_CHECKING:
    from headrace._transforms._map_order import InOrder

__all__ = [
    "Call", "CallFuture", "Calls", "MapResult", "Progress", "StartCall", "apply_chunk",
    "call_at",
]

#: What a call returns: its outputs (as a buffer keeps them), their costs, the errors
#: by position in the outputs, and the seconds it ran.
MapResult = tuple[list[Any], list[int], dict[int, Exception] | None, float]


class CallFuture(Protocol):
    """What the map needs of a running call: a ``concurrent.futures.Future`` of its
    :data:`MapResult` (worker processes), or a
    :class:`~headrace._transforms._map_threads.ThreadCall` (threads)."""

    def result(self, timeout: None = None) -> Any:
        """The call's :data:`MapResult`, once done; raises what the call raised."""

    def cancel(self) -> bool:
        """Cancel the call if it has not started; whether it is cancelled."""

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Call ``fn(future)`` once the call is done or cancelled."""


#: The map's hook that runs a call: ``(elements, progress, first, allowance=,
#: forced=)`` to a future of its :data:`MapResult` (threads, or worker processes).
StartCall = Callable[..., CallFuture]  # (a bound method: held weakly)


def call_at(fn: Callable[..., Any], element: Any, position: tuple[int, ...]) -> Any:
    """``fn`` applied the tf.data way (a tuple's components are the arguments, a list
    returned is a tuple), with the element's position published to the function (see
    :mod:`headrace.core.position`): random ops seeded with an int draw from it."""
    token = _POSITION.set(position)
    try:
        output = fn(*element) if isinstance(element, tuple) else fn(element)
    finally:
        _POSITION.reset(token)
    # (structure.returned, inlined: this runs per element)
    return tuple(output) if type(output) is list else output


class Progress:
    """Where a chunk's worker is, so that the elements after a slow one can be taken away.

    The worker claims each element under the lock; :meth:`split` lowers ``limit``
    to just past the element being computed and returns the positions given up.
    """

    __slots__ = ("limit", "lock", "position", "since")

    def __init__(self, limit: int) -> None:
        self.lock = threading.Lock()
        self.limit, self.position, self.since = limit, -1, 0.0

    def claim(self, position: int) -> bool:
        with self.lock:
            if position >= self.limit:
                return False
            self.position, self.since = position, time.perf_counter()
            return True

    def split(self, older_than: float) -> range:
        with self.lock:
            running = self.position
            if running < 0 or running + 1 >= self.limit or self.since > older_than:
                return range(0)
            given_up = range(running + 1, self.limit)
            self.limit = running + 1
            return given_up


def apply_chunk(
    fn: Callable[..., Any],
    elements: list[Any],
    admit: Callable[[Any], tuple[Any, int]],
    progress: Progress | None = None,
    first: int = 0,
    epochs: tuple[int, ...] = (),
    allowance: int | None = None,
    ledger: InFlight | None = None,
    forced: bool = False,
) -> MapResult:
    """``fn`` over a chunk: the outputs as a buffer keeps them, their costs, the errors.

    Each output is admitted (costed, and copied out if it is a small view of a
    large temporary) as soon as ``fn`` returns it, in the worker: a chunk of
    views would otherwise keep a chunk of temporaries alive until the consumer
    collects it — memory no booking covers. An element whose call raised
    leaves ``None``, its error, and the error's cost (an exception may carry
    arrays). ``first``: the position in the map's input of ``elements[0]`` (in
    ``epochs``), published to ``fn`` (see :mod:`headrace.core.position`).

    ``allowance``: the bytes booked for the chunk's outputs. Once the outputs cost
    more and inputs remain, the call stops there and returns fewer outputs than
    inputs (:func:`~headrace._memory.inflight.over_allowance`). The consumer runs
    the rest in a later call. So a call holds at most one element past its booking.

    ``ledger``: the stage's in-flight ledger. Each output's cost is reported to it
    as it is made, and the call also stops *before* an input whose output, at the
    largest size seen so far (by any call), would pass the allowance
    (:meth:`~headrace._memory.inflight.InFlight.stop_before`): calls queued before a
    jump in size then hand their inputs back instead of each making one more large
    output. Its first input too, unless ``forced`` (the consumer waits for it).
    """
    started = time.perf_counter()
    outputs: list[Any] = []
    sizes: list[int] = []
    failed: dict[int, Exception] | None = None
    spent, last = 0, len(elements) - 1
    limit = -1 if allowance is None else allowance  # (over_allowance, inlined: per element)
    ahead = ledger is not None and limit >= 0
    # Per element, the ledger's stop_before and observe are called only where they can
    # answer or learn something: stop_before needs the largest output so far to pass
    # the allowance, and observe (without a hint) only raises the largest. The ledger's
    # fields are read here, as each call would (a Python call per element less, each).
    for position, element in enumerate(elements):
        if (
            ahead and (position or not forced)
            and spent + ledger._largest > limit  # type: ignore[union-attr]
            and ledger.stop_before(spent, limit)  # type: ignore[union-attr]
        ):
            break  # its output would pass the allowance: the rest goes back
        if progress is not None and not progress.claim(position):
            break  # the rest was given to another call
        try:
            output, size = admit(call_at(fn, element, (*epochs, first + position)))
        except Exception as error:  # raised in the consumer, at this element's position
            if failed is None:
                failed = {}
            failed[len(outputs)] = unpin(error)  # held until handed out: pins nothing
            # What the error keeps alive counts against the allowance like an output.
            output, size = None, admit(error)[1]
        outputs.append(output)
        sizes.append(size)
        spent += size
        if ledger is not None and (size > ledger._largest or ledger.hint is not None):
            ledger.observe(size, limit)
        if spent > limit >= 0 and position < last:
            break  # past the allowance: the inputs left go back to the consumer
    return outputs, sizes, failed, time.perf_counter() - started


class Call:
    """Work in flight: a future over a chunk of inputs, its ticket, where it started.

    ``state_before`` is the input's state before the chunk's first element and
    ``first_index`` that element's index: a checkpoint inside a chunk restores the
    state and skips the elements already out, so the input's state is taken once per
    chunk, not once per element. ``error`` is what the input raised right after the
    chunk's elements (the chunk ends there): it is handed out in that place.
    ``start``: the position in that chunk of this call's first element (a call
    finishing a chunk whose first elements went out in another call: the tail of a
    split call, a handed-back tail, or an element that waited for room).
    ``ticket``: what the ledger booked for the outputs (one entry per input still
    this call's: a split takes entries away). ``elements``: the inputs, kept to hand
    them to a new call. ``origins``: where each came from, where the input can say
    (tokens of ``Iterator.origin_token``, made into origins for error notes only).
    ``future`` is None while the call waits to start: inputs handed back wait until
    their booking covers the first of them, or until the consumer needs them.
    """

    __slots__ = (
        "elements", "error", "first_index", "future", "origins", "progress", "start",
        "state_before", "ticket",
    )

    def __init__(
        self,
        ticket: Ticket,
        elements: list[Any],
        state_before: dict[str, Any],
        first_index: int,
        error: Exception | None,
        origins: list[Any] | None,
        start: int,
    ) -> None:
        self.ticket, self.elements = ticket, elements
        self.state_before, self.first_index, self.error = state_before, first_index, error
        self.origins, self.start = origins, start
        self.future: CallFuture | None = None
        self.progress: Progress | None = None


class Calls:
    """The calls of one map stage in flight, in input order: started, or waiting for room.

    ``start_call`` is the map's hook that runs a call (threads or worker
    processes), ``order`` the delivery order, which says what else a started call
    needs (out of order: a :class:`Progress` to split it by, and a queue it
    announces itself on when done). Inputs a call gives up (past its allowance, or
    after a slow element) go on in a new call (:meth:`hand_on`), booked by what is
    left of their ticket, topped up by the ledger as room allows.
    """

    __slots__ = ("ledger", "order", "queue", "start_call")

    def __init__(self, ledger: InFlight, order: InOrder, start_call: StartCall) -> None:
        self.ledger, self.order = ledger, order
        # Weakly: the hook is a method of the stage that owns these calls, and a strong
        # reference back made a cycle: a stage dropped without close() stayed alive
        # (pool, bookings and all) until the cyclic GC ran, not freed at once.
        self.start_call = weakref.WeakMethod(start_call)
        self.queue: deque[Call] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> PyIterator[Call]:
        return iter(self.queue)

    def first(self) -> Call:
        """The call of the earliest inputs (collected first where the order is kept)."""
        return self.queue[0]

    def holds(self, call: Call) -> bool:
        """Whether ``call`` is still in flight (a restore drops calls that may still
        announce themselves)."""
        return any(live is call for live in self.queue)

    def none_started(self) -> bool:
        """Whether every call waits for room (one must start: progress)."""
        return all(call.future is None for call in self.queue)

    def add(self, call: Call, *, front: bool = False, wait: bool = False) -> None:
        """Add ``call``; ``front``: it is the next to collect in order (a handed-back
        tail); ``wait``: it starts later, once its booking covers its first input
        (:meth:`start_waiting`) or the consumer needs it."""
        if front:
            self.queue.appendleft(call)
        else:
            self.queue.append(call)
        if not wait:
            self.start(call)

    def start(self, call: Call, *, forced: bool = False) -> None:
        """Start ``call``; ``forced``: the consumer waits for it, so it runs its first
        input whatever its booking (progress)."""
        elements = call.elements
        progress = self.order.progress(elements)
        start_call = self.start_call()
        assert start_call is not None  # (only the stage that owns them starts its calls)
        try:
            future = start_call(elements, progress, call.first_index + call.start,
                                allowance=call.ticket.booked, forced=forced)
        except Exception as refused:
            # The stage cannot run calls (its worker pool is broken): the chunk stays
            # pending with its elements' place and input state, and raises when its turn
            # comes, so a state taken now starts at it and nothing pulled is lost.
            refusal: Future[MapResult] = Future()
            refusal.set_exception(refused)
            future = refusal
        call.future, call.progress = future, progress
        self.order.watch(call, future)

    def start_waiting(self) -> None:
        """Start the handed-back inputs whose booking now covers their first output
        (the ledger books more for them as room comes back)."""
        top_up = self.ledger.top_up
        for call in self.queue:
            if call.future is None and top_up(call.ticket, call.elements).covers_first():
                self.start(call)

    def hand_on(self, call: Call, at: int, ticket: Ticket, *, front: bool) -> None:
        """Run the inputs of ``call`` from position ``at`` on (booked by ``ticket``) in a
        new call: the rest of a slow call, or the inputs a call handed back. It starts
        now if its booking covers its first input; else it waits like new work."""
        ticket = self.ledger.top_up(ticket, call.elements[at : at + len(ticket)])
        count = len(ticket)
        origins = call.origins
        error, call.error = call.error, None  # an input error comes after the tail
        tail = Call(ticket, call.elements[at : at + count], call.state_before,
                    call.first_index, error,
                    None if origins is None else origins[at : at + count], call.start + at)
        self.add(tail, front=front, wait=not ticket.covers_first())

    def split_slow(self, older_than: float) -> None:
        """Give the elements after one running since before ``older_than`` to a new call
        (calls with a :class:`Progress` only: out of order)."""
        for call in list(self.queue):
            if call.progress is None:
                continue
            given_up = call.progress.split(older_than)
            if given_up:
                self.hand_on(call, given_up.start,
                             self.ledger.split(call.ticket, given_up.start), front=False)

    def remove(self, call: Call) -> None:
        """Take ``call`` out (collected)."""
        if self.queue[0] is call:
            self.queue.popleft()
        else:
            self.queue.remove(call)

    def drop(self) -> None:
        """Cancel every call and give its booking back (a restore, or close)."""
        while self.queue:
            call = self.queue.popleft()
            if call.future is not None:
                call.future.cancel()
            call.ticket.release()
