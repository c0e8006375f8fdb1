"""AUTOTUNE's evidence for interleave: do its pulls wait, or compute?

In CPython, slots reading ahead on threads pay only when the inner pipelines wait
(a slow disk, a network file system, an object store); on page-cached files they
only add hand-offs. :class:`WaitWatch` tells the two apart from clocks the kernel
keeps per thread, cheaply enough to run on every pull.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from time import perf_counter
from typing import Any

from headrace._memory.buffer import Reservation
from headrace.io.filepool import FileLimiter, read_small_file

try:
    import resource

    _RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # Windows
    _RUSAGE_THREAD = None

__all__ = ["WaitWatch"]


def _run_queue_seconds(limiter: FileLimiter | None) -> float | None:
    """Time this thread has spent runnable but not running (preempted by other work):
    the second field of Linux's /proc/thread-self/schedstat; None where unavailable.

    Read on a file-pool slot (``limiter``: the pipeline's share), taken only if one is
    free: the file is one more descriptor while open (G2), and a sample must not close
    a reader's file to make room."""
    content = read_small_file("/proc/thread-self/schedstat", wait=False, limiter=limiter)
    try:
        return None if content is None else int(content.split()[1]) / 1e9
    except (IndexError, ValueError):
        return None


def _voluntary_switches() -> int:
    """Times this thread gave up its core to wait (I/O, sleep, a lock); 0 if unknown."""
    if _RUSAGE_THREAD is None:
        return 0
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


class WaitWatch:
    """AUTOTUNE's evidence that slots reading ahead on threads would overlap waits.

    Every pull's wall time is summed (two cheap clock reads). One pull in eight, at
    random, also reads this thread's CPU clock (a system call, too dear for every
    pull); since a pull's CPU time varies little, eight times their sum estimates the
    CPU all pulls used, while the wall time stays exact, rare long waits included.
    When a window has spent ``WINDOW_SECONDS`` inside pulls, it counts as waiting if:
    more than half of that was neither this thread's CPU nor time it sat preempted on
    a busy machine (Linux's schedstat run-queue time over the whole window, so at least
    as much as inside the pulls); this thread slept in the kernel at least once; and at
    the end of the window the GIL is free — three ``sleep(0)`` get it back within a
    millisecond each — so the waits were not for other Python threads, which more threads
    would not help.
    ``WINDOWS`` such windows in a row start the threads.
    """

    WINDOW_SECONDS = 0.02
    WINDOWS = 2
    SAMPLE_EVERY = 8  # on average; at random, so no slot is always or never sampled
    GIL_FREE_SECONDS = 0.001
    #: After this many computing windows in a row, stop watching for ``REST_SECONDS``
    #: (of wall time, read every ``REST_CHUNK`` pulls), then watch one window again: the
    #: clocks cost about a fifth of a page-cached pull, and storage rarely turns slow —
    #: when it does, threads start within about a second.
    REST_AFTER = 5
    REST_SECONDS = 1.0
    REST_CHUNK = 256

    def __init__(self, limiter: FileLimiter | None = None) -> None:
        self.limiter = limiter  # (the pipeline's share of descriptors: schedstat's read)
        self.random = random.Random(0x5EED)  # its own: the user's random state is theirs
        self.countdown = self.SAMPLE_EVERY  # pulls until the next sampled one
        self.waiting_windows = 0
        self.computing_windows = 0
        self.resting = 0  # pulls left, in this chunk of the rest, to take unwatched
        self.rest_until = 0.0
        self._start_window()

    def _start_window(self) -> None:
        self.pull_wall = 0.0
        self.sampled_cpu = 0.0
        self.switches = _voluntary_switches()
        self.run_queue = _run_queue_seconds(self.limiter)

    def rest_chunk_done(self) -> None:
        """A chunk of unwatched pulls is over: rest another, or watch a fresh window."""
        if perf_counter() < self.rest_until:
            self.resting = self.REST_CHUNK
        else:
            self._start_window()

    def sampled_pull(
        self, pull: Callable[[], tuple[Any, Reservation]]
    ) -> tuple[Any, Reservation]:
        """``pull()`` timed on both clocks; picks the next pull to sample."""
        self.countdown = 1 + int(self.random.random() * (2 * self.SAMPLE_EVERY - 1))
        started, cpu = perf_counter(), time.thread_time()
        try:
            return pull()
        finally:
            self.sampled_cpu += time.thread_time() - cpu
            self.pull_wall += perf_counter() - started

    def waiting_mostly(self) -> bool:
        """At the end of a window (``pull_wall`` >= ``WINDOW_SECONDS``): whether
        ``WINDOWS`` windows in a row waited."""
        computing = self.sampled_cpu * self.SAMPLE_EVERY
        # over the whole window, so no less than the part inside the pulls
        # (0 where either reading is missing: no schedstat, or no descriptor was free)
        now = _run_queue_seconds(self.limiter)
        preempted = 0.0 if now is None or self.run_queue is None else now - self.run_queue
        waited = (
            self.pull_wall - computing - preempted > 0.5 * self.pull_wall
            and (_RUSAGE_THREAD is None or _voluntary_switches() > self.switches)
            and _gil_is_free(self.GIL_FREE_SECONDS)
        )
        self.waiting_windows = self.waiting_windows + 1 if waited else 0
        self.computing_windows = 0 if waited else self.computing_windows + 1
        if self.computing_windows >= self.REST_AFTER:
            self.computing_windows = self.REST_AFTER - 1  # one more computing window: rest
            self.resting = self.REST_CHUNK
            self.rest_until = perf_counter() + self.REST_SECONDS
        self._start_window()
        return self.waiting_windows >= self.WINDOWS


def _gil_is_free(within: float, probes: int = 3) -> bool:
    """Whether this thread gets the GIL back within ``within`` s each time it gives it up
    (``probes`` times: one quick return can be luck; the first slow one ends the test)."""
    for _ in range(probes):
        started = perf_counter()
        time.sleep(0)
        if perf_counter() - started >= within:
            return False
    return True
