"""The in-flight ledger driven directly, by threads, with adversarial output sizes.

A small map is simulated over :class:`~headrace._memory.inflight.InFlight` and
its :class:`~headrace._memory.buffer.Buffer`: worker threads book a chunk ahead,
"compute" outputs whose sizes the ledger learns only after the work, stop at
their allowance and hand the rest back, then settle; a releaser thread drops
settled outputs at random moments. Sizes come from generators an adversary
would pick: a x1000 regime jump after thousands of small outputs, giants and
dwarfs in turn, heavy tails, inputs that grow at a fixed ratio, and outputs
larger than the whole budget.

The oracle is the promise itself, checked under one lock at every step:

- a call holds at most one element past its allowance (what was booked for it);
- the stage's bookings pass its share only by the overshoot of settled calls,
  at most one element each;
- so the real bytes (settled outputs alive plus outputs made in calls) stay
  within the share plus one element per call in flight or settled past its
  allowance;
- an output larger than the whole budget raises MemoryBudgetError naming the
  stage and the size, and the bookings go back.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import pytest

from headrace._errors import MemoryBudgetError
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import NO_RESERVATION, Reservation, release_all
from headrace._memory.inflight import InFlight, Ticket, over_allowance

KiB = 1024
SHARE = 1024 * KiB
DISTRIBUTIONS = ("regime", "giant_dwarf", "heavy", "ratio", "over_budget", "lying_hint")


def _sizes(rng: random.Random, distribution: str, count: int) -> tuple[list[int], list[int]]:
    """(input sizes, output sizes): the outputs are what the ledger learns only later."""
    inputs = [rng.randint(16, 256) for _ in range(count)]
    if distribution == "regime":  # thousands of small outputs, then x1000
        jump = rng.randint(count // 2, count - 50)
        small = rng.randint(64, 256)
        outputs = [small if i < jump else small * 1000 for i in range(count)]
    elif distribution == "giant_dwarf":
        giant = rng.randint(SHARE // 8, SHARE // 3)
        outputs = [giant if i % 2 else rng.randint(8, 64) for i in range(count)]
    elif distribution == "heavy":
        outputs = [min(int(64 * rng.paretovariate(0.8)), SHARE // 2) for _ in range(count)]
    elif distribution == "ratio":  # small inputs size the calls, then large ones come
        jump = rng.randint(count // 4, count - 20)
        inputs = [64 if i < jump else 64 * 200 for i in range(count)]
        outputs = [4 * nbytes for nbytes in inputs]
    elif distribution == "lying_hint":  # a hint of 100 B holds, then outputs jump x1000
        jump = rng.randint(count // 4, count - 20)
        outputs = [rng.randint(60, 100) if i < jump else 100_000 for i in range(count)]
    else:  # over_budget: one output larger than the whole budget
        outputs = [rng.randint(64, 4 * KiB) for _ in range(count)]
        outputs[rng.randrange(count // 2, count)] = SHARE + rng.randint(1, SHARE)
    return inputs, outputs


@dataclass
class _Running:
    allowance: int
    produced: int = 0
    last: int = 0


@dataclass
class _Sim:
    ledger: InFlight
    inputs: list[int]
    outputs: list[int]
    chunk: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_input: int = 0
    running: dict[int, _Running] = field(default_factory=dict)
    #: handed-back tails waiting for their booking to cover their first input: thread ->
    #: that input's position (the earliest is the one the map's consumer would force)
    waiting: dict[int, int] = field(default_factory=dict)
    #: settled outputs still alive: (their bookings, their bytes, the call's overshoot)
    alive: list[tuple[list[Reservation], int, int]] = field(default_factory=list)
    refused: list[MemoryBudgetError] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)  # raised in the threads
    stop: bool = False
    done: int = 0
    steps: int = 0
    largest_excess: int = 0

    def check(self) -> None:
        """The promise, at this step (call holding the lock)."""
        self.steps += 1
        share = self.ledger.share()
        held = self.ledger.buffer.stats().held
        for call in self.running.values():  # one element past the allowance, at most
            assert call.produced - call.last <= call.allowance, (call, share)
        overshoot = sum(over for _, _, over in self.alive)
        assert held <= share + overshoot, (held, share, overshoot)
        real = sum(nbytes for _, nbytes, _ in self.alive) + sum(
            call.produced for call in self.running.values())
        slack = overshoot + sum(call.last for call in self.running.values())
        assert real <= share + slack, (real, share, slack)
        self.largest_excess = max(self.largest_excess, real - share)


def _worker(sim: _Sim, rng: random.Random, ident: int) -> None:
    try:
        _work(sim, rng, ident)
    except BaseException as error:  # the main thread raises it
        with sim.lock:
            sim.failures.append(error)
            sim.stop = True
            sim.running.pop(ident, None)


def _work(sim: _Sim, rng: random.Random, ident: int) -> None:
    ledger = sim.ledger
    rest: tuple[Ticket, int] | None = None  # a handed-back tail and its first input
    while True:
        with sim.lock:
            if sim.stop:
                if rest is not None:
                    rest[0].release()
                return
            idle = not sim.running and not sim.alive
            if rest is not None:  # as the map: a tail starts once its booking covers its
                # first input; the earliest one also when nothing else runs or is held
                # (the consumer waits for it: progress)
                ticket = ledger.top_up(rest[0], [None] * len(rest[0]))
                alone = idle and rest[1] == min(sim.waiting.values())
                if ticket.covers_first() or alone:
                    first, rest = rest[1], None
                    del sim.waiting[ident]
                else:
                    ticket = None
            else:
                alone = idle and not sim.waiting
                if sim.next_input >= len(sim.inputs):
                    return
                if not ledger.may_start(alone):
                    ticket = None
                else:
                    ticket, first = Ticket(), sim.next_input
                    spent = 0
                    while len(ticket) < sim.chunk and sim.next_input < len(sim.inputs):
                        nbytes = sim.inputs[sim.next_input]
                        expected = ledger.expect(None, nbytes)
                        if not ledger.fits(expected, spent) and (len(ticket) or not alone):
                            break
                        ledger.add(ticket, nbytes, expected, NO_RESERVATION)
                        spent += expected
                        sim.next_input += 1
                    if not len(ticket):
                        ticket = None
                    else:
                        ledger.book(ticket)
            if ticket is not None:
                # nothing else runs or is held: it runs its first input whatever was
                # booked (the map's consumer waiting for it: progress)
                forced = alone
                call = sim.running[ident] = _Running(ticket.allowance)
                sim.check()
        if ticket is None:
            time.sleep(rng.random() * 1e-4)
            continue
        count, sizes = len(ticket), []
        for position in range(count):
            if rng.random() < 0.3:
                time.sleep(0)  # another thread's turn
            with sim.lock:  # an output at the largest size seen would pass: hand it back
                if (position or not forced) and ledger.stop_before(call.produced, call.allowance):
                    break
            size = sim.outputs[first + position]
            with sim.lock:
                call.produced += size
                call.last = size
                sizes.append(size)
                ledger.observe(size, call.allowance)
                sim.check()
            if over_allowance(call.produced, call.allowance, count - position - 1):
                break
        with sim.lock:
            ran = len(sizes)
            # the head keeps what its outputs cost; the tail gets what is left
            tail = ledger.split(ticket, ran, sum(sizes)) if ran < count else None
            # past what the call was booked: its last output at most
            overshoot = max(0, sum(sizes) - call.allowance)
            assert overshoot <= call.last, (overshoot, call)
            booked = ledger.settle(ticket, sizes, ticket.inputs, whole=tail is None)
            del sim.running[ident]
            # an output that can never fit comes back as its refusal, in its place: the
            # map drops it and hands the error out there; the other outputs go on
            kept = [(booking, size) for booking, size in zip(booked, sizes, strict=True)
                    if not isinstance(booking, MemoryBudgetError)]
            sim.refused += [booking for booking in booked if isinstance(booking, MemoryBudgetError)]
            if kept:
                sim.alive.append(([booking for booking, _ in kept],
                                  sum(size for _, size in kept), overshoot))
            sim.done += ran
            sim.check()
            if tail is not None:
                rest = (tail, first + ran)
                sim.waiting[ident] = first + ran


def _releaser(sim: _Sim, rng: random.Random, workers: list[threading.Thread]) -> None:
    while any(worker.is_alive() for worker in workers) or sim.alive:
        with sim.lock:
            if sim.alive and rng.random() < 0.7:
                bookings, _, _ = sim.alive.pop(rng.randrange(len(sim.alive)))
                for booking in bookings:
                    booking.release()
                sim.check()
        time.sleep(rng.random() * 2e-4)


def _run(seed: int, longest: int) -> _Sim:
    rng = random.Random(seed)
    distribution = DISTRIBUTIONS[seed % len(DISTRIBUTIONS)]
    count = rng.randint(longest // 5, longest)
    inputs, outputs = _sizes(rng, distribution, count)
    budget = MemoryBudget(SHARE)
    buffer = budget.account("map(sim)", weight=1.0)
    budget.allot()
    hint = (lambda _: 100) if distribution == "lying_hint" else None
    sim = _Sim(InFlight(buffer, hint), inputs, outputs, chunk=rng.choice([1, 8, 64, 256]))
    workers = [
        threading.Thread(target=_worker, args=(sim, random.Random(seed * 31 + k), k))
        for k in range(rng.randint(1, 4))
    ]
    releaser = threading.Thread(target=_releaser, args=(sim, random.Random(seed + 7), workers))
    for thread in workers:
        thread.start()
    releaser.start()
    for thread in workers:
        thread.join(30)
    releaser.join(30)
    assert not releaser.is_alive() and not any(thread.is_alive() for thread in workers)
    if sim.failures:
        raise sim.failures[0]
    largest = max(outputs)
    if largest > SHARE:  # the oracle: an output past the whole budget is refused
        assert sim.refused, f"seed {seed}: a {largest}-byte output was not refused"
        message = str(sim.refused[0])
        assert "map(sim)" in message, message
    else:
        assert not sim.refused, sim.refused
        assert sim.done == count  # every input ran once: the hand-backs lost nothing
    assert buffer.stats().held == 0  # every booking went back
    return sim


@pytest.mark.parametrize("seed", range(10))
def test_in_flight_stays_within_share_plus_one_element_per_call(seed: int) -> None:
    _run(seed, longest=1000)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 210))
def test_in_flight_stays_within_share_plus_one_element_per_call_more_seeds(seed: int) -> None:
    _run(seed, longest=4000)


def test_a_ticket_split_moves_its_booking_without_booking_anything() -> None:
    budget = MemoryBudget(SHARE)
    buffer = budget.account("map(split)", weight=1.0)
    budget.allot()
    ledger = InFlight(buffer)
    ticket = Ticket()
    for nbytes in (100, 200, 300, 400):
        ledger.add(ticket, nbytes, nbytes, NO_RESERVATION)
    ledger.book(ticket)
    assert buffer.stats().held == 1000
    tail = ledger.split(ticket, 1)
    assert (ticket.allowance, tail.allowance, len(ticket), len(tail)) == (100, 900, 1, 3)
    assert buffer.stats().held == 1000
    ledger.settle(ticket, [150], [100], whole=True)[0].release()
    tail.release()
    assert buffer.stats().held == 0


def test_a_split_after_outputs_jumped_leaves_the_tail_what_they_did_not_spend() -> None:
    """A call booked 4 x 100 B made one output of 350 B and stopped: the head keeps
    350 B of the booking and the tail gets the 50 B left, not its expected 300 B (it
    would make that much again while the 350 B output is booked anew at settling)."""
    budget = MemoryBudget(SHARE)
    buffer = budget.account("map(split)", weight=1.0)
    budget.allot()
    ledger = InFlight(buffer)
    ticket = Ticket()
    for _ in range(4):
        ledger.add(ticket, 10, 100, NO_RESERVATION)
    ledger.book(ticket)
    tail = ledger.split(ticket, 1, 350)
    assert (ticket.allowance, tail.allowance, len(tail)) == (350, 50, 3)
    assert buffer.stats().held == 400
    booked = ledger.settle(ticket, [350], [10], whole=False)
    assert buffer.stats().held == 400  # the output and the tail's 50 B
    release_all(booked)
    tail.release()
    assert buffer.stats().held == 0
    # outputs that cost all of it: the tail starts with nothing booked
    ticket = ledger.book(_ticket(ledger, [100, 100, 100]))
    tail = ledger.split(ticket, 1, 900)
    assert (ticket.allowance, tail.allowance) == (300, 0)
    release_all(ledger.settle(ticket, [900], [10], whole=False))
    tail.release()
    assert buffer.stats().held == 0


def _ticket(ledger: InFlight, expected: list[int]) -> Ticket:
    ticket = Ticket()
    for nbytes in expected:
        ledger.add(ticket, 10, nbytes, NO_RESERVATION)
    return ticket


def test_a_call_in_a_worker_process_books_the_output_it_packs_beside_its_copy() -> None:
    """Where calls run in worker processes (``packs``), a new call starts only while an
    output of the largest size and its copy fit, and books one such output while it
    runs (:meth:`InFlight.pack_reserve`); none where it does not fit."""
    budget = MemoryBudget(SHARE)
    buffer = budget.account("map(packs)", weight=1.0)
    budget.allot()
    threads, processes = InFlight(buffer), InFlight(buffer, packs=True)
    for ledger in (threads, processes):
        ticket = Ticket()
        ledger.add(ticket, 10, SHARE // 3, NO_RESERVATION)
        ledger.settle(ledger.book(ticket), [SHARE // 3], [10], whole=True)[0].release()
    assert threads.largest() == processes.largest() == SHARE // 3
    held = buffer.admit(SHARE // 2, elements=0)  # room for one output, not for two
    assert threads.may_start(alone=False) and not processes.may_start(alone=False)
    assert processes.may_start(alone=True)  # progress
    reserve = processes.pack_reserve()
    assert reserve.nbytes == SHARE // 3 and buffer.stats().held == SHARE // 2 + SHARE // 3
    assert processes.pack_reserve() is NO_RESERVATION  # a second one does not fit
    reserve.release()
    held.release()
    assert buffer.stats().held == 0
