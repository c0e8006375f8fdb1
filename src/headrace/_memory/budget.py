"""The byte budget: one pool per pipeline, one account per buffering stage.

Why shares and not one free-for-all pool: a stage that *waits while holding*
(shuffle filling its buffer, batch assembling, a deterministic parallel map
holding results that finished out of order) can deadlock a shared pool — it
holds bytes that the producer it waits for needs. Giving every buffering
stage its own share (a deterministic split of the budget made when the
iterator is built, from the pipeline's structure alone) makes every wait a
wait on the stage's *own* consumer, which always makes progress, so no
configuration can deadlock; and because the shares depend only on the
structure and the budget, so does every shrink decision — never on timing.

The booking contract, for every stage: **nothing enters a buffer unless what
the stage holds plus the element's cost fits its share.** A stage checks
:meth:`Buffer.fits` (or, on a producer thread, blocks in
:meth:`Buffer.wait_for_room`) with the element's real cost before it
books it with :meth:`Buffer.admit`. A stage that holds nothing may
always take one element that fits its share alone — which is what keeps every
pipeline moving — and an element that does not fit even that raises
:class:`MemoryBudgetError` naming the stage. An element whose size could not
be known before it existed (a user's function ran, a generator yielded) and
that does not fit waits *outside* the buffer, unbooked: that one element per
stage is the only memory beyond the shares.

Minimum working sets. A stage that must hold several bytes at once (a batch
being assembled, one batch in a prefetch queue) declares it with
:meth:`Buffer.require`. When that is more than its share, the budget
splits itself again (:meth:`MemoryBudget.allot`): the stage gets its minimum
and the others give up what they hold beyond theirs. Stages whose share sets
an order (shuffle) give last, only when the others cannot make room. Shares still depend only on the budget, the
structure and the data's sizes; :class:`MemoryBudgetError` names each
stage's minimum when they cannot all fit.

Reservations move with their element (:class:`Reservation`): a stage that
takes an element from a buffering stage books it on its own account first and
then releases the upstream booking, so the element is never uncounted.

One budget. Pipelines that set no budget draw from the process-wide default
together (a run's budget is a child of it, its *pool*). Their bookings never pass
the pool's total. The rule:

* Each stage has a *floor*: what it must be able to hold to move. That is its
  minimum working set, a batch's rows, or one element (its largest so far). The
  pool counts each stage at the larger of its floor and what it holds.
* A stage that holds nothing may take one element within its floor: that is what
  keeps a pipeline moving, and it is already counted. A floor that must grow (a
  larger element, a batch's rows) takes the growth from the pool at once. If the
  pool cannot give it, :class:`MemoryBudgetError` names every live pipeline and
  what it holds. It does not wait: the bytes are held by other pipelines, whose
  consumers may never come back.
* Beyond its floors, a run may hold a fair part of what the floors leave free:
  that free part divided by the live runs. A stage past it, or past the pool's
  total, waits as for its own share. It holds something, so its own consumer
  frees room: a pipeline never waits for another pipeline's consumer.
* A closed run gives its floors back.

The fair part depends on how many runs are live, so on a shared budget how
deep a prefetch fills may vary with the other pipelines. Set
``Options(memory_budget=...)`` on a pipeline to give it a budget of its own.
"""


from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from headrace._errors import MemoryBudgetError
from headrace._memory.buffer import (  # (the buffer's names re-exported while stages move over)
    NO_RESERVATION,
    AccountStats,
    BudgetClosed,
    Buffer,
    ChunkPart,
    Overdraft,
    RefusedAbove,
    Reservation,
    release_all,
)
from headrace._memory.units import format_apart, format_bytes

__all__ = [
    "NO_RESERVATION", "AccountStats", "BudgetClosed", "BudgetStats", "Buffer", "ChunkPart",
    "KeptStats", "MemoryBudget", "Overdraft", "Reservation", "release_all",
]


@dataclass(frozen=True)
class BudgetStats:
    """A snapshot of a budget's bookings, for the profiler (which reads no counters)."""

    #: The budget's total, and what its stages book now and at peak.
    total: int
    used: int
    peak: int
    #: Each stage's bookings.
    stages: tuple[AccountStats, ...]

@dataclass(frozen=True)
class KeptStats:
    """Memory a stage keeps beyond the run that made it, and where it is booked.

    A complete in-memory ``cache()`` belongs to its dataset (tf.data's rule: Keras's
    next epoch reads it), so it outlives the iterator that wrote it and stays booked —
    on the process-wide default budget, or on the cache stage's share of a run with its
    own ``memory_budget``. Each run that reads it reports it here by name, so its bytes
    are not mistaken for a leak or for the stage's working buffers.
    """

    #: The stage that keeps it (``"cache (kept)"``).
    name: str
    #: Bytes it holds in memory, booked on ``booked_on``.
    held: int
    #: Elements it holds in memory.
    elements: int
    #: Elements and bytes it spilled to disk (not booked: a reader books its buffers).
    spilled_elements: int
    spilled_bytes: int
    #: Which budget carries ``held``: ``"the default budget"`` or ``"this run's 'cache'
    #: share"``.
    booked_on: str
    #: The spill file, if any.
    spill_path: str | None = None

    def format(self) -> str:
        line = (
            f"{self.name}: {format_bytes(self.held)} in memory ({self.elements} elements), "
            f"booked on {self.booked_on}"
        )
        if self.spilled_elements:
            line += (
                f"; {self.spilled_elements} elements ({format_bytes(self.spilled_bytes)}) "
                f"on disk in {self.spill_path}"
            )
        return line


_run_numbers = itertools.count(1)


class MemoryBudget:
    """A pipeline's byte budget: the total its stages' shares are carved from.

    Thread-safe; one condition serves the budget and all its accounts (bookings
    are rare relative to the work they guard: once per element or batch).
    """

    def __init__(self, total: int, *, parent: MemoryBudget | Buffer | None = None) -> None:
        self.total = total
        self.used = 0
        self.peak = 0
        self.parent = parent
        self.accounts: list[Buffer] = []
        # Budgets drawn from a shared parent (the process-wide default) share its
        # condition, so a release in one pipeline wakes a producer in another.
        # A bare lock (the ``with`` of one costs a fraction of a Condition's), but
        # re-entrant: garbage collection can run inside a booking (it allocates) and
        # finalize an abandoned iterator of another pipeline on the same default budget,
        # whose close takes this lock again on the same thread. A plain Lock deadlocked.
        self.lock: threading.RLock = parent.lock if parent is not None else threading.RLock()
        self.changed: threading.Condition = (
            parent.changed if parent is not None else threading.Condition(self.lock)
        )
        # Producers waiting on ``changed``, shared with the parent like the condition
        # itself: releases skip notify_all() (its cost is per element) when none wait.
        self.waiting: list[int] = parent.waiting if parent is not None else [0]
        self._closed = False
        #: Called once when the run this budget belongs to closes (a cache's spill files).
        self._on_close: list[Callable[[], None]] = []
        #: What stages keep beyond this run (kept caches it reads), by key: each call
        #: describes it now, or gives None once it is gone.
        self._kept: dict[int, Callable[[], KeptStats | None]] = {}
        #: For a nested budget (an interleave slot's): called with what its stages'
        #: minima add up to when that passes ``total``, and those minima in words; makes room in the stage above
        #: and returns the new total, or raises MemoryBudgetError naming that stage.
        self.widen: Callable[[int, str], int] | None = None
        # One budget shared by pipelines (see the module's "One budget"). On a run drawn
        # from a shared budget: the pool, and what its stages have committed on it.
        self.pool: MemoryBudget | None = parent if isinstance(parent, MemoryBudget) else None
        # A stage counts on the pool at max(held, floor) = held + slack (see Buffer).
        self._floors = 0  # sum of the stages' floors (on the pool: of every run's stages)
        self._slack = 0  # sum of what their floors leave unfilled: max(0, floor - held)
        self._runs = 0  # on the pool: live runs
        self._members: weakref.WeakSet[MemoryBudget] = weakref.WeakSet()
        #: How refusals name this run ("pipeline 3"); set by the run.
        self.label = ""
        pool = self.pool
        if pool is not None:
            with pool.lock:
                pool._runs += 1
                pool._members.add(self)
                self.label = f"pipeline {next(_run_numbers)}"

    def booked(self) -> int:
        """What the budget's stages book now: the cheap read ``sizeof`` of an iterator
        makes (``stats()`` snapshots every stage)."""
        return self.used

    def stats(self) -> BudgetStats:
        """A consistent snapshot of the budget and of each stage's bookings."""
        with self.lock:
            return BudgetStats(
                self.total, self.used, self.peak,
                tuple(account.stats() for account in self.accounts),
            )

    def report_kept(self, key: int, describe: Callable[[], KeptStats | None]) -> None:
        """Have this run's stats show memory a stage keeps beyond it (see KeptStats)."""
        with self.lock:
            self._kept[key] = describe

    def kept_stats(self) -> tuple[KeptStats, ...]:
        """What the stages of this run keep beyond it, as it is now."""
        with self.lock:
            describers = list(self._kept.values())
        return tuple(stats for stats in (describe() for describe in describers) if stats)

    def child(self) -> MemoryBudget:
        """A per-iterator budget drawing from this one (which caps them all together)."""
        return MemoryBudget(self.total, parent=self)

    def over_shared_cap(self, nbytes: int) -> bool:
        """True when adding ``nbytes`` would take a budget this one draws from over its total.

        The parent is the process-wide default budget (shared by pipelines), or
        the account of the stage a nested pipeline runs in (an interleave slot's
        budget draws from the interleave stage's share, which a re-split may
        lower while the slot is open).
        """
        parent = self.parent
        while parent is not None:
            slack = parent._slack if isinstance(parent, MemoryBudget) else 0
            if parent.used + slack + nbytes > parent.total:
                return True
            parent = parent.parent
        return False

    def account(self, name: str, *, weight: float, sets_order: bool = False) -> Buffer:
        """Register a buffering stage; its share is set by :meth:`allot`.

        ``sets_order``: the stage's share decides which elements come out in which
        order (a shuffle buffer's size), so it never gives up bytes to another
        stage's minimum working set (see :meth:`allot`).
        """
        account = Buffer(self, name, weight, sets_order=sets_order)
        self.accounts.append(account)
        return account

    def set_aside(self, nbytes: int, refusal: Callable[[int], str]) -> None:
        """Take ``nbytes`` out of the budget for memory the pipeline holds for its whole
        run (a copy a source made of the user's data): the stages split what is left.
        :class:`MemoryBudgetError` with ``refusal(total)`` if nothing would be left."""
        with self.lock:
            if nbytes >= self.total:
                raise MemoryBudgetError(refusal(self.total))
            self.total -= nbytes
            allotted = bool(self.accounts)
        if allotted:
            self.allot()

    def allot(self) -> None:
        """Split the total among the accounts: by weight, but each at least its minimum.

        Deterministic: a function of the total, the weights (the structure) and
        the declared minima (the data's sizes). Raises :class:`MemoryBudgetError`
        naming every stage's minimum when they cannot all fit.

        Under the budget's lock from reading the minima to writing the shares: a
        stage that checks its holding against its share and books under the same
        lock (:meth:`Buffer.admit` with ``together=``, ``move_to(..., together=...)``) can never
        see its share lowered below that holding in between.
        """
        with self.changed:
            accounts = self.accounts
            weights = sum(account.weight for account in accounts)
            limits = [
                int(self.total * account.weight / weights) if weights else 0 for account in accounts
            ]
            minima = [account.minimum for account in accounts]
            if sum(minima) > self.total and self.widen is not None:
                try:
                    self.total = max(self.total, self.widen(sum(minima), self._listing()))
                except MemoryBudgetError as error:  # the stage above is refused: its words
                    raise RefusedAbove(str(error)) from None
                limits = [
                    int(self.total * account.weight / weights) if weights else 0
                    for account in accounts
                ]
            if sum(minima) > self.total:
                raise MemoryBudgetError(self._minima_message())
            deficit = sum(max(0, low - limit) for low, limit in zip(minima, limits, strict=True))
            limits = [max(low, limit) for low, limit in zip(minima, limits, strict=True)]
            # Stages whose share sets an order lend last: a re-split happens when a minimum
            # becomes known, and with threads that moment is timing, so lending a shuffle's
            # bytes can make its buffer, and so the order, depend on timing (G3). But the
            # minima fit, so refusing would stop a pipeline that can run: the shuffle shrinks.
            lenders = [
                k for k, account in enumerate(accounts)
                if not account.sets_order and limits[k] > minima[k]
            ]
            surplus = sum(limits[k] - minima[k] for k in lenders)
            if deficit > surplus:
                lenders = [k for k in range(len(accounts)) if limits[k] > minima[k]]
                surplus = sum(limits[k] - minima[k] for k in lenders)
            if deficit > 0:
                for k in lenders:
                    spare = limits[k] - minima[k]
                    limits[k] -= min(spare, -(-deficit * spare // surplus))  # ceil: never short
            for account, limit in zip(accounts, limits, strict=True):
                account.limit = limit
            self.changed.notify_all()

    def _listing(self) -> str:
        """Each stage's minimum working set and what it is for, in words."""
        return ", ".join(
            f"{account.name}: {format_bytes(account.minimum)}"
            + (f" for {account.minimum_what}" if account.minimum_what else "")
            for account in self.accounts
            if account.minimum
        )

    def _minima_message(self, first: str = "the pipeline's stages") -> str:
        listed = self._listing()
        needed, total = format_apart(sum(account.minimum for account in self.accounts),
                                     self.total)
        return (
            f"{first} must hold {needed} at once, more than the memory budget "
            f"of {total} (each stage's minimum working set: {listed}). "
            "Raise Options(memory_budget=...), or make elements or batches smaller."
        )

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the run closes: for what outlives one stage's iterator
        but not the run (a cache kept between the epochs of a ``repeat``)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Wake every waiting producer so that it can exit; run the close callbacks."""
        with self.changed:
            pool = self.pool
            if pool is not None and not self._closed:
                for account in self.accounts:
                    account._leave_pool()
                pool._runs -= 1
                pool._members.discard(self)
            self._closed = True
            self.changed.notify_all()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()

    def _refusal(self, account: Buffer, cost: int, what: str) -> str:
        """Why ``account`` (a stage of a run drawn from this shared budget) may not grow its
        floor by ``cost``: every live pipeline, with what it holds and needs at least."""
        runs = sorted(self._members, key=lambda run: run.label)
        listed = "; ".join(
            f"{run.label} ({', '.join(a.name for a in run.accounts) or 'no buffering stage'}) "
            f"holds {format_bytes(run.used)}, needs at least {format_bytes(run._floors)}"
            for run in runs
        )
        kept = self.used - sum(run.used for run in runs)
        if kept > 0:
            listed += f"; kept caches and closed runs not yet freed hold {format_bytes(kept)}"
        return (
            f"stage {account.name!r} of {account.budget.label} needs "
            f"{format_bytes(cost)} more for {what}, past the shared memory budget of "
            f"{format_bytes(self.total)} that pipelines without Options(memory_budget=...) "
            f"draw from together ({format_bytes(self.used)} booked, "
            f"{format_bytes(self._slack)} more promised to stages' minimum working sets). "
            f"The pipelines: {listed}. A pipeline does not wait for another one's consumer: "
            "give pipelines their own Options(memory_budget=...), close iterators no longer "
            "used, or raise the default budget."
        )

    def _add(self, nbytes: int) -> None:
        used = self.used = self.used + nbytes
        if used > self.peak:
            self.peak = used
        parent = self.parent
        if parent is not None:
            parent._add(nbytes)
