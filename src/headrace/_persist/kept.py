"""The process-wide registry of kept in-memory caches, and where their bytes are booked.

A complete in-memory cache belongs to its recipe node, as tf.data's memory cache
belongs to its dataset: every later iterator of the dataset (and of datasets built
on it: a map after it, with_options) reads it, never the input — Keras makes a new
iterator per epoch. It lives until the node is garbage-collected.

Its bytes stay booked while it lives:
* on the process-wide default budget, always (the "kept" booking, taken when the
  cache completes): it is memory headrace holds in this process outside any run, and
  every pipeline without its own memory_budget draws from that budget, so they leave
  room for it, between runs too;
* on the cache stage's share of each run that reads it, unless that run draws from
  the default budget itself (where it is already booked): a pipeline with its own
  memory_budget B still holds at most B, the kept cache included.
The spilled part is on disk: a run reading it books its read buffers only.
"""

from __future__ import annotations

import shutil
import threading
import weakref
from typing import TYPE_CHECKING, Any

from headrace._memory.budget import KeptStats, MemoryBudget
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._persist.records import book
from headrace.core.iterator import Context
from headrace.core.run import call_outside_collection, default_budget

if TYPE_CHECKING:
    from headrace._persist.cache import CacheNode


__all__ = [
    "KeptMemory",
    "book_for_run",
    "drawn_from_default",
    "keeper",
    "kept_caches",
    "kept_lock",
    "report_kept",
    "run_bookings",
]


kept_lock = threading.Lock()
#: The complete in-memory cache of each cache node (weak: dies with the node).
kept_caches: weakref.WeakKeyDictionary[CacheNode, KeptMemory] = weakref.WeakKeyDictionary()
#: What each run has booked of a kept cache, by the run's cache account (one booking
#: per run and node, however many epochs of a ``repeat`` read it).
run_bookings: weakref.WeakKeyDictionary[
    Buffer, tuple[weakref.ref[KeptMemory], Reservation]
] = weakref.WeakKeyDictionary()
_keepers: weakref.WeakKeyDictionary[MemoryBudget, Buffer] = weakref.WeakKeyDictionary()


def keeper(budget: MemoryBudget) -> Buffer:
    """The account of ``budget`` (the default one) that books kept caches.

    Outside the budget's split (a kept cache is memory that exists: it is booked as
    it is, never refused), it still counts in the budget's ``used``, which every
    pipeline drawing from that budget checks before it buffers more.
    """
    with kept_lock:
        account = _keepers.get(budget)
        if account is None:
            account = _keepers[budget] = Buffer.outside_split(budget, "cache (kept)")
        return account


def drawn_from_default(account: Buffer) -> bool:
    return account.budget.parent is default_budget()


class _KeptResources:
    """What a kept cache must give back when it dies (no reference to the cache itself,
    so that its finalizer cannot keep it alive)."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self.kept: Reservation = NO_RESERVATION

    def free(self) -> None:
        kept, self.kept = self.kept, NO_RESERVATION
        directory, self.directory = self.directory, None
        if kept is not NO_RESERVATION or directory is not None:
            call_outside_collection(_free, kept, directory)


def _free(kept: Reservation, directory: str | None) -> None:
    kept.release()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class KeptMemory:
    """The elements of one in-memory cache: the first ones in memory, the rest in a
    spill file. Holds no run (no context, no account), so keeping it keeps nothing else."""

    def __init__(self, epochs: tuple[int, ...], iteration: int) -> None:
        #: Which iterator wrote it (the epochs of enclosing repeats, the iterator's
        #: number): a restored state reads it only if it was written by the same one.
        self.epochs, self.iteration = epochs, iteration
        self.items: list[Any] = []
        self.booked = 0  # the in-memory items' bytes
        self.count = 0
        self.spill_path: str | None = None
        self.spill_bytes = 0  # the spill file's size, once complete
        self.resources = _KeptResources()
        # removed when collected, and at exit (weakref.finalize runs atexit)
        self._finalizer = weakref.finalize(self, self.resources.free)

    def free(self) -> None:
        self.items = []
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive


def report_kept(data: KeptMemory, ctx: Context, account: Buffer) -> None:
    """Show the kept cache in the stats of the run that reads it (G7): its bytes are
    booked for as long as the dataset lives, and the user should see where they went."""
    ref = weakref.ref(data)
    booked_on = (
        "the default budget" if drawn_from_default(account) else f"this run's {account.name!r} share"
    )

    def describe() -> KeptStats | None:
        kept = ref()
        if kept is None or not kept.alive:
            return None
        in_memory = len(kept.items)
        return KeptStats(
            name=f"{account.name} (kept)",
            held=kept.booked,
            elements=in_memory,
            spilled_elements=kept.count - in_memory,
            spilled_bytes=kept.spill_bytes,
            booked_on=booked_on,
            spill_path=kept.spill_path,
        )

    ctx.budget.report_kept(id(data), describe)


def book_for_run(data: KeptMemory, ctx: Context, account: Buffer) -> None:
    """Book a kept cache on a run that reads it, once per run (see above)."""
    if drawn_from_default(account):
        return
    booked = run_bookings.get(account)
    if booked is not None and booked[0]() is data:
        return
    held = book(account, data.booked, "the kept in-memory cache")
    run_bookings[account] = (weakref.ref(data), held)
    ctx.budget.on_close(held.release)
