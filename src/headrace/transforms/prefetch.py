"""``prefetch(buffer_size)``: a background thread keeps elements ready.

The queue is bounded twice: by ``buffer_size`` elements and by the stage's
share of the byte budget (the producer waits for room *before* it pulls the
next element). ``AUTOTUNE`` starts at 1 element and doubles the depth when the
queue, having been full, runs empty (a burst outran it), up to ~64 MiB of
elements and never past the budget share; a producer that is simply slower
gets no deeper buffer.

The producer thread holds no reference to the public iterator, so an
iterator dropped without ``close()`` is still garbage-collected; its
finalizer stops the thread. An exception in the producer is re-raised in the
consumer with its original traceback.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from headrace._state import StateReader, replay
from headrace.iterator import Context, Iterator
from headrace.memory.budget import BudgetClosed, Reservation, StageAccount, release_all
from headrace.node import Node, UnaryNode, check_positive
from headrace.options import AUTOTUNE

__all__ = ["PrefetchIterator", "PrefetchNode"]

_Item = tuple[Any, Reservation, dict[str, Any], int]
_MAX_AUTOTUNE_DEPTH = 1 << 16
#: AUTOTUNE stops deepening once the queue could hold this much: past a few
#: dozen MiB a deeper queue smooths nothing more, it only holds memory.
_AUTOTUNE_BYTES = 64 << 20
_CHUNK = 64


class PrefetchNode(UnaryNode):
    stage = "prefetch"

    def __init__(self, source: Node, buffer_size: int) -> None:
        super().__init__(source)
        if buffer_size != AUTOTUNE:
            check_positive("prefetch: buffer_size", buffer_size)
        self.buffer_size = buffer_size

    def params(self) -> tuple[Any, ...]:
        return (self.buffer_size,)

    def make_iterator(self, ctx: Context) -> Iterator:
        account = ctx.account(self, "prefetch", weight=1)
        return PrefetchIterator(self.inputs[0].make_iterator(ctx), ctx, account, self.buffer_size)


class _Producer:
    """The thread's side: pulls from the input into the queue (no link to the iterator)."""

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: StageAccount,
        depth: int,
        gate: threading.Semaphore | None,
        ready: threading.Condition | None,
    ) -> None:
        self.inner, self.ctx, self.account, self.depth = inner, ctx, account, depth
        self.gate = gate  # bounds how many producers run their input at once
        self.ready = ready or threading.Condition()
        # (element, booking, the input's state before its chunk, its position in the chunk)
        self.queue: deque[_Item] = deque()
        self.state_before_chunk = inner.get_state()
        self.outstanding = 0  # taken by the consumer but not handed out yet (counts as queued)
        self.filled = False  # the queue was full since the depth last grew
        self.finished = False
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="headrace-prefetch", daemon=True)

    def run(self) -> None:
        items: list[_Item] = []
        try:
            while self._wait_for_space():
                room = self.depth - len(self.queue) - self.outstanding
                if self.gate is None:
                    self._pull(items, room)
                else:
                    with self.gate:
                        self._pull(items, room)
                if not self._publish(items):
                    break
        except (StopIteration, BudgetClosed):
            pass
        except BaseException as error:  # re-raised in the consumer, after what came before
            self.error = error
        self._publish(items)
        with self.ready:
            # Always mark the end, also when stopped: a stage downstream may be
            # waiting on this queue from another producer thread.
            self.finished = True
            self.ready.notify_all()

    def _pull(self, items: list[_Item], room: int) -> None:
        """Pull up to ``room`` elements (at most a chunk) while the budget share has room.

        Per chunk, not per element: the thread hand-off (a lock, a wake-up, a
        GIL switch), the booking of elements nobody booked yet (one lock), and
        the input's state (a checkpoint inside the chunk replays from its start).
        """
        sizeof, account = self.ctx.sizeof, self.account
        state = self.state_before_chunk
        elements: list[Any] = []
        bookings: list[Reservation | None] = []
        sizes: list[int] = []
        try:
            for _ in range(max(1, min(room, _CHUNK))):
                element, reservation = self.inner.next_reserved()
                size = sizeof(element)
                elements.append(element)
                if reservation.account is None:
                    bookings.append(None)  # booked below, with the others, in one step
                    sizes.append(size)
                else:
                    bookings.append(reservation.move_to(account, size))
                if account.held + sum(sizes) + account.max_element > account.limit:
                    break
        finally:  # also at the end of the input: what was pulled is handed on
            if elements:
                self.state_before_chunk = self.inner.get_state()
                booked = iter(account.charge_chunk(sizes)) if sizes else iter(())
                items.extend(
                    (element, booking if booking is not None else next(booked), state, position)
                    for position, (element, booking) in enumerate(
                        zip(elements, bookings, strict=True)
                    )
                )

    def _publish(self, items: list[_Item]) -> bool:
        """Queue what was pulled; False (and everything released) once stopping."""
        with self.ready:
            if self.stopping:  # stop() may already have emptied the queue
                release_all(item[1] for item in items)
                items.clear()
                return False
            if items:
                self.queue.extend(items)
                items.clear()
                self.ready.notify_all()
            return True

    def _wait_for_space(self) -> bool:
        with self.ready:
            while not self.stopping and len(self.queue) + self.outstanding >= self.depth:
                self.filled = True  # the consumer is the slower side, for now
                self.ready.wait()
            if self.stopping:
                return False
        self.account.wait_for_room(cancelled=lambda: self.stopping)
        return not self.stopping

    def stop(self) -> None:
        with self.ready:
            self.stopping = True
            self.ready.notify_all()
        self.account.wake()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        with self.ready:
            release_all(item[1] for item in self.queue)
            self.queue.clear()


class PrefetchIterator(Iterator):
    stage = "prefetch"

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: StageAccount,
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
        self.taken: deque[_Item] = deque()  # taken from the producer's queue at once
        # After the last element handed out: the input's state before its chunk, and
        # how many elements of that chunk are out.
        self.state: tuple[dict[str, Any], int] = (inner.get_state(), 0)

    def start(self) -> _Producer:
        """Start producing now (parallel interleave reads its slots ahead)."""
        if self.producer is None:
            self.producer = _Producer(
                self.inner, self.ctx, self.account, self.depth, self.gate, self.ready
            )
            self.producer.thread.start()
        return self.producer

    def has_output(self) -> bool:
        """Whether ``next`` would return (or end) without waiting; call holding ``ready``."""
        producer = self.producer
        return bool(self.taken) or (
            producer is not None and bool(producer.queue or producer.finished)
        )

    def next_reserved(self) -> tuple[Any, Reservation]:
        if not self.taken:
            self._take_all()
        element, reservation, chunk_state, position = self.taken.popleft()
        self.state = (chunk_state, position + 1)
        assert self.producer is not None
        self.producer.outstanding -= 1
        return element, reservation

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
                and self.depth * self.account.max_element < _AUTOTUNE_BYTES
            ):
                # Full, then drained: a burst outran the buffer, so a deeper one helps. An
                # empty queue that never filled means the producer is the slow side, where
                # more depth would only hold more memory (tf.data's legacy autotuner rule).
                producer.depth = self.depth = min(self.depth * 2, _MAX_AUTOTUNE_DEPTH)
                producer.filled = False
            while not producer.queue and not producer.finished:
                producer.ready.wait()
            if not producer.queue:
                if producer.error is not None:
                    raise producer.error
                raise StopIteration
            self.taken, producer.queue = producer.queue, self.taken
            producer.outstanding = len(self.taken)
            producer.ready.notify_all()

    def get_state(self) -> dict[str, Any]:
        chunk_state, handed_out = self.state
        return {"inner": chunk_state, "skip": handed_out}

    @staticmethod
    def state_at(inner_state: dict[str, Any]) -> dict[str, Any]:
        """The state of a read-ahead whose input is at ``inner_state``, nothing read ahead
        (to restore a state saved before a read-ahead was put over the input)."""
        return {"inner": inner_state, "skip": 0}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, "prefetch")
        inner_state = reader.child("inner")
        # elements of the chunk already handed out: a position inside one chunk
        skip = reader.integer("skip", high=_CHUNK, why="the largest chunk")
        self._stop()
        self.inner.set_state(inner_state)
        replay(lambda: self.inner.next_reserved()[1].release(), skip, "prefetch", "skip")
        self.state = (self.inner.get_state(), 0)

    def _stop(self) -> None:
        release_all(item[1] for item in self.taken)
        self.taken.clear()
        if self.producer is not None:
            self.producer.stop()
            self.producer = None

    def close(self) -> None:
        self._stop()
        super().close()
