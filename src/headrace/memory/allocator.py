"""Keep freed element memory where the next element can reuse it (glibc).

glibc's malloc raises its mmap threshold each time a large block is freed (up
to 32 MiB), after which large NumPy buffers are carved from heap arenas — one
per thread, up to 8 per core. Memory freed in one thread's arena is not
reused by another's, so a parallel map on 16 threads making 4 MiB arrays kept
110-145 MiB resident above what the pipeline held: memory the budget cannot
see. Capping the number of arenas makes the threads share (and reuse) freed
blocks, so resident memory tracks what the budget accounts.

Why not a fixed mmap threshold (which returns every large buffer to the OS at
once)? It makes every large allocation page-fault afresh: a NumPy gather of
4 MiB batches ran 4.4x slower, in the whole process.

Capped arenas still fragment: with the raised threshold, large blocks freed
between live ones stay in the heap, and a shuffle of heavy-tailed 256 KiB-16 MiB
elements under 64 MiB grew the process 178 MiB (bound 141) with 60 MiB booked.
So budgets report what they release (:func:`note_released`); every
:data:`CHECK_EVERY` bytes the process's memory is compared with what live runs
book, and when what nobody booked has grown by a quarter of the largest live
budget since the last look, the heap's free pages go back (``malloc_trim``).
Memory the program itself keeps (a model, a dataset it holds) raises the floor
once and is not trimmed for again; in a run whose books match its memory the
check is one read of /proc/self/status per 16 MiB released.

This is process-wide, so it happens once, when the first iterator starts,
and only if ``Options(tune_allocator=False)`` was not asked for. Elsewhere
(musl, macOS) it does nothing. ``MALLOC_ARENA_MAX`` in the environment wins
for the arenas (the trimming still runs).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

__all__ = ["ARENA_MAX", "CHECK_EVERY", "note_released", "release_free_heap", "tune_allocator"]

#: Heap arenas glibc may create (M_ARENA_MAX); its default is 8 per core.
ARENA_MAX = 2
_M_ARENA_MAX = -8

#: Bytes released on budgets between two looks at the heap (see the module's text).
CHECK_EVERY = 16 << 20
#: Retention below this is never trimmed for (a small budget's quarter is noise).
_MIN_GROWTH = 8 << 20

_lock = threading.Lock()
_tuned: bool | None = None
_watching = False  # on glibc, with the allocator's tuning asked for
_released = 0  # since the last look (racy adds: a look a little early or late)
_floor = 0  # unbooked memory after the last trim (the program's own, not the heap's)


def tune_allocator() -> bool:
    """Cap glibc's heap arenas once per process; True if it was (or already is) done."""
    global _tuned, _watching
    with _lock:
        if _tuned is None:
            _tuned = _cap_arenas()
            _watching = sys.platform.startswith("linux") and _malloc_trim() is not None
        return _tuned


def note_released(nbytes: int) -> None:
    """A budget gave ``nbytes`` back: every :data:`CHECK_EVERY` bytes, look at the heap.

    Called after every release, outside the budget's lock (a trim takes
    milliseconds); costs an add and a compare between looks."""
    global _released
    _released += nbytes
    if _released >= CHECK_EVERY and _watching:
        _released = 0
        _trim_if_retaining()


def _trim_if_retaining() -> None:
    """Give free heap pages back if unbooked memory grew past the allowance since the
    last trim (a lock keeps two releasing threads from trimming at once)."""
    global _floor
    from headrace.memory.system import live_runs, sample_process_memory  # (system imports io)

    if not _lock.acquire(blocking=False):
        return  # another thread is looking
    try:
        memory = sample_process_memory()  # (None: the file pool is full; the next look)
        if memory is None:
            return
        unbooked = live_runs.unaccounted(memory)
        if unbooked > _floor + max(_MIN_GROWTH, live_runs.largest_total() // 4):
            release_free_heap()
            after = sample_process_memory()
            _floor = unbooked if after is None else live_runs.unaccounted(after)
        elif unbooked < _floor:
            _floor = unbooked
    finally:
        _lock.release()


def _cap_arenas() -> bool:
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    import ctypes  # here, not at import time: it costs ~10 ms that most imports never need

    try:
        # The process's own symbols (libc is loaded): no ctypes.util.find_library, which
        # runs ldconfig in a subprocess on the first iterator's path.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, ARENA_MAX))


def release_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``).

    A leak detector reading the process's resident memory after each epoch
    must see live memory, not blocks the allocator keeps for reuse: without
    this, a pipeline of large temporaries showed a steady few MiB per epoch of
    retained heap in a process that had loaded TensorFlow and torch, with no
    object growing. Does nothing off glibc.
    """
    trim = _malloc_trim() if sys.platform.startswith("linux") else None
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where there is none (musl, macOS)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim
