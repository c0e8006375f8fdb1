"""Work whose outputs do not exist yet: the *in-flight* ledger.

A parallel map starts a call before its outputs exist, so it must book them
ahead. The ledger guesses what a call will hold (:meth:`InFlight.expect`),
books that guess on the stage's :class:`~headrace._memory.buffer.Buffer` as a
:class:`Ticket`, hands a ticket's tail to a new call (:meth:`InFlight.split`)
and turns it into the outputs' own bookings once they arrive
(:meth:`InFlight.settle`).

Why a guess is enough. A guess can be wrong by any factor: outputs may jump
x1000 after thousands of small ones. So the ticket's bytes are also the call's
*allowance*. A call stops right after the output that takes it past its
allowance and hands the inputs it did not run back (see :func:`over_allowance`).
What a call holds beyond its booking is then at most one element. Across the
stage, held plus in flight stays within the share plus one element per call in
flight, whatever the sizes do.

The estimate. Each call is booked at the largest output seen so far, or at its
input's size times the ratio of the largest output to the largest input seen,
whichever is larger. The ratio matters when inputs grow: small inputs sized the
calls, then large ones came, and outputs grow with them. An input no larger
than the largest seen is booked at the largest output: outputs that do not
follow their inputs' size (an image decoded to a fixed size) are not booked at
the ratio of the smallest input (a 20 KB JPEG's 600 KB image booked every
100 KB JPEG at 3 MB, and a call took a fifth of the images it had room for).
An ``output_nbytes`` hint replaces both: it tells each output's size from its
input. What outputs cost beyond their hints (an array's header) is learned as
a slack added to each hint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from headrace._errors import MemoryBudgetError
from headrace._memory.buffer import NO_RESERVATION, Buffer, Overdraft, Reservation, release_all
from headrace._memory.units import is_byte_count

__all__ = ["InFlight", "Ticket", "over_allowance"]

#: What an output may cost past twice its call's booking before the hint is distrusted
#: (headers, small objects: the slack learns those).
_HINT_TOLERANCE = 4096

#: One call books at most this share of the stage's share (and at least one element),
#: so that several calls can run side by side. Time bounds the chunk too.
CALL_FRACTION = 4


def over_allowance(spent: int, allowance: int | None, remaining: int) -> bool:
    """Whether a call must stop: its outputs cost past its allowance and inputs remain.

    A call runs its inputs in order and adds each output's cost to ``spent``.
    Once ``spent`` passes ``allowance`` it stops after that output, if any input
    is left, and hands those inputs back. So a call holds at most one element
    beyond what was booked for it.
    """
    return allowance is not None and spent > allowance and remaining > 0


class Ticket:
    """What was booked ahead for one call: its inputs' expected outputs.

    ``expected`` and ``inputs`` hold one size per input (the expected output,
    the input's own size). ``booked`` is the bytes booked for them, which is the
    call's allowance. The bookings are released when the call settles, or move
    in part to a tail (:meth:`InFlight.split`).
    """

    __slots__ = ("booked", "bookings", "expected", "inputs", "pending", "slack")

    def __init__(self) -> None:
        self.bookings: list[Reservation] = []
        self.expected: list[int] = []
        self.inputs: list[int] = []
        self.booked = 0
        self.pending = 0  # expected bytes not booked yet (see InFlight.book)
        self.slack = 0  # the slack per element the expectations included (with a hint)

    @property
    def allowance(self) -> int:
        """The bytes a call may produce before it stops and hands the rest back."""
        return self.booked

    def __len__(self) -> int:
        return len(self.expected)

    def covers_first(self) -> bool:
        """Whether the booking covers the first input's expected output (a handed-back
        tail may start on its own then)."""
        return self.booked >= self.expected[0]

    def release(self) -> None:
        """Give the booking back (the call was dropped)."""
        release_all(self.bookings)
        self.bookings.clear()
        self.booked = 0


class InFlight:
    """The in-flight ledger of one stage: estimate, book ahead, split, settle.

    It books on the stage's ``buffer`` with ``count=False``: bytes of work in
    flight, not elements. ``hint``: the map's ``output_nbytes``, which tells an
    output's size from its input.
    """

    def __init__(
        self, buffer: Buffer, hint: Callable[[Any], int] | None = None, *, packs: bool = False
    ) -> None:
        self.buffer = buffer
        self.hint = hint
        #: Calls run in worker processes, which copy each output into shared memory.
        self.packs = packs
        self._largest = 0  # the largest output so far
        # The largest output and input of the calls settled so far, and their ratio
        # (see the module doc: ``expect`` and the map's chunks read ``_ratio``).
        self._top_output = self._top_input = 0
        self._ratio = 0.0
        # What outputs cost beyond their hints, per element: the least a call has
        # shown. A process map's segment slack varies by call; the least of it must
        # not inflate every later booking.
        self._slack: int | None = None
        self._raise = threading.Lock()  # (observe: calls on threads raise the largest)
        self._settled = False  # whether a call's outputs were settled (ratio, slack known)
        # The hint proved wrong (an output cost far more than the call's whole booking):
        # the ledger books as if there were none (see observe).
        self._distrust = False

    # -- questions -------------------------------------------------------------------------

    def largest(self) -> int:
        """The largest output so far (0 before the first)."""
        return self._largest

    def settled(self) -> bool:
        """Whether a call's outputs were settled: until then the ratio and the hint's
        slack are unknown, and one call at a time learns them."""
        return self._settled

    def observe(self, nbytes: int, allowance: int) -> None:
        """An output of ``nbytes`` was just made by a call booked ``allowance`` (called
        from the call's own thread).

        Learned now, not when the consumer collects the call: calls that start or
        go on after a jump in size then see it (:meth:`stop_before`), and so does
        the consumer's next booking. Settling learns the rest (ratio, slack).

        A hint is trusted while it holds: the slack learns what outputs cost beyond
        it. An output that costs more than twice its call's whole booking shows the
        hint understates (a jump the hint does not know of): from then on the
        ledger books and stops calls as if there were no hint.
        """
        if self.hint is not None and allowance >= 0 and (
            nbytes > 2 * allowance + _HINT_TOLERANCE
        ):
            self._distrust = True
        nbytes = min(nbytes, self.buffer.limit)  # (larger: refused, see settle)
        if nbytes > self._largest:
            with self._raise:
                if nbytes > self._largest:
                    self._largest = nbytes

    def stop_before(self, spent: int, allowance: int) -> bool:
        """Whether a call that has spent ``spent`` of ``allowance`` must hand its next
        input back before running it: its output, at the largest size seen so far,
        would pass the allowance.

        Without a hint, the largest output so far is the ledger's guess of the next
        one. When outputs jump in size while calls are queued or running, the calls
        booked at the old size stop before their next input instead of after it, so
        what is made past the bookings is one element per call *running*, not one per
        call booked. With a hint the booking is already the output's own size.
        """
        return (self.hint is None or self._distrust) and spent + self._largest > allowance

    def share(self) -> int:
        """The stage's share of the budget."""
        return self.buffer.share()

    def expect(self, element: Any, nbytes: int) -> int:
        """What a call on ``element`` (of ``nbytes``) will hold: at least the input.

        With a hint (while it holds: see :meth:`observe`), the hint plus the learned
        slack. A hint that raises, or answers anything but a finite number of bytes
        of at least 0, raises here (a ``TypeError`` saying what it answered): the map
        hands that error out in the element's place, as any error of the user's code.
        Without one, the larger of the largest output so far and the input's size
        at the ratio of the largest output to the largest input, capped at the
        share: a guess must not refuse.
        """
        if self.hint is None or self._distrust:
            return max(nbytes, self._largest, min(int(nbytes * self._ratio), self.buffer.limit))
        said = self.hint(element)
        if not is_byte_count(said):
            raise TypeError(
                f"output_nbytes returned {said!r:.60} for this element: it must return the "
                "bytes the map's output will hold, a finite number of at least 0")
        return max(nbytes, int(said) + (self._slack or 0))

    def guess(self, element: Any, nbytes: int) -> int:
        """:meth:`expect` for an input whose hint answered before (a tail handed back):
        should it fail now, the largest output so far."""
        try:
            return self.expect(element, nbytes)
        except Exception:
            return max(nbytes, self._largest)

    def may_start(self, alone: bool) -> bool:
        """Whether a new call may start: always when nothing else is in flight or ready
        (progress), else only while an output of the largest size so far fits (and,
        where calls run in worker processes, its copy: see :meth:`pack_reserve`)."""
        largest = self._largest
        if alone:
            return True
        # (the copy as bytes pending beside it: a stage's minimum stays one output)
        return self.buffer.fits(largest, pending=largest if self.packs else 0)

    def pack_reserve(self) -> Reservation:
        """Book, for a call about to start in a worker process, the output it holds
        beside its copy while it packs it into shared memory: one output at the
        largest size so far, while the call runs. Without it, each worker running
        held one such output unbooked (three workers raising 8 MiB errors: 24 MiB).
        Not booked where it does not fit (a call that must start for progress)."""
        nbytes = self._largest
        if not nbytes or self.buffer.room() < nbytes:
            return NO_RESERVATION
        return self.buffer.book_existing_total([nbytes], count=False)

    def room(self) -> int:
        """What is left of the share beside what the stage holds."""
        return self.buffer.room()

    def fits(self, nbytes: int, pending: int = 0) -> bool:
        """Whether ``nbytes`` more fit beside what the stage holds and ``pending``."""
        return self.buffer.room() >= pending + nbytes

    def call_bytes(self, calls: int, room: int | None = None) -> int:
        """The most a new call should book, with up to ``calls`` in flight: what fits
        beside what the stage holds (``room``, where the caller just asked it), and a
        fraction of the share, so that calls run side by side (its first input may pass
        it: see the map's chunks)."""
        if room is None:
            room = self.buffer.room()
        # (compares, not max() and min(): once per call started)
        divisor = calls if calls < CALL_FRACTION else CALL_FRACTION
        share = self.buffer.limit // (divisor if divisor > 1 else 1)
        if share < 1:
            share = 1
        return room if room < share else share

    # -- booking ---------------------------------------------------------------------------

    def add(self, ticket: Ticket, nbytes: int, expected: int, upstream: Reservation) -> None:
        """Put one input on ``ticket``: ``nbytes`` its own size, ``expected`` its output's.

        An input booked upstream moves onto this stage at once, since the stage
        above may wait for that room to give the next input. The others are
        booked together by :meth:`book`.
        """
        ticket.expected.append(expected)
        ticket.inputs.append(nbytes or 1)  # (a sizer may say 0: a ratio's divisor)
        if upstream.account is None:
            ticket.pending += expected
            return
        ticket.bookings.append(self.buffer.book_existing_total([expected], count=False))
        ticket.booked += expected
        upstream.release()

    def book(self, ticket: Ticket) -> Ticket:
        """Book what :meth:`add` left pending, as one booking. The inputs exist, so it is
        booked as it is: past the share only if the first input did not fit alone.

        The ticket takes the slack learned so far (its expectations included it).
        """
        ticket.slack = self._slack or 0
        if ticket.pending:
            ticket.bookings.append(
                self.buffer.book_existing_total([ticket.pending], count=False))
            ticket.booked += ticket.pending
            ticket.pending = 0
        return ticket

    def split(self, ticket: Ticket, at: int, head: int | None = None) -> Ticket:
        """The inputs from position ``at`` on, as a ticket of their own.

        ``head``: what the inputs before ``at`` hold (their outputs' costs, once
        made); by default what they are expected to. The head keeps its part of
        the booking first, and the tail gets what is left, up to its own
        expectation. The booking is the call's allowance, and outputs that jumped
        in size spent it: handed on whole, it would let the tail make as much
        again while the head's outputs are booked anew (a share's worth past the
        share per hand-on). Nothing is booked or released; an overdraft's excess
        stays with the head, so the split books exactly what the ticket did.
        """
        tail = Ticket()
        if head is None:
            head = sum(ticket.expected[:at])
        tail.expected, ticket.expected = ticket.expected[at:], ticket.expected[:at]
        tail.inputs, ticket.inputs = ticket.inputs[at:], ticket.inputs[:at]
        movable = sum(
            booking.nbytes - (booking.excess if isinstance(booking, Overdraft) else 0)
            for booking in ticket.bookings if booking.account is not None
        )
        nbytes = min(sum(tail.expected), movable - head)
        carved: Reservation = NO_RESERVATION
        for booking in ticket.bookings:
            if nbytes <= 0:
                break
            movable = booking.nbytes - (booking.excess if isinstance(booking, Overdraft) else 0)
            take = min(movable, nbytes)
            if take <= 0 or booking.account is None:
                continue
            booking.nbytes -= take
            nbytes -= take
            carved = carved.absorb(Reservation(booking.account, take))
        if carved.nbytes:
            tail.bookings.append(carved)
        tail.booked = carved.nbytes
        ticket.booked -= carved.nbytes
        return tail

    def top_up(self, ticket: Ticket, elements: list[Any]) -> Ticket:
        """Re-expect a handed-back tail at what is known now, and book the growth that
        fits beside what the stage holds (never past the share: the allowance stops
        the call instead). ``elements``: the tail's inputs, for the hint."""
        expected = [
            self.guess(element, nbytes)
            for element, nbytes in zip(elements, ticket.inputs, strict=True)
        ]
        ticket.expected = expected
        ticket.slack = self._slack or 0
        grant = min(sum(expected) - ticket.booked, self.buffer.room())
        if grant > 0:
            ticket.bookings.append(self.buffer.book_existing_total([grant], count=False))
            ticket.booked += grant
        return ticket

    def settle(
        self, ticket: Ticket, sizes: list[int], inputs: list[int], *, whole: bool
    ) -> list[Reservation | MemoryBudgetError]:
        """Outputs arrived: learn from them, release the ticket, book them as they are.

        ``sizes``: the outputs' costs; ``inputs``: their inputs' sizes. ``whole``: the
        call ran every input of the ticket without error (only then is the hint's
        slack learned: the booking then covers exactly these outputs). What passes
        the share is booked as an overdraft, which keeps new calls from starting
        until it drains; the allowance keeps it to one element per call.

        An output the pipeline can never hold (larger than the whole budget, with the
        other stages' minima) gets its refusal in its place, not a booking: the
        caller hands the error out at that element's position and drops the output,
        and the call's other outputs go on (raised for the whole call, they were lost).
        """
        if sizes:
            self._learn(sizes, inputs, ticket.booked if whole else None, ticket.slack)
            self._settled = True
        release_all(ticket.bookings)
        ticket.bookings.clear()
        ticket.booked = 0
        if not sizes:
            return []
        refused: dict[int, MemoryBudgetError] = {}
        buffer = self.buffer
        for position, nbytes in enumerate(sizes):
            if nbytes <= buffer.limit:  # (what expect checks first: a call per element less)
                continue
            try:
                buffer.expect(nbytes)
            except MemoryBudgetError as error:
                refused[position] = error
        if not refused:
            return list(self.buffer.admit_existing(sizes))
        kept = iter(self.buffer.admit_existing(
            [nbytes for position, nbytes in enumerate(sizes) if position not in refused]))
        return [refused[position] if position in refused else next(kept)
                for position in range(len(sizes))]

    def hold_error(self, nbytes: int) -> Reservation:
        """Book an error (of ``nbytes``) that a call raised in an output's place, held
        until its turn. It is never refused: the user's error must come out.

        A user's exception may carry large data (the rows it refused), and later
        calls may raise as large ones. So it counts as an output for the estimate
        of what a call will hold (capped at the share: a guess must not refuse),
        and fewer calls start. It does not teach the output/input ratio.
        """
        learned = min(nbytes, self.buffer.share())
        if learned > self._largest:
            self._largest = learned
        return self.buffer.overdraw(nbytes)

    def _learn(
        self, sizes: list[int], inputs: list[int], booked: int | None, slack: int
    ) -> None:
        largest = min(max(sizes), self.buffer.limit)  # (larger: refused)
        if largest > self._largest:
            self._largest = largest
        if self.hint is None:
            top_input = max(inputs)
            if largest > self._top_output or top_input > self._top_input:
                self._top_output = max(self._top_output, largest)
                self._top_input = max(self._top_input, top_input)
                self._ratio = self._top_output / self._top_input
        elif booked is not None:  # booked at the hints (plus ``slack`` each): what the
            # outputs cost beyond the hints alone (a booking that included the slack
            # must not teach that there is none)
            excess = max(0, slack - ((booked - sum(sizes)) // len(sizes)))
            self._slack = excess if self._slack is None else min(self._slack, excess)
