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

This is process-wide, so it happens once, when the first iterator starts,
and only if ``Options(tune_allocator=False)`` was not asked for. Elsewhere
(musl, macOS) it does nothing. ``MALLOC_ARENA_MAX`` in the environment wins.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["ARENA_MAX", "release_free_heap", "tune_allocator"]

#: Heap arenas glibc may create (M_ARENA_MAX); its default is 8 per core.
ARENA_MAX = 2
_M_ARENA_MAX = -8

_lock = threading.Lock()
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Cap glibc's heap arenas once per process; True if it was (or already is) done."""
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = _cap_arenas()
        return _tuned


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
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
