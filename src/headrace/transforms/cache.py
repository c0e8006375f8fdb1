"""``cache(filename="")``: read the input once, serve every later epoch from the cache.

tf.data's in-memory cache grows until the process dies. Here ``cache()`` keeps
elements in memory only while they fit in the stage's share of the budget
(G1): when the next one would not, it and every later element *spill* to an
on-disk cache in a temporary directory (one warning names the sizes and the
directory), so a dataset several times the budget caches without passing it.
As in tf.data, a complete cache belongs to the dataset, not to the iterator
that wrote it: the epochs of a ``repeat`` after it and every later ``iter()``
of the dataset (Keras makes one per epoch) read only the cache, never the
input. Its bytes stay booked while it lives — on the process-wide default
budget, and on the cache stage's share of each run with its own
``memory_budget`` that reads it (see "kept memory caches" below) — and it is
freed, spill files included, when the dataset is garbage-collected (or at
exit). A cache that is not complete is freed when its iterator closes (also
after an exception). Two iterators that start before either completes each
read the input; the first to complete is kept and both read it afterwards
(tf.data's rule).

``cache(filename)`` is tf.data's persistent cache: ``<filename>.hrcache``
(elements, TFRecord-framed, CRC-checked) and ``<filename>.hrcache.json``, the
manifest that marks it complete. Both are written atomically and only at the
end of the input (or once the input's cardinality is reached, as in tf.data),
so a crashed or interrupted writer never leaves a cache that looks complete.
The manifest records the *content* fingerprint of the pipeline above the cache
(:meth:`~headrace.core.node.Node.data_fingerprint`: its structure, a digest of its
in-memory arrays and of those its functions capture, the identity of its files):
a run of another pipeline, or of this one over changed data, rebuilds the cache
(with a warning) instead of reading stale data. It also vouches for the data
file: ``<filename>.hrcache.crc`` holds each record's data CRC as written (the
manifest holds its digest), and every record read is compared with it before it
is used, so a data file from another cache or changed since is refused with
:class:`~headrace.errors.DataLossError` naming it, at no extra read. The manifest
itself is sealed (a checksum over its fields, :func:`headrace.core.state.seal`): one
edited since is a DataLossError naming it, never believed nor silently rebuilt over
(an older headrace's unsealed manifest is rebuilt, as before). One writer at a time: ``<filename>.lockfile`` is held with
``flock`` (released by the kernel if the writer dies), and a second writer
gets tf.data's error naming it.

As in tf.data, an iterator that stops before the end (``cache().take(k)``)
leaves a *partial* cache, which is discarded with a warning that says to
write ``take(k).cache()`` instead.

Elements on disk use :mod:`headrace.io.elements` (no pickle): arrays, numbers,
bytes, str, None and dicts/tuples/lists of them. Elements that stay in memory
are kept as they are, with their arrays made read-only views, so an in-place
edit by a consumer cannot change what the next epoch reads.

Checkpoints (G4) hold the mode (writing or reading), the position, and which
iterator wrote the cache (its repeat epochs and its number, which seed a
reshuffling shuffle above the cache), never cached data. A kept cache that
iterator wrote is read from the position; without one (a new process, or a
cache another iterator wrote) the cache is rebuilt by replaying the input as
that iterator read it — exact for a deterministic input, like any replay —
while a complete ``cache(filename)`` is simply read from the position.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import copy
import errno
import fcntl
import glob
import json
import os
import shutil
import struct
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any

import numpy as np
import xxhash

from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, UnaryNode
from headrace.core.run import call_outside_collection, default_budget
from headrace.core.state import POSITION, StateReader, is_sealed, past_end, seal
from headrace.errors import CheckpointError, DataLossError, HeadraceWarning, InvalidArgumentError
from headrace.io._crc32c import masked_crc32c
from headrace.io.blocks import BLOCK_CODECS, BlockCodec, block_codec
from headrace.io.elements import ELEMENTS_FORMAT, EncodedParts, decode_element, encode_element_parts
from headrace.io.filepool import FileLimiter, HeldSlots, get_default_pool
from headrace.io.streams import DEFAULT_BUFFER_SIZE
from headrace.io.tfrecord.framing import RECORD_OVERHEAD_BYTES, encode_records
from headrace.io.tfrecord.reader import records_in_spans
from headrace.io.tfrecord.writer import TFRecordWriter, record_frame
from headrace.io.tfrecord_index import _write_atomically as write_atomically
from headrace.io.tfrecord_index import index_path_for, load_index, write_index
from headrace.memory.budget import KeptStats, MemoryBudget
from headrace.memory.buffer import NO_RESERVATION, Buffer, Reservation
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
#: Which iterator of the dataset wrote the cache (seeds a reshuffling shuffle above it).
WRITER_ITERATION = "writer_iteration"
_MANIFEST_FORMAT = "headrace.cache"
#: 2: content fingerprints, and each record's CRC recorded (``<file>.crc``).
_MANIFEST_VERSION = 3  # 3: sealed (a checksum over its fields); older ones are rebuilt
_BYTES_OVERHEAD = 33  # what a bytes object costs beyond its payload (sys.getsizeof(b""))
_FRAME_HEADER = struct.Struct("<QI")  # a TFRecord's length and its masked CRC
_FRAME_FOOTER = struct.Struct("<I")  # its data's masked CRC
#: Records at least this large are read each into a buffer of its own and decoded
#: there (no copy); smaller ones are read in runs and split out (one small copy each).
_IN_PLACE_BYTES = 32 << 10


class CacheNode(UnaryNode):
    """The recipe of ``cache(filename)``; ``filename=""`` caches in memory (and spills)."""

    stage = "cache"
    budget_weight = 1.0
    #: Whether an iterator that finds another one writing the file reads its input
    #: without writing (snapshot) instead of raising tf.data's lock error (cache).
    passthrough_when_locked = False
    #: Whether stopping before the end warns with tf.data's partial-cache advice.
    warns_partial = True
    #: How the file is compressed (:mod:`headrace.io.blocks`; None: not at all).
    compression: str | None = None

    def __init__(self, source: Node, filename: str | os.PathLike[str] = "") -> None:
        super().__init__(source)
        if not isinstance(filename, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"cache: filename must be a str or os.PathLike, got {type(filename).__name__}"
            )
        name = os.fspath(filename)
        if name:
            directory = os.path.dirname(os.path.abspath(name))
            if not os.path.isdir(directory):
                raise InvalidArgumentError(
                    f"cache: the directory of filename {name!r} does not exist"
                )
        self.filename = name

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


def _book(account: Buffer, nbytes: int, what: str) -> Reservation:
    """Book ``nbytes`` held together with what the stage holds. Past its share the
    budget splits itself again, or MemoryBudgetError names the stage and ``what``."""
    return account.admit(nbytes, together=what)


def _chunk_bytes(share: int) -> int:
    """How many record bytes the cache reads (or writes) at once: 1/16 of its share."""
    return max(16 << 10, min(1 << 20, share // 16))


def in_memory_room(share: int) -> int:
    """Bytes of elements a cache with this share keeps in memory before it spills.

    The rest stays free for the spill writer's buffers now, and for the spill
    reader's buffer and one element later: at least a quarter of the share.
    Lint predicts the spill from it.
    """
    reserve = max(share // 4, DEFAULT_BUFFER_SIZE + 3 * _chunk_bytes(share))
    return max(share - reserve, 0)


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
    """Encoded elements appended to one file; its buffers booked. At the end the file
    gets its ``.hrx`` index (from the offsets written, no scan), so readers fetch
    records with positioned reads (see :class:`_RecordReader`).

    Small records are joined into batches of up to a chunk and framed together (one
    write); the batch and its framed copy are booked. A record of a chunk or more is
    written alone, framed around its parts (:meth:`TFRecordWriter.write_parts`): its
    arrays go from the element to the file with no copy in between, so writing it
    costs only what encoding copied (booked while it is written) — never the two extra
    copies of the element (joined payload, framed record) that once went unbooked.
    """

    def __init__(
        self,
        path: str,
        account: Buffer,
        codec: BlockCodec | None = None,
        *,
        limiter: FileLimiter | None,
        stage: str,
    ) -> None:
        self.path = path
        self.account = account
        self.codec = codec
        #: Fixed, and its buffers booked, at the first element: a writer made while the
        #: iterator tree is built (cache(filename)) sees its stage's share only then.
        self.batch_limit = 0
        self.booking = NO_RESERVATION
        #: With a codec, per block (``offsets`` are the blocks'): its records and its size
        #: decompressed (see :mod:`headrace.io.blocks`).
        self.blocks: list[tuple[int, int]] = []
        #: The file written counts against the caps on open files (G2) until it is
        #: closed: its slot is held from before the open to after the close.
        self.slot = get_default_pool().hold(
            1, limiter=limiter, stage=stage, what=f"the file it writes ({path!r})"
        )
        try:
            self.writer: TFRecordWriter | None = TFRecordWriter(path)
        except BaseException:
            self.slot.release()
            raise
        self.batch: list[bytes] = []
        self.batch_bytes = 0
        self.count = 0
        self.nbytes = 0
        #: Where each record starts (8 bytes a record, booked as it grows).
        self.offsets = array.array("q")
        #: Each record's (block's) data CRC, as its footer holds it (4 bytes a record,
        #: booked with the offsets): the manifest's record of what the file must hold.
        self.crcs = array.array("I")
        self.offsets_booking = account.charge(0)

    def _start(self) -> None:
        self.batch_limit = _chunk_bytes(self.account.share())
        # the batch, its framed copy, and (compressed) the block made of it
        buffers = (3 if self.codec is not None else 2) * self.batch_limit
        self.booking = _book(
            self.account, DEFAULT_BUFFER_SIZE + buffers, "the cache's write buffers"
        )

    def append(self, encoded: EncodedParts) -> None:
        if not self.batch_limit:
            self._start()
        size = encoded.nbytes + _BYTES_OVERHEAD
        if self.batch_bytes + size > self.batch_limit:
            self.flush()
        self.count += 1
        if size <= self.batch_limit:
            self.batch.append(b"".join(encoded.parts))
            self.batch_bytes += size
            return
        self._write_alone(encoded)

    def _write_alone(self, encoded: EncodedParts) -> None:
        """Write one large record from its parts (what encoding copied booked meanwhile)."""
        assert self.writer is not None
        work = encoded.copied
        if self.codec is not None:
            work += self.codec.work_bytes(encoded.nbytes + RECORD_OVERHEAD_BYTES)
        copies = _book(self.account, work, "one cached element being encoded")
        try:
            self._grow_offsets(1)
            try:
                head, foot = record_frame(encoded.parts)
                if self.codec is None:
                    written = self.writer.write_framed([head, *encoded.parts, foot], 1)
                    self.crcs.append(_FRAME_FOOTER.unpack(foot)[0])
                else:
                    written = self._write_block([head, *encoded.parts, foot], 1)
            except OSError as error:
                self.abort()
                if error.errno in _FULL:
                    raise _disk_full(error, self.path, self.count, self.nbytes) from error
                raise
        finally:
            copies.release()
        self.offsets.append(self.nbytes)
        self.nbytes += written

    def _write_block(self, framed: list[bytes | memoryview], records: int) -> int:
        """Write framed records as one compressed block; the bytes it takes in the file."""
        assert self.writer is not None and self.codec is not None
        block = self.codec.compress(framed)
        self.blocks.append((records, sum(len(part) for part in framed)))
        head, foot = record_frame([block])
        self.crcs.append(_FRAME_FOOTER.unpack(foot)[0])
        return self.writer.write_framed([head, block, foot], 1)

    def _grow_offsets(self, records: int) -> None:
        self.offsets_booking = self.offsets_booking.absorb(
            _book(self.account, 12 * records, "the cache's record offsets and checksums")
        )

    def flush(self) -> None:
        if not self.batch or self.writer is None:
            return
        batch, self.batch = self.batch, []
        if self.codec is not None:  # one block: one offset, and its records and size
            self._grow_offsets(2)
            try:
                written = self._write_block([encode_records(batch)], len(batch))
            except OSError as error:
                self.abort()
                if error.errno in _FULL:
                    raise _disk_full(error, self.path, self.count, self.nbytes) from error
                raise
            self.offsets.append(self.nbytes)
            self.nbytes += written
            self.batch_bytes = 0
            return
        self._grow_offsets(len(batch))
        framed = encode_records(batch)
        ends = np.cumsum([len(payload) + RECORD_OVERHEAD_BYTES for payload in batch])
        footers = np.frombuffer(framed, dtype=np.uint8)[(ends - 4)[:, None] + np.arange(4)]
        self.crcs.extend(footers.copy().view("<u4").reshape(-1).tolist())
        try:
            self.writer.write_framed([framed], len(batch))
        except OSError as error:
            self.abort()
            if error.errno in _FULL:
                raise _disk_full(error, self.path, self.count, self.nbytes) from error
            raise
        position = self.nbytes
        for payload in batch:
            self.offsets.append(position)
            position += len(payload) + RECORD_OVERHEAD_BYTES
        self.nbytes = position
        self.batch_bytes = 0

    def finish(self) -> None:
        """Write what is left, move the file to its name (atomic, fsynced), index it."""
        self.flush()
        #: What the manifest records of the complete file (each record's data CRC).
        self.final_crcs = self.crcs
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
                write_index(self.path, self.offsets)
            except OSError as error:
                self._release()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                if error.errno in _FULL:
                    raise _disk_full(error, self.path, self.count, self.nbytes) from error
                raise
        self._release()

    def abort(self) -> None:
        writer, self.writer = self.writer, None
        self.batch = []
        if writer is not None:
            writer.abort()
        self._release()

    def _release(self) -> None:
        self.slot.release()
        booking, self.booking = self.booking, NO_RESERVATION
        booking.release()
        self.offsets_booking.release()
        self.offsets = array.array("q")
        self.crcs = array.array("I")


class _Expected:
    """What a complete cache file must hold, as its manifest recorded it: the data CRC
    of each record (each block, compressed), from ``<file>.crc`` (whose digest the
    manifest holds). Each record is compared as it is read, before it is used: a data
    file of another cache, or one changed since, is refused at its first record that
    differs — no element of it is ever served, and no extra read is needed."""

    def __init__(self, crcs: Any, manifest: str) -> None:
        self.crcs = np.asarray(crcs, dtype=np.uint32)
        self.manifest = manifest

    def mismatch(self, path: str, problem: str, offset: int | None = None) -> DataLossError:
        return DataLossError(
            f"cache: {path} is not the file its manifest {self.manifest} describes "
            f"({problem}): it belongs to another cache or was changed after it was "
            "written; delete the cache's files to rebuild it",
            path=path,
            offset=offset,
        )


def _checksums_digest(crcs: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(crcs)


def _check_frame(buffer: bytes, offset: int, path: str, stream: str = "") -> tuple[int, int]:
    """Check one framed record in place (length, both CRCs); its payload's bounds.
    ``stream``: what the offset counts in, when not the file's bytes."""
    view = memoryview(buffer)
    problem = ""
    if len(buffer) < RECORD_OVERHEAD_BYTES:
        problem = "truncated record"
    else:
        length, length_crc = _FRAME_HEADER.unpack_from(buffer, 0)
        if masked_crc32c(view[:8]) != length_crc:
            problem = "corrupted record (bad length checksum)"
        elif length != len(buffer) - RECORD_OVERHEAD_BYTES:
            problem = f"record of {length} bytes where the index says {len(buffer) - 16}"
        else:
            (data_crc,) = _FRAME_FOOTER.unpack_from(buffer, 12 + length)
            if masked_crc32c(view[12 : 12 + length]) != data_crc:
                problem = "corrupted record (bad data checksum)"
    if problem:
        raise DataLossError(
            f"{problem} at offset {offset}{stream} in file {path}", path=path, offset=offset
        )
    return 12, 12 + length


class _RecordReader:
    """Encoded elements of one indexed file, in order, fetched with positioned reads.

    The ``.hrx`` index (refused if the file's size changed) says
    where every record starts, so reading is one ``pread`` per run of consecutive
    records up to the stage's chunk, and skipping is free. A record that fills a read
    alone (large records) is decoded where it was read: its arrays are views into the
    buffer the kernel copied the page cache into — no other copy. Smaller ones are
    split out of their shared buffer (one small copy each), so that an element never
    pins its neighbours. The index (8 bytes a record), the records read ahead and each
    element handed on are booked on the stage's account.
    """

    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        expected: _Expected | None = None,
    ) -> None:
        self.path, self.ctx, self.account = path, ctx, account
        index = load_index(path, size_only=True)  # every record is checked as it is read
        self.offsets = index.offsets
        self.size = index.shard_size
        self.expected = expected
        if expected is not None and len(expected.crcs) != len(self.offsets):
            raise expected.mismatch(
                path, f"its index lists {len(self.offsets)} records where the manifest "
                f"recorded {len(expected.crcs)}"
            )
        nbytes = self.offsets.nbytes + (0 if expected is None else expected.crcs.nbytes)
        self.index_booking = _book(account, nbytes, "the cache file's index")
        self.stream = get_default_pool().open(
            path, limiter=file_limiter(ctx), buffer_size=4096  # positioned reads: unused
        )
        self.next = 0  # the next record to hand on
        #: Records read, next first: (buffer, payload start, stop, bytes booked for it).
        self.pending: list[tuple[bytes, int, int, int]] = []
        self.pending_booked = 0
        self.next_pending = 0

    @property
    def chunk(self) -> int:
        # Read when reading, not when made: a reader made while the iterator tree is
        # built (a complete cache file) sees its stage's share only once the budget is
        # split, and a chunk fixed then (16 KiB) read 100 KB records one call each.
        return _chunk_bytes(self.account.share())

    def _end(self, record: int) -> int:
        return int(self.offsets[record + 1]) if record + 1 < len(self.offsets) else self.size

    def _refill(self) -> bool:
        first = self.next
        if first >= len(self.offsets):
            return False
        begin = int(self.offsets[first])
        if self._end(first) - begin >= _IN_PLACE_BYTES:
            return self._refill_large(first)
        last = first
        while last + 1 < len(self.offsets) and self._end(last + 1) - begin <= self.chunk:
            last += 1
        size = self._end(last) - begin
        self._release_pending()
        # (one record may pass the chunk: past the share, the budget splits again)
        what = "one cached element" if last == first else "cached elements read ahead"
        _book(self.account, size + _BYTES_OVERHEAD, what)
        self.pending_booked = size + _BYTES_OVERHEAD
        (buffer,) = self.stream.pread_many([begin], [size])
        if last == first:  # decoded in place: the element's arrays are views of ``buffer``
            self.pending = [(buffer, *self._check_one(buffer, begin), self.pending_booked)]
            self._check_entry(buffer, len(buffer), first)
        else:
            records = records_in_spans([buffer], [last - first + 1], [begin], path=self.path)
            for entry in range(first, last + 1):
                self._check_entry(buffer, self._end(entry) - begin, entry)
            del buffer
            self.pending = [
                (record, 0, len(record), len(record) + _BYTES_OVERHEAD) for record in records
            ]
            self._rebook_pending()
        self.next_pending = 0
        return True

    def _refill_large(self, first: int) -> bool:
        """Read the run of large records from ``first`` (up to a chunk, or one beyond it),
        each into a buffer of its own, with one call (one file-pool check-out): each is
        decoded where it was read, its arrays views of its own buffer — the kernel's copy
        from the page cache is the only one — and no element pins another's bytes."""
        starts = [int(self.offsets[first])]
        sizes = [self._end(first) - starts[0]]
        total = sizes[0]
        record = first + 1
        while record < len(self.offsets):
            start = int(self.offsets[record])
            size = self._end(record) - start
            if size < _IN_PLACE_BYTES or total + size > self.chunk:
                break
            starts.append(start)
            sizes.append(size)
            total += size
            record += 1
        self._release_pending()
        booked = total + _BYTES_OVERHEAD * len(sizes)
        what = "one cached element" if len(sizes) == 1 else "cached elements read ahead"
        _book(self.account, booked, what)
        self.pending_booked = booked
        buffers = self.stream.pread_many(starts, sizes)
        self.pending = [
            (buffer, *_check_frame(buffer, start, self.path), len(buffer) + _BYTES_OVERHEAD)
            for buffer, start in zip(buffers, starts, strict=True)
        ]
        for entry, buffer in enumerate(buffers, first):
            self._check_entry(buffer, len(buffer), entry)
        self._rebook_pending()  # (a short read at a truncated end books less)
        self.next_pending = 0
        return True

    def _rebook_pending(self) -> None:
        """Book exactly what the pending records' shares will return (the buffers read
        were booked with their framing; the records count each object's overhead)."""
        shares = sum(share for *_, share in self.pending)
        if shares > self.pending_booked:
            _book(self.account, shares - self.pending_booked, "cached elements read ahead")
        else:
            self.account.release(self.pending_booked - shares)
        self.pending_booked = shares

    def _check_one(self, buffer: bytes, offset: int) -> tuple[int, int]:
        return _check_frame(buffer, offset, self.path)

    def _check_entry(self, buffer: bytes, stop: int, entry: int) -> None:
        """Refuse index entry ``entry`` (its frame ends at ``stop`` in ``buffer``, its
        CRCs already checked) unless its data CRC is the one the manifest recorded."""
        expected = self.expected
        if expected is None:
            return
        (crc,) = _FRAME_FOOTER.unpack_from(buffer, stop - _FRAME_FOOTER.size)
        if crc != expected.crcs[entry]:
            offset = int(self.offsets[entry])
            raise expected.mismatch(
                self.path, f"record {entry} at offset {offset} is not the one written there",
                offset,
            )

    def _take(self) -> tuple[bytes, int, int, int]:
        """The next record (buffer, payload bounds, offset), its read-ahead booking returned."""
        if self.next_pending >= len(self.pending) and not self._refill():
            raise StopIteration
        offset = self._offset(self.next)
        buffer, start, stop = self._hand_on(self.next_pending)
        self.next_pending += 1
        self.next += 1
        return buffer, start, stop, offset

    def _hand_on(self, index: int) -> tuple[bytes, int, int]:
        """Pending record ``index`` out of the read-ahead, its share returned (booked
        again as the element it becomes)."""
        buffer, start, stop, share = self.pending[index]
        self.pending[index] = (b"", 0, 0, 0)
        self.pending_booked -= share
        self.account.release(share)
        return buffer, start, stop

    def _offset(self, record: int) -> int:
        """Where an error in ``record`` is reported: its offset in the file."""
        return int(self.offsets[record])

    def pull(self) -> tuple[Any, Reservation]:
        buffer, start, stop, offset = self._take()
        element = decode_element(buffer, path=self.path, offset=offset, start=start, stop=stop)
        del buffer
        cost = self.ctx.sizeof(element)
        return element, _book(self.account, cost, "one cached element")

    def skip(self, count: int) -> int:
        """Skip ``count`` elements without reading them; returns how many there were."""
        self._release_pending()
        done = min(count, len(self.offsets) - self.next)
        self.next += done
        return done

    def _release_pending(self) -> None:
        self.account.release(self.pending_booked)
        self.pending_booked = 0
        self.pending = []
        self.next_pending = 0

    def close(self) -> None:
        self._release_pending()
        self.stream.close()
        self.index_booking.release()


class _BlockReader(_RecordReader):
    """Encoded elements of a compressed cache file (:mod:`headrace.io.blocks`), in order:
    one positioned read and one decompression per block, every check before any use.

    The ``.hrx`` index gives the blocks' offsets and the manifest each block's records
    and decompressed size, so skipping is still free (to the block that holds the
    position). The compressed block, the decompressed one and each element handed on
    are booked; an error names the file and the block's offset (and, inside a block,
    that the offset counts in its decompressed bytes).
    """

    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        codec: BlockCodec,
        blocks: list[tuple[int, int]],
        expected: _Expected | None = None,
    ) -> None:
        super().__init__(path, ctx, account, expected)
        self.codec = codec
        self.blocks = blocks
        if len(blocks) != len(self.offsets):
            self.close()
            raise DataLossError(
                f"cache: the index of {path} lists {len(self.offsets)} blocks where its "
                f"manifest lists {len(blocks)}",
                path=path,
            )
        #: The first element of each block (and the total, last).
        self.starts = [0]
        for records, _ in blocks:
            self.starts.append(self.starts[-1] + records)
        self.pending_first = 0  # the element number of ``pending[0]``
        self.block_offset = 0  # of the block ``pending`` came from

    def _refill(self) -> bool:
        if self.next >= self.starts[-1]:
            return False
        block = bisect.bisect_right(self.starts, self.next) - 1
        begin = int(self.offsets[block])
        size = self._end(block) - begin
        records, raw_size = self.blocks[block]
        self._release_pending()
        work = size + raw_size + 2 * _BYTES_OVERHEAD
        _book(self.account, work, "a compressed block read ahead")
        self.pending_booked = work
        (buffer,) = self.stream.pread_many([begin], [size])
        start, stop = _check_frame(buffer, begin, self.path)
        self._check_entry(buffer, len(buffer), block)
        raw = self.codec.decompress(
            memoryview(buffer)[start:stop], raw_size, path=self.path, offset=begin
        )
        del buffer
        stream = f" of the {self.codec.name} block at offset {begin}, decompressed,"
        if records == 1:  # decoded in place: the element's arrays are views of ``raw``
            bounds = _check_frame(raw, 0, self.path, stream)
            self.pending = [(raw, *bounds, raw_size + _BYTES_OVERHEAD)]
        else:
            try:
                split = records_in_spans([raw], [records], [0], path=self.path)
            except DataLossError as error:
                raise DataLossError(
                    f"{error} (the offset counts in the {self.codec.name} block at offset "
                    f"{begin}, decompressed)",
                    path=self.path,
                    offset=begin,
                ) from None
            del raw
            self.pending = [(record, 0, len(record), len(record) + _BYTES_OVERHEAD) for record in split]
        self._rebook_pending()  # the compressed block is gone: the records' shares stay
        self.pending_first = self.starts[block]
        self.block_offset = begin
        self.next_pending = self.next - self.pending_first
        for dropped in range(self.next_pending):  # before a skipped-to position
            self._hand_on(dropped)
        return True

    def _offset(self, record: int) -> int:
        return self.block_offset  # (the message says the offset counts in the block)

    def skip(self, count: int) -> int:
        self._release_pending()
        done = min(count, self.starts[-1] - self.next)
        self.next += done
        return done


# --------------------------------------------------------------------------- stores


class _Store:
    """Where one cache's elements go while it is written, and how it is read."""

    #: Whether stopping before the end discards cached elements (and so warns).
    partial = True

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


class _PassThrough(_Store):
    """Another iterator writes the file: pass the input's elements on, write nothing."""

    partial = False

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        self.count += 1
        return element, upstream

    def finish(self) -> None:
        """Nothing was written, so nothing completes: later passes look for the file."""

    def discard(self) -> None:
        """Nothing to remove."""


class _StoreReader:
    def pull(self) -> tuple[Any, Reservation]:
        raise NotImplementedError

    def skip(self, count: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release by default."""


# --------------------------------------------------------------------------- kept memory caches
#
# A complete in-memory cache belongs to its recipe node, as tf.data's memory cache
# belongs to its dataset: every later iterator of the dataset (and of datasets built
# on it: a map after it, with_options) reads it, never the input — Keras makes a new
# iterator per epoch. It lives until the node is garbage-collected.
#
# Its bytes stay booked while it lives:
# * on the process-wide default budget, always (the "kept" booking, taken when the
#   cache completes): it is memory headrace holds in this process outside any run, and
#   every pipeline without its own memory_budget draws from that budget, so they leave
#   room for it, between runs too;
# * on the cache stage's share of each run that reads it, unless that run draws from
#   the default budget itself (where it is already booked): a pipeline with its own
#   memory_budget B still holds at most B, the kept cache included.
# The spilled part is on disk: a run reading it books its read buffers only.

_kept_lock = threading.Lock()
#: The complete in-memory cache of each cache node (weak: dies with the node).
_kept: weakref.WeakKeyDictionary[CacheNode, _KeptMemory] = weakref.WeakKeyDictionary()
#: What each run has booked of a kept cache, by the run's cache account (one booking
#: per run and node, however many epochs of a ``repeat`` read it).
_run_bookings: weakref.WeakKeyDictionary[
    Buffer, tuple[weakref.ref[_KeptMemory], Reservation]
] = weakref.WeakKeyDictionary()
_keepers: weakref.WeakKeyDictionary[MemoryBudget, Buffer] = weakref.WeakKeyDictionary()


def _keeper(budget: MemoryBudget) -> Buffer:
    """The account of ``budget`` (the default one) that books kept caches.

    Outside the budget's split (a kept cache is memory that exists: it is booked as
    it is, never refused), it still counts in the budget's ``used``, which every
    pipeline drawing from that budget checks before it buffers more.
    """
    with _kept_lock:
        account = _keepers.get(budget)
        if account is None:
            account = _keepers[budget] = Buffer.outside_split(budget, "cache (kept)")
        return account


def _drawn_from_default(account: Buffer) -> bool:
    return account.budget.parent is default_budget()


class _KeptResources:
    """What a kept cache must give back when it dies (no reference to the cache itself,
    so that its finalizer cannot keep it alive)."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self.kept: Reservation = NO_RESERVATION

    def free(self) -> None:
        kept, self.kept = self.kept, NO_RESERVATION
        directory, self.directory = self.directory, None
        if kept is not NO_RESERVATION or directory is not None:
            call_outside_collection(_free, kept, directory)


def _free(kept: Reservation, directory: str | None) -> None:
    kept.release()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class _KeptMemory:
    """The elements of one in-memory cache: the first ones in memory, the rest in a
    spill file. Holds no run (no context, no account), so keeping it keeps nothing else."""

    def __init__(self, epochs: tuple[int, ...], iteration: int) -> None:
        #: Which iterator wrote it (the epochs of enclosing repeats, the iterator's
        #: number): a restored state reads it only if it was written by the same one.
        self.epochs, self.iteration = epochs, iteration
        self.items: list[Any] = []
        self.booked = 0  # the in-memory items' bytes
        self.count = 0
        self.spill_path: str | None = None
        self.spill_bytes = 0  # the spill file's size, once complete
        self.resources = _KeptResources()
        # removed when collected, and at exit (weakref.finalize runs atexit)
        self._finalizer = weakref.finalize(self, self.resources.free)

    def free(self) -> None:
        self.items = []
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive


def _report_kept(data: _KeptMemory, ctx: Context, account: Buffer) -> None:
    """Show the kept cache in the stats of the run that reads it (G7): its bytes are
    booked for as long as the dataset lives, and the user should see where they went."""
    ref = weakref.ref(data)
    booked_on = (
        "the default budget" if _drawn_from_default(account) else f"this run's {account.name!r} share"
    )

    def describe() -> KeptStats | None:
        kept = ref()
        if kept is None or not kept.alive:
            return None
        in_memory = len(kept.items)
        return KeptStats(
            name=f"{account.name} (kept)",
            held=kept.booked,
            elements=in_memory,
            spilled_elements=kept.count - in_memory,
            spilled_bytes=kept.spill_bytes,
            booked_on=booked_on,
            spill_path=kept.spill_path,
        )

    ctx.budget.report_kept(id(data), describe)


class _MemoryStore(_Store):
    """Writes a :class:`_KeptMemory`: elements in memory while they fit three quarters
    of the share, then a spill file; kept by the node once complete.

    The last quarter of the share stays free for reading the spill file back (its
    buffer and one element at a time), so reading never needs more than the share.
    """

    def __init__(
        self, node: CacheNode, ctx: Context, account: Buffer, epochs: tuple[int, ...]
    ) -> None:
        super().__init__(epochs)
        self.node, self.ctx, self.account = node, ctx, account
        self.data = _KeptMemory(epochs, ctx.run.iteration)
        #: The in-memory elements' booking (``data.booked`` bytes), one for all.
        self.booking: Reservation = NO_RESERVATION
        self.spill: _RecordWriter | None = None
        self.lock = threading.Lock()
        self.discarded = False
        #: The cache later epochs read: this one, or one another iterator completed first.
        self.kept: _KeptMemory | None = None

    def _fits_in_memory(self, cost: int) -> bool:
        account = self.account
        room = in_memory_room(account.share())
        return self.data.booked + cost <= room and not account.budget.over_shared_cap(cost)

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        element, cost = self.ctx.admit(element)
        data = self.data
        if self.spill is None and self._fits_in_memory(cost):
            element = _read_only(element)
            self.booking = self.booking.absorb(self.account.admit(cost, upstream))
            data.booked += cost
            data.items.append(element)
            data.count = self.count = self.count + 1
            return element, NO_RESERVATION
        if self.spill is None:
            self._start_spill(cost)
        assert self.spill is not None
        try:
            self.spill.append(encode_element_parts(element))
        except BaseException:
            self.discard()  # a full disk or an element it cannot store: no files left
            raise
        data.count = self.count = self.count + 1
        return element, upstream

    def _start_spill(self, cost: int) -> None:
        directory = tempfile.mkdtemp(prefix=f"headrace-cache-{os.getpid()}-")
        self.data.resources.directory = directory
        self.data.spill_path = os.path.join(directory, "spill.hrcache")
        account = self.account
        warnings.warn(
            f"cache: the elements cached so far ({self.count} elements, "
            f"{format_bytes(self.data.booked)}) fill the in-memory part of the stage's share "
            f"of the memory budget ({format_bytes(account.share())}); the next element "
            f"({format_bytes(cost)}) and all later ones "
            f"spill to an on-disk cache in {directory} (removed with the dataset, or at "
            "exit)",
            HeadraceWarning,
            stacklevel=6,
        )
        try:
            self.spill = _RecordWriter(
                self.data.spill_path, account,
                limiter=file_limiter(self.ctx), stage=f"{self.node.stage}() spilling to disk",
            )
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
            self.data.spill_bytes = self.spill.nbytes
        self.complete = True
        self.kept = self._publish()
        _report_kept(self.kept, self.ctx, self.account)

    def _publish(self) -> _KeptMemory:
        """Give the complete cache to the node, and move its booking where a kept cache's
        goes (see above); if another iterator completed one first, read that one (as
        tf.data does) and free this one."""
        data, account = self.data, self.account
        with _kept_lock:
            kept = _kept.get(self.node)
            if kept is None:
                _kept[self.node] = data
        if kept is not None:
            self.discard()
            return kept
        data.resources.kept = _keeper(default_budget()).charge(data.booked)
        held, self.booking = self.booking, NO_RESERVATION
        if _drawn_from_default(account):
            held.release()  # booked on the default budget above instead
        else:
            _run_bookings[account] = (weakref.ref(data), held)
            self.ctx.budget.on_close(held.release)
        return data

    def discard(self) -> None:
        with self.lock:
            if self.discarded or self.kept is not None:
                return
            self.discarded = True
        if self.spill is not None:
            self.spill.abort()
        data = self.data
        booking, self.booking = self.booking, NO_RESERVATION
        booking.release()
        data.booked = 0
        data.free()

    def reader(self) -> _StoreReader:
        assert self.kept is not None
        return _MemoryReader(self.kept, self.ctx, self.account)


def _book_for_run(data: _KeptMemory, ctx: Context, account: Buffer) -> None:
    """Book a kept cache on a run that reads it, once per run (see above)."""
    if _drawn_from_default(account):
        return
    booked = _run_bookings.get(account)
    if booked is not None and booked[0]() is data:
        return
    held = _book(account, data.booked, "the kept in-memory cache")
    _run_bookings[account] = (weakref.ref(data), held)
    ctx.budget.on_close(held.release)


class _KeptStore(_Store):
    """A kept in-memory cache, as a later iterator of the dataset finds it."""

    def __init__(self, data: _KeptMemory, ctx: Context, account: Buffer) -> None:
        super().__init__(data.epochs)
        self.data, self.ctx, self.account = data, ctx, account
        self.complete = True
        self.count = data.count
        _book_for_run(data, ctx, account)
        _report_kept(data, ctx, account)

    def reader(self) -> _StoreReader:
        return _MemoryReader(self.data, self.ctx, self.account)

    def discard(self) -> None:
        """A kept cache lives as long as its node."""


class _MemoryReader(_StoreReader):
    def __init__(self, data: _KeptMemory, ctx: Context, account: Buffer) -> None:
        self.data, self.ctx, self.account = data, ctx, account
        self.next = 0
        self.spill: _RecordReader | None = None

    def _spill(self) -> _RecordReader:
        if self.spill is None:
            assert self.data.spill_path is not None
            self.spill = _RecordReader(self.data.spill_path, self.ctx, self.account)
        return self.spill

    def pull(self) -> tuple[Any, Reservation]:
        items = self.data.items
        if self.next < len(items):
            element = items[self.next]
            self.next += 1
            return element, NO_RESERVATION  # booked with the cache
        if self.data.spill_path is None:
            raise StopIteration
        pair = self._spill().pull()
        self.next += 1
        return pair

    def skip(self, count: int) -> int:
        in_memory = min(count, max(0, len(self.data.items) - self.next))
        self.next += in_memory
        if in_memory == count or self.data.spill_path is None:
            return in_memory
        skipped = self._spill().skip(count - in_memory)
        self.next += skipped
        return in_memory + skipped

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None


class _FileStore(_Store):
    """tf.data's persistent cache: written under a lock, published atomically at the end."""

    def __init__(
        self, node: CacheNode, ctx: Context, account: Buffer, epochs: tuple[int, ...]
    ) -> None:
        super().__init__(epochs)
        self.ctx, self.account = ctx, account
        self.paths = _CachePaths(node.filename)
        self.fingerprint = node.inputs[0].data_fingerprint()
        self.expected: _Expected | None = None
        self.codec = block_codec(node.compression)
        self.blocks: list[tuple[int, int]] = []
        limiter, stage = file_limiter(ctx), f"{node.stage}({node.filename!r})"
        self.lock_slot = get_default_pool().hold(
            1, limiter=limiter, stage=stage, what=f"its lock ({self.paths.lock!r})"
        )
        try:
            self.lock_fd = _acquire_lock(self.paths)
        except BaseException:
            self.lock_slot.release()
            raise
        try:
            _remove_leftovers(self.paths)
            self.writer: _RecordWriter | None = _RecordWriter(
                self.paths.data, account, self.codec, limiter=limiter, stage=stage
            )
        except BaseException:
            _release_lock(self.paths, self.lock_fd, self.lock_slot)
            raise

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        assert self.writer is not None
        try:
            self.writer.append(encode_element_parts(element))
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
            self.blocks = writer.blocks
            checksums = np.asarray(writer.final_crcs, dtype="<u4").tobytes()
            write_atomically(self.paths.checksums, [checksums])
            self.expected = _Expected(writer.final_crcs, self.paths.manifest)
            manifest: dict[str, Any] = {
                "format": _MANIFEST_FORMAT,
                "version": _MANIFEST_VERSION,
                "elements_format": ELEMENTS_FORMAT,
                "fingerprint": self.fingerprint,
                "elements": self.count,
                "bytes": os.path.getsize(self.paths.data),
                "checksums": _checksums_digest(checksums),
                "created": time.time(),
            }
            if self.codec is not None:  # what a reader needs to find and check each block
                manifest["compression"] = self.codec.name
                manifest["blocks"] = [list(block) for block in self.blocks]
            seal(manifest)  # an edited manifest is refused, never believed or rebuilt over
            write_atomically(self.paths.manifest, [json.dumps(manifest).encode()])
        except BaseException:
            for path in (self.paths.data, self.paths.checksums):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            _release_lock(self.paths, self.lock_fd, self.lock_slot)
            raise
        _release_lock(self.paths, self.lock_fd, self.lock_slot)
        self.complete = True

    def discard(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.abort()
            _release_lock(self.paths, self.lock_fd, self.lock_slot)

    def reader(self) -> _StoreReader:
        return _FileReader(
            self.paths.data, self.ctx, self.account, self.codec, self.blocks, self.expected
        )


class _FileReader(_StoreReader):
    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        codec: BlockCodec | None = None,
        blocks: list[tuple[int, int]] | None = None,
        expected: _Expected | None = None,
    ) -> None:
        self.records = (
            _RecordReader(path, ctx, account, expected)
            if codec is None
            else _BlockReader(path, ctx, account, codec, blocks or [], expected)
        )

    def pull(self) -> tuple[Any, Reservation]:
        return self.records.pull()

    def skip(self, count: int) -> int:
        return self.records.skip(count)

    def close(self) -> None:
        self.records.close()


class _CompleteFile(_Store):
    """A complete ``cache(filename)`` found on disk."""

    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        count: int,
        codec: BlockCodec | None,
        blocks: list[tuple[int, int]],
        expected: _Expected,
    ) -> None:
        super().__init__(())
        self.path, self.ctx, self.account = path, ctx, account
        self.complete = True
        self.count = count
        self.codec, self.blocks = codec, blocks
        self.expected = expected

    def reader(self) -> _StoreReader:
        return _FileReader(
            self.path, self.ctx, self.account, self.codec, self.blocks, self.expected
        )

    def discard(self) -> None:
        """A complete cache stays on disk."""


class _CachePaths:
    def __init__(self, filename: str) -> None:
        self.prefix = filename
        self.data = f"{filename}.hrcache"
        self.manifest = f"{filename}.hrcache.json"
        #: Each record's data CRC, as written (its digest is in the manifest).
        self.checksums = f"{filename}.hrcache.crc"
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


def _release_lock(paths: _CachePaths, fd: int, slot: HeldSlots) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.lock)  # while still holding it: no one can take a stale copy
    try:
        os.close(fd)
    finally:
        slot.release()  # its descriptor is gone: a reader may take the slot


def _remove_leftovers(paths: _CachePaths) -> None:
    """Under the lock: what a crashed writer left (temporary files, a manifest-less data
    file) is never complete, so it goes; so does a manifest that is about to be stale."""
    directory, name = os.path.split(os.path.abspath(paths.data))
    pattern = f".{glob.escape(name)}*.tmp"  # the data file's, its index's, its checksums'
    for leftover in glob.glob(os.path.join(glob.escape(directory), pattern)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    for path in (paths.manifest, paths.data, index_path_for(paths.data), paths.checksums):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _find_complete(node: CacheNode, ctx: Context, account: Buffer) -> _CompleteFile | None:
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
    if manifest.get("version") != _MANIFEST_VERSION:
        return None  # an older headrace's (keyed by structure only, unsealed): rebuilt
    if not is_sealed(manifest):
        raise DataLossError(
            f"cache: the manifest {paths.manifest} was changed after this cache was written "
            "(its fields do not match its checksum): its counts and checksums cannot be "
            "believed; delete the cache's files to rebuild it",
            path=paths.manifest,
        )
    if manifest.get("elements_format") != ELEMENTS_FORMAT:
        return None  # sealed by a headrace that encodes elements otherwise: rebuilt
    fingerprint = node.inputs[0].data_fingerprint()
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
    if not os.path.exists(index_path_for(paths.data)):  # written before the manifest
        return None
    expected = _read_checksums(paths, manifest)
    compression = manifest.get("compression")  # detected: whatever this run would write
    if compression is None:
        return _CompleteFile(paths.data, ctx, account, count, None, [], expected)
    blocks = manifest.get("blocks")
    if (
        compression not in BLOCK_CODECS
        or not isinstance(blocks, list)
        or not all(
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(n, int) and n >= 0 for n in block)
            for block in blocks
        )
        or sum(block[0] for block in blocks) != count
    ):
        raise DataLossError(
            f"cache: the manifest {paths.manifest} is corrupted (compression "
            f"{compression!r:.40} with blocks that do not add up to its {count} elements)",
            path=paths.manifest,
        )
    codec = block_codec(compression)  # SNAPPY without cramjam: says what to install
    return _CompleteFile(
        paths.data, ctx, account, count, codec, [(int(n), int(raw)) for n, raw in blocks],
        expected,
    )


def _read_checksums(paths: _CachePaths, manifest: dict[str, Any]) -> _Expected:
    """The records' CRCs a complete cache's manifest vouches for (``<file>.crc``, checked
    against the digest the manifest holds); DataLossError naming the file otherwise."""
    try:
        with open(paths.checksums, "rb") as file:
            checksums = file.read()
    except OSError as error:
        raise DataLossError(
            f"cache: {paths.checksums}, the record checksums of the complete cache "
            f"{paths.data}, cannot be read ({error.strerror}); delete the cache's files "
            "to rebuild it",
            path=paths.checksums,
        ) from None
    if len(checksums) % 4 or _checksums_digest(checksums) != manifest.get("checksums"):
        raise DataLossError(
            f"cache: {paths.checksums} is not the checksum file its manifest "
            f"{paths.manifest} describes (it belongs to another cache or was changed); "
            "delete the cache's files to rebuild it",
            path=paths.checksums,
        )
    return _Expected(np.frombuffer(checksums, dtype="<u4"), paths.manifest)


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
        #: Which iterator wrote (or writes) the cache read here: its epochs and number.
        self.writer: tuple[tuple[int, ...], int] = (ctx.epochs, ctx.run.iteration)
        self.cardinality = node.inputs[0].cardinality()
        complete = self._complete_store()
        if complete is not None:
            self._read(complete)
        else:
            self._write(ctx)

    # -- modes ---------------------------------------------------------------------------
    def _complete_store(
        self, writer: tuple[tuple[int, ...], int] | None = None
    ) -> _Store | None:
        """The complete cache to read, if there is one; ``writer`` (a restored state's
        epochs and iteration): only an in-memory cache that iterator wrote."""
        if self.node.filename:
            return _find_complete(self.node, self.ctx, self.account)
        data = _kept.get(self.node)
        if data is None or (writer is not None and writer != (data.epochs, data.iteration)):
            return None
        return _KeptStore(data, self.ctx, self.account)

    def _read(self, store: _Store) -> None:
        self.store, self.writing, self.position = store, False, 0
        self.source = store.reader()
        self.inputs = ()
        if isinstance(store, _KeptStore):
            self.writer = (store.data.epochs, store.data.iteration)
        else:  # a cache file: any iterator rebuilds it alike
            self.writer = (self.ctx.epochs, self.ctx.run.iteration)

    def _write(self, ctx: Context) -> None:
        """Start writing a new cache, reading the input with ``ctx`` (the writer's epochs)."""
        epochs = ctx.epochs
        if self.node.filename:
            try:
                store: _Store = _FileStore(self.node, ctx, self.account, epochs)
            except FileExistsError:
                if not self.node.passthrough_when_locked:
                    raise
                store = _PassThrough(epochs)
        else:
            store = _MemoryStore(self.node, ctx, self.account, epochs)
        self.store, self.writing, self.position = store, True, 0
        self.writer = (epochs, ctx.run.iteration)
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
        epochs, iteration = self.writer
        return {
            MODE: WRITE if self.writing else READ,
            POSITION: self.position,
            EPOCHS: list(epochs),
            WRITER_ITERATION: iteration,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        mode = reader.raw(MODE)
        if mode not in (WRITE, READ):
            raise reader.error(MODE, f"must be {WRITE!r} or {READ!r}, got {mode!r:.40}")
        position = reader.integer(POSITION)
        epochs = tuple(reader.integers(EPOCHS, len(self.ctx.epochs)))
        iteration = reader.integer(WRITER_ITERATION)
        self._stop(warn=False)
        complete = self._complete_store((epochs, iteration))
        if complete is not None:
            self._read(complete)
            self._skip(position)
            return
        # No complete cache here: rebuild it as the writing iterator read its input.
        self._write(self._writer_context(epochs, iteration))
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
        if self.node.filename:
            self._read(self._complete_or_fail())
        else:
            assert isinstance(store, _MemoryStore) and store.kept is not None
            self._read(_KeptStore(store.kept, self.ctx, self.account))
        self._skip(position)

    def _writer_context(self, epochs: tuple[int, ...], iteration: int) -> Context:
        """A context in which the input reads as it did for the iterator that wrote the
        cache: its repeat epochs, and its iterator number (what seeds a reshuffling
        shuffle above the cache), which may be an earlier iterator's than this run's."""
        ctx = copy.copy(self.ctx)
        ctx.epochs = epochs
        if iteration != ctx.run.iteration:
            file_limiter(ctx)  # made now, so the copy below shares the run's limiter
            ctx.run = copy.copy(ctx.run)
            ctx.run.iteration = iteration
        return ctx

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
            if warn and self.position and self.node.warns_partial and store.partial:
                # (one that read nothing truncated nothing)
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
