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
from headrace.core.handoff import holds_a_place
from headrace.core.iterator import Iterator
from headrace.core.state import ERRORS_MET, INT64_MAX, StateReader, past_end

__all__ = ["ReplayedInput"]

START = "input_start"
CONSUMED = "consumed"


class ReplayedInput:
    """An input iterator that counts what it gave, and can be replayed to a count.

    It counts the errors the input raised in elements' places too (:data:`ERRORS_MET`):
    a replay passes them, also those raised after the last element, so a state taken
    right after an error resumes after it (it raised the error again, and a state taken
    later made ``set_state`` raise it)."""

    def __init__(self, inner: Iterator) -> None:
        self.inner = inner
        self.start = inner.get_state()
        self.consumed = 0
        self.errors = 0

    def pull(self) -> tuple[Any, Reservation]:
        try:
            pair = self.inner.pull()
        except StopIteration:
            raise
        except Exception as error:
            if holds_a_place(error):
                self.errors += 1
            raise
        self.consumed += 1
        return pair

    def as_dict(self) -> dict[str, Any]:
        errors = {ERRORS_MET: self.errors} if self.errors else {}
        return {START: self.start, CONSUMED: self.consumed, **errors}

    def restore(self, reader: StateReader, feed: Callable[[Any, Reservation], None]) -> None:
        """Set the input to its saved start and hand ``feed`` each consumed element again,
        passing the errors met among them."""
        consumed = reader.integer(CONSUMED)
        errors = reader.optional_integer(ERRORS_MET, 1, INT64_MAX) or 0
        self.start = reader.child(START)
        self.inner.set_state(self.start)
        self.consumed = self.errors = 0
        while self.consumed < consumed or self.errors < errors:
            try:
                element, reservation = self.pull()
            except StopIteration:
                raise past_end(reader.stage, CONSUMED, consumed, self.consumed) from None
            except Exception:
                if self.errors > errors:  # more than the run it was taken from met
                    raise
                continue
            feed(element, reservation)
