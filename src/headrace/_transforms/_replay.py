"""State by replay: for stages whose memory is a function of everything read so far.

``unique``'s set of seen values, ``scan``'s carried state and
``group_by_window``'s open groups are data, and iterator states never hold data
(G4). So such a stage saves its input's state at the start of the run plus how
many input elements it consumed; a restore sets the input back to its start
and feeds it that many elements again, rebuilding the memory exactly (for a
deterministic input), without emitting anything. The cost of a restore is a
re-read of the input so far: say so in the stage's docs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headrace._memory.buffer import Reservation
from headrace.core.iterator import Iterator
from headrace.core.state import StateReader, past_end

__all__ = ["ReplayedInput"]

START = "input_start"
CONSUMED = "consumed"


class ReplayedInput:
    """An input iterator that counts what it gave, and can be replayed to a count."""

    def __init__(self, inner: Iterator) -> None:
        self.inner = inner
        self.start = inner.get_state()
        self.consumed = 0

    def pull(self) -> tuple[Any, Reservation]:
        pair = self.inner.pull()
        self.consumed += 1
        return pair

    def as_dict(self) -> dict[str, Any]:
        return {START: self.start, CONSUMED: self.consumed}

    def restore(self, reader: StateReader, feed: Callable[[Any, Reservation], None]) -> None:
        """Set the input to its saved start and hand ``feed`` each consumed element again."""
        consumed = reader.integer(CONSUMED)
        self.start = reader.child(START)
        self.inner.set_state(self.start)
        self.consumed = 0
        for done in range(consumed):
            try:
                element, reservation = self.inner.pull()
            except StopIteration:
                raise past_end(reader.stage, CONSUMED, consumed, done) from None
            self.consumed += 1
            feed(element, reservation)
