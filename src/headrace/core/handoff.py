"""What a background stage hands to its consumer: a chunk of elements, and where it began.

Parallel ``map``, ``prefetch`` and interleave's read-ahead slots (which are
prefetches) all move work between threads in chunks, because a thread hand-off
per element (a lock, a wake-up, a GIL switch) costs more than a cheap element.
:class:`Handoff` is that unit. Per position it holds either an element with its
budget reservation, or an error: an error travels *in its element's place*, so
the consumer raises it only after every earlier element, holds no reservation
for it once it is raised, and continues with the next position on the
following ``next()`` — nothing before or after it is lost (tf.data's behaviour,
where an element's error does not end the iteration).

Errors are booked while they wait. A user's exception may carry large data (the
rows it refused, in its ``args`` or attributes), and a read-ahead stage may hold
many of them for their turn. So a held error is booked at its size
(:func:`book_error`), like an element, and released when it is handed out.

Errors pin nothing. An exception keeps its traceback, and the traceback keeps
every frame it passed through with all their locals: the elements a stage had
pulled when it failed (a ``padded_batch`` refused for its 32 rows holds the
rows), the input of a user function that raised, its temporaries. The stage
released their bookings as the error left it, so an error that a read-ahead
stage holds to hand out later (in its element's place) would hold that memory
with no booking (G1): refused batches waiting in parallel maps could hold several
times the budget. Every stage that keeps an error passes it through :func:`unpin` first, which
replaces its traceback's frames by their text, in a note (file, line, function
and source line, as the traceback would show them).

Checkpoints. A chunk remembers its input's state before its first element;
the consumer's state is that plus how many positions it handed out. Restoring
(:func:`restore_input`) puts the input back at the chunk's start and pulls that
many positions again — an error counts as the position it held, so the elements
after it line up exactly as in the original run.
"""

from __future__ import annotations

import builtins
import linecache
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from headrace._errors import WorkerPoolError, add_note
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation, release_all
from headrace.core.iterator import Iterator
from headrace.core.state import INNER, SKIP, past_end

__all__ = [
    "TRACEBACK_NOTE", "Handoff", "book_error", "drop_frames", "holds_a_place", "restore_input",
    "skip_positions", "unpin",
]

_Error = TypeVar("_Error", bound=BaseException)

#: ExceptionGroup's base (Python >= 3.11): its members are unpinned with it.
_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)

#: How the note that carries a held error's traceback begins (one note per error: a
#: traceback added where it is held again is put before the one it has).
TRACEBACK_NOTE = "headrace: traceback where it was raised (kept as text, frames dropped):\n"


def unpin(error: _Error) -> _Error:
    """``error`` with its traceback as a note, not as frames: an error that a stage
    keeps to raise later must not keep the elements it met alive (see the module doc).

    Clearing the frames' locals is not enough: each frame a traceback holds keeps
    its caller's frame (``f_back``), and so on up the thread's stack, and a frame
    still running when the error is caught keeps all its locals once it returns (a
    parallel map's chunk of inputs). So the frames are dropped and their lines kept
    as text, as for an error raised in a worker process. The causes, contexts and
    group members of ``error`` are unpinned too. Returns ``error``.
    """
    return drop_frames(error, keep_text=True)


def drop_frames(error: _Error, *, keep_text: bool = False) -> _Error:
    """Drop the traceback of ``error`` and of its causes, contexts and group members
    (where the traceback is kept as text already: an error a worker process sends);
    ``keep_text``: as a note first (:func:`unpin`). Returns ``error``."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        trace = current.__traceback__
        if trace is not None:
            current.__traceback__ = None
            if keep_text:
                _note_traceback(current, _traceback_text(trace))
        pending += (current.__cause__, current.__context__)
        if _GROUP is not None and isinstance(current, _GROUP):
            pending.extend(getattr(current, "exceptions", ()))
    return error


def _traceback_text(trace: TracebackType | None) -> str:
    """The lines Python shows for ``trace`` (without its column markers, whose parse of
    each source line made an error cost ~40 us more: a map whose elements often fail)."""
    lines = []
    while trace is not None:
        code = trace.tb_frame.f_code
        lines.append(f'  File "{code.co_filename}", line {trace.tb_lineno}, in {code.co_name}\n')
        source = linecache.getline(code.co_filename, trace.tb_lineno).strip()
        if source:
            lines.append(f"    {source}\n")
        trace = trace.tb_next
    return "".join(lines)


def _note_traceback(error: BaseException, lines: str) -> None:
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        for at, note in enumerate(notes):
            if isinstance(note, str) and note.startswith(TRACEBACK_NOTE):
                # held again after it was raised: the frames from there on come first,
                # as they would in the traceback (outermost first)
                notes[at] = TRACEBACK_NOTE + lines + note[len(TRACEBACK_NOTE):]
                return
    add_note(error, TRACEBACK_NOTE + lines.rstrip("\n"))


def book_error(buffer: Buffer, sizeof: Callable[[Any], int], error: BaseException) -> Reservation:
    """Book an error a stage holds for its turn at its size (what it keeps alive).

    The error exists already, so it is never refused: the user's own error must come
    out, not a MemoryBudgetError in its place. What passes the share is an overdraft,
    which keeps the stage from starting more work until it drains.
    """
    return buffer.overdraw(sizeof(error))


def holds_a_place(error: BaseException) -> bool:
    """Whether an error an input raised stands in an element's place (the input moved
    past that element: a stage above counts it as one position, and a state taken
    after it resumes after it), or is the input's own failure, which moved it
    nowhere: :class:`~headrace._errors.WorkerPoolError`, raised at every ``next()``
    until the iterator is closed. A stage that counted that as a position would
    skip a real element on resume (a prefetch over a broken process map).
    """
    return not isinstance(error, WorkerPoolError)


class Handoff:
    """Positions ``0..len(elements)-1`` of one chunk, taken in order by one consumer.

    ``errors`` maps a position to the exception raised there (its element slot
    holds ``None``; its reservation books the error's own size, released when it
    is raised: :func:`book_error`). ``first_index`` is the index, in
    the stage's input, of position 0 (for error notes and checkpoints). ``tokens``,
    where a stage above asks for origins, holds each position's origin token
    (:meth:`~headrace.core.iterator.Iterator.origin_token` of the input, taken by the
    producer right after its pull: the input runs ahead of what is handed out).
    """

    __slots__ = (
        "elements", "errors", "first_index", "reservations", "state_before", "taken", "tokens",
    )

    def __init__(
        self,
        elements: list[Any],
        reservations: list[Reservation],
        state_before: dict[str, Any],
        errors: dict[int, Exception] | None = None,
        first_index: int = 0,
        *,
        start: int = 0,
        tokens: list[Any] | None = None,
    ) -> None:
        self.elements, self.reservations, self.tokens = elements, reservations, tokens
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
            # A held error is booked at its size, like an element: handed out, it is
            # the consumer's, and its booking ends here.
            held, self.reservations[position] = self.reservations[position], NO_RESERVATION
            held.release()
            raise errors.pop(position)
        element = self.elements[position]
        # The consumer owns the element now: this chunk must not keep its memory alive
        # after the consumer drops it and releases its reservation.
        self.elements[position] = None
        return element, self.reservations[position]

    @classmethod
    def finishing(
        cls,
        element: Any,
        reservation: Reservation,
        state_before: dict[str, Any],
        position: int,
        token: Any = None,
    ) -> Handoff:
        """Position ``position`` of a chunk whose earlier positions were handed on already
        (``token``: its origin token, where origins are tracked)."""
        return cls(
            [None] * position + [element],
            [NO_RESERVATION] * position + [reservation],
            state_before,
            start=position,
            tokens=None if token is None else [None] * position + [token],
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
    skip_positions(inner, skip, stage)


def skip_positions(inner: Iterator, skip: int, stage: str) -> None:
    """Pull and drop ``skip`` positions of ``inner`` that were handed out before its
    state was taken (an error counts as its position; see :func:`restore_input`)."""
    for done in range(skip):
        try:
            _, reservation = inner.pull()
        except StopIteration:
            raise past_end(stage, SKIP, skip, done) from None
        except Exception:  # delivered at this position before: it counts, once
            continue
        reservation.release()
