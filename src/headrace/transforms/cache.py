"""``cache(filename="")``: read the input once, serve every later epoch from the cache.

tf.data's in-memory cache grows until the process dies. Here ``cache()`` keeps
elements in memory only while they fit in the stage's share of the budget
(G1): when the next one would not, it and every later element *spill* to an
on-disk cache in a temporary directory (one warning names the sizes and the
directory), so a dataset several times the budget caches without passing it.
The cache lives as long as the run (the ``DatasetIterator``): the epochs of a
``repeat`` after it read only the cache, never the input; the temporary files
are removed when the iterator closes (also after an exception, or at exit).

``cache(filename)`` is tf.data's persistent cache: ``<filename>.hrcache``
(elements, TFRecord-framed, CRC-checked) and ``<filename>.hrcache.json``, the
manifest that marks it complete. Both are written atomically and only at the
end of the input (or once the input's cardinality is reached, as in tf.data),
so a crashed or interrupted writer never leaves a cache that looks complete.
The manifest records the fingerprint of the pipeline above the cache: a run
of another pipeline rebuilds the cache (with a warning) instead of reading
stale data. One writer at a time: ``<filename>.lockfile`` is held with
``flock`` (released by the kernel if the writer dies), and a second writer
gets tf.data's error naming it.

As in tf.data, an iterator that stops before the end (``cache().take(k)``)
leaves a *partial* cache, which is discarded with a warning that says to
write ``take(k).cache()`` instead.

Elements on disk use :mod:`headrace.io.elements` (no pickle): arrays, numbers,
bytes, str, None and dicts/tuples/lists of them. Elements that stay in memory
are kept as they are, with their arrays made read-only views, so an in-place
edit by a consumer cannot change what the next epoch reads.

Checkpoints (G4) hold the mode (writing or reading), the position and the
epochs of the writing iterator, never cached data. Restored in a run that
does not have the cache (a new process), the cache is rebuilt by replaying
the input from its start — exact for a deterministic input, like any replay —
while a complete ``cache(filename)`` is simply read from the position.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import glob
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any

import numpy as np

from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, UnaryNode
from headrace.core.state import POSITION, StateReader, past_end
from headrace.errors import CheckpointError, InvalidArgumentError
from headrace.io.elements import ELEMENTS_FORMAT, decode_element, encode_element
from headrace.io.filepool import get_default_pool
from headrace.io.streams import DEFAULT_BUFFER_SIZE
from headrace.io.tfrecord.framing import RECORD_OVERHEAD_BYTES
from headrace.io.tfrecord.reader import TFRecordReader
from headrace.io.tfrecord.writer import TFRecordWriter
from headrace.io.tfrecord_index import _write_atomically as write_atomically
from headrace.memory.budget import NO_RESERVATION, Reservation, StageAccount
from headrace.memory.units import format_bytes
from headrace.sources.files import file_limiter

__all__ = ["PARTIAL_CACHE_ADVICE", "CacheNode"]

#: tf.data's warning for a cache an iterator stopped reading before the end.
PARTIAL_CACHE_ADVICE = (
    "The calling iterator did not fully read the dataset being cached. In order to avoid "
    "unexpected truncation of the dataset, the partially cached contents of the dataset "
    "will be discarded. This can happen if you have an input pipeline similar to "
    "`dataset.cache().take(k).repeat()`. You should use `dataset.take(k).cache().repeat()` "
    "instead."
)

MODE = "mode"
WRITE = "write"
READ = "read"
EPOCHS = "epochs"
_MANIFEST_FORMAT = "headrace.cache"
_BYTES_OVERHEAD = 33  # what a bytes object costs beyond its payload (sys.getsizeof(b""))


class CacheNode(UnaryNode):
    """The recipe of ``cache(filename)``; ``filename=""`` caches in memory (and spills)."""

    stage = "cache"
    budget_weight = 1.0

    def __init__(self, source: Node, filename: str | os.PathLike[str] = "") -> None:
        super().__init__(source)
        if not isinstance(filename, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"cache: filename must be a str or os.PathLike, got {type(filename).__name__}"
            )
        self.filename = os.fspath(filename)
        if self.filename:
            directory = os.path.dirname(os.path.abspath(self.filename))
            if not os.path.isdir(directory):
                raise InvalidArgumentError(
                    f"cache: the directory of filename {self.filename!r} does not exist"
                )

    def params(self) -> tuple[Any, ...]:
        return (self.filename,)

    def make_iterator(self, ctx: Context) -> Iterator:
        if ctx.run.probe:  # reading one element for a spec: neither cache nor warn,
            ctx.account(self)  # but split the budget as a real run does
            return self.inputs[0].make_iterator(ctx)
        return _CacheIterator(self, ctx)


# --------------------------------------------------------------------------- helpers


def _read_only(value: Any) -> Any:
    """``value`` with every array a read-only view (cheap: no data is copied)."""
    if isinstance(value, np.ndarray):
        if not value.flags.writeable:
            return value
        view = value.view()
        view.flags.writeable = False
        return view
    if isinstance(value, dict):
        return {key: _read_only(item) for key, item in value.items()}
    if isinstance(value, tuple):
        items = [_read_only(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_read_only(item) for item in value]
    return value


def _book(account: StageAccount, nbytes: int, what: str) -> Reservation:
    """Book ``nbytes`` beside what the stage holds; past its share the budget splits
    itself again (:meth:`StageAccount.require`) or raises MemoryBudgetError."""
    if account.held + nbytes > account.limit:
        account.require(account.held + nbytes, what=what)
    return account.charge(nbytes)


def _chunk_bytes(account: StageAccount) -> int:
    """How many record bytes the cache reads (or writes) at once: 1/16 of its share."""
    return max(16 << 10, min(1 << 20, account.limit // 16))


def _reserve(account: StageAccount) -> int:
    """What the in-memory part leaves free: the spill writer's buffers now, the spill
    reader's buffer and one element later; at least a quarter of the share."""
    return max(account.limit // 4, DEFAULT_BUFFER_SIZE + 3 * _chunk_bytes(account))


def _disk_full(error: OSError, path: str, count: int, nbytes: int) -> OSError:
    return OSError(
        error.errno,
        f"cache: no space left on the device writing {path} after {count} elements "
        f"({format_bytes(nbytes)}): the partial cache was removed, nothing that looks "
        "complete is left. Free space, or point the cache elsewhere (cache(filename) "
        "or the TMPDIR environment variable for cache()).",
        path,
    )


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class _RecordWriter:
    """Encoded elements appended to one file, in batches; its buffers booked."""

    def __init__(self, path: str, account: StageAccount) -> None:
        self.path = path
        self.account = account
        self.batch_limit = _chunk_bytes(account)
        self.booking = _book(
            account, DEFAULT_BUFFER_SIZE + self.batch_limit, "the cache's write buffers"
        )
        self.writer: TFRecordWriter | None = TFRecordWriter(path)
        self.batch: list[bytes] = []
        self.batch_bytes = 0
        self.count = 0
        self.nbytes = 0

    def append(self, payload: bytes) -> None:
        self.batch.append(payload)
        self.batch_bytes += len(payload)
        self.count += 1
        if self.batch_bytes >= self.batch_limit:
            self.flush()

    def flush(self) -> None:
        if not self.batch or self.writer is None:
            return
        batch, self.batch = self.batch, []
        try:
            self.writer.write_many(batch)
        except OSError as error:
            self.abort()
            if error.errno in _FULL:
                raise _disk_full(error, self.path, self.count, self.nbytes) from error
            raise
        self.nbytes += self.batch_bytes + RECORD_OVERHEAD_BYTES * len(batch)
        self.batch_bytes = 0

    def finish(self) -> None:
        """Write what is left and move the file to its name (atomic, fsynced)."""
        self.flush()
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError as error:
                self.booking.release()
                if error.errno in _FULL:
                    raise _disk_full(error, self.path, self.count, self.nbytes) from error
                raise
        self.booking.release()

    def abort(self) -> None:
        writer, self.writer = self.writer, None
        self.batch = []
        if writer is not None:
            writer.abort()
        self.booking.release()


class _RecordReader:
    """Encoded elements of one file, read in order: its buffer and the records read
    ahead booked on the stage's account, each element booked as it is handed on."""

    def __init__(self, path: str, ctx: Context, account: StageAccount) -> None:
        self.path, self.ctx, self.account = path, ctx, account
        self.chunk = _chunk_bytes(account)
        # the pooled stream's buffer and the record reader's
        self.base = _book(account, 2 * self.chunk, "the cache's read buffers")
        stream = get_default_pool().open(path, limiter=file_limiter(ctx), buffer_size=self.chunk)
        self.reader = TFRecordReader(stream, path=path, buffer_size=self.chunk, close_stream=True)
        self.pending: list[tuple[bytes, int]] = []  # (record, offset), next first
        self.pending_booked = 0
        self.next_pending = 0

    def _refill(self) -> bool:
        length = self.reader.next_length()
        if length is not None and length > self.chunk:  # one record beyond the buffer
            self.account.require(self.account.held + length, what="one cached element")
        start = self.reader.next_offset
        records = self.reader.read_batch(256, self.chunk)
        if not records:
            return False
        self._release_pending()
        self.pending_booked = sum(len(record) for record in records) + _BYTES_OVERHEAD * len(
            records
        )
        _book(self.account, self.pending_booked, "cached elements read ahead").nbytes = 0
        offsets = []
        for record in records:
            offsets.append(start)
            start += len(record) + RECORD_OVERHEAD_BYTES
        self.pending = list(zip(records, offsets, strict=True))
        self.next_pending = 0
        return True

    def _take(self) -> tuple[bytes, int]:
        if self.next_pending >= len(self.pending) and not self._refill():
            raise StopIteration
        record, offset = self.pending[self.next_pending]
        self.pending[self.next_pending] = (b"", offset)
        self.next_pending += 1
        share = len(record) + _BYTES_OVERHEAD
        self.pending_booked -= share
        self.account.release(share)
        return record, offset

    def pull(self) -> tuple[Any, Reservation]:
        record, offset = self._take()
        element = decode_element(record, path=self.path, offset=offset)
        del record
        cost = self.ctx.sizeof(element)
        return element, _book(self.account, cost, "one cached element")

    def skip(self, count: int) -> int:
        """Skip ``count`` elements without decoding them; returns how many there were."""
        for done in range(count):
            try:
                self._take()
            except StopIteration:
                return done
        return count

    def _release_pending(self) -> None:
        self.account.release(self.pending_booked)
        self.pending_booked = 0
        self.pending = []
        self.next_pending = 0

    def close(self) -> None:
        self._release_pending()
        self.reader.close()
        self.base.release()


# --------------------------------------------------------------------------- stores


class _Store:
    """Where one cache's elements go while it is written, and how it is read."""

    def __init__(self, epochs: tuple[int, ...]) -> None:
        #: The epochs (of enclosing repeats) of the iterator that wrote it: a rebuild
        #: replays the input as that iterator saw it.
        self.epochs = epochs
        self.complete = False
        self.count = 0

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError

    def reader(self) -> _StoreReader:
        raise NotImplementedError


class _StoreReader:
    def pull(self) -> tuple[Any, Reservation]:
        raise NotImplementedError

    def skip(self, count: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release by default."""


# Memory stores by the cache stage's account: one per cache node and run (and per
# interleave slot), kept between the epochs of a repeat.
_memory_stores: weakref.WeakKeyDictionary[StageAccount, _MemoryStore] = (
    weakref.WeakKeyDictionary()
)


class _MemoryStore(_Store):
    """Elements in memory while they fit three quarters of the share, then a spill file.

    The last quarter stays free for reading the spill file back (its buffer and one
    element at a time), so reading never needs more than the share.
    """

    def __init__(self, ctx: Context, account: StageAccount, epochs: tuple[int, ...]) -> None:
        super().__init__(epochs)
        self.ctx, self.account = ctx, account
        self.items: list[Any] = []
        self.booked = 0
        self.spill: _RecordWriter | None = None
        self.spill_path: str | None = None
        self.directory: str | None = None
        self._cleanup: weakref.finalize[Any, Any] | None = None
        self.lock = threading.Lock()
        self.discarded = False

    def _fits_in_memory(self, cost: int) -> bool:
        account = self.account
        room = account.limit - _reserve(account)
        return self.booked + cost <= room and not account.budget.over_shared_cap(cost)

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        element, cost = self.ctx.admit(element)
        if self.spill is None and self._fits_in_memory(cost):
            element = _read_only(element)
            self.account.charge(cost).nbytes = 0  # held by the store, released in bulk
            self.booked += cost
            upstream.release()
            self.items.append(element)
            self.count += 1
            return element, NO_RESERVATION
        if self.spill is None:
            self._start_spill(cost)
        assert self.spill is not None
        try:
            self.spill.append(encode_element(element))
        except BaseException:
            self.discard()  # a full disk or an element it cannot store: no files left
            raise
        self.count += 1
        return element, upstream

    def _start_spill(self, cost: int) -> None:
        directory = tempfile.mkdtemp(prefix=f"headrace-cache-{os.getpid()}-")
        self.directory = directory
        # removed at exit too if nothing closed the run (weakref.finalize runs atexit)
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True)
        self.spill_path = os.path.join(directory, "spill.hrcache")
        account = self.account
        warnings.warn(
            f"cache: the elements cached so far ({self.count} elements, "
            f"{format_bytes(self.booked)}) fill the in-memory part of the stage's share "
            f"({format_bytes(account.limit)} of the {format_bytes(account.budget.total)} "
            f"memory budget); the next element ({format_bytes(cost)}) and all later ones "
            f"spill to an on-disk cache in {directory} (removed when the iterator closes)",
            ResourceWarning,
            stacklevel=6,
        )
        try:
            self.spill = _RecordWriter(self.spill_path, account)
        except BaseException:
            self.discard()
            raise

    def finish(self) -> None:
        if self.spill is not None:
            try:
                self.spill.finish()
            except BaseException:
                self.discard()
                raise
        self.complete = True

    def discard(self) -> None:
        with self.lock:
            if self.discarded:
                return
            self.discarded = True
        if self.spill is not None:
            self.spill.abort()
        self.items = []
        self.account.release(self.booked)
        self.booked = 0
        if self._cleanup is not None:
            self._cleanup()
        if _memory_stores.get(self.account) is self:
            del _memory_stores[self.account]

    def reader(self) -> _StoreReader:
        return _MemoryReader(self)


class _MemoryReader(_StoreReader):
    def __init__(self, store: _MemoryStore) -> None:
        self.store = store
        self.next = 0
        self.spill: _RecordReader | None = None

    def pull(self) -> tuple[Any, Reservation]:
        items = self.store.items
        if self.next < len(items):
            element = items[self.next]
            self.next += 1
            return element, NO_RESERVATION  # booked by the store
        if self.store.spill_path is None or self.store.discarded:
            raise StopIteration
        if self.spill is None:
            self.spill = _RecordReader(self.store.spill_path, self.store.ctx, self.store.account)
        pair = self.spill.pull()
        self.next += 1
        return pair

    def skip(self, count: int) -> int:
        in_memory = min(count, max(0, len(self.store.items) - self.next))
        self.next += in_memory
        if in_memory == count or self.store.spill_path is None:
            return in_memory
        if self.spill is None:
            self.spill = _RecordReader(self.store.spill_path, self.store.ctx, self.store.account)
        skipped = self.spill.skip(count - in_memory)
        self.next += skipped
        return in_memory + skipped

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None


class _FileStore(_Store):
    """tf.data's persistent cache: written under a lock, published atomically at the end."""

    def __init__(
        self, node: CacheNode, ctx: Context, account: StageAccount, epochs: tuple[int, ...]
    ) -> None:
        super().__init__(epochs)
        self.ctx, self.account = ctx, account
        self.paths = _CachePaths(node.filename)
        self.fingerprint = node.inputs[0].fingerprint()
        self.lock_fd = _acquire_lock(self.paths)
        try:
            _remove_leftovers(self.paths)
            self.writer: _RecordWriter | None = _RecordWriter(self.paths.data, account)
        except BaseException:
            _release_lock(self.paths, self.lock_fd)
            raise

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        assert self.writer is not None
        try:
            self.writer.append(encode_element(element))
        except BaseException:
            self.discard()
            raise
        self.count += 1
        return element, upstream

    def finish(self) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            writer.finish()
            manifest = {
                "format": _MANIFEST_FORMAT,
                "elements_format": ELEMENTS_FORMAT,
                "fingerprint": self.fingerprint,
                "elements": self.count,
                "bytes": os.path.getsize(self.paths.data),
                "created": time.time(),
            }
            write_atomically(self.paths.manifest, [json.dumps(manifest).encode()])
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.paths.data)
            _release_lock(self.paths, self.lock_fd)
            raise
        _release_lock(self.paths, self.lock_fd)
        self.complete = True

    def discard(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.abort()
            _release_lock(self.paths, self.lock_fd)

    def reader(self) -> _StoreReader:
        return _FileReader(self.paths.data, self.ctx, self.account)


class _FileReader(_StoreReader):
    def __init__(self, path: str, ctx: Context, account: StageAccount) -> None:
        self.records = _RecordReader(path, ctx, account)

    def pull(self) -> tuple[Any, Reservation]:
        return self.records.pull()

    def skip(self, count: int) -> int:
        return self.records.skip(count)

    def close(self) -> None:
        self.records.close()


class _CompleteFile(_Store):
    """A complete ``cache(filename)`` found on disk."""

    def __init__(self, path: str, ctx: Context, account: StageAccount, count: int) -> None:
        super().__init__(())
        self.path, self.ctx, self.account = path, ctx, account
        self.complete = True
        self.count = count

    def reader(self) -> _StoreReader:
        return _FileReader(self.path, self.ctx, self.account)

    def discard(self) -> None:
        """A complete cache stays on disk."""


class _CachePaths:
    def __init__(self, filename: str) -> None:
        self.prefix = filename
        self.data = f"{filename}.hrcache"
        self.manifest = f"{filename}.hrcache.json"
        self.lock = f"{filename}.lockfile"


def _acquire_lock(paths: _CachePaths) -> int:
    """Hold ``<filename>.lockfile`` (flock: a dead writer's lock is released by the kernel)."""
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        raise FileExistsError(
            errno.EEXIST,
            "cache: there appears to be a concurrent caching iterator running - cache "
            f"lockfile already exists ({paths.lock!r}; {holder or 'holder unknown'}). If you "
            "are sure no other running process is using this cache prefix, delete the "
            "lockfile and re-initialize the iterator.",
            paths.lock,
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"Created at: {int(time.time())} by pid {os.getpid()}\n".encode(), 0)
    return fd


def _release_lock(paths: _CachePaths, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.lock)  # while still holding it: no one can take a stale copy
    os.close(fd)


def _remove_leftovers(paths: _CachePaths) -> None:
    """Under the lock: what a crashed writer left (temporary files, a manifest-less data
    file) is never complete, so it goes; so does a manifest that is about to be stale."""
    directory, name = os.path.split(os.path.abspath(paths.data))
    for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}*.tmp")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    for path in (paths.manifest, paths.data):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _find_complete(node: CacheNode, ctx: Context, account: StageAccount) -> _CompleteFile | None:
    """The complete cache on disk for this pipeline, or None (warning if it is another's)."""
    paths = _CachePaths(node.filename)
    try:
        with open(paths.manifest, encoding="utf-8") as file:
            manifest = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # unreadable: not complete; the writer replaces it
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        return None
    fingerprint = node.inputs[0].fingerprint()
    if manifest.get("fingerprint") != fingerprint:
        warnings.warn(
            f"cache: {paths.manifest} was written by a different pipeline (fingerprint "
            f"{manifest.get('fingerprint')!r}; the pipeline above this cache is "
            f"{fingerprint!r}): rebuilding it",
            UserWarning,
            stacklevel=5,
        )
        return None
    count, nbytes = manifest.get("elements"), manifest.get("bytes")
    try:
        size = os.path.getsize(paths.data)
    except OSError:
        return None
    if not isinstance(count, int) or size != nbytes:
        return None
    return _CompleteFile(paths.data, ctx, account, count)


# --------------------------------------------------------------------------- iterator


class _CacheIterator(Iterator):
    stage = "cache"

    def __init__(self, node: CacheNode, ctx: Context) -> None:
        super().__init__()
        self.node, self.ctx = node, ctx
        self.account = ctx.account(node)
        self.upstream: Iterator | None = None
        self.store: _Store | None = None
        self.source: _StoreReader | None = None
        self.writing = False
        self.position = 0
        self.cardinality = node.inputs[0].cardinality()
        complete = self._complete_store()
        if complete is not None:
            self._read(complete)
        else:
            self._write(ctx)

    # -- modes ---------------------------------------------------------------------------
    def _complete_store(self) -> _Store | None:
        if self.node.filename:
            return _find_complete(self.node, self.ctx, self.account)
        store = _memory_stores.get(self.account)
        return store if store is not None and store.complete else None

    def _read(self, store: _Store) -> None:
        self.store, self.writing, self.position = store, False, 0
        self.source = store.reader()
        self.inputs = ()

    def _write(self, ctx: Context) -> None:
        """Start writing a new cache, reading the input with ``ctx`` (the writer's epochs)."""
        epochs = ctx.epochs
        if self.node.filename:
            store: _Store = _FileStore(self.node, ctx, self.account, epochs)
        else:
            previous = _memory_stores.get(self.account)
            if previous is not None:
                previous.discard()
            memory = _MemoryStore(ctx, self.account, epochs)
            _memory_stores[self.account] = memory
            ctx.budget.on_close(memory.discard)
            store = memory
        self.store, self.writing, self.position = store, True, 0
        try:
            self.upstream = self.node.inputs[0].make_iterator(ctx)
        except BaseException:
            store.discard()
            raise
        self.inputs = (self.upstream,)

    # -- elements -------------------------------------------------------------------------
    def pull(self) -> tuple[Any, Reservation]:
        if not self.writing:
            assert self.source is not None
            pair = self.source.pull()
            self.position += 1
            return pair
        store, upstream = self.store, self.upstream
        assert store is not None and upstream is not None
        if store.complete:
            raise StopIteration
        try:
            element, reservation = upstream.pull()
        except StopIteration:
            store.finish()
            raise
        pair = store.append(element, reservation)
        self.position += 1
        if store.count == self.cardinality:  # as tf.data: complete without reading the end
            store.finish()
        return pair

    # -- checkpoints -----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        assert self.store is not None
        return {
            MODE: WRITE if self.writing else READ,
            POSITION: self.position,
            EPOCHS: list(self.store.epochs if self.writing else self._writer_epochs()),
        }

    def _writer_epochs(self) -> tuple[int, ...]:
        store = self.store
        if store is not None and not isinstance(store, _CompleteFile):
            return store.epochs
        return self.ctx.epochs  # a cache from an earlier run: any epochs rebuild it alike

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        mode = reader.raw(MODE)
        if mode not in (WRITE, READ):
            raise reader.error(MODE, f"must be {WRITE!r} or {READ!r}, got {mode!r:.40}")
        position = reader.integer(POSITION)
        epochs = reader.integers(EPOCHS, len(self.ctx.epochs))
        self._stop(warn=False)
        complete = self._complete_store()
        if complete is not None:
            self._read(complete)
            self._skip(position)
            return
        # No complete cache in this run: rebuild it as the writing iterator read its input.
        writer_ctx = copy.copy(self.ctx)
        writer_ctx.epochs = tuple(epochs)
        self._write(writer_ctx)
        if mode == WRITE:
            for done in range(position):
                try:
                    _, reservation = self.pull()
                except StopIteration:
                    raise past_end(self.stage, POSITION, position, done) from None
                reservation.release()
            return
        while True:  # the reading phase: the whole cache first, then the position in it
            try:
                self.pull()[1].release()
            except StopIteration:
                break
        store = self.store
        assert store is not None
        if not store.complete:
            raise CheckpointError(f"{self.stage}: the cache could not be rebuilt")
        self._read(store if not self.node.filename else self._complete_or_fail())
        self._skip(position)

    def _complete_or_fail(self) -> _Store:
        complete = self._complete_store()
        if complete is None:
            raise CheckpointError(f"{self.stage}: the cache file could not be rebuilt")
        return complete

    def _skip(self, position: int) -> None:
        assert self.source is not None
        done = self.source.skip(position)
        if done < position:
            raise past_end(self.stage, POSITION, position, done)
        self.position = position

    # -- closing -----------------------------------------------------------------------------
    def _stop(self, *, warn: bool) -> None:
        store = self.store
        if self.writing and store is not None and not store.complete:
            if warn and self.position:  # one that read nothing truncated nothing
                warnings.warn(f"cache: {PARTIAL_CACHE_ADVICE}", UserWarning, stacklevel=3)
            store.discard()
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        if self.source is not None:
            self.source.close()
            self.source = None
        self.inputs = ()
        self.writing = False

    def close(self) -> None:
        self._stop(warn=True)
