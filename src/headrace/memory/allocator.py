"""Make freed element memory go back to the OS promptly (glibc).

glibc's malloc raises its mmap threshold each time a large block is freed (up
to 32 MiB), after which large NumPy buffers are carved from per-thread heap
arenas; freeing them leaves the pages in the arena instead of returning them.
With a parallel map on 16 threads making 4 MiB arrays, that kept 110-145 MiB
resident above what the pipeline held — memory the budget cannot see. Fixing
the mmap threshold makes every buffer above it its own mapping, unmapped the
moment it is freed, so resident memory tracks what the budget accounts.

This is process-wide, so it happens once, when the first iterator starts,
and only if ``Options(tune_allocator=False)`` was not asked for. Elsewhere
(musl, macOS) it does nothing.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["MMAP_THRESHOLD_BYTES", "tune_allocator"]

#: Allocations above this size get their own mapping (glibc's M_MMAP_THRESHOLD).
MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold once per process; True if it was (or already is) set."""
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = _set_mmap_threshold()
        return _tuned


def _set_mmap_threshold() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here, not at import time: it costs ~10 ms that most imports never need
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
