"""Which inputs go into one call of a parallel map: chunks sized by time and by bytes.

Time: a call is given several elements when ``fn`` is quick, so that the fixed
cost of a thread hand-off (20-200 us with the GIL contended) stays small against
the work it carries (:class:`ChunkSize`). Bytes: each input is booked at its
expected output size on the stage's in-flight ledger as it is pulled
(:class:`InputFeed`); a chunk books at most what fits beside what the stage holds
and a fraction of the share, so that several calls run side by side. An input
whose expected output does not fit ends its chunk and waits aside, its upstream
booking kept, until room comes back (:meth:`InputFeed.take_aside`).

The feed is also where the input is: its state after the last input pulled and
that input's index, from which every chunk records where it starts (a checkpoint
inside a chunk restores the state and skips the elements already out).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from headrace._errors import Origin, note_element_error
from headrace._memory.buffer import Reservation
from headrace._memory.inflight import InFlight, Ticket
from headrace._transforms._map_calls import Call
from headrace.core.handoff import restore_input, unpin
from headrace.core.iterator import Context, Iterator, origin_probe

__all__ = ["MAX_CHUNK", "TARGET_CALL_SECONDS", "Aside", "ChunkSize", "InputFeed"]

#: How long a call on threads should run: chunks grow to it. Each call costs the
#: consumer some 50-100 us with the GIL held (its inputs pulled, its outputs booked,
#: its hand-offs), so a map of 1 ms images on 2 threads gave 8% of the GIL to that
#: at 2 ms calls, and its threads waited on an empty queue 8% of the time: at 8 ms,
#: 6-20% more images a second for 3-10% less CPU (plain tf.image on threads, A/B in
#: alternation; benchmarks/bench_images.py), cheap and 0.1-0.3 ms maps unchanged.
TARGET_CALL_SECONDS = 8e-3
#: The most inputs in one call (a checkpoint's skip inside a chunk is at most this).
MAX_CHUNK = 256


class ChunkSize:
    """How many inputs the next call gets: as many as ``fn`` runs in ``target_seconds``
    at the speed the last call showed, at most ``most``."""

    __slots__ = ("chunk", "most", "target_seconds")

    def __init__(self, target_seconds: float, most: int) -> None:
        self.chunk = 1
        self.target_seconds, self.most = target_seconds, most

    def learn(self, seconds: float, ran: int) -> None:
        """A call ran ``ran`` inputs in ``seconds``."""
        per_element = seconds / max(ran, 1)
        if per_element > 0:
            wanted = int(self.target_seconds / per_element) or 1
            self.chunk = max(1, min(self.most, wanted))


class Aside(NamedTuple):
    """An input pulled but not started (its expected output did not fit yet): the
    last position of its chunk (``state_before``, ``first_index``: the chunk's)."""

    element: Any
    reservation: Reservation  # its upstream booking, kept while it waits
    nbytes: int
    origin: Any
    state_before: dict[str, Any]
    first_index: int
    position: int


class InputFeed:
    """The map's input: pulled a chunk at a time, each input booked on the ledger.

    ``state_after`` is the input's state after the last input pulled and
    ``next_index`` the index of the next one; ``exhausted``: the input ended;
    ``aside``: an input that waits for room (:meth:`take_aside`).
    """

    __slots__ = (
        "aside", "exhausted", "inner", "ledger", "next_index", "probe", "sizeof", "stage",
        "state_after",
    )

    def __init__(self, inner: Iterator, ctx: Context, ledger: InFlight, stage: str) -> None:
        self.inner, self.ledger, self.stage = inner, ledger, stage
        self.sizeof = ctx.sizeof
        self.state_after = inner.get_state()
        self.next_index = 0
        self.exhausted = False
        # Where the input's elements come from: asked per element pulled (a call ahead
        # of their failing), so the chain of stages passing it through is walked once.
        self.probe = origin_probe(inner)
        self.aside: Aside | None = None

    def origin(self, token: Any) -> Origin | None:
        """Where the input element of ``token`` (taken as it was pulled) comes from."""
        return None if self.probe is None else self.probe[1](token)

    # (The loop runs per input: it keeps the ledger's guess and add's common case
    # inline, where a helper would cost a Python call per input.)
    def pull_chunk(self, count: int, calls: int, alone: bool) -> Call:  # noqa: C901
        """A call (not started) of up to ``count`` inputs, booked at their expected output
        size, and the error the input raised after them (which ends the chunk), if any.

        A chunk books at most what fits beside what the stage holds, and at most its
        part of the share with up to ``calls`` in flight (:meth:`InFlight.call_bytes`).
        An input whose expected output does not fit (known only once it is pulled: a
        larger output/input ratio, or what ``output_nbytes`` says of it) ends the chunk
        and waits aside for room, unless nothing else is held (``alone``: no call in
        flight or ready). The ledger books the inputs (see :meth:`InFlight.add`).
        """
        state_before, first_index = self.state_after, self.next_index
        elements: list[Any] = []
        ticket = Ticket()
        upstream_error: Exception | None = None
        inner, sizeof, ledger = self.inner, self.sizeof, self.ledger
        expect, add = ledger.expect, ledger.add
        probe = None if self.probe is None else self.probe[0]
        origins: list[Any] | None = None if probe is None else []
        estimate = ledger.largest()
        room = ledger.room()
        share = ledger.share()  # (expect's cap, read once a chunk)
        cap = ledger.call_bytes(calls, room)
        spent = 0  # bytes this chunk books
        while len(elements) < count and (not elements or spent + estimate <= cap):
            try:
                element, reservation = inner.pull()
            except StopIteration:
                self.exhausted = True
                break
            except Exception as error:  # an upstream element's error: handed out in its place
                upstream_error = unpin(error)  # held by the call: must pin no element
                break
            origin = None if probe is None else probe()
            # A call in flight will soon hold its output: book the larger of the two
            # (the output's size from the input itself, where output_nbytes says it).
            nbytes = sizeof(element)
            try:
                if ledger.hint is None or ledger._distrust:  # (expect's guess, inlined)
                    size = int(nbytes * ledger._ratio)
                    if size > share:
                        size = share
                    largest = ledger._largest
                    if largest > size:
                        size = largest
                    if nbytes > size:
                        size = nbytes
                else:
                    size = expect(element, nbytes)
            except Exception as error:  # output_nbytes failed: the element's error, in its place
                reservation.release()
                upstream_error = self._hint_failed(error, origin, first_index + len(elements))
                break
            # (at most the estimate: it was checked to fit before the pull)
            if size > estimate and spent + size > (cap if elements else room) and (
                elements or not alone
            ):
                self.aside = Aside(element, reservation, nbytes, origin,
                                   state_before, first_index, len(elements))
                break
            elements.append(element)
            if origins is not None:
                origins.append(origin)
            if reservation.account is None:  # (add's common case, inlined: per element)
                ticket.expected.append(size)
                ticket.inputs.append(nbytes or 1)  # (a sizer may say 0: a ratio's divisor)
                ticket.pending += size
            else:
                add(ticket, nbytes, size, reservation)
            spent += size
        self._advance(len(elements) + (upstream_error is not None) + (self.aside is not None))
        return Call(ledger.book(ticket), elements, state_before, first_index,
                    upstream_error, origins, 0)

    def _hint_failed(self, error: Exception, origin: Any, index: int) -> Exception:
        """The error of ``output_nbytes`` on the input at ``index``, noted as that
        element's (handed out in its place), pinning nothing."""
        where = None if origin is None else self.origin(origin)
        return unpin(note_element_error(error, f"{self.stage}'s output_nbytes", index, where))

    def _advance(self, count: int) -> None:
        """``count`` more input positions were taken (elements, an error, an input set
        aside): the input's state now is where the next chunk starts."""
        if count:
            self.state_after = self.inner.get_state()
            self.next_index += count

    def take_aside(self, alone: bool) -> Call | None:
        """A call (not started) of the input set aside, booked, once its expected output
        fits beside what the stage holds (or ``alone``: nothing else in flight or ready,
        progress); None while it must wait."""
        aside = self.aside
        assert aside is not None
        ledger = self.ledger
        size = ledger.guess(aside.element, aside.nbytes)
        if not alone and not ledger.fits(size):
            return None
        self.aside = None
        ticket = Ticket()
        ledger.add(ticket, aside.nbytes, size, aside.reservation)
        return Call(ledger.book(ticket), [aside.element], aside.state_before,
                    aside.first_index, None,
                    None if aside.origin is None else [aside.origin], aside.position)

    def earliest(self) -> tuple[int, Any, int]:
        """Where the next input not pulled is, or the input set aside: its index, the
        input's state before its chunk, its position in the chunk."""
        aside = self.aside
        if aside is None:
            return self.next_index, self.state_after, 0
        return aside.first_index + aside.position, aside.state_before, aside.position

    def restore(self, inner_state: Any, skip: int) -> None:
        """Start again from the input restored to ``inner_state``, ``skip`` elements past
        it (the caller sets ``next_index``, the index of that element)."""
        restore_input(self.inner, inner_state, skip, self.stage)
        self.state_after = self.inner.get_state()
        self.exhausted = False

    def drop_aside(self) -> None:
        """Give the input set aside back (its upstream booking with it)."""
        if self.aside is not None:
            self.aside.reservation.release()
            self.aside = None
