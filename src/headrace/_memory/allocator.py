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
:data:`CHECK_EVERY` bytes (an eighth of the largest live budget, if more) the
process's memory is compared with what live runs book, and when what nobody
booked has grown by a quarter of that budget since the last look, and the heap
has that much in free blocks, the heap's free pages go back (``malloc_trim``).
Memory the program itself keeps (a model, a dataset it holds) raises the floor
once and is not trimmed for again; in a run whose books match its memory the
check is one read of /proc/self/status per 16 MiB released, or per eighth of
the budget.

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
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from headrace._memory.buffer import Reservation

__all__ = [
    "ARENA_MAX",
    "CHECK_EVERY",
    "POOLED_BYTES",
    "ArrayPool",
    "heap_info",
    "note_released",
    "owns_pooled",
    "pooled_storage",
    "release_free_heap",
    "tune_allocator",
]

#: Heap arenas glibc may create (M_ARENA_MAX); its default is 8 per core.
ARENA_MAX = 2
_M_ARENA_MAX = -8

#: Bytes released on budgets between two looks at the heap (see the module's text),
#: times one more for every :data:`_SCALE_UNIT` of the largest live budget (an eighth
#: of it, twice per allowance): a look (/proc and mallinfo2) costs 0.2-0.3 ms of CPU
#: in a busy process, and a 256 MiB image pipeline releasing 700 KB an image looked
#: every 23 images (2.5% of its CPU).
CHECK_EVERY = 16 << 20
_SCALE_UNIT = 128 << 20
#: Retention below this is never trimmed for (a small budget's quarter is noise).
_MIN_GROWTH = 8 << 20

_lock = threading.Lock()
_tuned: bool | None = None
_watching = False  # on glibc, with the allocator's tuning asked for
_released = 0  # since the last look (racy adds: a look a little early or late)
_floor = 0  # unbooked memory after the last trim (the program's own, not the heap's)
_scale = 1  # CHECK_EVERY's multiple between looks (from the largest budget at the last)


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
    if _released >= CHECK_EVERY * _scale and _watching:
        _released = 0
        _trim_if_retaining()


def _trim_if_retaining() -> None:
    """Give free heap pages back if unbooked memory grew past the allowance since the
    last trim and the heap has that much free (a lock keeps two releasing threads from
    trimming at once).

    Without the second test, memory the program holds for a moment (the batch the
    training loop is on, 77 MB of images, mapped outside the heap) read as growth: an
    image pipeline trimmed once a batch, and faulted the heap's pages back in (8-12%
    of its CPU)."""
    global _floor, _scale
    from headrace._memory.system import live_runs, sample_process_memory  # (system imports io)

    if not _lock.acquire(blocking=False):
        return  # another thread is looking
    try:
        memory = sample_process_memory()  # (None: the file pool is full; the next look)
        if memory is None:
            return
        unbooked = live_runs.unaccounted(memory)
        largest = live_runs.largest_total()
        _scale = max(1, largest // _SCALE_UNIT)
        allowance = max(_MIN_GROWTH, largest // 4)
        if unbooked > _floor + allowance and _free_heap() > allowance:
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


def _free_heap() -> int:
    """Bytes in the heap's free blocks, all arenas (glibc's ``mallinfo2``); where that
    is unknown, as if every unbooked byte were free. Blocks whose pages a trim already
    gave back count too: an upper bound."""
    info = heap_info()
    return sys.maxsize if info is None else int(info.fordblks)


def heap_info() -> Any:
    """glibc's ``mallinfo2()`` now (``uordblks``: bytes in use, ``fordblks``: free,
    ``hblkhd``: mapped blocks; every arena), in microseconds; None where there is no
    such call (musl, macOS, glibc before 2.33). Internal: the trimming here and the
    doctor's allocation counter read it."""
    function = _mallinfo2()
    return None if function is None else function()


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, or None."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.argtypes = []
    function.restype = MallInfo2
    return function


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


#: Pages of a fresh array a caller may have touched beyond the rows it wrote: the
#: rest of the huge page (NumPy asks for them on large arrays) and of a small page.
_PAGE_MARGIN = (2 << 20) + (4 << 10)


class _Kept(NamedTuple):
    """Internal: released memory an :class:`ArrayPool` keeps (see its ``_idle``)."""

    storage: np.ndarray[Any, Any]
    booking: Reservation | None
    exchange: bool


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
    - while the caller fills a fresh array from ``empty(..., exchange=True)``: the
      caller will move the rows written so far into the released memory
      (:meth:`exchange`) and let the fresh array go, whose booking then covers the
      released memory. Until it does, the process holds the released memory *and*
      the fresh array's touched pages, so ``booker`` books those pages: the rows
      the caller said it may have written, with a huge page of margin. The caller
      does not write past what was booked: it says which row it is about to write
      before it looks for released memory, and a release says it is coming before
      it reads that row, so one of the two sees the other; a caller that sees a
      release coming waits for its booking.

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
        #: Released memory kept: (storage, the booking made for it, None where
        #: ``keep_bytes`` covers it; whether it waits for an :meth:`exchange`).
        self._idle: collections.deque[_Kept] = collections.deque()
        self._closed = False
        self._between = False  # settled, not begun: the caller waits for its next batch
        #: Fresh arrays that would move into released memory, by size in 8-byte words,
        #: and the bytes of each size's rows the caller may have written (see exchange).
        self._waiting: collections.Counter[int] = collections.Counter()
        self._written: dict[int, int] = {}
        #: Releases being booked for a waiting fresh array, by size (see exchange).
        self._incoming: collections.Counter[int] = collections.Counter()
        # A release in the consumer against the caller's calls; reentrant, as a lease may
        # die in a collection that an allocation under the lock sets off.
        self._lock = threading.RLock()
        self._booked = threading.Condition(self._lock)  # an incoming release is booked
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
                    self._written[words] = 0
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
                kept = idle.popleft()
                if kept.booking is not None:
                    freed.append(kept.booking)
                if kept.storage.size == words:
                    found = kept.storage
                    break
        for booking in freed:
            booking.release()
        return found

    def exchange(self, array: np.ndarray[Any, Any],
                 rows: int) -> tuple[np.ndarray[Any, Any], Reservation] | None:
        """``array`` (fresh, from ``empty(..., exchange=True)``) moved into memory of its
        size released since, or None if none waits; called before each row is written,
        ``rows`` being the rows written so far.

        Returns the new array, its first ``rows`` rows copied over, and the booking of
        ``array``'s touched pages: the caller drops ``array`` (its pages go back to the
        system), then releases the booking. Cheap when nothing was released: it runs
        per row."""
        lease = array.base
        if type(lease) is not _Lease:
            return None
        words = lease.storage.size
        # Say what may be written before looking for a release (see the class).
        self._written[words] = (rows + 1) * (array.nbytes // max(len(array), 1))
        if not self._idle and not self._incoming:
            return None
        found = None
        with self._booked:
            while self._incoming[words]:
                self._booked.wait()
            if not self._waiting[words]:
                return None
            for index, kept in enumerate(self._idle):
                if kept.storage.size == words and kept.exchange:
                    found = kept
                    del self._idle[index]
                    self._waiting[words] -= 1
                    break
        if found is None:
            return None
        assert found.booking is not None, "exchange: released memory kept unbooked"
        moved = self._lease(found.storage, array.shape, array.dtype)
        if rows:
            moved[:rows] = array[:rows]
        self.reused += 1
        self.exchanged += 1
        return moved, found.booking

    def withdraw(self, array: np.ndarray[Any, Any]) -> None:
        """``array`` (fresh, from ``empty(..., exchange=True)``) no longer waits for
        released memory: the caller replaced it (a column widened). Memory kept for it
        goes, with its booking, which covered it only as long as ``array`` did."""
        lease = array.base
        if type(lease) is not _Lease:
            return
        words = lease.storage.size
        dropped: list[_Kept] = []
        with self._booked:
            while self._incoming[words]:
                self._booked.wait()
            if self._waiting[words]:
                self._waiting[words] -= 1
            surplus = sum(1 for kept in self._idle
                          if kept.exchange and kept.storage.size == words)
            surplus -= self._waiting[words]
            for kept in list(self._idle):
                if surplus > 0 and kept.exchange and kept.storage.size == words:
                    dropped.append(kept)
                    surplus -= 1
            if dropped:  # (by identity: a tuple of arrays has no truth for ==)
                self._idle = collections.deque(
                    kept for kept in self._idle if all(kept is not d for d in dropped))
        while dropped:
            kept = dropped.pop()
            booking = kept.booking
            del kept  # (the memory goes before its booking)
            assert booking is not None
            booking.release()

    def begin(self) -> list[Reservation]:
        """The caller is about to book and take its next arrays: nothing released from
        now on is booked by the pool, and the bookings of what it kept between batches
        are handed over (the caller books its arrays over them, then takes the memory
        with :meth:`empty`)."""
        with self._booking, self._lock:
            self._between = False
            handed: list[Reservation] = []
            for index, kept in enumerate(list(self._idle)):
                if kept.booking is not None:
                    handed.append(kept.booking)
                    self._idle[index] = _Kept(kept.storage, None, False)
            return handed

    def settle(self) -> None:
        """The caller's arrays are filled: no fresh array waits any more (the released
        memory kept for them is freed, beyond ``keep_bytes``), and until :meth:`begin`
        a release is kept where ``booker`` books it."""
        freed: list[Reservation] = []
        with self._lock:
            self._waiting.clear()
            self._written.clear()
            idle = self._idle
            total = sum(kept.storage.nbytes for kept in idle)
            while idle and total > self.keep_bytes:
                kept = idle.popleft()
                total -= kept.storage.nbytes
                if kept.booking is not None:
                    freed.append(kept.booking)
            self._between = not self._closed and self._booker is not None
        for booking in freed:
            booking.release()

    def _returned(self, storage: np.ndarray[Any, Any]) -> None:
        """A lease died: keep its memory for the next batch or a fresh array waiting
        for it where it can be booked, or let it go."""
        if self._closed:
            return
        booker = None if self._booker is None else self._booker()
        words = storage.size
        with self._lock:
            if sum(kept.storage.nbytes for kept in self._idle) + storage.nbytes <= (
                self.keep_bytes
            ):
                self._idle.append(_Kept(storage, None, False))
                return
            if booker is None:
                return
            waiting = self._waiting[words] > self._incoming[words] + sum(
                1 for kept in self._idle if kept.exchange and kept.storage.size == words
            )
            if waiting:
                # Said before reading what the caller may have written (see exchange).
                self._incoming[words] += 1
                written = self._written.get(words, 0)
            elif not self._between:
                return
        if waiting:
            self._keep_for_exchange(storage, booker, written)
        elif self._booking.acquire(blocking=False):
            try:
                if self._between:  # (begin() cannot run while we hold _booking)
                    booking = booker(storage.nbytes)
                    if booking is not None:
                        with self._lock:
                            self._idle.append(_Kept(storage, booking, False))
            finally:
                self._booking.release()

    def _keep_for_exchange(self, storage: np.ndarray[Any, Any],
                           booker: Callable[[int], Reservation | None], written: int) -> None:
        """Keep released memory for the fresh array being filled, booking the pages of
        that array the caller may touch until it moves over (see the class); the
        caller counted this release as incoming."""
        words = storage.size
        booking = None
        try:
            booking = booker(min(storage.nbytes, written + _PAGE_MARGIN))
            if booking is not None:
                with self._lock:
                    if self._waiting[words]:
                        self._idle.append(_Kept(storage, booking, True))
                        booking = None
        finally:
            with self._booked:
                self._incoming[words] -= 1
                if not self._incoming[words]:
                    del self._incoming[words]  # (an empty Counter is false: see exchange)
                self._booked.notify_all()
            if booking is not None:  # (the array was filled meanwhile)
                booking.release()

    def idle_bytes(self) -> int:
        """Bytes released by the consumer and kept for reuse (see the class)."""
        return sum(kept.storage.nbytes for kept in list(self._idle))

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
            self._written.clear()
            self._between = False
            bookings = [kept.booking for kept in self._idle if kept.booking is not None]
            self._idle.clear()
        for booking in bookings:
            booking.release()

    def close(self) -> None:
        """Free what is kept, and keep nothing released from now on."""
        self._closed = True
        self.clear()
