"""What the machine and this process have: memory available (cgroup-aware), memory in use."""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from headrace.io.filepool import get_default_pool, read_small_file

__all__ = [
    "LiveRuns",
    "ProcessMemory",
    "available_memory",
    "live_runs",
    "open_file_count",
    "process_memory",
    "sample_process_memory",
]


def _read_int(path: str) -> int | None:
    data = read_small_file(path)
    text = data.decode(errors="replace").strip() if data is not None else ""
    return int(text) if text.isdigit() else None


def _meminfo_available() -> int | None:
    data = read_small_file("/proc/meminfo")
    for line in (data or b"").decode(errors="replace").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def available_memory() -> int:
    """Memory available to this process, in bytes.

    Inside a cgroup v2 container with a ``memory.max`` limit, that limit minus
    the cgroup's current usage (the host's MemAvailable would overstate it and
    get the process OOM-killed); otherwise ``MemAvailable`` from /proc/meminfo.
    The smaller of the two when both apply.
    """
    candidates = []
    limit = _read_int("/sys/fs/cgroup/memory.max")
    current = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and current is not None:
        candidates.append(max(limit - current, 0))
    meminfo = _meminfo_available()
    if meminfo is not None:
        candidates.append(meminfo)
    if not candidates:  # not Linux: fall back to the total physical memory
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        candidates.append(pages * os.sysconf("SC_PAGE_SIZE") if pages else 1 << 30)
    return min(candidates)


@dataclass(frozen=True)
class ProcessMemory:
    """This process's resident memory by kind, in bytes (Linux /proc/self/status)."""

    anonymous: int
    shared: int
    file_backed: int

    @property
    def charged(self) -> int:
        """What the budget's measured guarantee covers: anonymous + shared memory."""
        return self.anonymous + self.shared


def process_memory() -> ProcessMemory:
    """Current RssAnon, RssShmem and RssFile of this process."""
    # Read on a slot of the file pool: a descriptor headrace opens counts against its cap.
    return _parse_status(read_small_file("/proc/self/status") or b"")


def sample_process_memory() -> ProcessMemory | None:
    """:func:`process_memory`, or None when the file pool has no free slot: a sample
    taken on a hot path (a budget's release) must neither wait nor close a reader."""
    data = read_small_file("/proc/self/status", wait=False)
    return None if data is None else _parse_status(data)


def _parse_status(data: bytes) -> ProcessMemory:
    # (three lookups, not a parse of its ~60 lines: every iterator that starts reads it)
    return ProcessMemory(_kib_field(data, b"\nRssAnon:"), _kib_field(data, b"\nRssShmem:"),
                         _kib_field(data, b"\nRssFile:"))


def _kib_field(status: bytes, key: bytes) -> int:
    """The ``kB`` value of ``key`` in /proc/self/status, in bytes (0 where absent)."""
    at = status.find(key)
    if at < 0:
        return 0
    end = status.find(b"\n", at + len(key))
    words = status[at + len(key) : end if end >= 0 else len(status)].split()
    return int(words[0]) * 1024 if words and words[0].isdigit() else 0


def open_file_count() -> int:
    """Descriptors this process has open (Linux), or -1 where unknown."""
    with get_default_pool().transient():  # the listing's own descriptor counts too
        try:
            return len(os.listdir("/proc/self/fd"))
        except OSError:
            return -1


class LiveRuns:
    """The budgets of the iterators alive in this process, and the memory they started from.

    What ``stats()`` reports as *unaccounted*: the growth of this process's
    anonymous + shared memory since the first of the live iterators started,
    minus what all of them have booked. A per-iterator baseline cannot be
    attributed (a training and an evaluation iterator reuse each other's freed
    heap), so the figure is process-wide. It is an upper bound on memory the
    budget does not see — the training loop's own allocations and the
    allocator's slack are in it too — whose *trend* is what matters; see
    benchmarks/results/backstop.md for why it is reported, not enforced.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._budgets: weakref.WeakSet[Any] = weakref.WeakSet()
        self._baseline = 0

    def start(self, budget: Any) -> None:
        """Count ``budget`` (an object with ``used``) as live; the first sets the baseline."""
        with self._lock:
            if not self._budgets:
                self._baseline = process_memory().charged
            self._budgets.add(budget)

    def stop(self, budget: Any) -> None:
        """``budget``'s iterator closed (a collected one leaves on its own)."""
        with self._lock:
            self._budgets.discard(budget)

    def largest_total(self) -> int:
        """The largest total of the live runs' budgets (0 when none is live)."""
        with self._lock:
            return max((budget.total for budget in self._budgets), default=0)

    def unaccounted(self, memory: ProcessMemory) -> int:
        """Growth of ``memory`` since the baseline, less every live run's bookings (>= 0).

        Memory below the baseline plus the bookings means memory held when the baseline
        was taken has been freed since (a long-lived iterator outlives what was around
        it then): the baseline moves down to there, so later growth is seen from where
        the process is, not hidden behind what it no longer holds."""
        with self._lock:
            booked: int = sum(budget.used for budget in self._budgets)
            grown = memory.charged - self._baseline - booked
            if grown < 0:
                self._baseline += grown
                return 0
            return grown


#: The one registry of this process.
live_runs = LiveRuns()
