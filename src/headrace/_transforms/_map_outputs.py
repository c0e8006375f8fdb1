"""A finished call of a parallel map, settled: its outputs booked, its errors in place.

The in-flight ledger booked a call's outputs ahead (a ticket); once they exist
they are booked as they are (:meth:`~headrace._memory.inflight.InFlight.settle`),
and an output the pipeline can never hold becomes its element's
:class:`~headrace._errors.MemoryBudgetError`. Errors of ``fn`` (and the input's,
after the chunk) are noted with the stage and the element's index and origin,
and booked at their own size until their turn (:meth:`InFlight.hold_error`).
What comes out is a :class:`~headrace.core.handoff.Handoff` at the chunk's
positions, handed out in order from there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headrace._errors import MemoryBudgetError, Origin, note_element_error
from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._memory.inflight import InFlight, Ticket
from headrace._transforms._map_calls import Call
from headrace.core.handoff import Handoff

__all__ = ["CallOutputs"]

Errors = dict[int, Exception]


class CallOutputs:
    """Settles the calls of one map stage (``stage``, for error notes) on its ``ledger``.

    ``sizeof`` costs an error held for its turn; ``origin`` makes an input's origin
    token into where it comes from (for the notes of errors only).
    """

    __slots__ = ("ledger", "origin", "sizeof", "stage")

    def __init__(self, ledger: InFlight, sizeof: Callable[[Any], int], stage: str,
                 origin: Callable[[Any], Origin | None]) -> None:
        self.ledger, self.sizeof, self.stage, self.origin = ledger, sizeof, stage, origin

    def book(self, ticket: Ticket, outputs: list[Any], costs: list[int],
             failed: Errors | None, rest: Ticket | None
             ) -> tuple[list[Reservation], Errors | None]:
        """Book the outputs of a call (``costs``: theirs) in place of its ``ticket``: one
        reservation per output, and the errors by position, with the outputs the budget
        refused among them (their slots then hold None). ``rest``: the ticket of the
        inputs the call handed back, given up if the budget closed meanwhile."""
        ran = len(outputs)
        # the failed positions hold no output: their errors are booked by handoff()
        good = [p for p in range(ran) if failed is None or p not in failed]
        sizes = costs if failed is None else [costs[p] for p in good]
        inputs = ticket.inputs if failed is None else [ticket.inputs[p] for p in good]
        reservations = [NO_RESERVATION] * ran
        try:
            booked = self.ledger.settle(ticket, sizes, inputs,
                                        whole=failed is None and rest is None)
        except BaseException:  # (the budget closed): book nothing more
            if rest is not None:
                rest.release()
            raise
        for position, booking in zip(good, booked, strict=True):
            if isinstance(booking, MemoryBudgetError):  # never fits: its error, in its place
                outputs[position] = None
                failed = {} if failed is None else failed
                failed[position] = booking
            else:
                reservations[position] = booking
        return reservations, failed

    def handoff(self, call: Call, outputs: list[Any], reservations: list[Reservation],
                failed: Errors | None) -> Handoff | None:
        """The call's outputs at their positions in its chunk, its errors noted and held
        in their places, the input's error after them; None if there is nothing to hand
        out (the call handed every input back)."""
        errors = None if failed is None else self._noted(call, failed, reservations)
        if call.error is not None:
            errors = errors or {}
            errors[len(outputs)] = call.error
            outputs.append(None)
            reservations.append(self.ledger.hold_error(self.sizeof(call.error)))
        if not outputs:
            return None
        start = call.start
        if start:  # positions in the chunk, after those another call handed out
            outputs = [None] * start + outputs
            reservations = [NO_RESERVATION] * start + reservations
            if errors is not None:
                errors = {start + position: error for position, error in errors.items()}
        return Handoff(outputs, reservations, call.state_before, errors, call.first_index,
                       start=start)

    def _noted(self, call: Call, failed: Errors, reservations: list[Reservation]) -> Errors:
        """The errors of ``fn`` (and the budget's refusals) with the stage, the element's
        index and origin noted, each booked until its turn (in ``reservations``)."""
        origins, origin = call.origins, self.origin
        first = call.first_index + call.start
        errors: Errors = {
            position: note_element_error(
                error, self.stage, first + position,
                None if origins is None else origin(origins[position]),
            )
            for position, error in failed.items()
        }
        hold_error, sizeof = self.ledger.hold_error, self.sizeof
        for position, error in errors.items():  # held for their turn: booked
            reservations[position] = hold_error(sizeof(error))
        return errors
