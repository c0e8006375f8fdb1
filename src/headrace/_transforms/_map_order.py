"""The delivery order of a parallel map: which call is collected next, and where a
checkpoint restores.

``deterministic=True`` (:class:`InOrder`) collects the calls in input order, so
outputs come out in input order; a checkpoint restores at the first input not
handed out. ``deterministic=False`` (:class:`OutOfOrder`) collects whichever call
finishes first: calls announce themselves on a queue when done, a call whose
element runs long gives up the elements after it
(:meth:`~headrace._transforms._map_calls.Calls.split_slow`), and a checkpoint
restores at the earliest input not handed out of all, so that what came out after
it comes again (at-least-once).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from queue import Empty, SimpleQueue
from typing import Any

from headrace._transforms._map_calls import Call, CallFuture, Calls, Progress
from headrace._transforms._map_chunks import TARGET_CALL_SECONDS
from headrace.core.state import mark_out_of_order

__all__ = ["SPLIT_AFTER_SECONDS", "InOrder", "OutOfOrder", "Where"]

#: With ``deterministic=False``, an element running this long gives up the rest of its
#: chunk (a target call: quick elements never pay for it).
SPLIT_AFTER_SECONDS = TARGET_CALL_SECONDS

#: Where an input not handed out yet is: its index, the input's state before its chunk,
#: its position in the chunk.
Where = tuple[int, Any, int]


class InOrder:
    """``deterministic=True``: calls collected in input order."""

    #: Inputs a call hands back are the next to collect.
    hands_back_first = True

    def progress(self, elements: list[Any]) -> Progress | None:
        """What a call on ``elements`` reports its progress to (None: it is never split)."""
        return None

    def watch(self, call: Call, future: CallFuture) -> None:
        """Follow a call just started (in order: nothing to do)."""

    def most_calls(self, threads: int, settled: bool) -> int:
        """How many calls may be in flight: one until an output's size is known (it sets
        what later calls are booked at), then two per thread."""
        return 2 * threads if settled else 1

    def next_call(self, calls: Calls) -> Call | None:
        """The next call to collect (still in ``calls``), started now if it waited for
        room (the consumer needs it: it may run one past its booking)."""
        call = calls.first()
        if call.future is None:
            calls.start(call, forced=True)
        return call

    def overtake(self, threads: int, in_flight: int, settled: bool) -> bool:
        """Whether one more call should start beside a first call that straggles (in
        order: never, the consumer waits for the first call's outputs anyway)."""
        return False

    def failed(self, call: Call) -> None:
        """``call`` failed as a whole and stays in flight, to raise again at its turn."""

    def earliest(self, pending: Iterable[Where]) -> Where | None:
        """Of the inputs not handed out, in input order, where a restore starts."""
        return next(iter(pending), None)

    def mark(self, state: dict[str, Any], iterator: Any) -> dict[str, Any]:
        """``state`` as :meth:`get_state` returns it (in order: as it is)."""
        return state


def _announce(finished: SimpleQueue[Call], call: Call, _: object) -> None:
    finished.put(call)


class OutOfOrder(InOrder):
    """``deterministic=False``: whichever call finishes first is collected first.

    Before any output size is known, one call runs alone (its output sets what
    later calls are booked at). When that first call straggles, as tf.data lets a
    slow first element be overtaken, one more call starts beside it, booked at its
    input's size like the first (:meth:`overtake`); the first of the two to finish
    settles the ledger, and the usual calls in flight follow.
    """

    hands_back_first = False

    def __init__(self) -> None:
        # Finished calls announce themselves here (one queue get per call, not a wait()
        # over every call in flight).
        self.finished: SimpleQueue[Call] = SimpleQueue()
        #: The first call ran past SPLIT_AFTER_SECONDS before any output was settled:
        #: one more call may start beside it.
        self.straggling = False

    def progress(self, elements: list[Any]) -> Progress | None:
        return Progress(len(elements)) if elements else None

    def watch(self, call: Call, future: CallFuture) -> None:
        # (the queue, not self: threads must not hold the stage)
        future.add_done_callback(functools.partial(_announce, self.finished, call))

    def most_calls(self, threads: int, settled: bool) -> int:
        return 2 * threads if settled else 1 + self.straggling

    def next_call(self, calls: Calls) -> Call | None:
        """The first call to finish; None when none finished within
        :data:`SPLIT_AFTER_SECONDS` (the first call may be straggling: :meth:`overtake`).
        Calls that ran long meanwhile give up the elements after their current one."""
        while True:  # calls dropped by a restore may still announce themselves: skip them
            if calls.none_started():
                calls.start(calls.first(), forced=True)  # (progress: nothing else runs)
            calls.split_slow(time.perf_counter() - SPLIT_AFTER_SECONDS)
            try:
                call = self.finished.get(timeout=SPLIT_AFTER_SECONDS)
            except Empty:
                return None
            if calls.holds(call):
                return call

    def overtake(self, threads: int, in_flight: int, settled: bool) -> bool:
        """Whether one more call should start beside a first call that straggles (see the
        class doc): once, with a second thread, and only before any output is settled."""
        if self.straggling or threads < 2 or settled or in_flight != 1:
            return False
        self.straggling = True
        return True

    def failed(self, call: Call) -> None:
        self.finished.put(call)  # announced again: taken (and raised) again

    def earliest(self, pending: Iterable[Where]) -> Where | None:
        # A later chunk may be ready (or partly handed out) while an earlier one still
        # runs: restoring at the first ready lost the earlier one's elements.
        return min(pending, key=lambda where: where[0], default=None)

    def mark(self, state: dict[str, Any], iterator: Any) -> dict[str, Any]:
        return mark_out_of_order(state, iterator)
