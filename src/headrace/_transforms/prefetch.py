"""``prefetch(buffer_size)``: a background thread keeps elements ready.

The queue is bounded twice: by ``buffer_size`` elements and by the stage's
share of the byte budget (the producer waits for room *before* it pulls the
next element). ``AUTOTUNE`` starts at 1 element and doubles the depth when the
queue, having been full, runs empty (a burst outran it), up to ~64 MiB of
elements and never past the budget share; a producer that is simply slower
gets no deeper buffer.

The producer thread holds no reference to the public iterator, so an
iterator dropped without ``close()`` is still garbage-collected; its
finalizer stops the thread. An exception the input raises is re-raised in the
consumer with its original traceback, at its element's position: every
element pulled before it comes first, and the next ``next()`` continues with
the elements after it (see :mod:`headrace.core.handoff`).

Origins. The producer pulls ahead of what is handed out, so the input's
"origin of the element returned last" is not the consumer's. Once a stage above
asks for origins (``track_origins``: a map, when it starts), the producer takes
the input's origin token right after each pull and the chunk carries it beside
the element; the iterator answers ``origin_token`` for the element it handed out
last. Until then no token is taken: a pipeline that never asks pays nothing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from headrace._errors import MemoryBudgetError, Origin
from headrace._memory.buffer import BudgetClosed, Buffer, Reservation
from headrace._options import AUTOTUNE
from headrace.core.handoff import Handoff, book_error, holds_a_place, skip_positions, unpin
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import Node, ShardRole, Traits, UnaryNode, check_positive
from headrace.core.state import INNER, SKIP, StateReader

__all__ = ["PrefetchIterator", "PrefetchNode"]

_MAX_AUTOTUNE_DEPTH = 1 << 16
#: AUTOTUNE stops deepening once the queue could hold this much: past a few
#: dozen MiB a deeper queue smooths nothing more, it only holds memory.
_AUTOTUNE_BYTES = 64 << 20
_CHUNK = 64


class PrefetchNode(UnaryNode):
    stage = "prefetch"

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()  # one element out per element in

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return reach(self.inputs[0])  # changes timing, not elements

    def traits(self) -> Traits:
        return Traits(prefetches=True)

    def __init__(self, source: Node, buffer_size: int | None) -> None:
        super().__init__(source)
        if buffer_size is None:  # tf.data: None means AUTOTUNE
            buffer_size = AUTOTUNE
        if buffer_size != AUTOTUNE:
            buffer_size = check_positive("prefetch: buffer_size", buffer_size, allow_zero=True)
        self.buffer_size = buffer_size

    def shard_role(self) -> ShardRole:
        return ShardRole.ONE_TO_ONE

    def params(self) -> tuple[Any, ...]:
        return (self.buffer_size,)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.buffer_size == 0:  # tf.data: prefetch(0) prefetches nothing
            return self.inputs[0].make_iterator(ctx)
        account = ctx.account(self)
        return PrefetchIterator(self.inputs[0].make_iterator(ctx), ctx, account, self.buffer_size)


class _Producer:
    """The thread's side: pulls from the input into the queue (no link to the iterator)."""

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: Buffer,
        depth: int,
        gate: threading.Semaphore | None,
        ready: threading.Condition | None,
        probe: Callable[[], Any] | None = None,
        restore: tuple[dict[str, Any], int] | None = None,
    ) -> None:
        self.inner, self.ctx, self.account, self.depth = inner, ctx, account, depth
        #: A state to put the input in first, and the positions after it to drop (those
        #: handed out before it was taken): see :meth:`run`.
        self.restore = restore
        self.restored = threading.Event()  # set once the restore is done (or failed)
        self.restore_error: BaseException | None = None
        self.restored_state: dict[str, Any] = {}  # the input's, right after the restore
        #: The input's ``origin_token``, once a stage above asks for origins: taken
        #: after each pull, carried in the chunk beside the element.
        self.probe = probe
        self.gate = gate  # bounds how many producers run their input at once
        self.ready = ready or threading.Condition()
        self.queue: deque[Handoff] = deque()
        self.queued = 0  # positions in the queue
        self.state_before_chunk = inner.get_state()
        self.outstanding = 0  # taken by the consumer but not handed out yet (counts as queued)
        self.filled = False  # the queue was full since the depth last grew
        self.finished = False
        self.error: BaseException | None = None  # what ended the thread, not an element's error
        self.stopping = False
        #: Set by a final stop (the run closes): the thread closes its input before it
        #: ends, so that a generator's ``finally``/``with`` exit runs on the thread that
        #: ran its body (a sqlite3 connection made there can only be closed there).
        self.close_input = False
        self.close_error: BaseException | None = None
        # An element that did not fit the share yet, with its chunk coordinates:
        # (element, its upstream booking, its cost, its chunk's input state, position,
        # its origin token).
        self.aside: tuple[Any, Reservation, int, dict[str, Any], int, Any] | None = None
        self.consumer_waiting = False  # the consumer waits for this queue (see starving)
        self.thread = threading.Thread(target=self.run, name="headrace-prefetch", daemon=True)

    def run(self) -> None:
        chunks: list[Handoff] = []
        if self.restore is not None and not self._restore(*self.restore):
            return
        try:
            ended = False
            while not ended and self._wait_for_space():
                room = self.depth - self.queued - self.outstanding
                if self.gate is None:
                    ended = self._pull(chunks, room)
                else:
                    with self.gate:
                        ended = self._pull(chunks, room)
                if not self._publish(chunks):
                    break
        except BudgetClosed:
            pass
        except BaseException as error:  # re-raised in the consumer, after what came before
            self.error = unpin(error)
        self._publish(chunks)
        if self.close_input:
            try:
                self.inner.close()
            except BaseException as error:  # the consumer's close() raises it
                self.close_error = error
        with self.ready:
            # Always mark the end, also when stopped: a stage downstream may be
            # waiting on this queue from another producer thread.
            self.finished = True
            self.ready.notify_all()

    def _restore(self, inner_state: dict[str, Any], skip: int) -> bool:
        """Restore the input on this thread, as ``set_state`` asked (it waits for this):
        the input's replay then runs where the input will run, as in a run from the
        start (a generator's sqlite3 connection is only usable on the thread that
        opened it). False if the restore failed: ``set_state`` raises its error."""
        try:
            self.inner.set_state(inner_state)
            skip_positions(self.inner, skip, "prefetch")
            self.state_before_chunk = self.restored_state = self.inner.get_state()
        except BaseException as error:
            self.restore_error = error
            with self.ready:
                self.finished = True
                self.ready.notify_all()
            return False
        finally:
            self.restored.set()
        return True

    def _pull(self, chunks: list[Handoff], room: int) -> bool:  # noqa: C901
        """Pull up to ``room`` elements (at most a chunk) while each fits the budget share;
        True at the end of the input.

        Per chunk, not per element: the thread hand-off (a lock, a wake-up, a
        GIL switch), the booking of elements nobody booked yet (one lock), and
        the input's state (a checkpoint inside the chunk replays from its start).
        Each element is costed (and compacted) before it enters; the first one
        that does not fit beside the others waits in ``aside``, unbooked, until
        the consumer has made room (:meth:`_wait_for_space`), then goes out as
        the last position of its chunk. An error the input raises ends the
        chunk and is handed out in its place; the next chunk continues after
        it, as tf.data does.
        """
        account = self.account
        if self.aside is not None:
            room = self._take_aside(chunks, room)
            if room <= 0:
                return False
        state = self.state_before_chunk
        elements: list[Any] = []
        bookings: list[Reservation | None] = []
        sizes: list[int] = []
        pending = 0
        pulled = False
        errors: dict[int, Exception] | None = None
        ended = False
        probe = self.probe
        tokens: list[Any] | None = None if probe is None else []
        token = None

        def held_in_place(error: Exception, token: Any) -> dict[int, Exception]:
            """An error in its element's place in the chunk, handed out in its turn."""
            position = len(elements)
            unpin(error)  # (its frames dropped before it is sized and booked)
            elements.append(None)
            bookings.append(book_error(account, self.ctx.sizeof, error))
            if tokens is not None:
                tokens.append(token)
            return {position: error}

        try:
            for _ in range(max(1, min(room, _CHUNK))):
                try:
                    element, reservation = self.inner.pull()
                except (StopIteration, BudgetClosed):
                    ended = True
                    break
                except Exception as error:
                    if not holds_a_place(error):  # the input's own failure: no position;
                        raise  # it ends this thread, after the elements pulled before it
                    pulled = True
                    errors = held_in_place(error, None)
                    break
                pulled = True
                if probe is not None:  # the input is still on this element: ask it now
                    token = probe()
                element, cost = self.ctx.admit(element)
                try:
                    fits = account.fits(cost, pending=pending)
                except MemoryBudgetError as error:  # refused: the element goes no further,
                    reservation.release()  # its booking upstream is returned, and its
                    # error stands in its place; the thread goes on with the next (it
                    # used to end here, and every later pull raised the error again)
                    errors = held_in_place(error, token)
                    break
                if not fits:
                    # Starving means nothing of this stage's is on its way to the consumer:
                    # the element taken from aside above (in chunks, not yet queued) is.
                    if elements or chunks or not self.starving():
                        self.aside = (element, reservation, cost, state, len(elements), token)
                        break
                    elements.append(element)  # one element past the share, no more
                    bookings.append(self._overdraw(reservation, cost))
                    if tokens is not None:
                        tokens.append(token)
                    break
                elements.append(element)
                if tokens is not None:
                    tokens.append(token)
                if reservation.account is None:
                    bookings.append(None)  # booked below, with the others, in one step
                    sizes.append(cost)
                    pending += cost
                else:
                    bookings.append(account.admit(cost, reservation))
        finally:  # also when booking fails: what was pulled is handed on
            if pulled:
                self.state_before_chunk = self.inner.get_state()
            if elements:
                chunks.append(self._chunk(elements, bookings, sizes, state, errors, tokens))
        return ended

    def _take_aside(self, chunks: list[Handoff], room: int) -> int:
        """Hand on the element waiting aside, if it fits now or the consumer starves;
        the room left for this pull (0: pull nothing more)."""
        assert self.aside is not None
        element, reservation, cost, state, position, token = self.aside
        starved = not self.account.fits(cost)
        if starved and not self.starving():
            return 0
        self.aside = None
        booking = (
            self._overdraw(reservation, cost) if starved
            else self.account.admit(cost, reservation)
        )
        chunks.append(Handoff.finishing(element, booking, state, position, token))
        return 0 if starved else room - 1  # starved: one element past the share, no more

    def _chunk(self, elements: list[Any], bookings: list[Reservation | None],
               sizes: list[int], state: Any, errors: dict[int, Exception] | None,
               tokens: list[Any] | None) -> Handoff:
        """A chunk of pulled elements, those nobody booked yet booked in one step."""
        booked = iter(self.account.admit_chunk(sizes)) if sizes else iter(())
        reservations = [
            booking if booking is not None else next(booked) for booking in bookings
        ]
        return Handoff(elements, reservations, state, errors, tokens=tokens)

    def _overdraw(self, reservation: Reservation, cost: int) -> Reservation:
        """Book an element taken only because the consumer starves (see :meth:`starving`):
        past the share, as an overdraft, which keeps the stage from taking more until it
        has drained."""
        (booking,) = self.account.admit_existing([cost])
        reservation.release()
        return booking

    def _publish(self, chunks: list[Handoff]) -> bool:
        """Queue what was pulled; False (and everything released) once stopping."""
        with self.ready:
            if self.stopping:  # stop() may already have emptied the queue
                for chunk in chunks:
                    chunk.release()
                chunks.clear()
                return False
            if chunks:
                self.queue.extend(chunks)
                self.queued += sum(chunk.pending() for chunk in chunks)
                chunks.clear()
                self.ready.notify_all()
            return True

    def _wait_for_space(self) -> bool:
        with self.ready:
            while not self.stopping and self.queued + self.outstanding >= self.depth:
                self.filled = True  # the consumer is the slower side, for now
                self.ready.wait()
            if self.stopping:
                return False
        estimate = self.aside[2] if self.aside is not None else None
        self.account.wait_for_room(
            estimate, cancelled=lambda: self.stopping, starving=self.starving
        )
        return not self.stopping

    def starving(self) -> bool:
        """Nothing of this stage's is queued or being handed out and the consumer waits
        for it: what its account holds is downstream (a parallel map's calls in flight
        keep their inputs' bookings), and those stages may be waiting on the consumer
        that waits here. One element then goes out as an overdraft: without it, fuzz
        spec error_spec seed 89 (an interleave's prefetch under two process maps and a
        thread map, 16 MiB) hung for good."""
        return self.consumer_waiting and self.queued + self.outstanding == 0

    def stop(self, final: bool = False) -> None:
        """Stop the thread and release the queue; ``final``: the run closes, and the
        thread (if it still runs) closes the input itself before it ends."""
        with self.ready:
            self.stopping = True
            self.close_input = final
            self.ready.notify_all()
        self.account.wake()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        with self.ready:
            for chunk in self.queue:
                chunk.release()
            self.queue.clear()
            self.queued = 0
        if self.aside is not None and not self.thread.is_alive():
            self.aside[1].release()
            self.aside = None


class PrefetchIterator(Iterator):
    stage = "prefetch"

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: Buffer,
        buffer_size: int,
        *,
        gate: threading.Semaphore | None = None,
        ready: threading.Condition | None = None,
    ) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account
        self.autotune = buffer_size == AUTOTUNE
        self.depth = 1 if self.autotune else buffer_size
        self.gate, self.ready = gate, ready
        self.producer: _Producer | None = None
        self.taken: deque[Handoff] = deque()  # taken from the producer's queue at once
        self.current: Handoff | None = None  # the chunk being handed out
        self.state_at_start = inner.get_state()  # before the first chunk
        #: The input's ``origin_probe``, once a stage above asks for origins.
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None

    def start(self, restore: tuple[dict[str, Any], int] | None = None) -> _Producer:
        """Start producing now (parallel interleave reads its slots ahead); ``restore``:
        the input's state and positions to skip, put in place by the thread first."""
        if self.producer is None:
            self.producer = _Producer(
                self.inner, self.ctx, self.account, self.depth, self.gate, self.ready,
                None if self.probe is None else self.probe[0], restore,
            )
            self.producer.thread.start()
        return self.producer

    def has_output(self) -> bool:
        """Whether ``next`` would return (or end) without waiting; call holding ``ready``."""
        producer, current = self.producer, self.current
        return (
            bool(self.taken)
            or (current is not None and current.taken < len(current))
            or (producer is not None and bool(producer.queue or producer.finished))
        )

    def source_ended(self) -> bool:
        """Whether the producer has read its input to the end (what it read may still be
        queued). Read without the lock: a stale answer only delays the caller's step."""
        producer = self.producer
        return producer is not None and producer.finished

    def pull(self) -> tuple[Any, Reservation]:
        chunk = self.current
        if chunk is None or chunk.taken == len(chunk):
            if not self.taken:
                self._take_all()
            chunk = self.current = self.taken.popleft()
        assert self.producer is not None
        self.producer.outstanding -= 1
        return chunk.take()  # raises the input's error at its position

    def origin(self) -> Origin | None:
        return self.origin_of(self.origin_token())

    def origin_token(self) -> Any:
        """The token of the element handed out last: read from its chunk when asked,
        so that handing elements out costs nothing more."""
        chunk = self.current
        tokens = None if chunk is None else chunk.tokens
        return None if tokens is None or not chunk.taken else tokens[chunk.taken - 1]  # type: ignore[union-attr]

    def origin_of(self, token: Any) -> Origin | None:
        probe = self.probe
        return None if probe is None or token is None else probe[1](token)

    def track_origins(self, tokens: bool = True) -> bool:
        """From now on the producer takes each element's origin token right after its
        pull (it runs ahead: the input's own answer is about a later element), and
        the chunk hands it out with the element. Asked before the thread starts (a
        map asks as the pipeline starts); elements pulled before carry none."""
        if self.probe is None:
            self.probe = origin_probe(self.inner)
            if self.probe is not None and self.producer is not None:
                self.producer.probe = self.probe[0]
        return self.probe is not None

    def _take_all(self) -> None:
        """Wait for the queue, then take everything in it with one lock.

        Per-element locking between two threads costs a GIL hand-off each time;
        taking the whole queue keeps that per batch of elements.
        """
        producer = self.start()
        with producer.ready:
            if (
                not producer.queue
                and not producer.finished
                and self.autotune
                and producer.filled
                and self.depth * self.account.largest() < _AUTOTUNE_BYTES
            ):
                # Full, then drained: a burst outran the buffer, so a deeper one helps. An
                # empty queue that never filled means the producer is the slow side, where
                # more depth would only hold more memory (tf.data's legacy autotuner rule).
                producer.depth = self.depth = min(self.depth * 2, _MAX_AUTOTUNE_DEPTH)
                producer.filled = False
            while not producer.queue and not producer.finished:
                # The producer may be asleep in _wait_for_space, having checked while the
                # elements taken last time still counted as outstanding; they are all
                # handed out now (pull() lowers the count without the lock): wake it, or
                # both wait for each other. It may be waiting for room too, which only
                # stages downstream of this consumer can give back: see starving().
                producer.consumer_waiting = True
                producer.ready.notify_all()
                self.account.wake()
                producer.ready.wait()
            producer.consumer_waiting = False
            if not producer.queue:
                if producer.error is not None:
                    raise producer.error
                raise StopIteration
            self.taken, producer.queue = producer.queue, self.taken
            producer.outstanding, producer.queued = producer.queued, 0
            producer.ready.notify_all()

    def get_state(self) -> dict[str, Any]:
        if self.current is None:
            return self.state_at(self.state_at_start)
        return self.current.state()

    @staticmethod
    def state_at(inner_state: dict[str, Any]) -> dict[str, Any]:
        """The state of a read-ahead whose input is at ``inner_state``, nothing read ahead
        (to restore a state saved before a read-ahead was put over the input)."""
        return {INNER: inner_state, SKIP: 0}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, "prefetch")
        inner_state = reader.child(INNER)
        # elements of the chunk already handed out: a position inside one chunk
        skip = reader.integer(SKIP, high=_CHUNK + 1, why="the largest chunk and its error")
        self._stop()
        # The producer thread restores the input (see _Producer._restore): the replay
        # runs on the thread that goes on from there.
        producer = self.start(restore=(inner_state, skip))
        producer.restored.wait()
        if producer.restore_error is not None:
            self.producer = None
            producer.thread.join()
            raise producer.restore_error
        self.state_at_start = producer.restored_state  # (the thread has gone on since)

    def _stop(self, final: bool = False) -> None:
        for chunk in self.taken:
            chunk.release()
        self.taken.clear()
        if self.current is not None:
            self.current.release()
            self.current = None
        if self.producer is not None:
            producer, self.producer = self.producer, None
            producer.stop(final)
            if producer.close_error is not None:
                super().close()  # the rest of the input, if it was not closed
                raise producer.close_error

    def close(self) -> None:
        self._stop(final=True)
        super().close()  # (a no-op for the stages the producer thread closed)
