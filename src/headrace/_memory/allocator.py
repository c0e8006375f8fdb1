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

Batches are a case of their own (:class:`ArrayPool`): a batch of 128 224x224x3
float32 images is 77 MB, far above any mmap threshold, so glibc maps it afresh
and the kernel zeroes its 19,000 pages as the rows are written (~600 KB a
image: 11% of a 2-process image pipeline's CPU, all of it in the consumer),
then unmaps it when the consumer lets go. The pool hands the same memory out
again once nothing references the batch any more.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from headrace._memory.buffer import Reservation

__all__ = [
    "ARENA_MAX",
    "CHECK_EVERY",
    "POOLED_BYTES",
    "ArrayPool",
    "note_released",
    "owns_pooled",
    "pooled_storage",
    "release_free_heap",
    "tune_allocator",
]

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
    from headrace._memory.system import live_runs, sample_process_memory  # (system imports io)

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


#: Arrays at least this large come from an :class:`ArrayPool`; smaller ones are carved
#: from the heap, whose free blocks are reused without the kernel's help anyway.
POOLED_BYTES = 1 << 20


class _Lease:
    """Internal: the owner (``.base``) of one array an :class:`ArrayPool` handed out.

    NumPy makes an array over it from ``__array_interface__`` and keeps it as the
    array's base, and every view keeps that array: the lease dies when the last array
    that can reach its memory does, and only then does the memory go back to the pool.
    A raw pointer taken from the array (``ctypes``) is not a reference and is not seen.
    """

    __slots__ = ("__array_interface__", "pool", "storage")

    def __init__(self, pool: ArrayPool, storage: np.ndarray[Any, Any],
                 shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.pool, self.storage = pool, storage
        self.__array_interface__ = {
            "data": (storage.ctypes.data, False), "shape": shape, "typestr": dtype.str,
            "descr": dtype.descr, "version": 3,
        }

    def __del__(self) -> None:
        self.pool._returned(self.storage)


def pooled_storage(owner: object) -> np.ndarray[Any, Any] | None:
    """The memory behind an array's ``base`` if that base is an :class:`ArrayPool`'s
    lease, else None: what a pooled batch costs is that memory, not the pool's state
    (the budget's costing asks this rather than walking the lease's references)."""
    return owner.storage if type(owner) is _Lease else None


def owns_pooled(array: np.ndarray[Any, Any]) -> bool:
    """Whether ``array`` came from an :class:`ArrayPool` and is the only array over its
    memory: a consumer that takes ownership of an array's buffer (TensorFlow's
    zero-copy wrap) may take it as it would an array owning its data; the memory
    goes back to the pool when the consumer lets go of the array."""
    lease = array.base
    # the lease's references: the array's base, `lease` here, getrefcount's argument
    return type(lease) is _Lease and sys.getrefcount(lease) <= 3


class ArrayPool:
    """Large output arrays (a batch's columns) used again once nothing references them.

    Why: a fresh 77 MB batch is mapped, zeroed page by page by the kernel while its
    rows are copied in, and unmapped when the consumer drops it; reusing it saves the
    zeroing and the faults. Why it is safe: an array from :meth:`empty` is a view
    whose owner is a lease object; the memory goes back to the pool when the lease
    dies, which is when the last array (or view, memoryview, tensor made with
    ``torch.from_numpy``, ...) over it is gone. A batch the consumer keeps is never
    handed out again.

    Budget: the caller books every array it takes (the memory is booked while it is a
    batch), and released memory is kept only while something books it:

    - up to ``keep_bytes`` in all, which the caller books as the pool's spare (the
      batch stage books one batch's columns where its share has room beside a batch);
    - between :meth:`settle` and :meth:`begin` (the caller waits for its next batch's
      first element), where ``booker`` books it on the caller's share — it has room
      then, since the batch before went on. :meth:`begin` hands those bookings to the
      caller, which books its next arrays over them (no moment counted twice or not
      at all);
    - while the caller fills a fresh array from ``empty(..., exchange=True)``, whose
      untouched pages the kernel has not mapped yet: the caller moves the rows
      written so far into the released array (:meth:`exchange`) and lets the fresh
      one go. The fresh array's booking covers the released one: the process holds
      the released array plus the rows written, no more than a moment before, when
      the consumer still had it.

    Memory released at any other time is freed at once. :meth:`clear` (the end of the
    input) and :meth:`close` (the iterator's) free what waits and give its bookings
    back. Thread-safe: releases come from any thread (the consumer's).
    """

    def __init__(self, keep_bytes: int = 0,
                 booker: Callable[[int], Reservation | None] | None = None) -> None:
        self.keep_bytes = keep_bytes
        # Books ``nbytes`` on the caller's share if it has room, else None (any thread).
        # A method is held weakly: the leases of the batches a user keeps hold the pool,
        # and must not keep the iterator (its stages, their threads' state) alive.
        self._booker: Callable[[], Callable[[int], Reservation | None] | None] | None = (
            None if booker is None
            else weakref.WeakMethod(booker) if inspect.ismethod(booker)
            else (lambda: booker)
        )
        #: Released memory kept, each with the booking made for it (None: covered by
        #: ``keep_bytes`` or by a fresh array waiting for it).
        self._idle: collections.deque[tuple[np.ndarray[Any, Any], Reservation | None]] = (
            collections.deque()
        )
        self._closed = False
        self._between = False  # settled, not begun: the caller waits for its next batch
        #: Sizes (in 8-byte words) of fresh arrays that would take released memory now.
        self._waiting: collections.Counter[int] = collections.Counter()
        # A release in the consumer against the caller's calls; reentrant, as a lease may
        # die in a collection that an allocation under the lock sets off.
        self._lock = threading.RLock()
        # Held while a release is booked between batches: begin() waits for it, so the
        # caller's next booking never meets one half made. A release finding it taken
        # frees its memory instead of waiting (it may run inside the budget's lock).
        self._booking = threading.Lock()
        #: Arrays handed out, and how many of them reused released memory (stats, tests);
        #: ``exchanged`` counts the reuses by hand-over (:meth:`exchange`).
        self.handed = self.reused = self.exchanged = 0

    def empty(self, shape: tuple[int, ...], dtype: Any,
              exchange: bool = False) -> np.ndarray[Any, Any]:
        """An uninitialised array of ``shape`` and ``dtype``, as ``np.empty``: released
        memory of the same size where there is some, else fresh. Object arrays and
        arrays under :data:`POOLED_BYTES` are plain ``np.empty`` (an object array's
        slots must start as None; small blocks the heap reuses itself).

        ``exchange``: a fresh array waits, until :meth:`settle`, for memory of its
        size that is released meanwhile (:meth:`exchange` moves it over)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if dtype.hasobject or nbytes < POOLED_BYTES or self._closed:
            return np.empty(shape, dtype)
        words = -(-nbytes // 8)  # float64 items: 16-byte alignment, as np.empty gives
        storage = self._take_idle(words)
        if storage is None:
            storage = np.empty(words, np.float64)
            if exchange:
                with self._lock:
                    self._waiting[words] += 1
        else:
            self.reused += 1
        self.handed += 1
        return self._lease(storage, tuple(shape), dtype)

    def _lease(self, storage: np.ndarray[Any, Any], shape: tuple[int, ...],
               dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        array: np.ndarray[Any, Any] = np.asarray(_Lease(self, storage, shape, dtype))
        return array

    def _take_idle(self, words: int) -> np.ndarray[Any, Any] | None:
        """Released memory of ``words`` 8-byte words, or None; one of another size met on
        the way is freed (the caller's shapes changed). A booking it still had goes back:
        the caller books what it takes."""
        found = None
        freed: list[Reservation] = []
        with self._lock:
            idle = self._idle
            while idle:
                storage, booking = idle.popleft()
                if booking is not None:
                    freed.append(booking)
                if storage.size == words:
                    found = storage
                    break
        for booking in freed:
            booking.release()
        return found

    def exchange(self, array: np.ndarray[Any, Any], rows: int) -> np.ndarray[Any, Any] | None:
        """``array`` (fresh, from ``empty(..., exchange=True)``) moved into memory of its
        size released since: its first ``rows`` rows copied over, the new array returned
        (the caller drops ``array``, whose pages go back to the system); None if no
        such memory waits. A cheap check when none does: it runs per row."""
        if not self._idle:
            return None
        lease = array.base
        if type(lease) is not _Lease:
            return None
        words = lease.storage.size
        storage = None
        with self._lock:
            if not self._waiting[words]:
                return None
            kept = list(self._idle)  # (a release meanwhile only appends)
            for index in range(len(kept)):
                if kept[index][0].size == words and kept[index][1] is None:
                    storage = kept[index][0]
                    del self._idle[index]
                    self._waiting[words] -= 1
                    break
        if storage is None:
            return None
        moved = self._lease(storage, array.shape, array.dtype)
        if rows:
            moved[:rows] = array[:rows]
        self.reused += 1
        self.exchanged += 1
        return moved

    def begin(self) -> list[Reservation]:
        """The caller is about to book and take its next arrays: nothing released from
        now on is booked by the pool, and the bookings of what it kept between batches
        are handed over (the caller books its arrays over them, then takes the memory
        with :meth:`empty`)."""
        with self._booking, self._lock:
            self._between = False
            handed: list[Reservation] = []
            for index, (storage, booking) in enumerate(list(self._idle)):
                if booking is not None:
                    handed.append(booking)
                    self._idle[index] = (storage, None)
            return handed

    def settle(self) -> None:
        """The caller's arrays are filled: no fresh array waits any more (the released
        memory kept for them is freed, beyond ``keep_bytes``), and until :meth:`begin`
        a release is kept where ``booker`` books it."""
        freed: list[Reservation] = []
        with self._lock:
            self._waiting.clear()
            idle = self._idle
            total = sum(storage.nbytes for storage, _ in idle)
            while idle and total > self.keep_bytes:
                storage, booking = idle.popleft()
                total -= storage.nbytes
                if booking is not None:  # (none after begin(), which took them)
                    freed.append(booking)
            self._between = not self._closed and self._booker is not None
        for booking in freed:
            booking.release()

    def _returned(self, storage: np.ndarray[Any, Any]) -> None:
        """A lease died: keep its memory for the next batch or a fresh array waiting
        for it, or let it go."""
        if self._closed:
            return
        with self._lock:
            if self._waiting[storage.size] > sum(
                1 for kept, _ in self._idle if kept.size == storage.size
            ) or sum(kept.nbytes for kept, _ in self._idle) + storage.nbytes <= self.keep_bytes:
                self._idle.append((storage, None))
                return
            if not self._between:
                return
        booker = None if self._booker is None else self._booker()
        if booker is None or not self._booking.acquire(blocking=False):
            return
        try:
            if self._between:  # (begin() cannot run while we hold _booking)
                booking = booker(storage.nbytes)
                if booking is not None:
                    with self._lock:
                        self._idle.append((storage, booking))
        finally:
            self._booking.release()

    def idle_bytes(self) -> int:
        """Bytes released by the consumer and kept for reuse (see the class)."""
        return sum(storage.nbytes for storage, _ in list(self._idle))

    def pooled_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        """What an array of ``shape`` and ``dtype`` from :meth:`empty` would take in the
        pool (0 where it would be a plain ``np.empty``)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        return 0 if dtype.hasobject or nbytes < POOLED_BYTES else -(-nbytes // 8) * 8

    def clear(self) -> None:
        """Free the released arrays kept and give their bookings back (no more batches
        are coming for now)."""
        with self._booking, self._lock:
            self._waiting.clear()
            self._between = False
            bookings = [booking for _, booking in self._idle if booking is not None]
            self._idle.clear()
        for booking in bookings:
            booking.release()

    def close(self) -> None:
        """Free what is kept, and keep nothing released from now on."""
        self._closed = True
        self.clear()
