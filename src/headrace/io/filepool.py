"""A process-wide pool of file descriptors with a hard cap (guarantee G2).

Why: tf.data opens one descriptor per file it reads at once (``3 * cycle_length`` under a
parallel interleave), and thousands of shards end in "Too many open files". Here every
stream headrace reads goes through a :class:`FilePool`, which never has more than
``max_open_files`` descriptors open, counting all threads and all pipelines. When a stream
needs a descriptor and the pool is full, the pool *suspends* the least-recently-used idle
stream (see :mod:`headrace.io.streams`), which resumes later at the same byte; if every
descriptor is in the middle of a read, the caller waits on a condition variable until one
is released.

Pieces:

* :class:`FilePool` — ``open(path, compression_type, *, limiter=, memory_account=)``
  returns a :class:`PooledStream` (``read``/``tell``/``seek``/``close``, a context manager).
* :meth:`FilePool.limiter` — a pipeline's share (``Options(max_open_files=...)``): streams
  opened with it count against the limiter's cap *and* the pool's, so a pipeline can only
  lower its share, never raise the process cap.
* :meth:`FilePool.hold` — slots for descriptors that are not suspendable streams (a
  cache or snapshot writer's file and its lock): they count against the caps like
  readers, so readers are suspended to make room for them, and a cap too small to leave
  one reader beside them is refused with an error naming the stage.
* :class:`MemoryAccount` — where suspended compressed streams charge the state they keep
  (zlib window, unread output), so the memory budget sees it.
* :func:`get_default_pool` / :func:`set_max_open_files` — the process-wide pool, capped by
  default at a quarter of the soft ``RLIMIT_NOFILE``, leaving the rest to the user's code.

Locking (G1's fixed order, *budget first, then file pool*): the pool never waits for the
budget. It calls ``MemoryAccount.charge``/``discharge`` while holding its own lock — so a
charge and its discharge are never seen out of order — and requires them to be quick,
non-blocking and never to call back into a pool. Handles never hold the pool's lock while
reading: a read marks its stream *busy* under the lock, reads without it, then releases.

Garbage collection (G6): a :class:`PooledStream` dropped without ``close()`` releases its
descriptor through ``weakref.finalize``. The pool's bookkeeping references only the
internal ``_Entry`` records, never the handles, so it cannot keep an abandoned handle alive.
Finalizers can run inside any allocation, including while this thread holds the pool's
lock, so they never block on it: they queue the entry, and whoever releases the lock next
closes it (see :meth:`FilePool._close_abandoned_entries`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar

from headrace._closing import ClosesOnExit
from headrace._errors import FileLimitError, InvalidArgumentError
from headrace.io.streams import DEFAULT_BUFFER_SIZE, SuspendableStream, make_stream

_T = TypeVar("_T")

__all__ = [
    "FileLimiter",
    "FilePool",
    "FilePoolStats",
    "HeldSlots",
    "MemoryAccount",
    "PooledStream",
    "borrowed_slot",
    "default_max_open_files",
    "file_at_fault",
    "get_default_pool",
    "opening_under",
    "read_small_file",
    "set_max_open_files",
]

_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
_UNLIMITED_NOFILE_FALLBACK = 4096
"""Soft limit assumed when RLIMIT_NOFILE is unlimited or unknown: descriptors still cost
kernel memory, so the default cap stays finite (a quarter of this)."""



#: ``errno`` values of an open that fails because of the file itself, not of the
#: process's descriptors or memory (see :func:`file_at_fault`).
_FILE_ERRNOS = frozenset({errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.EACCES,
                          errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG, errno.ENXIO})


def file_at_fault(error: OSError) -> bool:
    """Whether an open failed because of the file (missing, a directory, not readable):
    a reader then skips it, the error raised in its place, and goes on with the next
    file. Not the descriptor cap (:class:`~headrace._errors.FileLimitError`): the
    file is not at fault, and skipping it would lose it."""
    return not isinstance(error, FileLimitError) and error.errno in _FILE_ERRNOS


class MemoryAccount(Protocol):
    """Where the pool charges the bytes a suspended stream keeps (a pipeline's budget).

    The bytes already exist when they are charged (the state was live while the stream
    was open), so an account records them and cannot refuse them. Both methods are called
    with the pool's lock held: they must not block and must not call into a file pool.
    """

    def charge(self, nbytes: int) -> None: ...

    def discharge(self, nbytes: int) -> None: ...


@dataclass(frozen=True)
class FilePoolStats:
    """A snapshot of a pool's counters, for the profiler."""

    max_open_files: int
    open_files: int
    """Descriptors the pool has open (or is opening) right now."""
    peak_open_files: int
    streams: int
    """Streams opened and not yet closed, with or without a descriptor."""
    suspensions: int
    resumptions: int
    suspended_nbytes: int
    """Bytes kept by suspended streams (decompressor state and unread output)."""


def _check_max_open_files(max_open_files: int) -> int:
    if (
        isinstance(max_open_files, bool)
        or not isinstance(max_open_files, int)
        or max_open_files < 1
    ):
        raise InvalidArgumentError(f"max_open_files must be an int >= 1, got {max_open_files!r}")
    return max_open_files


class FileLimiter:
    """A pipeline's share of a :class:`FilePool`; create it with :meth:`FilePool.limiter`.

    Its cap can only lower the pool's: a stream opened with a limiter needs a free slot in
    both. When the limiter is full, the pool suspends the least-recently-used idle stream
    *of this limiter*, so one pipeline never takes descriptors from another to exceed its
    own share.
    """

    def __init__(self, pool: FilePool, max_open_files: int) -> None:
        self._pool = pool
        self._max_open_files = _check_max_open_files(max_open_files)
        # Guarded by the pool's lock:
        self._open_files = 0
        self._held = 0  # of which held by writers (:meth:`FilePool.hold`)
        self._idle: collections.OrderedDict[_Entry, None] = collections.OrderedDict()

    @property
    def pool(self) -> FilePool:
        return self._pool

    @property
    def max_open_files(self) -> int:
        return self._max_open_files

    @property
    def open_files(self) -> int:
        """Descriptors this limiter's streams hold right now."""
        return self._open_files

    def _is_full(self) -> bool:
        return self._open_files >= self._max_open_files


class _Entry:
    """The pool's record of one stream. Holds the stream, never the handle (see module doc)."""

    __slots__ = ("account", "busy", "closed", "ever_opened", "limiter", "saved_nbytes", "stream")

    def __init__(
        self,
        stream: SuspendableStream,
        limiter: FileLimiter | None,
        account: MemoryAccount | None,
    ) -> None:
        self.stream = stream
        self.limiter = limiter
        self.account = account
        self.busy = False  # a thread is using the stream; it must not be suspended
        self.closed = False
        self.ever_opened = False  # the first open is not a "resumption"
        self.saved_nbytes = 0  # suspended state charged to ``account``


class _LockThenSweep:
    """``with pool._locked:`` — the pool's lock, closing streams abandoned meanwhile once it
    is released. A class rather than a generator: it wraps every read."""

    __slots__ = ("_lock", "_sweep")

    def __init__(self, lock: threading.Lock, sweep: Callable[[], None]) -> None:
        self._lock = lock
        self._sweep = sweep

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()
        self._sweep()


class FilePool:
    """Descriptors for many streams, never more than ``max_open_files`` open at once.

    Thread-safe. Most code uses the process-wide pool from :func:`get_default_pool`;
    separate pools are for tests and for callers that want an isolated cap.
    """

    def __init__(self, max_open_files: int) -> None:
        self._max_open_files = _check_max_open_files(max_open_files)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot freed or a stream idled
        self._waiters = 0
        self._idle: collections.OrderedDict[_Entry, None] = collections.OrderedDict()  # LRU
        self._abandoned: collections.deque[_Entry] = collections.deque()
        self._locked = _LockThenSweep(self._lock, self._close_abandoned_entries)
        self._open_files = 0
        self._held = 0  # of which held by writers (:meth:`hold`), never suspendable
        self._peak_open_files = 0
        #: The pipelines' shares: a sample of headrace's own counts against each of them.
        self._limiters: weakref.WeakSet[FileLimiter] = weakref.WeakSet()
        self._streams = 0
        self._suspensions = 0
        self._resumptions = 0
        self._suspended_nbytes = 0

    # ------------------------------------------------------------------ public API
    @property
    def max_open_files(self) -> int:
        return self._max_open_files

    def set_max_open_files(self, max_open_files: int) -> None:
        """Change the cap; safe at any time, also with streams open.

        Lowering it suspends idle streams at once and waits until streams busy in a read
        have finished it and been suspended, so when this returns the new cap holds.
        Must not be called from a thread that is itself inside a pooled read.
        """
        _check_max_open_files(max_open_files)
        with self._locked:
            if max_open_files < self._held + 1:  # waiting for room would never end
                raise InvalidArgumentError(
                    f"max_open_files={max_open_files} is below the {self._held + 1} "
                    f"descriptors in use now: {self._held} held by cache/snapshot writers "
                    f"(their file and lock) plus one to read their input"
                )
            self._max_open_files = max_open_files
            self._suspend_idle_over_cap()
            self._notify_change()
            while self._open_files > self._max_open_files:
                self._wait_for_change()

    def limiter(self, max_open_files: int) -> FileLimiter:
        """A share of this pool capped at ``max_open_files`` (for one pipeline)."""
        limiter = FileLimiter(self, max_open_files)
        with self._locked:
            self._limiters.add(limiter)
        return limiter

    def hold(
        self, count: int, *, limiter: FileLimiter | None = None, stage: str, what: str
    ) -> HeldSlots:
        """Reserve ``count`` slots for descriptors the caller opens itself (``what``:
        ``stage``'s output file, its lock), so they count against the caps like readers'
        (G2).

        Why: a writer's descriptors cannot be suspended and resumed like a reader's, so
        they hold their slots until :meth:`HeldSlots.release`; idle readers are suspended
        to make room, and a busy one is waited for. A cap that would leave no slot for
        the reader feeding ``stage`` (``count + 1`` with the slots already held) is
        refused at once with :class:`~headrace._errors.InvalidArgumentError` naming the
        stage and the cap, instead of a pipeline that waits for a slot forever.
        """
        _check_max_open_files(count)
        if limiter is not None and limiter.pool is not self:
            raise InvalidArgumentError("the limiter belongs to a different FilePool")
        with self._locked:
            for owner, cap, held in (
                ("the process-wide cap (headrace.io.filepool.set_max_open_files)",
                 self._max_open_files, self._held),
                *(() if limiter is None else (
                    ("Options(max_open_files=...)", limiter.max_open_files, limiter._held),
                )),
            ):
                needed = held + count + 1
                if cap < needed:
                    raise InvalidArgumentError(
                        f"{stage} needs {count} more open file(s), for {what}: with the "
                        f"{held} already held by cache/snapshot writers (their files and "
                        f"locks) and one to read the input, {needed} in all, above "
                        f"max_open_files={cap} set by {owner}. Raise that cap to at least "
                        f"{needed}."
                    )
            reserved = 0
            try:
                while reserved < count:
                    self._reserve_slot(limiter)
                    reserved += 1
                    self._held += 1
                    if limiter is not None:
                        limiter._held += 1
            except BaseException:
                self._unhold(limiter, reserved)
                raise
        return HeldSlots(self, limiter, count)

    def hold_spare(self, count: int, *, limiter: FileLimiter | None = None) -> HeldSlots:
        """Up to ``count`` slots that are free now, for descriptors that speed work up
        but that it does not need (an upload's parts sent in parallel, each on a
        connection of its own): no stream is suspended for them and none is waited
        for, so they may be fewer than asked, or none (:attr:`HeldSlots.count`)."""
        with self._locked:
            taken = 0
            while taken < count and not self._is_full(limiter):
                self._reserve_slot(limiter)
                taken += 1
                self._held += 1
                if limiter is not None:
                    limiter._held += 1
        return HeldSlots(self, limiter, taken)

    @contextlib.contextmanager
    def transient(
        self, *, wait: bool = True, limiter: FileLimiter | None = None
    ) -> Iterator[bool]:
        """One slot for a descriptor the caller opens and closes at once (a ``/proc`` or
        cgroup file, a directory listing), so it counts against the cap like a reader's
        (G2). Yields True while the slot is held.

        Like a reader's open, it suspends an idle stream or waits for a busy one when the
        pool is full. ``wait=False``: yields False at once instead, and the caller skips
        its read (a sample on a hot path must not close a reader's file). ``limiter``: a
        pipeline's share, which the slot counts against too.

        ``wait=False`` without a limiter is a sample of headrace's own taken beside the
        pipelines (the heap watcher's ``/proc/self/status`` on a budget's release): its
        slot counts against every pipeline's share as well, and it is skipped while any
        share is full. So a pipeline capped at N never has more than N descriptors open
        beside it, headrace's own reads included (a reader of its that opens meanwhile
        waits for the slot or suspends an idle one).
        """
        if limiter is not None and limiter.pool is not self:
            raise InvalidArgumentError("the limiter belongs to a different FilePool")
        shares: list[FileLimiter] = []
        if wait:
            with self._locked:
                self._reserve_slot(limiter)
            got = True
        else:
            got = self._try_reserve(limiter, shares)
        try:
            yield got
        finally:
            if got:
                with self._locked:
                    for share in shares:
                        share._open_files -= 1
                    self._release_slot(limiter)

    def _try_reserve(self, limiter: FileLimiter | None, shares: list[FileLimiter]) -> bool:
        """A slot for a sample on a hot path, if one is free now, without waiting: not
        for the lock either. The sample may come from a release made while this thread
        holds the lock (a reader closed or resumed gives back its suspended state's
        booking, and the release looks at the heap): waiting there never ended. With no
        ``limiter``, ``shares`` gets every pipeline's share, which the slot counts against."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if limiter is None:
                shares.extend(self._limiters)
            if self._is_full(limiter) or any(share._is_full() for share in shares):
                shares.clear()
                return False
            self._reserve_slot(limiter)
            for share in shares:
                share._open_files += 1
            return True
        finally:
            self._lock.release()
            self._close_abandoned_entries()

    def _unhold(self, limiter: FileLimiter | None, count: int) -> None:
        for _ in range(count):
            self._held -= 1
            if limiter is not None:
                limiter._held -= 1
            self._release_slot(limiter)

    def open(
        self,
        path: str | os.PathLike[str],
        compression_type: str | None = None,
        *,
        limiter: FileLimiter | None = None,
        memory_account: MemoryAccount | None = None,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        successor: Any = None,
        on_last_range: Callable[[], None] | None = None,
    ) -> PooledStream:
        """Open ``path`` for reading its decompressed bytes through this pool.

        The file is opened at once, so a missing file or a process out of descriptors
        fails here (``FileNotFoundError``, :class:`~headrace._errors.FileLimitError`)
        rather than at the first read. Blocks while every slot is busy in a read.
        ``successor`` and ``on_last_range``: an object read ahead across a list of
        objects (see :meth:`SuspendableStream.attach_successor`).
        """
        if limiter is not None and limiter.pool is not self:
            raise InvalidArgumentError("the limiter belongs to a different FilePool")
        stream = make_stream(path, compression_type, buffer_size=buffer_size)
        stream.attach_pool(self, limiter)
        if successor is not None or on_last_range is not None:
            stream.attach_successor(successor, on_last_range)
        entry = _Entry(stream, limiter, memory_account)
        with self._locked:
            self._streams += 1
        try:
            self._check_out(entry, open_descriptor=True)
        except BaseException:
            self._close_entry(entry)
            raise
        self._check_in(entry)
        return PooledStream(self, entry)

    def stats(self) -> FilePoolStats:
        with self._locked:
            return FilePoolStats(
                max_open_files=self._max_open_files,
                open_files=self._open_files,
                peak_open_files=self._peak_open_files,
                streams=self._streams,
                suspensions=self._suspensions,
                resumptions=self._resumptions,
                suspended_nbytes=self._suspended_nbytes,
            )

    @contextlib.contextmanager
    def borrow(self, limiter: FileLimiter | None = None) -> Iterator[None]:
        """One slot for a descriptor the caller opens and closes inside the block (an
        index file read whole, a shard's fingerprint), so it counts against the caps.

        Why: such a descriptor lives too briefly to be worth suspending, yet while it is
        open it is one more file (G2). An idle stream is suspended to make room for it,
        and a busy one is waited for. Do not call it from inside a pooled read.
        ``limiter`` None: the pipeline share set by :func:`opening_under` (a dataset
        built by an interleave's function while the pipeline runs), if any.
        """
        if limiter is None:
            limiter = _opening_limiter.get()
            if limiter is not None and limiter.pool is not self:
                limiter = None  # (a share of another pool: this pool's cap still holds)
        if limiter is not None and limiter.pool is not self:
            raise InvalidArgumentError("the limiter belongs to a different FilePool")
        with self._locked:
            self._reserve_slot(limiter)
        try:
            yield
        finally:
            with self._locked:
                self._release_slot(limiter)

    # ------------------------------------------------------------------ check out / in
    def _check_out(self, entry: _Entry, *, open_descriptor: bool) -> None:
        """Mark ``entry`` busy (waiting while another thread uses it) and, if asked,
        make sure it holds a descriptor. Pair with :meth:`_check_in`."""
        with self._locked:
            while entry.busy:
                self._wait_for_change()
            if entry.closed:
                raise ValueError(f"I/O operation on closed stream of {entry.stream.path!r}")
            entry.busy = True
            self._forget_idle(entry)
            if not open_descriptor or entry.stream.holds_descriptor:
                return
            try:
                self._reserve_slot(entry.limiter)
            except BaseException:
                self._mark_not_busy(entry)
                raise
        try:
            self._resume(entry)
        except BaseException:
            entry.stream.suspend()  # in case only the bookkeeping after the open failed
            with self._locked:
                self._release_slot(entry.limiter)
                self._mark_not_busy(entry)
            raise

    def _check_in(self, entry: _Entry) -> None:
        with self._locked:
            self._mark_not_busy(entry)
            if entry.stream.holds_descriptor:
                self._mark_idle(entry)
                self._suspend_idle_over_cap()

    def _mark_not_busy(self, entry: _Entry) -> None:
        entry.busy = False
        self._notify_change()

    # ------------------------------------------------------------------ slots
    def _reserve_slot(self, limiter: FileLimiter | None) -> None:
        """Count one more descriptor, suspending LRU idle streams or waiting for a slot."""
        while self._is_full(limiter):
            victim = self._choose_victim(limiter)
            if victim is None:
                self._wait_for_change()
            else:
                self._suspend(victim)
        self._open_files += 1
        self._peak_open_files = max(self._peak_open_files, self._open_files)
        if limiter is not None:
            limiter._open_files += 1

    def _release_slot(self, limiter: FileLimiter | None) -> None:
        self._open_files -= 1
        if limiter is not None:
            limiter._open_files -= 1
        self._notify_change()

    def _is_full(self, limiter: FileLimiter | None) -> bool:
        return self._open_files >= self._max_open_files or (
            limiter is not None and limiter._is_full()
        )

    def _choose_victim(self, limiter: FileLimiter | None) -> _Entry | None:
        """The LRU idle stream whose suspension frees a slot this caller can use: the
        limiter's own when the limiter is the bottleneck, else anyone's."""
        idle = limiter._idle if limiter is not None and limiter._is_full() else self._idle
        return next(iter(idle), None)

    def _suspend_idle_over_cap(self) -> None:
        """After the cap was lowered, get back under it as far as idle streams allow (busy
        ones come back here when their read ends). Limiters' caps never change."""
        while self._open_files > self._max_open_files and self._idle:
            self._suspend(next(iter(self._idle)))

    # ------------------------------------------------------------------ suspend / resume
    def _suspend(self, entry: _Entry) -> None:
        """Close an idle stream's descriptor and charge the state it keeps."""
        self._forget_idle(entry)
        try:
            entry.stream.suspend()
        finally:  # the descriptor is gone even if close() reported an error
            self._release_slot(entry.limiter)
        self._suspensions += 1
        self._set_saved_nbytes(entry, entry.stream.suspended_nbytes)

    def _resume(self, entry: _Entry) -> None:
        """Reopen a busy entry's stream in its reserved slot, outside the lock (an open on a
        network file system can be slow). If the process, not the pool, is out of
        descriptors, give back the pool's own idle ones until the open succeeds."""
        while True:
            try:
                entry.stream.resume()
                break
            except OSError as error:
                if error.errno not in _OUT_OF_DESCRIPTORS:
                    raise
                with self._locked:
                    if not self._idle:
                        raise self._file_limit_error(entry.stream.path, error) from error
                    self._suspend(next(iter(self._idle)))
        with self._locked:
            if entry.ever_opened:
                self._resumptions += 1
            entry.ever_opened = True
            self._set_saved_nbytes(entry, 0)

    def _set_saved_nbytes(self, entry: _Entry, nbytes: int) -> None:
        """Move ``entry``'s charge to ``nbytes``: charge on suspend, discharge on resume/close."""
        previous, entry.saved_nbytes = entry.saved_nbytes, nbytes
        self._suspended_nbytes += nbytes - previous
        if entry.account is not None:
            if previous:
                entry.account.discharge(previous)
            if nbytes:
                entry.account.charge(nbytes)

    def _file_limit_error(self, path: str, error: OSError) -> FileLimitError:
        soft, hard = _nofile_limits()
        held_by_pool = self._open_files - 1  # minus the slot reserved for this very open
        if error.errno == errno.ENFILE:
            reason = "the system-wide table of open files is full (ENFILE, fs.file-max)"
        else:
            in_use = _count_process_descriptors()
            if in_use is None:  # listing them needs a descriptor too
                reason = (
                    f"the process has all {soft} descriptors its soft RLIMIT_NOFILE allows open"
                )
            else:
                reason = f"the process has {in_use} descriptors open, soft RLIMIT_NOFILE {soft}"
        message = (
            f"cannot open {path!r}: {reason} (hard limit {hard}). headrace's file pool holds "
            f"{held_by_pool} of them (cap max_open_files={self._max_open_files}) and none "
            f"is idle, so it cannot give one back; the rest are used elsewhere in the process. "
            f"Fix: raise the limit (`ulimit -n <n>` before starting Python, up to the hard "
            f"limit, or resource.setrlimit(resource.RLIMIT_NOFILE, ...)), or lower "
            f"headrace's cap (headrace.io.filepool.set_max_open_files(n) or "
            f"Options(max_open_files=n)) so the rest of the process keeps enough."
        )
        return FileLimitError(error.errno, message)  # no filename: the message names it

    # ------------------------------------------------------------------ closing
    def _close_entry(self, entry: _Entry) -> None:
        """Close on request: wait for a read of this stream in another thread to finish."""
        with self._locked:
            while entry.busy:
                self._wait_for_change()
            self._close_entry_locked(entry)

    def _suspend_on_request(self, entry: _Entry) -> None:
        with self._locked:
            while entry.busy:
                self._wait_for_change()
            if not entry.closed and entry.stream.holds_descriptor:
                self._suspend(entry)

    def _close_abandoned(self, entry: _Entry) -> None:
        """``weakref.finalize`` callback of a handle collected without ``close()``.

        May run in any thread, inside any allocation — also while this very thread holds
        the lock — so it must not wait for the lock: it queues the entry and closes the
        queue only if the lock is free; otherwise the holder closes it on release.
        """
        self._abandoned.append(entry)
        self._close_abandoned_entries()

    def _close_abandoned_entries(self) -> None:
        # Queue first, try-lock second (in the finalizer); release first, check the queue
        # second (in every lock holder): between them, no queued entry is ever missed.
        while self._abandoned and self._lock.acquire(blocking=False):
            try:
                while self._abandoned:
                    self._close_entry_locked(self._abandoned.popleft())
            finally:
                self._lock.release()

    def _close_entry_locked(self, entry: _Entry) -> None:
        if entry.closed:
            return
        entry.closed = True
        self._streams -= 1
        self._forget_idle(entry)
        held_descriptor = entry.stream.holds_descriptor
        try:
            entry.stream.close()
        finally:
            if held_descriptor:
                self._release_slot(entry.limiter)
            self._set_saved_nbytes(entry, 0)
            self._notify_change()

    # ------------------------------------------------------------------ waiting
    def _wait_for_change(self) -> None:
        """Wait (lock held) until a slot frees, a stream idles or a cap changes."""
        self._waiters += 1
        try:
            self._changed.wait()
        finally:
            self._waiters -= 1

    def _notify_change(self) -> None:
        # Skipping notify_all without waiters keeps the check-in after every read cheap.
        if self._waiters:
            self._changed.notify_all()

    # ------------------------------------------------------------------ LRU bookkeeping
    def _mark_idle(self, entry: _Entry) -> None:
        self._idle[entry] = None
        if entry.limiter is not None:
            entry.limiter._idle[entry] = None

    def _forget_idle(self, entry: _Entry) -> None:
        self._idle.pop(entry, None)
        if entry.limiter is not None:
            entry.limiter._idle.pop(entry, None)


class HeldSlots:
    """Slots reserved by :meth:`FilePool.hold`; :meth:`release` (idempotent) gives them
    back once the caller has closed the descriptors they stood for."""

    def __init__(self, pool: FilePool, limiter: FileLimiter | None, count: int) -> None:
        self._pool = pool
        self._limiter = limiter
        self._count = count

    @property
    def count(self) -> int:
        """How many slots are held (0 once released)."""
        return self._count

    def release(self) -> None:
        count, self._count = self._count, 0
        if count:
            with self._pool._locked:
                self._pool._unhold(self._limiter, count)


class PooledStream(ClosesOnExit):
    """A stream whose descriptor the pool may take back between calls.

    Reads, ``tell`` and ``seek`` behave exactly as on :class:`~headrace.io.streams.SuspendableStream`;
    suspension and resumption are invisible except in the pool's stats. Use one handle
    from one thread at a time (concurrent calls on the same handle are serialized).
    """

    def __init__(self, pool: FilePool, entry: _Entry) -> None:
        self._pool = pool
        self._entry = entry
        self._finalizer = weakref.finalize(self, pool._close_abandoned, entry)

    @property
    def path(self) -> str:
        return self._entry.stream.path

    @property
    def compression_type(self) -> str:
        return self._entry.stream.compression_type

    @property
    def closed(self) -> bool:
        return self._entry.closed

    @property
    def holds_descriptor(self) -> bool:
        """Whether the stream has a descriptor open now (False while suspended)."""
        return self._entry.stream.holds_descriptor

    def read(self, size: int = -1, /) -> bytes:
        """The next ``size`` decompressed bytes; fewer only at the end of the stream."""
        return self._checked_out(lambda stream: stream.read(size))

    def readinto(self, buffer: memoryview, /) -> int:
        """Read the next bytes into ``buffer``; how many (fewer only at the end)."""
        return self._checked_out(lambda stream: stream.readinto(buffer))

    def pread_many(self, offsets: list[int], sizes: list[int]) -> list[bytes]:
        """Positioned reads (``sizes[i]`` bytes at ``offsets[i]``) of an uncompressed file,
        all under one check-out of the descriptor; the stream's position does not move."""
        return self._checked_out(lambda stream: stream.pread_many(offsets, sizes))

    def pread_scatter(self, offset: int, buffers: list[memoryview]) -> int:
        """A positioned read into ``buffers``, one after another, of an uncompressed file
        (see :meth:`~headrace.io.streams.SuspendableStream.pread_scatter`)."""
        return self._checked_out(lambda stream: stream.pread_scatter(offset, buffers))

    def pread_into(self, offset: int, buffer: memoryview) -> int:
        """A positioned read into ``buffer`` of an uncompressed file (see
        :meth:`~headrace.io.streams.SuspendableStream.pread_into`); the position stays."""
        return self._checked_out(lambda stream: stream.pread_into(offset, buffer))

    def read_ahead(self, offset: int | None, size: int) -> bool:
        """An object's stream: fetch the ``size`` bytes at ``offset`` in the background,
        for the next positioned read (see :meth:`headrace.io.objstore._RemoteReads.read_ahead`);
        whether it was asked for. A local file: nothing (the page cache reads ahead)."""
        def ask(stream: SuspendableStream) -> bool:
            ahead = getattr(stream, "read_ahead", None)
            return bool(ahead(offset, size)) if ahead is not None else False

        return self._checked_out(ask, open_descriptor=False)

    def tell(self) -> int:
        """Decompressed bytes read so far; needs no descriptor."""
        return self._checked_out(lambda stream: stream.tell(), open_descriptor=False)

    def seek(self, offset: int, /) -> int:
        """Move to decompressed byte ``offset``; compressed streams decompress to get there."""
        return self._checked_out(lambda stream: stream.seek(offset))

    def _checked_out(
        self, use: Callable[[SuspendableStream], _T], *, open_descriptor: bool = True
    ) -> _T:
        """Run ``use`` on the stream while this thread has it checked out of the pool
        (with a descriptor, unless told it needs none)."""
        pool, entry = self._pool, self._entry
        pool._check_out(entry, open_descriptor=open_descriptor)
        try:
            return use(entry.stream)
        finally:
            pool._check_in(entry)

    def suspend(self) -> None:
        """Give the descriptor back now, e.g. when this stream will not be read for a while."""
        self._pool._suspend_on_request(self._entry)

    def close(self) -> None:
        """Free the descriptor and any charged bytes. Idempotent."""
        if self._finalizer.detach() is not None:
            self._pool._close_entry(self._entry)



# ---------------------------------------------------------------------- process-wide pool

_default_pool: FilePool | None = None
_default_pool_lock = threading.Lock()


def _nofile_limits() -> tuple[int | str, int | str]:
    """The soft and hard RLIMIT_NOFILE, as ints or ``"unlimited"``/``"unknown"``."""
    try:
        import resource
    except ImportError:  # not POSIX
        return "unknown", "unknown"
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = ("unlimited" if value == resource.RLIM_INFINITY else value for value in limits)
    return soft, hard


def _count_process_descriptors() -> int | None:
    """Descriptors the process has open, or None if it cannot tell (listing
    ``/proc/self/fd`` needs a descriptor itself, which may be exactly what is missing)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listing the directory
    except OSError:
        return None


def default_max_open_files() -> int:
    """A quarter of the soft RLIMIT_NOFILE (at least 1): headrace takes a bounded share and
    leaves the rest to the user's code, sockets, and libraries."""
    soft, _ = _nofile_limits()
    return max(1, (soft if isinstance(soft, int) else _UNLIMITED_NOFILE_FALLBACK) // 4)


def get_default_pool() -> FilePool:
    """The process-wide pool every pipeline shares unless given another one."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = FilePool(default_max_open_files())
        return _default_pool


_opening_limiter: contextvars.ContextVar[FileLimiter | None] = contextvars.ContextVar(
    "headrace_opening_limiter", default=None
)


@contextlib.contextmanager
def opening_under(limiter: FileLimiter | None) -> Iterator[None]:
    """Charge the descriptors opened in this block to ``limiter`` (a pipeline's share).

    Why: a dataset built while a pipeline runs (an interleave's function calling
    ``Dataset.load``, ``from_npy``...) opens files for a moment (a manifest, a header,
    an index) with no pipeline context at hand; those opens take a slot through
    :meth:`FilePool.borrow` with no limiter, which counts them against the process-wide
    cap only, and the pipeline's ``Options(max_open_files=n)`` is passed by one. The
    interleave sets its pipeline's share around the function, and ``borrow`` uses it.
    """
    token = _opening_limiter.set(limiter)
    try:
        yield
    finally:
        _opening_limiter.reset(token)


def borrowed_slot() -> contextlib.AbstractContextManager[None]:
    """A slot of the process-wide pool, under the pipeline share of :func:`opening_under`
    if one is set, for a descriptor the caller opens and closes inside the block (G2)."""
    return get_default_pool().borrow()


def read_small_file(
    path: str, *, wait: bool = True, limiter: FileLimiter | None = None
) -> bytes | None:
    """The bytes of a small file (``/proc/self/status``, a cgroup limit), read on a slot
    of the process-wide pool: headrace's own reads count against its cap (G2), and
    against ``limiter``'s (a pipeline's share) when a pipeline reads it.

    None when the file cannot be read, or when ``wait`` is False and no slot is free.
    """
    with get_default_pool().transient(wait=wait, limiter=limiter) as got:
        if not got:
            return None
        try:
            descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            parts = []
            while part := os.read(descriptor, 1 << 16):
                parts.append(part)
            return b"".join(parts)
        except OSError:
            return None
        finally:
            os.close(descriptor)


def set_max_open_files(max_open_files: int) -> None:
    """Set the process-wide cap on descriptors headrace opens.

    May be called at any time: best at start-up, before pipelines run. Called with streams
    open it suspends idle ones at once and waits for busy reads to finish, so when it
    returns the new cap holds. Not from inside a pooled read (it would wait for itself).
    """
    global _default_pool
    _check_max_open_files(max_open_files)
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = FilePool(max_open_files)
            return
        pool = _default_pool
    pool.set_max_open_files(max_open_files)
