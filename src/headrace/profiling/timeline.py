"""Stats over time: a sampler thread that snapshots a running pipeline.

Each :class:`Sample` holds, at one moment: every stage's elements out so far
and bytes held against its share, the budget's total and use, and the
process's anonymous, shared and file-backed memory, the part of its growth no
stage accounts for (``unaccounted``), open descriptors and threads. The
sampler also watches the decisions the pipeline takes while it runs —
a share re-split, a shuffle shrunk to fit, AUTOTUNE deepening a prefetch or
switching an interleave to threads, a parallel map's chunk size — and records
each with its time (:class:`Decision`).

It reads what the stages already keep (their accounts, their tuning
attributes), so it costs the pipeline nothing per element: it can be left on
(:class:`Monitor`). Per-stage element counts come from a profile's probes
(:mod:`headrace.profiling.probe`) when there are some.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headrace.profiling.process import ProcessSnapshot, snapshot

if TYPE_CHECKING:
    from headrace._memory.buffer import Buffer
    from headrace.core.iterator import Iterator
    from headrace.core.run import DatasetIterator
    from headrace.profiling.probe import Instrumenter

__all__ = ["KNOBS", "SUMMARY_AFTER", "Decision", "Monitor", "Sample", "Sampler", "summarize_decisions"]

#: Attributes through which stages show the choices they made while running (what
#: AUTOTUNE and the budget decided): read by the sampler, never written.
KNOBS: tuple[tuple[str, str], ...] = (
    ("depth", "prefetch depth"),
    ("shrunk_to", "shuffle buffer shrunk to"),
    ("capacity", "buffer capacity"),
    ("threaded", "reads ahead on threads"),
    ("chunk", "elements per call"),
)
_MAX_CHANGES_PER_KNOB = 40  # a knob that moves all the time (a chunk size) is not a log


@dataclass(frozen=True)
class Decision:
    """One choice taken while running: which stage, what, from what to what, when."""

    seconds: float
    stage: str
    what: str
    before: Any
    after: Any

    def format(self) -> str:
        before = "" if self.before is None else f"{self.before} -> "
        return f"{self.seconds:8.3f} s  {self.stage}: {self.what} {before}{self.after}"


#: A knob that moved more often than this is one line in a profile's text (every move
#: stays in :attr:`Profile.decisions` and the HTML report).
SUMMARY_AFTER = 5


def summarize_decisions(decisions: Sequence[Decision]) -> list[str]:
    """The decisions as lines for a terminal: one per decision, except that a knob that
    moved more than :data:`SUMMARY_AFTER` times (a parallel map's chunk size, which
    AUTOTUNE adjusts all along) is one line saying where it went, how often and between
    which values."""
    groups: dict[tuple[str, str], list[Decision]] = {}
    for decision in decisions:
        groups.setdefault((decision.stage, decision.what), []).append(decision)
    lines: list[tuple[float, str]] = []
    for (stage, what), moves in groups.items():
        if len(moves) <= SUMMARY_AFTER:
            lines += [(move.seconds, move.format()) for move in moves]
            continue
        values = [moves[0].before, *(move.after for move in moves)]
        if values[0] is None:
            values = values[1:]
        path = " -> ".join(map(str, values[:3])) + " -> ... -> " + str(values[-1])
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        spread = (f", between {min(numbers)} and {max(numbers)}"
                  if len(numbers) == len(values) else "")
        lines.append((moves[0].seconds,
                       f"{moves[0].seconds:8.3f} s  {stage}: {what} {path} ({len(moves)} "
                       f"changes until {moves[-1].seconds:.3f} s{spread}; each one in the "
                       f"HTML report)"))
    return [line for _, line in sorted(lines, key=lambda pair: pair[0])]


@dataclass(frozen=True)
class Sample:
    """A pipeline and its process at one moment (seconds since the profile started)."""

    seconds: float
    epoch: int
    #: Per stage (in the order of the profile's stages): elements out so far.
    elements: tuple[int, ...]
    #: Per stage: bytes held now against its share, and the share.
    held: tuple[int, ...]
    shares: tuple[int, ...]
    budget_total: int
    budget_used: int
    memory: ProcessSnapshot
    #: Growth of anonymous + shared memory since the profile started.
    growth: int

    @property
    def unaccounted(self) -> int:
        """Growth of the process that no stage's booking explains (may be negative)."""
        return self.growth - self.budget_used


def _accounts_by_node(iterator: DatasetIterator) -> dict[int, Buffer]:
    """The run's stage accounts, keyed by ``id`` of their recipe node."""
    accounts: dict[int, Buffer] = getattr(iterator.context, "_accounts", {})
    return accounts


class Sampler:
    """Samples one run (or a run per epoch) on a background thread every ``interval`` s.

    ``stages`` lists ``(name, key)`` of the stages to follow — ``key`` is ``id`` of
    the recipe node (the account key) — and grows as a profile finds stages.
    """

    def __init__(
        self,
        instrumenter: Instrumenter | None = None,
        *,
        interval: float = 0.05,
        detail_every: int = 5,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        self.instrumenter = instrumenter
        self.interval = interval
        self.detail_every = detail_every
        self.on_sample = on_sample
        self.samples: list[Sample] = []
        self.decisions: list[Decision] = []
        self.stage_names: list[str] = []
        self._stage_keys: list[int] = []
        # A weak reference: sampling never keeps an abandoned iterator (and its threads,
        # files and budget) alive; the sampler stops once its iterator is gone.
        self._iterator: weakref.ref[DatasetIterator] | None = None
        self._epoch = 0
        self._knobs: dict[tuple[int, str], Any] = {}
        self._changes: dict[tuple[int, str], int] = {}
        self._started = time.perf_counter()
        # The cheap read (one /proc file): a sampler per iterator must not make building
        # an iterator slower; the first tick on the thread takes the detailed one.
        self._start_memory = snapshot(detailed=False)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ticks = 0

    @property
    def start_memory(self) -> ProcessSnapshot:
        return self._start_memory

    def watch(self, iterator: DatasetIterator, epoch: int = 0) -> None:
        """Follow ``iterator`` from now on (a new one each epoch)."""
        with self._lock:
            self._iterator, self._epoch = weakref.ref(iterator), epoch
            self._knobs.clear()  # new iterators: their knobs start afresh

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="headrace-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample(detailed=True)  # the end state

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # never take the pipeline down; the next tick retries
                continue

    def now(self) -> float:
        return time.perf_counter() - self._started

    def _current(self) -> DatasetIterator | None:
        return None if self._iterator is None else self._iterator()

    def _sync_stages(self, iterator: DatasetIterator | None) -> None:
        if self.instrumenter is not None:
            for record in self.instrumenter.records[len(self._stage_keys):]:
                self._stage_keys.append(id(record.node))
                self.stage_names.append(record.name)
        if iterator is not None:
            for key, account in list(_accounts_by_node(iterator).items()):
                if key not in self._stage_keys:
                    self._stage_keys.append(key)
                    self.stage_names.append(account.name)

    def sample(self, *, detailed: bool = False) -> Sample:
        """Take one sample now (also called by the profile at the end of each epoch)."""
        with self._lock:
            self._ticks += 1
            iterator, epoch = self._current(), self._epoch
            if iterator is None and self._iterator is not None:
                self._stop.set()  # the iterator was dropped: nothing left to watch
            self._sync_stages(iterator)
            seconds = self.now()
            counts: dict[int, int] = {}
            if self.instrumenter is not None:
                counts = {id(r.node): r.count for r in self.instrumenter.records}
            accounts = _accounts_by_node(iterator) if iterator is not None else {}
            inner = {} if self.instrumenter is None else {
                id(r.node): r.inner_held for r in self.instrumenter.records if r.accounts
            }  # the stages of an interleave's inner datasets book under their slots' budgets
            held, shares = [], []
            for key in self._stage_keys:
                account = accounts.get(key)
                if account is None and key in inner:
                    now, share, _ = inner[key]
                    held.append(now)
                    shares.append(share)
                    continue
                booking = account.stats() if account is not None else None
                held.append(booking.held if booking is not None else 0)
                shares.append(booking.limit if booking is not None else 0)
            booked = iterator.context.budget.stats() if iterator is not None else None
            # Workers every time (the memory line charges them: a sample without them
            # would dip); the rest of the detail (descriptors, USS) every few ticks
            memory = snapshot(detailed=detailed or self._ticks % self.detail_every == 1,
                              workers=True)
            growth = memory.charged - self._start_memory.charged
            sample = Sample(
                seconds,
                epoch,
                tuple(counts.get(key, 0) for key in self._stage_keys),
                tuple(held),
                tuple(shares),
                booked.total if booked is not None else 0,
                booked.used if booked is not None else 0,
                memory,
                growth,
            )
            self.samples.append(sample)
            if iterator is not None:
                self._watch_decisions(iterator, accounts, seconds)
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample

    def _note(self, key: tuple[int, str], stage: str, what: str, value: Any, seconds: float,
              *, first_counts: bool) -> None:
        known = key in self._knobs
        before = self._knobs.get(key)
        self._knobs[key] = value
        if (known and before != value) or (not known and first_counts and value is not None):
            changes = self._changes.get(key, 0) + 1
            self._changes[key] = changes
            if changes <= _MAX_CHANGES_PER_KNOB:
                self.decisions.append(Decision(seconds, stage, what, before, value))

    def _watch_decisions(
        self, iterator: DatasetIterator, accounts: dict[int, Buffer], seconds: float
    ) -> None:
        for key, account in list(accounts.items()):
            self._note((key, "share"), account.name, "share of the budget (bytes)",
                       account.share(), seconds, first_counts=False)
        stages: list[Iterator] = iterator.stages()
        for stage in stages:
            state = stage.__dict__
            for attribute, what in KNOBS:
                if attribute not in state and not (
                    attribute == "threaded" and hasattr(type(stage), "threaded")
                ):
                    continue
                value = getattr(stage, attribute, None)
                if not isinstance(value, (int, bool)) and value is not None:
                    continue
                # shrink decisions count from their first sighting; others only on change
                self._note((id(stage), attribute), str(getattr(stage, "stage", "?")), what,
                           value, seconds, first_counts=attribute == "shrunk_to")


class Monitor:
    """Stats over time for one iterator, cheap enough to leave on (no per-element cost).

    ``with Monitor(iterator) as monitor: ...`` samples every ``interval`` s on a
    thread; ``monitor.samples`` and ``monitor.decisions`` hold what it saw.
    """

    def __init__(self, iterator: DatasetIterator, *, interval: float = 0.1) -> None:
        self.sampler = Sampler(interval=interval)
        self.sampler.watch(iterator)

    @property
    def samples(self) -> list[Sample]:
        return self.sampler.samples

    @property
    def decisions(self) -> list[Decision]:
        return self.sampler.decisions

    @property
    def stage_names(self) -> list[str]:
        return self.sampler.stage_names

    def __enter__(self) -> Monitor:
        self.sampler.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sampler.stop()
