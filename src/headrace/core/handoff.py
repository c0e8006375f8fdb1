"""What a background stage hands to its consumer: a chunk of elements, and where it began.

Parallel ``map``, ``prefetch`` and interleave's read-ahead slots (which are
prefetches) all move work between threads in chunks, because a thread hand-off
per element (a lock, a wake-up, a GIL switch) costs more than a cheap element.
:class:`Handoff` is that unit. Per position it holds either an element with its
budget reservation, or an error: an error travels *in its element's place*, so
the consumer raises it only after every earlier element, holds no reservation
for it, and continues with the next position on the following ``next()`` —
nothing before or after it is lost (tf.data's behaviour, where an element's
error does not end the iteration).

Checkpoints. A chunk remembers its input's state before its first element;
the consumer's state is that plus how many positions it handed out. Restoring
(:func:`restore_input`) puts the input back at the chunk's start and pulls that
many positions again — an error counts as the position it held, so the elements
after it line up exactly as in the original run.
"""

from __future__ import annotations

from typing import Any

from headrace.core.iterator import Iterator
from headrace.core.state import INNER, SKIP, past_end
from headrace.memory.budget import NO_RESERVATION, Reservation, release_all

__all__ = ["Handoff", "restore_input"]


class Handoff:
    """Positions ``0..len(elements)-1`` of one chunk, taken in order by one consumer.

    ``errors`` maps a position to the exception raised there (its element slot
    holds ``None``, its reservation is empty). ``first_index`` is the index, in
    the stage's input, of position 0 (for error notes and checkpoints).
    """

    __slots__ = ("elements", "errors", "first_index", "reservations", "state_before", "taken")

    def __init__(
        self,
        elements: list[Any],
        reservations: list[Reservation],
        state_before: dict[str, Any],
        errors: dict[int, Exception] | None = None,
        first_index: int = 0,
        *,
        start: int = 0,
    ) -> None:
        self.elements, self.reservations = elements, reservations
        self.state_before, self.errors, self.first_index = state_before, errors, first_index
        # Positions handed out. ``start`` > 0: the chunk's first positions went out in an
        # earlier Handoff (an element that waited for room finishes its chunk alone).
        self.taken = start

    def __len__(self) -> int:
        return len(self.elements)

    def take(self) -> tuple[Any, Reservation]:
        """The next position: its element and reservation, or its error raised."""
        position = self.taken
        self.taken = position + 1
        errors = self.errors
        if errors is not None and position in errors:
            raise errors.pop(position)
        element = self.elements[position]
        # The consumer owns the element now: this chunk must not keep its memory alive
        # after the consumer drops it and releases its reservation.
        self.elements[position] = None
        return element, self.reservations[position]

    @classmethod
    def finishing(
        cls, element: Any, reservation: Reservation, state_before: dict[str, Any], position: int
    ) -> Handoff:
        """Position ``position`` of a chunk whose earlier positions were handed on already."""
        return cls(
            [None] * position + [element],
            [NO_RESERVATION] * position + [reservation],
            state_before,
            start=position,
        )

    def pending(self) -> int:
        """Positions not handed out yet."""
        return len(self.elements) - self.taken

    def state(self) -> dict[str, Any]:
        """Where the consumer is: the input before this chunk, and positions handed out."""
        return {INNER: self.state_before, SKIP: self.taken}

    def release(self) -> None:
        """Return the bookings of the positions not handed out (the chunk is dropped)."""
        release_all(self.reservations[self.taken :])
        self.errors = None


def restore_input(inner: Iterator, inner_state: dict[str, Any], skip: int, stage: str) -> None:
    """Restore ``inner`` to ``inner_state``, then pull the ``skip`` positions that were
    already handed out (see :meth:`Handoff.state`).

    An error met while skipping was delivered as that position in the original run:
    it counts as one position and is not raised again. An input that ends before
    ``skip`` positions means the state is not of this data: a CheckpointError.
    """
    inner.set_state(inner_state)
    for done in range(skip):
        try:
            _, reservation = inner.pull()
        except StopIteration:
            raise past_end(stage, SKIP, skip, done) from None
        except Exception:  # delivered at this position before: it counts, once
            continue
        reservation.release()
