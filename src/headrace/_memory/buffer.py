"""A buffering stage's holding against its share of the budget: the *buffer* primitive.

Every stage that holds elements (a shuffle's buffer, a prefetch queue, a batch
being assembled, an interleave's open slots, a cache's write buffer, a reader's
read-ahead, an adapter's ring) holds them through one :class:`Buffer`. The buffer
is the only place where bytes are checked against the share and booked. A stage
asks it questions (:meth:`Buffer.fits`, :meth:`Buffer.room`) and books through it:
:meth:`Buffer.enter` waits for room and books, :meth:`Buffer.admit` books what it
checked, and an :class:`Assembly` holds a batch being built. It never reads or
writes the counters. Work whose outputs do not exist yet (a map's calls in flight)
is booked through the in-flight ledger (:mod:`headrace._memory.inflight`).

Reservations move with their element (:class:`Reservation`): a stage that
takes an element from a buffering stage books it on its own buffer first and
then releases the upstream booking, so the element is never uncounted.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headrace._errors import MemoryBudgetError
from headrace._memory.allocator import note_released
from headrace._memory.units import format_bytes

if TYPE_CHECKING:
    from headrace._memory.budget import MemoryBudget

__all__ = [
    "NO_RESERVATION",
    "AccountStats",
    "Assembly",
    "BudgetClosed",
    "Buffer",
    "Reservation",
    "release_all",
]


class RefusedAbove(MemoryBudgetError):
    """A nested budget could not widen: the stage holding it was refused (its message)."""


class BudgetClosed(Exception):
    """Raised inside a waiting producer when its iterator closes (internal)."""


@dataclass(frozen=True)
class AccountStats:
    """A snapshot of one stage's bookings."""

    name: str
    limit: int
    held: int
    peak: int
    elements: int
    max_element: int
    #: Most bytes held past the share as an overdraft (outputs that outgrew their estimate).
    overdrawn_peak: int = 0
    #: Bytes held past the share as an overdraft now.
    overdrawn: int = 0


class Buffer:
    """What one buffering stage holds, against its share (``limit``) of the budget."""

    def __init__(
        self, budget: MemoryBudget, name: str, weight: float, *, sets_order: bool = False
    ) -> None:
        self.budget = budget
        self.name = name
        self.weight = weight
        self.sets_order = sets_order
        self.limit = 0
        #: The bytes this stage must be able to hold at once (see :meth:`require`).
        self.minimum = 0
        self.minimum_what = ""
        self.held = 0
        self.peak = 0
        self.elements = 0
        self.max_element = 0
        #: Bytes held beyond the share by :meth:`admit_existing` (outputs larger than
        #: their estimate), now and at peak: the only way ``held`` may pass ``limit``.
        self.overdrawn = 0
        self.overdrawn_peak = 0
        #: Bookings that took the stage past its share other than as an overdraft.
        self.breaches = 0
        #: The budget shared by pipelines that this stage's run draws from (the
        #: process-wide default), or None: see :class:`MemoryBudget` for the rule.
        self._pool: MemoryBudget | None = budget.pool
        self._pool_floor = 0  # the floor last counted on the pool
        self._pool_slack = 0  # and what of it was unfilled: max(0, floor - held)
        self._together = 0  # the most it had to hold at once (a batch's rows), on a pool
        self._changed = budget.changed
        self.lock = budget.lock  # the condition's lock: bookings take only this

    # -- as the parent of a nested pipeline's budget (an interleave slot's) ----------------
    # Everything the nested stages book is this stage's holding: it shows in its stats,
    # counts against its share (which re-splits may lower) and against the budget above.

    @property
    def used(self) -> int:
        return self.held

    @property
    def total(self) -> int:
        return self.limit

    @property
    def parent(self) -> MemoryBudget:
        return self.budget

    @property
    def changed(self) -> threading.Condition:
        return self._changed

    @property
    def waiting(self) -> list[int]:
        return self.budget.waiting

    # -- the questions a stage may ask (stages never read the counters themselves) --------

    def share(self) -> int:
        """The bytes this stage may hold now (a re-split may change it)."""
        return self.limit

    def room(self) -> int:
        """What is left of the share beside what the stage holds (negative in an overdraft).

        On a budget shared by pipelines, also no more than the pool leaves this stage
        (see :class:`~headrace._memory.budget.MemoryBudget`, "One budget").
        """
        room = self.limit - self.held
        if self._pool is not None:
            with self.lock:
                pooled = self._pool_room()
            if pooled < room:
                room = pooled
        return room

    def is_empty(self) -> bool:
        """True when the stage holds nothing (it may then always take one element)."""
        return not self.held

    def largest(self) -> int:
        """The largest element booked here so far (0 before the first)."""
        return self.max_element

    def admit(
        self, nbytes: int, upstream: Reservation | None = None, *, together: str | None = None,
        elements: int = 1,
    ) -> Reservation:
        """Book an element of ``nbytes`` that enters this stage, taking over its ``upstream``
        booking (released once this one is made: the element is never uncounted).

        ``together``: the stage must hold it together with what it holds already (a
        batch's rows), which then is its minimum working set (see :meth:`require`); the
        text says what is assembled, for the error when it cannot fit. The caller checked
        :meth:`fits` or waited (:meth:`wait_for_room`) first: this books, it does not wait.
        ``elements``: how many elements the bytes are (0: bytes a stage keeps beside
        its elements, such as a scan's state or a reader's index).
        """
        if upstream is not None and upstream.account is not None:
            return upstream.move_to(self, nbytes, together=together)
        if together is not None:
            return self._hold(nbytes, what=together, elements=elements)
        return self._charge(nbytes, elements=elements)

    def _add(self, nbytes: int) -> None:
        held = self.held = self.held + nbytes
        if held > self.peak:
            self.peak = held
        self.budget._add(nbytes)
        if self._pool is not None:
            self._count_on_pool()

    def _check_fits(self, nbytes: int, what: str = "one element") -> None:
        """Make room for ``nbytes`` held alone (a minimum), or raise naming the stage."""
        if nbytes > self.limit:
            self.require(nbytes, what=what)

    def _refusal(self, message: str) -> MemoryBudgetError:
        error = MemoryBudgetError(message)
        error.stage = self.name
        return error

    def require(self, nbytes: int, *, what: str, whole: int = 0) -> None:
        """Declare that this stage must be able to hold ``nbytes`` at once (its minimum).

        Called when the minimum becomes known from the data (the first batch's
        size, say), before the bytes are allocated. Past the stage's share, the
        budget is split again so that it fits; if the minima of all the stages
        cannot fit together, :class:`MemoryBudgetError` names them.
        ``whole``: what all of ``what`` will need, where ``nbytes`` is only the part
        gathered so far (the first rows of a batch): a refusal states that need.
        """
        if nbytes <= self.minimum:
            return
        if self._pool is not None:
            self._refuse_past_pool(self._pool_cost(nbytes, floor=True), f"{what} ({format_bytes(nbytes)})")
        previous = self.minimum, self.minimum_what
        self.minimum, self.minimum_what = nbytes, what
        if nbytes > self.limit:
            try:
                self.budget.allot()
            except RefusedAbove as error:
                self.minimum, self.minimum_what = previous
                raise self._refusal(str(error)) from None
            except MemoryBudgetError:
                stated = max(nbytes, whole)
                self.minimum = stated  # the listing of the minima states it too
                so_far = (
                    f" ({format_bytes(nbytes)} of it gathered so far)" if stated > nbytes else ""
                )
                message = self.budget._minima_message(
                    f"stage {self.name!r} needs {format_bytes(stated)} at once for {what}"
                    f"{so_far}; with the other stages, the pipeline"
                )
                self.minimum, self.minimum_what = previous
                raise self._refusal(message) from None
        if self._pool is not None:
            with self.lock:
                self._count_on_pool()

    def fits(self, nbytes: int, *, pending: int = 0) -> bool:  # noqa: C901
        """Whether an element of ``nbytes`` may enter this stage's buffer now.

        True when it fits beside what the stage holds plus ``pending`` (bytes
        it is about to book), also under a shared default budget's total, or
        when the stage holds nothing and the element fits its share alone. An
        element larger than the whole share first makes the budget split
        itself again (:meth:`require`), or raises :class:`MemoryBudgetError`.
        """
        # Per element (a prefetch's, a shuffle's): _check_fits, _pool_short, _pool_cost
        # and _floor are inlined here, the same arithmetic without four Python calls.
        limit = self.limit
        if nbytes > limit:
            self.require(nbytes, what="one element")
            limit = self.limit
        own = self.held
        held = own + pending
        pool = self._pool
        if not held:
            # (an element within the stage's floor adds nothing to what the pool counts)
            if pool is not None and nbytes > self._floor():
                self._refuse_past_pool(self._pool_cost(nbytes), "one element")
            return True
        after = held + nbytes
        if after > limit:
            return False
        if pool is None:
            return not self.budget.over_shared_cap(pending + nbytes)
        # _pool_short(pending + nbytes): what the booking adds past max(held, floor)
        old = self.minimum
        if self.max_element > old:
            old = self.max_element
        if self._together > old:
            old = self._together
        if own > old:
            old = own
        cost = after - old
        if cost <= 0:  # (within the floor, or what the stage holds: nothing new on the pool)
            return True
        total = pool.total
        if pool.used + pool._slack + cost > total:
            return False
        run = self.budget
        runs = pool._runs
        return run.used + run._slack - run._floors + cost <= (total - pool._floors) // (
            runs if runs > 1 else 1
        )

    def wait_for_room(
        self,
        estimate: int | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        starving: Callable[[], bool] | None = None,
    ) -> None:
        """Block until an element of ``estimate`` bytes (default: the largest seen) fits.

        A stage that holds nothing never waits: it may always hold one element,
        which is what keeps every pipeline moving. ``starving``: the stage's own
        buffer is empty and its consumer waits on it, while what the account holds
        are elements handed on downstream (a booking travels with its element): the
        stage may then take one element too, as an overdraft, since the stages
        holding those bookings may be waiting on the very consumer it feeds. Callers
        wake waiters (:meth:`wake`) when that becomes true.
        """
        nbytes = self.max_element if estimate is None else estimate
        if estimate is not None:
            self._check_fits(nbytes)
        with self._changed:
            if not self.held and self._pool is not None:
                self._refuse_past_pool(self._pool_cost(nbytes), "one element")
            while self.held and (
                self.held + nbytes > self.limit
                or (
                    self._pool_short(nbytes) if self._pool is not None
                    else self.budget.over_shared_cap(nbytes)
                )
            ):
                if starving is not None and starving():
                    break
                if self.budget._closed or (cancelled is not None and cancelled()):
                    raise BudgetClosed
                self.budget.waiting[0] += 1
                try:
                    self._changed.wait()
                finally:
                    self.budget.waiting[0] -= 1
            if self.budget._closed or (cancelled is not None and cancelled()):
                raise BudgetClosed

    def wake(self) -> None:
        """Wake producers waiting for room (so they can notice a stop request)."""
        with self._changed:
            self._changed.notify_all()

    def _charge(self, nbytes: int, *, elements: int = 1) -> Reservation:
        """Book ``nbytes`` for ``elements`` elements (one, by default) now held by this stage."""
        if nbytes > self.limit:
            self._check_fits(nbytes)
        with self.lock:
            self._book(nbytes, elements)
        return Reservation(self, nbytes)

    def _book(self, nbytes: int, elements: int = 1, *, overdraft: int = 0) -> None:
        """Add the bytes of ``elements`` elements (call holding the lock).

        ``overdraft``: the part of them booked past the share knowingly (see
        :meth:`admit_existing`). Any other booking that takes what the stage
        holds past its share is a *breach* of the contract, counted (tests
        assert there are none).
        """
        held = self.held
        within = held - self.overdrawn
        if overdraft:
            self.overdrawn += overdraft
            self.overdrawn_peak = max(self.overdrawn_peak, self.overdrawn)
        limit = self.limit
        if within + nbytes - overdraft > (limit if limit > within else within):
            self.breaches += 1
        held = self.held = held + nbytes
        if held > self.peak:
            self.peak = held
        self.elements += elements
        # elements=0: bytes booked ahead for work in flight, or its growth (not an element)
        per_element = nbytes if elements <= 1 else nbytes // elements
        if elements and per_element > self.max_element:
            self.max_element = per_element
        self.budget._add(nbytes)
        if self._pool is not None and (
            self._pool_slack or held < self._pool_floor or self.max_element > self._pool_floor
        ):
            self._count_on_pool()  # (only while the floor is unfilled, or it grew)

    def _unbook(self, nbytes: int) -> None:
        """Remove bytes and wake waiting producers (call holding the lock)."""
        self.held -= nbytes
        self.budget._add(-nbytes)
        if self._pool is not None and self.held < self._pool_floor:
            self._count_on_pool()  # (the floor is unfilled again)
        if self.budget.waiting[0]:
            self._changed.notify_all()

    def admit_chunk(self, sizes: list[int]) -> list[Reservation]:
        """Book several elements as one chunk: one lock now, one lock when all are gone.

        Each element gets a :class:`ChunkPart`; releasing a part takes no lock
        (an atomic ``list.pop``); the chunk's bytes return to the stage when its
        last part is released. Until then the early parts' bytes stay booked —
        an over-count of at most one chunk, which keeps the cap, and it takes the
        per-element lock off the consumer's path.
        """
        chunk = _Chunk(self, self._book_sizes(sizes), len(sizes))
        return [ChunkPart(chunk, nbytes) for nbytes in sizes]

    def _book_sizes(self, sizes: list[int]) -> int:
        """Book elements of these sizes under one lock; returns their total."""
        for nbytes in sizes:
            if nbytes > self.limit:  # (_check_fits, inlined: per element)
                self.require(nbytes, what="one element")
        total = sum(sizes)
        with self.lock:
            self._book(total, len(sizes))  # (counts the pool's part, but a larger floor)
            largest = max(sizes, default=0)
            if largest > self.max_element:
                self.max_element = largest
                if self._pool is not None:
                    self._count_on_pool()
        return total

    def _hold(self, nbytes: int, *, what: str, elements: int = 1) -> Reservation:
        """Book bytes a stage must hold *together* (its minimum working set).

        Unlike :meth:`_charge`, the bytes already held count: they and ``nbytes``
        become the stage's declared minimum (see :meth:`require`), so the
        budget splits itself again if it must, or raises
        :class:`MemoryBudgetError` naming the stage and what it was assembling.
        """
        with self.lock:  # checked and booked as one step (see allot)
            self._check_fits(self.held + nbytes, what)
            if self._pool is not None:
                self._hold_on_pool(self.held + nbytes, what)
            self._book(nbytes, elements)
        return Reservation(self, nbytes)

    def _fit_together(self, nbytes: int, what: str) -> None:
        """Make the share hold what the stage holds plus ``nbytes`` at once (call holding
        the lock): its minimum grows to that, or :class:`MemoryBudgetError`."""
        needed = self.held + nbytes
        if needed > self.limit:
            self.require(needed, what=what)
        if self._pool is not None:
            self._hold_on_pool(needed, what)

    def admit_existing(self, sizes: list[int], *, count: bool = True) -> list[Reservation]:
        """Book elements that already exist (outputs of calls that were in flight).

        Their memory is there whether or not it fits, so it is booked as it is:
        what fits the share normally, the rest as an *overdraft* (counted in
        ``overdrawn`` and in the stats) which stops the stage from starting new
        work until it has drained. Bounded by the calls that were in flight when
        outputs grew past their estimate.
        """
        for nbytes in sizes:
            if nbytes > self.limit:  # (_check_fits, inlined: per element)
                self.require(nbytes, what="one element")  # split again, or refuse
        elements = 1 if count else 0  # count=False: bytes booked ahead for work in flight
        book = self._book
        bookings: list[Reservation] = []
        with self.lock:
            for nbytes in sizes:  # (_book_existing, inlined: per element)
                excess = self.held + nbytes - self.limit
                if excess > nbytes:
                    excess = nbytes
                if excess <= 0:
                    book(nbytes, elements)
                    bookings.append(Reservation(self, nbytes))
                    continue
                book(nbytes, elements, overdraft=excess)
                bookings.append(Overdraft(self, nbytes, excess))
        return bookings

    def book_existing_total(self, sizes: list[int], *, count: bool = True) -> Reservation:
        """:meth:`admit_existing` for elements released together: one booking for all.

        ``count=False``: bytes booked ahead for work in flight (a parallel map's
        inputs, at their expected output size), not elements of this stage's own.
        """
        for nbytes in sizes:
            self._check_fits(nbytes)
        total = sum(sizes)
        with self.lock:
            excess = max(0, min(total, self.held + total - self.limit))
            self._book(total, (len(sizes) or 1) if count else 0, overdraft=excess)
        return Overdraft(self, total, excess) if excess else Reservation(self, total)

    def overdraw(self, nbytes: int) -> Reservation:
        """Book more bytes for work already in flight (several elements' growth, each of
        which passed :meth:`admit_existing`'s check): past the share as an overdraft."""
        with self.lock:
            return self._book_existing(nbytes, 0)  # growth of elements already counted

    def _book_existing(self, nbytes: int, elements: int = 1) -> Reservation:
        """Book ``nbytes``; what passes the share is an overdraft (call holding the lock)."""
        excess = max(0, min(nbytes, self.held + nbytes - self.limit))
        self._book(nbytes, elements, overdraft=excess)
        return Overdraft(self, nbytes, excess) if excess else Reservation(self, nbytes)

    def release(self, nbytes: int) -> None:
        """Return ``nbytes`` to the stage's share and wake a waiting producer."""
        if not nbytes:
            return
        with self.lock:
            self._unbook(nbytes)
        note_released(nbytes)

    def expect(self, nbytes: int, *, together: str | None = None, what: str = "one element",
               whole: int = 0) -> None:
        """Check that an element of ``nbytes`` not made yet could be admitted.

        A reader asks this before it reads a record whose size it knows from a
        header, and again as a line or field it gathers grows. Past the share,
        the budget splits again if it can, as :meth:`admit` would; if it cannot,
        :class:`MemoryBudgetError` is raised now, before the bytes exist.
        ``together``: the element joins what the stage holds (a batch's rows).
        ``whole``: what the whole of ``together`` will need, for the refusal to state
        (see :meth:`require`). Nothing is booked.
        """
        if together is None:
            if nbytes > self.limit:
                self.require(nbytes, what=what)
            return
        with self.lock:  # checked as _hold() checks, under the lock the split takes
            if whole and self.held + nbytes > self.limit:  # a refusal states ``whole``
                self.require(self.held + nbytes, what=together, whole=whole)
            self._fit_together(nbytes, together)

    def enter(
        self,
        nbytes: int,
        upstream: Reservation | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> Reservation:
        """Wait until an element of ``nbytes`` fits, then book it (see :meth:`admit`).

        One step under the lock: of several producers on one stage, only one
        takes the last room, so the stage never holds past its share. An element
        larger than the share raises :class:`MemoryBudgetError` naming the stage
        (after a re-split, if one can make it fit), and ``upstream`` is released.
        """
        try:
            with self._changed:
                self.wait_for_room(nbytes, cancelled=cancelled)
                return self.admit(nbytes, upstream)
        except BaseException:
            if upstream is not None:
                upstream.release()
            raise

    def fix_share(self, nbytes: int) -> None:
        """Set this stage's share by hand: a budget split in fixed parts outside
        :meth:`MemoryBudget.allot` (a server's segments beside its consumers' runs)."""
        with self._changed:
            self.limit = nbytes
            self._changed.notify_all()

    def share_text(self) -> str:
        """This stage's share and the budget it is cut from, for messages ("2 MiB of 8 MiB")."""
        return f"{format_bytes(self.limit)} of {format_bytes(self.budget.total)}"

    # -- the budget shared by pipelines (see MemoryBudget: "One budget") -----------------

    def _floor(self) -> int:
        """What this stage must be able to hold to move: its minimum, or one element."""
        # Comparisons, not max(): this runs per element on the shared pool, and a
        # builtin max() call costs several times as much.
        floor = self.minimum
        if self.max_element > floor:
            floor = self.max_element
        if self._together > floor:
            floor = self._together
        return floor

    def _count_on_pool(self) -> None:
        """Bring this stage's part of the shared pool up to date (call holding the lock).

        The pool counts a stage at max(held, floor) = held + slack; ``used`` counts the
        held part already, so only the floor and its unfilled part are kept here.
        """
        floor = self.minimum
        if self.max_element > floor:
            floor = self.max_element
        if self._together > floor:
            floor = self._together
        slack = floor - self.held
        if slack < 0:
            slack = 0
        if slack == self._pool_slack and floor == self._pool_floor:
            return  # (the common case: a stage holding more than its floor)
        pool, run = self._pool, self.budget
        if pool is None:
            return
        run._slack += slack - self._pool_slack
        pool._slack += slack - self._pool_slack
        run._floors += floor - self._pool_floor
        pool._floors += floor - self._pool_floor
        self._pool_floor, self._pool_slack = floor, slack

    def _leave_pool(self) -> None:
        """The run closed: its floor goes back to the pool (call holding the lock).
        Bytes still held are released later, and count in the pool's use until then."""
        pool, run = self._pool, self.budget
        if pool is None:
            return
        self._pool = None
        run._slack -= self._pool_slack
        pool._slack -= self._pool_slack
        run._floors -= self._pool_floor
        pool._floors -= self._pool_floor
        self._pool_floor = self._pool_slack = 0

    def _pool_cost(self, nbytes: int, *, floor: bool = False) -> int:
        """What booking ``nbytes`` more (``floor``: a minimum of ``nbytes``) adds to the
        bytes this stage has committed on the shared pool."""
        held = self.held
        old = self._floor()
        if held > old:
            old = held
        new = nbytes if floor else held + nbytes
        if nbytes > new:
            new = nbytes
        return new - old if new > old else 0

    def _hold_on_pool(self, needed: int, what: str) -> None:
        """The stage must hold ``needed`` bytes at once: its floor on the pool grows to
        that, or :class:`MemoryBudgetError` (call holding the lock)."""
        if needed <= self._together:
            return
        self._refuse_past_pool(self._pool_cost(needed, floor=True), what)
        self._together = needed
        self._count_on_pool()

    def _pool_room(self) -> int:
        """The most bytes this stage may book now as far as the pool goes (call holding
        the lock): what its floor has unfilled, plus what :meth:`_pool_short` allows."""
        pool = self._pool
        assert pool is not None
        run = self.budget
        # (compares, not max() and min(): a map asks this per call it starts)
        floor = self.minimum
        if self.max_element > floor:
            floor = self.max_element
        if self._together > floor:
            floor = self._together
        gap = floor - self.held
        if gap < 0:
            gap = 0
        total = pool.total
        free = total - pool.used - pool._slack
        runs = pool._runs
        fair = (total - pool._floors) // (runs if runs > 1 else 1) - (
            run.used + run._slack - run._floors
        )
        if fair < free:
            free = fair
        return gap + free if free > 0 else gap

    def _pool_short(self, nbytes: int) -> bool:
        """True when ``nbytes`` more, beyond this stage's floor, would pass the shared
        pool's total or this run's fair part of what the floors leave free."""
        pool = self._pool
        assert pool is not None
        cost = self._pool_cost(nbytes)
        if not cost:
            return False
        if pool.used + pool._slack + cost > pool.total:
            return True
        run = self.budget
        free = pool.total - pool._floors
        runs = pool._runs
        return run.used + run._slack - run._floors + cost > free // (runs if runs > 1 else 1)

    def _refuse_past_pool(self, cost: int, what: str) -> None:
        """Raise :class:`MemoryBudgetError` when this stage's floor cannot grow by ``cost``
        within the shared pool: waiting would wait on other pipelines' consumers."""
        pool = self._pool
        if pool is None or not cost:
            return
        with self.lock:
            if pool.used + pool._slack + cost <= pool.total:
                return
            raise MemoryBudgetError(pool._refusal(self, cost, what))

    def ceiling(self) -> int:
        """The largest element this stage could ever hold: the whole budget.

        A re-split may give one stage that much (see :meth:`require`), and a
        nested budget may widen up to the budgets above it; a larger element
        cannot be held at all. A producer that can tell (a worker process, before
        it copies an output into shared memory) refuses it there.
        """
        budget: MemoryBudget | Buffer | None = self.budget
        total = 0
        while budget is not None:
            total = max(total, budget.total)
            budget = budget.parent
        return total

    def stats(self) -> AccountStats:
        """A consistent snapshot, for the profiler."""
        with self.lock:
            return AccountStats(
                self.name,
                self.limit,
                self.held,
                self.peak,
                self.elements,
                self.max_element,
                self.overdrawn_peak,
                self.overdrawn,
            )

    @classmethod
    def outside_split(cls, budget: MemoryBudget, name: str) -> Buffer:
        """A buffer for memory that outlives every run, such as a kept cache.

        It is not one of the budget's stages: it has no share, and the budget
        never splits for it. Its bookings are never refused, since the memory
        exists already. They still count in the budget's use, which every stage
        drawing from the budget checks before it buffers more.
        """
        buffer = cls(budget, name, 0.0)
        buffer.limit = sys.maxsize
        return buffer


class Reservation:
    """Bytes booked for one element on one stage's account; moves with the element."""

    __slots__ = ("account", "nbytes")

    def __init__(self, account: Buffer | None, nbytes: int) -> None:
        self.account = account
        self.nbytes = nbytes

    def absorb(self, other: Reservation) -> Reservation:
        """Take over ``other``'s bytes, booked on the same account: one booking for both
        (a batch holding the objects of its elements), nothing re-booked. Returns the
        booking that now holds them (``self``, or a new one if ``self`` held nothing)."""
        if not other.nbytes:
            return self
        if self.account is None:  # nothing booked yet (never mutate NO_RESERVATION)
            moved = Reservation(other.account, other.nbytes)
            other.nbytes = 0
            return moved
        assert other.account is self.account, "absorb: bookings on different accounts"
        self.nbytes += other.nbytes
        other.nbytes = 0
        return self

    def release(self) -> None:
        """Give the bytes back (the element left headrace's buffers)."""
        if self.account is not None and self.nbytes:
            self.account.release(self.nbytes)
        self.nbytes = 0

    def move_to(
        self, account: Buffer, nbytes: int, *, together: str | None = None
    ) -> Reservation:
        """Book ``nbytes`` on ``account`` and release this booking, as one step.

        Stages of one pipeline share one lock, so the move is atomic: the
        element is never counted twice or not at all. ``together``: the stage
        must hold the element together with what it holds already (the rows of a
        batch being assembled), which is then its minimum working set, checked
        and booked under the lock as :meth:`Buffer._hold` does; the text
        says what is assembled, for the error when it cannot fit.
        """
        source = self.account
        try:
            if source is None or source.lock is not account.lock:
                moved = (
                    account._charge(nbytes) if together is None
                    else account._hold(nbytes, what=together)
                )
                self.release()
                return moved
            if nbytes > account.limit:
                account._check_fits(nbytes)
            with account.lock:
                # Unbooked before it is booked again: a move within one account (the rows a
                # padded batch keeps) never counts the element twice, not even inside the
                # lock, where the breach count and the peaks would see it.
                old, self.nbytes = self.nbytes, 0
                if old:
                    source._unbook(old)
                if together is not None:
                    account._fit_together(nbytes, together)
                account._book(nbytes, 0 if source is account else 1)
        except MemoryBudgetError:  # refused: the element goes nowhere, its bytes come back
            self.release()
            raise
        return Reservation(account, nbytes)


class Overdraft(Reservation):
    """A booking part of which lies beyond the stage's share (see ``admit_existing``)."""

    __slots__ = ("excess",)

    def __init__(self, account: Buffer, nbytes: int, excess: int) -> None:
        super().__init__(account, nbytes)
        self.excess = excess

    def _settle(self) -> None:
        """The bytes leave the share's overdraft (they are released or moved on)."""
        account, excess = self.account, self.excess
        self.excess = 0
        if account is not None and excess:
            with account.lock:
                account.overdrawn -= excess

    def release(self) -> None:
        if self.account is None:
            super().release()
            return
        # One step: a reader of the budget's use and the overdraft never sees the
        # overdraft gone while its bytes are still in use.
        with self.account.lock:
            super().release()
            self._settle()

    def move_to(
        self, account: Buffer, nbytes: int, *, together: str | None = None
    ) -> Reservation:
        self._settle()
        return super().move_to(account, nbytes, together=together)


class _Chunk:
    """Bytes booked for a chunk of elements; returned when the last element is released."""

    __slots__ = ("account", "nbytes", "tokens")

    def __init__(self, account: Buffer, nbytes: int, count: int) -> None:
        self.account, self.nbytes = account, nbytes
        # One token per element; list.pop() is atomic, and whoever pops token 0 (the
        # last one left) releases the chunk: exactly once, whatever the threads.
        self.tokens = list(range(count))

    def release_one(self) -> None:
        if self.tokens.pop() == 0:
            self.account.release(self.nbytes)


class ChunkPart(Reservation):
    """One element's part of a chunk booking (see :meth:`Buffer.admit_chunk`)."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: _Chunk, nbytes: int) -> None:
        super().__init__(chunk.account, nbytes)
        self.chunk: _Chunk | None = chunk

    def release(self) -> None:
        chunk, self.chunk = self.chunk, None
        if chunk is not None:
            chunk.release_one()
        self.nbytes = 0

    def move_to(
        self, account: Buffer, nbytes: int, *, together: str | None = None
    ) -> Reservation:
        moved = (
            account._charge(nbytes) if together is None else account._hold(nbytes, what=together)
        )
        self.release()
        return moved


class Assembly:
    """A batch being assembled in place on a :class:`Buffer`: one minimum working set.

    The rows it keeps and the output it allocates are held *together*: past the
    stage's share, the budget splits itself again, or :class:`MemoryBudgetError`
    names the stage and what it assembles. A row booked upstream moves its booking
    here. A row nobody booked is booked in groups of :data:`GROUP_BYTES`, one lock
    per group. :meth:`finish` hands the batch one reservation; :meth:`abandon`
    (a failure, a dropped remainder) gives everything back.
    """

    __slots__ = ("_loose", "_loose_rows", "_out", "_rows", "buffer", "what")

    #: Rows nobody booked are booked in groups of about this many bytes: at most this
    #: much is held unbooked, for the time it takes to gather a group.
    GROUP_BYTES = 64 << 10

    def __init__(self, buffer: Buffer, what: str) -> None:
        self.buffer, self.what = buffer, what
        self._rows = 0  # booked for rows kept (their objects, or the rows themselves)
        self._out = 0  # booked for the output (its columns, their growth)
        self._loose = self._loose_rows = 0  # rows' bytes not booked yet

    def reserve(self, nbytes: int, *, what: str | None = None, elements: int = 0,
                replacing: Reservation | None = None) -> None:
        """Book ``nbytes`` the assembly is about to allocate (its output, a widened
        column), held with what it holds: refused before anything is allocated.
        ``elements``: 1 for the output itself, so the stage's stats count it.
        ``replacing``: a booking on the same buffer for memory the output will reuse
        (a released batch the stage kept): given back in the same step, under the
        lock, so the memory is never counted twice or not at all."""
        self._book_loose()  # the rows gathered so far count in the check
        what = what or self.what
        buffer = self.buffer
        if replacing is None or not replacing.nbytes:
            buffer._hold(nbytes, what=what, elements=elements)
        else:
            assert replacing.account is buffer, "reserve: a booking on another buffer"
            with buffer.lock:
                old, replacing.nbytes = replacing.nbytes, 0
                buffer._unbook(old)
                buffer._fit_together(nbytes, what)  # (refused: the old bytes stay unbooked)
                buffer._book(nbytes, elements)
        self._out += nbytes

    def take(self, nbytes: int, upstream: Reservation) -> None:
        """Keep a row of ``nbytes`` (or the objects of one) in the batch.

        Its ``upstream`` booking moves here at once: waiting on the upstream
        stage's share would stall it. It is checked as it is booked.
        """
        if upstream.account is None:  # checked when its group is booked (per row: cheap)
            loose = self._loose = self._loose + nbytes
            self._loose_rows += 1
            if loose >= self.GROUP_BYTES:
                self._book_loose()
            return
        self._rows += upstream.move_to(self.buffer, nbytes, together=self.what).nbytes

    def _book_loose(self) -> None:
        loose, rows = self._loose, self._loose_rows
        if loose:
            self.buffer._hold(loose, what=self.what, elements=rows)
            self._rows += loose
        self._loose = self._loose_rows = 0

    def drop_rows(self) -> None:
        """The rows were copied into the output and are gone: their bytes come back."""
        self._loose = self._loose_rows = 0
        rows, self._rows = self._rows, 0
        self.buffer.release(rows)

    def shrink(self, nbytes: int) -> None:
        """Part of the output was freed (a column replaced by its widened copy)."""
        nbytes = min(nbytes, self._out)
        self._out -= nbytes
        self.buffer.release(nbytes)

    def finish(self) -> Reservation:
        """The batch is made: one reservation holds it (the rows kept and the output)."""
        self._book_loose()
        nbytes = self._rows + self._out
        self._rows = self._out = 0
        return Reservation(self.buffer, nbytes) if nbytes else NO_RESERVATION

    def abandon(self) -> None:
        """Give back everything booked (the batch failed or is not handed out)."""
        self._loose = self._loose_rows = 0
        nbytes = self._rows + self._out
        self._rows = self._out = 0
        self.buffer.release(nbytes)


NO_RESERVATION = Reservation(None, 0)
"""The reservation of nothing: what a stage that reserves no bytes passes on."""


def release_all(reservations: Any) -> None:
    """Release every reservation in an iterable (used by close paths)."""
    for reservation in reservations:
        reservation.release()

