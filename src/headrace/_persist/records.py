"""The cache's file format: encoded elements in TFRecord frames, indexed and checksummed.

A cache file (and a memory cache's spill file) is a TFRecord file of elements
encoded by :mod:`headrace.io.elements`. Its ``.hrx`` index says where each
record starts, so readers fetch records with positioned reads and skip for
free. Each record's data CRC is kept as written, so a reader can refuse a file
that is not the one its manifest describes. Compressed files hold blocks of
records (:mod:`headrace.io.blocks`).

The writer's buffers, the reader's read-ahead and each element handed on are
booked on the stage's buffer, held together with what it holds already: a
record larger than the share makes the budget split again, or raises
MemoryBudgetError naming the stage.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import errno
import os
import struct
from typing import Any

import numpy as np
import xxhash

from headrace._errors import DataLossError
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.units import format_bytes
from headrace._persist.columnar import Layout, layout_for
from headrace._sources.files import file_limiter
from headrace.core.iterator import Context
from headrace.io import objstore
from headrace.io._crc32c import crc32c, masked_crc32c
from headrace.io._native import native_module
from headrace.io.blocks import BlockCodec
from headrace.io.elements import EncodedParts, decode_element
from headrace.io.filepool import FileLimiter, get_default_pool
from headrace.io.streams import DEFAULT_BUFFER_SIZE
from headrace.io.tfrecord.framing import RECORD_OVERHEAD_BYTES, encode_records
from headrace.io.tfrecord.reader import records_in_spans
from headrace.io.tfrecord.writer import TFRecordWriter, record_frame
from headrace.io.tfrecord_index import load_index, write_index

__all__ = [
    "BYTES_OVERHEAD",
    "BlockReader",
    "EvenOffsets",
    "Expected",
    "RecordReader",
    "RecordWriter",
    "book",
    "check_alike_records",
    "check_run",
    "check_scattered",
    "checksums_digest",
    "chunk_bytes",
    "one_size",
]


BYTES_OVERHEAD = 33  # what a bytes object costs beyond its payload (sys.getsizeof(b""))
_FRAME_HEADER = struct.Struct("<QI")  # a TFRecord's length and its masked CRC
_FRAME_FOOTER = struct.Struct("<I")  # its data's masked CRC
#: Records at least this large are read each into a buffer of its own and decoded
#: there (no copy); smaller ones are read in runs and split out (one small copy each).
_IN_PLACE_BYTES = 32 << 10
#: Batches of records from this size on, once their layout is known, are read straight
#: into the batch's rows (one piece per leaf); smaller ones are read in runs into one
#: buffer and copied out column by column (pieces of a few bytes would cost more).
_SCAN_BELOW = 4 << 10
#: Bytes of skeleton read with a record's frame when a batch's layout is learnt.
_SKELETON_GUESS = 240


def book(account: Buffer, nbytes: int, what: str) -> Reservation:
    """Book ``nbytes`` held together with what the stage holds. Past its share the
    budget splits itself again, or MemoryBudgetError names the stage and ``what``."""
    return account.admit(nbytes, together=what)


#: The most a cache read of an object asks for at once (AWS's advice for ranged GETs).
REMOTE_CHUNK_BYTES = 8 << 20


def chunk_bytes(share: int) -> int:
    """How many record bytes the cache reads (or writes) at once: 1/16 of its share."""
    return max(16 << 10, min(1 << 20, share // 16))


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


class RecordWriter:
    """Encoded elements appended to one file; its buffers booked. At the end the file
    gets its ``.hrx`` index (from the offsets written, no scan), so readers fetch
    records with positioned reads (see :class:`RecordReader`).

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
        self.offsets_booking = account.admit(0)

    def _start(self) -> None:
        self.batch_limit = chunk_bytes(self.account.share())
        # the batch, its framed copy, and (compressed) the block made of it
        buffers = (3 if self.codec is not None else 2) * self.batch_limit
        self.booking = book(
            self.account, DEFAULT_BUFFER_SIZE + buffers, "the cache's write buffers"
        )

    def append(self, encoded: EncodedParts) -> None:
        if not self.batch_limit:
            self._start()
        size = encoded.nbytes + BYTES_OVERHEAD
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
        copies = book(self.account, work, "one cached element being encoded")
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
            book(self.account, 12 * records, "the cache's record offsets and checksums")
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
        #: The framed size every record shares, 0 where they differ (or blocks).
        self.record_bytes = 0 if self.codec is not None else one_size(self.offsets, self.nbytes)
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


def one_size(offsets: Any, end: int) -> int:
    """Internal: the framed size every record shares, given where each starts and where
    the last ends; 0 where they differ (or none). Checked a slice at a time."""
    count = len(offsets)
    if not count:
        return 0
    size = (int(offsets[1]) if count > 1 else end) - int(offsets[0])
    if int(offsets[0]) != 0 or end - int(offsets[count - 1]) != size or size <= 0:
        return 0
    for at in range(0, count, 1 << 16):
        part = np.asarray(offsets[at : at + (1 << 16) + 1], dtype=np.int64)
        if len(part) > 1 and (np.diff(part) != size).any():
            return 0
    return size


class EvenOffsets:
    """Internal: where each of ``count`` records of ``size`` bytes laid end to end
    starts, computed rather than held: a cache or a saved shard of one-size records
    (small ones above all) needs no index in memory, where the ``.hrx``'s 8 bytes a
    record were most of what reading it held (1.6 MB for 200,000 records).

    Read as an index's offsets are: a position (an int), a slice, or an array of
    positions (uint64 offsets, as the ``.hrx`` holds them)."""

    __slots__ = ("count", "size")
    nbytes = 0  # (booked as an index is: nothing held)

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: int | slice | np.ndarray[Any, Any]) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.count)
            return np.arange(start, stop, step, dtype=np.uint64) * np.uint64(self.size)
        if isinstance(key, np.ndarray):
            many = np.asarray(key, dtype=np.int64)
            many = np.where(many < 0, many + self.count, many)
            if many.size and (many.min() < 0 or many.max() >= self.count):
                bad = key.reshape(-1)[int(np.argmax((many < 0) | (many >= self.count)))]
                raise IndexError(f"record {bad} of {self.count}")
            return many.astype(np.uint64) * np.uint64(self.size)
        key = int(key)  # (a numpy integer too)
        at = key + self.count if key < 0 else key
        if not 0 <= at < self.count:
            raise IndexError(f"record {key} of {self.count}")
        return at * self.size


class Expected:
    """What a complete cache file must hold, as its manifest recorded it: the data CRC
    of each record (each block, compressed), from ``<file>.crc`` (whose digest the
    manifest holds). Each record is compared as it is read, before it is used: a data
    file of another cache, or one changed since, is refused at its first record that
    differs — no element of it is ever served, and no extra read is needed."""

    def __init__(self, crcs: Any, manifest: str, record_bytes: int = 0) -> None:
        self.crcs = np.asarray(crcs, dtype=np.uint32)
        self.manifest = manifest
        #: The framed size every record shares (0: they differ, or it was not recorded):
        #: a reader then computes each record's offset instead of loading the index.
        self.record_bytes = record_bytes

    def mismatch(self, path: str, problem: str, offset: int | None = None) -> DataLossError:
        return DataLossError(
            f"cache: {path} is not the file its manifest {self.manifest} describes "
            f"({problem}): it belongs to another cache or was changed after it was "
            "written; delete the cache's files to rebuild it",
            path=path,
            offset=offset,
        )


def checksums_digest(crcs: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(crcs)


def _check_frame(
    buffer: bytes | memoryview, offset: int, path: str, stream: str = ""
) -> tuple[int, int]:
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


#: CRC32C of ``n`` zero bytes, by ``n`` (what :func:`check_alike_records` needs per size).
_ZEROS_CRC: dict[int, int] = {}
_MASK_DELTA = np.uint32(0xA282EAD8)


def check_alike_records(
    view: memoryview, rows: int, size: int, start: int, path: str
) -> np.ndarray[Any, Any]:
    """Check a run of ``rows`` framed records of ``size`` bytes each (read at file offset
    ``start`` into ``view``) as a TFRecord reader checks each one — length, length CRC,
    data CRC — with one CRC32C pass over the whole run in C instead of a call (and a
    copied-out payload) per record. Returns the records' footers (their masked data
    CRCs). Internal: the frames' bytes in ``view`` are overwritten, the payloads stay.

    Why one pass suffices: CRC32C is affine, so a record's payload ``p`` with CRC ``c``
    followed by the four bytes ``c ^ crc32c(zeros(len(p)))`` drives the CRC register from
    zero back to zero, and a record whose payload does not match its footer leaves it
    non-zero. With the frames' headers zeroed (they are compared with the first record's,
    which is checked in full) and each footer replaced so, the whole run leaves the
    register at zero exactly when every record would pass its own check — an error in one
    record is caught whenever its own CRC would catch it. A failure is then located
    record by record, and reported as the record reader reports it (file and offset)."""
    if rows <= 0:
        return np.empty(0, np.uint32)
    _check_frame(view[:size], start, path)  # the first record's frame, in full

    def column(dtype: str, at: int) -> np.ndarray[Any, Any]:
        # one field of every record, as a strided array (a loop over rows in C)
        field: np.ndarray[Any, Any] = np.ndarray((rows,), dtype, view, at, (size,))
        return field

    lengths, length_crcs, footer = column("<u8", 0), column("<u4", 8), column("<u4", size - 4)
    if rows > 1:
        # (copied out first: NumPy's loops over unaligned strided fields are slow)
        heads = lengths.astype(np.uint64) ^ (length_crcs.astype(np.uint64) << np.uint64(32))
        differ = heads != heads[0]
        if differ.any():  # another length: its own check says what is wrong, and where
            row = int(differ.argmax())
            _check_frame(view[row * size : (row + 1) * size], start + row * size, path)
    footers: np.ndarray[Any, Any] = footer.astype(np.uint32)
    payload = size - RECORD_OVERHEAD_BYTES
    zeros = _ZEROS_CRC.get(payload)
    if zeros is None:
        zeros = _ZEROS_CRC[payload] = crc32c(bytes(payload))
    rotated = footers - _MASK_DELTA  # (unmasked, vectorized: see unmask_crc)
    footer[...] = ((rotated >> np.uint32(17)) | (rotated << np.uint32(15))) ^ np.uint32(zeros)
    lengths.fill(0)
    length_crcs.fill(0)
    if crc32c(view[: rows * size], 0xFFFFFFFF) != 0xFFFFFFFF:
        for row in range(rows):
            if crc32c(view[row * size : (row + 1) * size], 0xFFFFFFFF) != 0xFFFFFFFF:
                offset = start + row * size
                raise DataLossError(
                    f"corrupted record (bad data checksum) at offset {offset} in file {path}",
                    path=path,
                    offset=offset,
                )
    return footers


def check_run(
    view: memoryview, rows: int, size: int, start: int, path: str, head: bytes
) -> np.ndarray[Any, Any] | None:
    """Internal: check a run of ``rows`` framed records of ``size`` bytes each (read at
    file offset ``start`` into ``view``) as a TFRecord reader checks each one, each
    payload starting with ``head`` (the skeleton). Returns the records' footers (masked
    data CRCs), None where every record is sound but one has another skeleton (it needs
    decoding on its own), or raises DataLossError naming ``path`` and the offset of the
    first record that is not sound. With the C extension, one call checks the run without
    writing to it (~3 us for 1024 small records, where NumPy's field-by-field checks take
    20 times as long); without it, :func:`check_alike_records` overwrites the frames."""
    native = native_module()
    if native is None:
        footers = check_alike_records(view, rows, size, start, path)
        heads = np.ndarray((rows,), f"V{len(head)}", view, 12, (size,))
        return None if (heads != np.void(head)).any() else footers
    found = np.empty(rows, np.uint32)
    wrong = native.check_alike(view, rows, size, head, found)
    if wrong >= 0:  # its own check says what is wrong, and where; else its skeleton
        _check_frame(view[wrong * size : (wrong + 1) * size], start + wrong * size, path)
        return None
    return found


def check_scattered(
    frames: memoryview, prefix: int, head: bytes,
    targets: list[np.ndarray[Any, Any]], rows: list[int],
) -> tuple[np.ndarray[Any, Any], int]:
    """Internal: check records read in pieces — record ``k``'s frame header and ``head``
    (the payload's skeleton) at ``frames[k * (prefix + 4) :][:prefix]``, the rest of its
    payload in row ``rows[k]`` of each of ``targets`` (where it landed: the batch's rows),
    its footer in the four bytes after its prefix. Returns the footers (masked data
    CRCs) and the first ``k`` whose record is not sound or has another skeleton (-1 when
    none; the caller reads that one again to say why).

    The frames are compared all at once (every header must be the one the length
    implies, every skeleton ``head``); the data CRCs start from ``head``'s, the same for
    every record, so each record costs one CRC call in C per target."""
    count, stride = len(rows), prefix + 4

    def column(dtype: str, at: int) -> np.ndarray[Any, Any]:
        field: np.ndarray[Any, Any] = np.ndarray((count,), dtype, frames, at, (stride,))
        return field

    length = prefix - 12 + sum(target.shape[1] for target in targets)
    length_crc = masked_crc32c(length.to_bytes(8, "little"))
    skeletons = column(f"V{len(head)}", 12) if head else None
    footers = column("<u4", prefix).astype(np.uint32)
    bad = (column("<u8", 0) != length) | (column("<u4", 8) != length_crc)
    if skeletons is not None:
        bad |= skeletons != np.void(head)
    native = native_module()
    extend = crc32c if native is None else native.crc32c  # (one call less per piece)
    start = extend(head, 0)
    crcs = np.empty(count, np.uint32)
    # (slices of one flat view per target: cheaper than a row's array view each)
    flats = [(target.reshape(-1).data, target.shape[1]) for target in targets]
    for number, row in enumerate(rows):
        crc = start
        for flat, width in flats:
            crc = extend(flat[row * width : (row + 1) * width], crc)
        crcs[number] = crc
    rotated = crcs >> np.uint32(15) | crcs << np.uint32(17)
    bad |= rotated + np.uint32(_MASK_DELTA) != footers  # (masked, as mask_crc does)
    return footers, int(bad.argmax()) if bad.any() else -1


class RecordReader:
    """Encoded elements of one indexed file, in order, fetched with positioned reads.

    The ``.hrx`` index (refused if the file's size changed) says where every record
    starts — or, where the manifest records one size for every record, each start is
    computed (:class:`EvenOffsets`) and the index is not loaded — so reading is one
    ``pread`` per run of consecutive records up to the stage's chunk, and skipping is
    free. A record that fills a read alone (large records) is decoded where it was read:
    its arrays are views into the buffer the kernel copied the page cache into — no
    other copy. Smaller ones are split out of their shared buffer (one small copy each),
    so that an element never pins its neighbours. The index (8 bytes a record, when
    loaded), the manifest's CRCs (4 bytes a record), the records read ahead and each
    element handed on are booked on the stage's account.
    """

    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        expected: Expected | None = None,
    ) -> None:
        self.path, self.ctx, self.account = path, ctx, account
        self.expected = expected
        #: The framed size all records share, 0 where they differ (see :meth:`_one_size`).
        self.uniform: int | None = None
        self.offsets: Any
        if expected is not None and expected.record_bytes and not objstore.is_remote(path):
            self._even_offsets(expected, expected.record_bytes)
        else:
            index = load_index(path, size_only=True)  # every record is checked as read
            self.offsets = index.offsets
            self.size = index.shard_size
        if expected is not None and len(expected.crcs) != len(self.offsets):
            raise expected.mismatch(
                path, f"its index lists {len(self.offsets)} records where the manifest "
                f"recorded {len(expected.crcs)}"
            )
        nbytes = self.offsets.nbytes + (0 if expected is None else expected.crcs.nbytes)
        self.index_booking = book(account, nbytes, "the cache file's index")
        self.stream = get_default_pool().open(
            path, limiter=file_limiter(ctx), buffer_size=4096  # positioned reads: unused
        )
        #: An object (``cache(url)``): the range the next refill reads is fetched while
        #: this one's records are used, booked here (``ahead_booking``) until it is read.
        self.remote = objstore.is_remote(path)
        self.ahead_booking = NO_RESERVATION
        if self.remote:
            self.stream.read_ahead(None, 0)  # (only the ranges named below)
        self.next = 0  # the next record to hand on
        #: A record found bad while its run was read, and its error: raised once the
        #: records before it are handed on (see :meth:`_refill_checked`).
        self.failure: tuple[int, DataLossError] | None = None
        #: Records read, next first: (buffer, payload start, stop, bytes booked for it).
        self.pending: list[tuple[bytes, int, int, int]] = []
        self.pending_booked = 0
        self.next_pending = 0
        #: Batches decoded column by column (see :meth:`read_batch`): its reused read
        #: buffer and that buffer's booking; off once a skeleton needs per-element work.
        self.columnar = type(self).columnar_reads
        self.run_buffer = bytearray()
        self.run_booking = NO_RESERVATION
        #: The layout of the records batched last: (record size, head, layout, whether
        #: they are read straight into the batch's rows, :meth:`_scatter_batch`).
        self.batch_plan: tuple[int, bytes, Layout, bool] | None = None

    #: Whether :meth:`read_batch` may serve batches from this reader's records.
    columnar_reads = True

    def _even_offsets(self, expected: Expected, size: int) -> None:
        """Records all ``size`` bytes (the manifest says so): each one's offset is
        computed, the index is not loaded; the file must be exactly that long (as the
        index would check), else the error names it."""
        count = len(expected.crcs)
        self.size = os.path.getsize(self.path)
        if self.size != count * size:
            raise expected.mismatch(
                self.path, f"it holds {self.size} bytes where {count} records of {size} "
                f"bytes make {count * size}"
            )
        self.offsets = EvenOffsets(size, count)
        self.uniform = size

    @property
    def chunk(self) -> int:
        # Read when reading, not when made: a reader made while the iterator tree is
        # built (a complete cache file) sees its stage's share only once the budget is
        # split, and a chunk fixed then (16 KiB) read 100 KB records one call each.
        share = self.account.share()
        if self.remote:  # each read is a round trip: fewer, larger ones (at most 1/8)
            return max(chunk_bytes(share), min(REMOTE_CHUNK_BYTES, share // 8))
        # (a read-ahead is optional: on a share of a few KiB, chunk_bytes' 16 KiB floor
        # would make it the stage's minimum, and refuse a pipeline one record runs)
        return min(chunk_bytes(share), share // 4)

    def _end(self, record: int) -> int:
        return int(self.offsets[record + 1]) if record + 1 < len(self.offsets) else self.size

    def _refill_checked(self) -> bool:
        """:meth:`_refill`, where a record found bad ends its run before it: the records
        before it are handed on first, then its error is raised once (:meth:`_take`),
        and reading goes on after it — the index says where the next record starts."""
        stop = len(self.offsets)
        failure = None
        while True:
            try:
                filled = self._refill(stop)
            except DataLossError as error:
                bad = self._record_at(error, self.next)
                if bad <= self.next:
                    self._skip_bad(bad)
                    raise
                failure, stop = (bad, error), bad
                continue
            self.failure = failure
            return filled

    def _record_at(self, error: DataLossError, lowest: int) -> int:
        """The record (from ``lowest`` on) that holds the offset ``error`` names; ``lowest``
        where it names none in this file."""
        offset = error.offset
        if offset is None or error.path not in (None, self.path):
            return lowest
        low, high = lowest, len(self.offsets) - 1  # the last record starting at or before it
        while low < high:
            middle = (low + high + 1) // 2
            if int(self.offsets[middle]) <= offset:
                low = middle
            else:
                high = middle - 1
        return low

    def _skip_bad(self, record: int) -> None:
        """Go on after bad record ``record`` (its error is being raised)."""
        self._release_pending()
        self.next = max(record, self.next) + 1

    def _refill(self, stop: int) -> bool:
        """Read the next run of records (before record ``stop``) into ``pending``, every
        one checked; False at the end."""
        first = self.next
        if first >= stop:
            return False
        begin = int(self.offsets[first])
        if self._end(first) - begin >= _IN_PLACE_BYTES:
            return self._refill_large(first, stop)
        last = first
        while last + 1 < stop and self._end(last + 1) - begin <= self.chunk:
            last += 1
        size = self._end(last) - begin
        self._release_pending()
        # (one record may pass the chunk: past the share, the budget splits again)
        what = "one cached element" if last == first else "cached elements read ahead"
        book(self.account, size + BYTES_OVERHEAD, what)
        self.pending_booked = size + BYTES_OVERHEAD
        (buffer,) = self.stream.pread_many([begin], [size])
        self._read_next_ahead(last + 1)
        if last == first:  # decoded in place: the element's arrays are views of ``buffer``
            self.pending = [(buffer, *self._check_one(buffer, begin), self.pending_booked)]
            self._check_entry(buffer, len(buffer), first)
        else:
            records = records_in_spans([buffer], [last - first + 1], [begin], path=self.path)
            for entry in range(first, last + 1):
                self._check_entry(buffer, self._end(entry) - begin, entry)
            del buffer
            self.pending = [
                (record, 0, len(record), len(record) + BYTES_OVERHEAD) for record in records
            ]
            self._rebook_pending()
        self.next_pending = 0
        return True

    def _refill_large(self, first: int, stop: int) -> bool:
        """Read the run of large records from ``first`` (up to a chunk, or one beyond it),
        each into a buffer of its own, with one call (one file-pool check-out): each is
        decoded where it was read, its arrays views of its own buffer — the kernel's copy
        from the page cache is the only one — and no element pins another's bytes.
        An object's run is one ranged GET (a request per record would spend the read
        waiting), each record copied out of it into a buffer of its own."""
        starts, sizes = self._large_run(first, stop)
        total = sum(sizes)
        self._release_pending()
        booked = total + BYTES_OVERHEAD * len(sizes)
        what = "one cached element" if len(sizes) == 1 else "cached elements read ahead"
        book(self.account, booked, what)
        self.pending_booked = booked
        if self.remote and len(sizes) > 1:  # (the records of a run are contiguous)
            (run,) = self.stream.pread_many([starts[0]], [total])
            view = memoryview(run)
            buffers = [bytes(view[start - starts[0] : start - starts[0] + size])
                       for start, size in zip(starts, sizes, strict=True)]
            del view, run
        else:
            buffers = self.stream.pread_many(starts, sizes)
        self._read_next_ahead(first + len(sizes))
        self.pending = [
            (buffer, *_check_frame(buffer, start, self.path), len(buffer) + BYTES_OVERHEAD)
            for buffer, start in zip(buffers, starts, strict=True)
        ]
        for entry, buffer in enumerate(buffers, first):
            self._check_entry(buffer, len(buffer), entry)
        self._rebook_pending()  # (a short read at a truncated end books less)
        self.next_pending = 0
        return True

    def _large_run(self, first: int, stop: int | None = None) -> tuple[list[int], list[int]]:
        """The large records a refill from ``first`` reads (up to a chunk, or one
        beyond it; before record ``stop``): their offsets and sizes."""
        starts = [int(self.offsets[first])]
        sizes = [self._end(first) - starts[0]]
        total = sizes[0]
        record = first + 1
        while record < (len(self.offsets) if stop is None else stop):
            start = int(self.offsets[record])
            size = self._end(record) - start
            if size < _IN_PLACE_BYTES or total + size > self.chunk:
                break
            starts.append(start)
            sizes.append(size)
            total += size
            record += 1
        return starts, sizes

    def _first_range(self, first: int) -> tuple[int, int] | None:
        """The range (offset, size) an object's refill from record ``first`` reads first."""
        if first >= len(self.offsets):
            return None
        begin = int(self.offsets[first])
        if self._end(first) - begin >= _IN_PLACE_BYTES:
            return begin, sum(self._large_run(first)[1])
        last = first
        while last + 1 < len(self.offsets) and self._end(last + 1) - begin <= self.chunk:
            last += 1
        return begin, self._end(last) - begin

    def _read_next_ahead(self, first: int) -> None:
        """An object: the range read ahead before is read now (its booking goes: the
        refill booked those bytes); ask for the one the refill from ``first`` will read,
        booked as the stage's bytes, when it fits beside what the stage holds (else the
        refill reads it then, as a local file is read)."""
        self.ahead_booking.release()
        self.ahead_booking = NO_RESERVATION
        if not self.remote:
            return
        wanted = self._first_range(first)
        if wanted is None or wanted[1] > self.account.room():
            return
        self.ahead_booking = self.account.admit(
            wanted[1], together="the cached records read ahead", elements=0
        )
        if not self.stream.read_ahead(*wanted):
            self.ahead_booking.release()
            self.ahead_booking = NO_RESERVATION

    def _rebook_pending(self) -> None:
        """Book exactly what the pending records' shares will return (the buffers read
        were booked with their framing; the records count each object's overhead)."""
        shares = sum(share for *_, share in self.pending)
        if shares > self.pending_booked:
            book(self.account, shares - self.pending_booked, "cached elements read ahead")
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
        """The next record (buffer, payload bounds, offset), its read-ahead booking
        returned; a bad record's error, once, where it comes (see :meth:`_refill_checked`)."""
        if self.next_pending >= len(self.pending):
            failure = self.failure
            if failure is not None and failure[0] == self.next:
                self._skip_bad(failure[0])
                raise failure[1]
            if not self._refill_checked():
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
        return element, book(self.account, cost, "one cached element")

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
        self.failure = None  # (found again if still ahead)
        self.next_pending = 0

    # -- batches, column by column -------------------------------------------------------
    def read_batch(
        self, count: int, out_account: Buffer, *, whole: bool = False
    ) -> tuple[Any, Reservation, int] | None:
        """:meth:`_read_batch`, or None (nothing consumed) where a record among the
        batch's is bad: the caller then batches these elements one by one, so the bad
        one raises in its place with the semantics of every other element error (the
        rows before it dropped with their batch, the next batch after it, and a ``take``
        or ``skip`` above counting only the elements that came)."""
        try:
            return self._read_batch(count, out_account, whole=whole)
        except DataLossError:
            return None  # (the batch's reads raise before ``next`` moves)

    def _read_batch(
        self, count: int, out_account: Buffer, *, whole: bool = False
    ) -> tuple[Any, Reservation, int] | None:
        """The next ``count`` elements (fewer at the end) batched, decoded column by
        column, or None where they are not all alike — records of one size and one
        skeleton whose leaves are fixed-size numbers (:mod:`headrace._persist.columnar`);
        then nothing was consumed and the caller decodes them one by one (also when
        fewer than ``count`` are left and ``whole`` asks for a full batch).

        The layout comes from the first record's head; the batch's columns are booked
        on ``out_account`` (the batch stage's) before they are allocated, and before
        any record is read: large records are then read straight into the rows
        (:meth:`_scatter_batch`), smaller ones in runs (up to the stage's chunk) into
        one reused buffer booked on this stage's account (:meth:`_run_batch`). Every
        record is checked (framing, both CRCs, its skeleton, the manifest's CRC)
        before its bytes are handed on. So what the cache stage must hold beside a
        batch is its index and CRCs, the frames' scratch, and a run buffer sized from
        the share left once the batch is booked. Returns the batch, its booking and
        how many elements it holds."""
        first, total = self.next, len(self.offsets)
        last = min(first + count, total)
        if not self.columnar or last <= first or (whole and last - first < count):
            return None
        begin = int(self.offsets[first])
        size = self._end(first) - begin
        if self._end(last - 1) - begin != size * (last - first) or size < RECORD_OVERHEAD_BYTES + 4:
            return None
        if last - first > 1 and self._one_size() != size:  # the ends evenly spaced
            spacing = np.diff(self.offsets[first:last])
            if spacing.min() != size or spacing.max() != size:
                return None
        plan = self.batch_plan
        if plan is None or plan[0] != size:
            found = self._layout_of(begin, size)
            if found is None:
                return None
            head, layout = found
            # (not an object's: a scattered read is a GET per piece, where a run is one)
            scatter = size >= _SCAN_BELOW and not self.remote and all(
                leaf.copy_bytes for leaf in layout.leaves
            )
            plan = self.batch_plan = (size, head, layout, scatter)
            if scatter:
                self._drop_run_buffer()  # (no buffer in between, from the first batch)
        _, head, layout, scatter = plan
        if scatter:  # large records: read straight into the rows
            return self._scatter_batch(first, last, size, head, layout, out_account)
        return self._run_batch(first, last, size, head, layout, out_account)

    def _layout_of(self, begin: int, size: int) -> tuple[bytes, Layout] | None:
        """The skeleton (with its u32 length) and layout of the records of ``size`` bytes
        from offset ``begin``, read from the first one's head alone, or None where they
        do not batch column by column. The head is used before its record's CRC is
        checked: only to size the batch, which every record of it is then checked
        against (framing, both CRCs, the skeleton), so a damaged head is still refused
        by name; read first, so no read buffer is held when the batch books its rows."""
        # One read for the frame and a skeleton of usual size (an object's read is a
        # round trip); a longer skeleton is read after it.
        guess = min(size, 16 + _SKELETON_GUESS)
        scratch = book(self.account, guess + BYTES_OVERHEAD, "a cached record's skeleton")
        try:
            (prefix,) = self.stream.pread_many([begin], [guess])
            if len(prefix) < 16:
                return None  # a truncated file: the record reader names where
            (skeleton,) = struct.unpack_from("<I", prefix, 12)
            if 16 + skeleton + 4 > size:
                return None  # (the element decoder names what is wrong)
            if 16 + skeleton <= len(prefix):
                tree = prefix[16 : 16 + skeleton]
            else:
                scratch = scratch.absorb(book(self.account, skeleton + BYTES_OVERHEAD,
                                              "a cached record's skeleton"))
                (tree,) = self.stream.pread_many([begin + 16], [skeleton])
        finally:
            scratch.release()
        head = prefix[12:16] + tree
        layout = layout_for(head)
        if layout is None:
            self.columnar = False  # this dataset's elements need objects
            return None
        if 16 + skeleton + layout.data_bytes + 4 != size:
            return None  # (the element decoder names what is wrong)
        return head, layout

    def _run_batch(
        self, first: int, last: int, size: int, head: bytes, layout: Layout,
        out_account: Buffer,
    ) -> tuple[Any, Reservation, int] | None:
        """:meth:`read_batch` through the reused read buffer: the batch's rows are booked
        first, then the buffer is sized from the share that leaves (so the two never
        pass the budget together), and each run is checked before it is copied out."""
        rows = last - first
        booking = out_account.admit(
            layout.output_bytes(rows), together=f"a batch of {rows} elements"
        )
        try:
            outputs = layout.allocate(rows)
            # (the buffer held already counts: the share left beside the rows)
            room = self.account.room() + len(self.run_buffer)
            per_read = max(1, min(self.chunk, room) // size)
            buffer = self._run_buffer(min(per_read, rows) * size)
            view = memoryview(buffer)
            matrix = np.frombuffer(buffer, np.uint8)
            try:
                at = first
                while at < last:
                    step = min(per_read, last - at)
                    start = int(self.offsets[at])
                    nbytes = step * size
                    if self.stream.pread_into(start, view[:nbytes]) < nbytes:
                        booking.release()
                        return None  # a truncated file: the record reader names where
                    if not self._check_run(view[:nbytes], step, size, start, at, head):
                        booking.release()
                        self.columnar = False  # skeletons mixed in runs: one by one now
                        return None
                    records = matrix[:nbytes].reshape(step, size)
                    layout.fill(outputs, at - first, records[:, 12 + len(head) : size - 4])
                    at += step
            finally:
                del view, matrix
        except BaseException:
            booking.release()
            raise
        self._release_pending()  # (a read-ahead of earlier elements, now passed)
        self.next = last
        if last == len(self.offsets):  # the end: the read buffer goes before the reader
            self._drop_run_buffer()
        return layout.build(iter(outputs)), booking, rows

    def _one_size(self) -> int:
        """The framed size every record of the file shares (0 where they differ), found
        once, a slice of the index at a time: a batch then need not compare its
        records' offsets."""
        if self.uniform is None:
            self.uniform = one_size(self.offsets, self.size)
        return self.uniform

    def _scatter_batch(
        self, first: int, last: int, size: int, head: bytes, layout: Layout,
        out_account: Buffer,
    ) -> tuple[Any, Reservation, int] | None:
        """:meth:`read_batch` for large records of a known layout: each record is read
        straight into the batch's rows (its frame and skeleton into a small scratch
        buffer), one ``preadv`` per run, then checked in place (framing, both CRCs over
        the bytes where they landed, the manifest's CRC). The kernel's copy from the page
        cache is the only one: no read buffer, no copy out of it. A record that fails a
        check is read again and checked the usual way, for the usual error."""
        rows = last - first
        prefix = 12 + len(head)
        booking = out_account.admit(
            layout.output_bytes(rows), together=f"a batch of {rows} elements"
        )
        try:
            outputs = layout.allocate(rows)
            targets = [
                out.reshape(rows, -1).view(np.uint8)
                for out, leaf in zip(outputs, layout.leaves, strict=True) if leaf.nbytes
            ]
            scratch = bytearray(rows * (prefix + 4))
            with contextlib.ExitStack() as stack:
                stack.callback(book(self.account, len(scratch), "cached records' frames").release)
                frames = memoryview(scratch)
                per_call = max(1, 1024 // (2 + len(targets)))
                # (slices of one flat view each: a row's array view and its buffer
                # export cost several times a memoryview slice, 96 times a batch)
                flats = [(target.reshape(-1).data, target.shape[1]) for target in targets]
                for at in range(0, rows, per_call):
                    stop = min(rows, at + per_call)
                    pieces: list[memoryview] = []
                    for row in range(at, stop):
                        mark = row * (prefix + 4)
                        pieces.append(frames[mark : mark + prefix])
                        for flat, width in flats:
                            pieces.append(flat[row * width : (row + 1) * width])
                        pieces.append(frames[mark + prefix : mark + prefix + 4])
                    start = int(self.offsets[first + at])
                    wanted = (stop - at) * size
                    if self.stream.pread_scatter(start, pieces) < wanted:
                        booking.release()
                        return None  # a truncated file: the record reader names where
                    footers, wrong = check_scattered(
                        frames[at * (prefix + 4) :], prefix, head, targets, list(range(at, stop))
                    )
                    expected = self.expected
                    if wrong < 0 and expected is not None:
                        differ = footers != expected.crcs[first + at : first + stop]
                        wrong = int(differ.argmax()) if differ.any() else -1
                    if wrong >= 0:
                        self._check_alone(first + at + wrong)  # raises, naming the record
                        booking.release()
                        self.columnar = False  # sound, but another skeleton
                        return None
        except BaseException:
            booking.release()
            raise
        self._release_pending()
        self.next = last
        return layout.build(iter(outputs)), booking, rows

    def _check_alone(self, record: int) -> None:
        """Read record ``record`` alone and check it as :meth:`pull` does (raising the
        error that names the file and its offset)."""
        start = int(self.offsets[record])
        (buffer,) = self.stream.pread_many([start], [self._end(record) - start])
        _check_frame(buffer, start, self.path)
        self._check_entry(buffer, len(buffer), record)

    def _run_buffer(self, nbytes: int) -> bytearray:
        """The reused read buffer, at least ``nbytes`` (its growth booked first)."""
        if len(self.run_buffer) < nbytes:
            self.run_booking = self.run_booking.absorb(
                book(self.account, nbytes - len(self.run_buffer), "cached records read ahead")
            )
            self.run_buffer = bytearray(nbytes)
        return self.run_buffer

    def _check_run(
        self, view: memoryview, rows: int, size: int, start: int, first: int, head: bytes
    ) -> bool:
        """Every record of a run of ``rows`` records of ``size`` bytes read at file offset
        ``start`` checked (see :func:`check_run`) and its CRC compared with the manifest's,
        or an error naming the file and the offset of the first one that is wrong; False
        where every record is sound but one's skeleton is not ``head``."""
        footers = check_run(view, rows, size, start, self.path, head)
        if footers is None:
            return False
        expected = self.expected
        if expected is None:
            return True
        differ = footers != expected.crcs[first : first + rows]
        if differ.any():
            entry = first + int(differ.argmax())
            offset = int(self.offsets[entry])
            raise expected.mismatch(
                self.path, f"record {entry} at offset {offset} is not the one written there",
                offset,
            )
        return True

    def _drop_run_buffer(self) -> None:
        self.run_buffer = bytearray()
        booking, self.run_booking = self.run_booking, NO_RESERVATION
        booking.release()

    def close(self) -> None:
        self._release_pending()
        self._drop_run_buffer()
        self.stream.close()
        self.ahead_booking.release()
        self.ahead_booking = NO_RESERVATION
        self.index_booking.release()


class BlockReader(RecordReader):
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
        expected: Expected | None = None,
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

    def _refill_checked(self) -> bool:
        """:meth:`_refill`; a bad block raises its error once and reading goes on with
        the next block (a block is checked, and lost, whole)."""
        try:
            return self._refill(len(self.offsets))
        except DataLossError:
            block = bisect.bisect_right(self.starts, self.next) - 1
            self._release_pending()
            self.next = self.starts[block + 1]
            raise

    def _refill(self, stop: int) -> bool:
        if self.next >= self.starts[-1]:
            return False
        block = bisect.bisect_right(self.starts, self.next) - 1
        begin = int(self.offsets[block])
        size = self._end(block) - begin
        records, raw_size = self.blocks[block]
        self._release_pending()
        work = size + raw_size + 2 * BYTES_OVERHEAD
        book(self.account, work, "a compressed block read ahead")
        self.pending_booked = work
        (buffer,) = self.stream.pread_many([begin], [size])
        self._read_next_ahead(self.starts[block + 1])
        start, stop = _check_frame(buffer, begin, self.path)
        self._check_entry(buffer, len(buffer), block)
        raw = self.codec.decompress(
            memoryview(buffer)[start:stop], raw_size, path=self.path, offset=begin
        )
        del buffer
        stream = f" of the {self.codec.name} block at offset {begin}, decompressed,"
        if records == 1:  # decoded in place: the element's arrays are views of ``raw``
            bounds = _check_frame(raw, 0, self.path, stream)
            self.pending = [(raw, *bounds, raw_size + BYTES_OVERHEAD)]
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
            self.pending = [(record, 0, len(record), len(record) + BYTES_OVERHEAD) for record in split]
        self._rebook_pending()  # the compressed block is gone: the records' shares stay
        self.pending_first = self.starts[block]
        self.block_offset = begin
        self.next_pending = self.next - self.pending_first
        for dropped in range(self.next_pending):  # before a skipped-to position
            self._hand_on(dropped)
        return True

    def _offset(self, record: int) -> int:
        return self.block_offset  # (the message says the offset counts in the block)

    def _first_range(self, first: int) -> tuple[int, int] | None:
        """The block that holds element ``first``: one read per block."""
        if first >= self.starts[-1]:
            return None
        block = bisect.bisect_right(self.starts, first) - 1
        begin = int(self.offsets[block])
        return begin, self._end(block) - begin

    #: Blocks are decompressed whole: elements are decoded one by one from them.
    columnar_reads = False

    def skip(self, count: int) -> int:
        self._release_pending()
        done = min(count, self.starts[-1] - self.next)
        self.next += done
        return done
