"""TFRecord sources: streamed file by file, or random access through ``.hrx`` indexes.

Streaming (``TFRecordDataset``) reads through the process-wide file pool with
the framing reader of :mod:`headrace.io.tfrecord.reader` (CRC-checked, bounded by
``max_record_bytes``, optionally skipping corrupt records); ``batch`` is
pushed into the reader, so a batch of 1,024 records costs one call.

Indexed (``TFRecordDataset(..., indexed=True)``) loads each shard's record
offsets (building missing indexes, refusing stale ones): the dataset becomes
random-access, so ``shuffle`` and ``global_shuffle`` hold indices instead of
records, ``shard`` reads only its own records and resuming is O(1).
"""

from __future__ import annotations

import bisect
import os
from itertools import accumulate
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, MemoryBudgetError, Origin
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._sources.files import (
    FileRecordsNode,
    OriginLog,
    RecordReader,
    file_limiter,
    filename_list,
    record_cost,
    refused_record,
)
from headrace._structure import TensorSpec
from headrace.core.fingerprint import file_identity
from headrace.core.indexing import RandomAccess
from headrace.core.iterator import Context
from headrace.core.node import Node, SourceNode
from headrace.io import objstore
from headrace.io.columns import lengths, object_array, wire_bytes
from headrace.io.filepool import PooledStream, get_default_pool
from headrace.io.streams import DEFAULT_BUFFER_SIZE
from headrace.io.tfrecord.framing import DEFAULT_MAX_RECORD_BYTES, RECORD_OVERHEAD_BYTES
from headrace.io.tfrecord.reader import TFRecordReader, records_in_spans
from headrace.io.tfrecord_index import (
    StaleIndexError,
    TFRecordIndex,
    build_index,
    index_path_for,
    load_index,
)

__all__ = ["IndexedTFRecordNode", "TFRecordNode", "tfrecord_node"]

#: A random read fetches one record: read ahead a page, not 256 KiB.
_RANDOM_READ_BUFFER = 4096
#: Consecutive records are fetched by one positioned read of at most this many bytes:
#: a streaming reader's buffer, so random access holds no more unbooked bytes than it.
_MAX_RUN_BYTES = DEFAULT_BUFFER_SIZE


class TFRecordNode(FileRecordsNode):
    """``TFRecordDataset`` over one or more files, read one after another."""

    stage = "tfrecord"

    def __init__(
        self,
        filenames: Any,
        compression_type: str | None,
        buffer_size: int | None,
        *,
        verify_crc: bool,
        max_record_bytes: int,
        skip_corrupt: bool,
    ) -> None:
        super().__init__(filenames, compression_type, buffer_size)
        self.verify_crc = verify_crc
        self.max_record_bytes = max_record_bytes
        self.skip_corrupt = skip_corrupt

    def params(self) -> tuple[Any, ...]:
        return (*super().params(), self.verify_crc, self.skip_corrupt)

    def open_reader(self, stream: PooledStream, start: int, buffer_bytes: int) -> RecordReader:
        stream.seek(start)
        return _TFRecordReaderAdapter(
            TFRecordReader(
                stream,
                path=stream.path,
                start_offset=start,
                compression_type=self.compression_type,
                verify_crc=self.verify_crc,
                max_record_bytes=self.max_record_bytes,
                skip_corrupt=self.skip_corrupt,
                buffer_size=buffer_bytes,
            )
        )


#: Records read per call when elements are pulled one at a time (interleave, map), at
#: most: the bytes read ahead are bounded by the room left on the stage's share too.
_READ_AHEAD_RECORDS = 64


class _TFRecordReaderAdapter:
    """The file source's reader protocol over :class:`TFRecordReader`.

    One record at a time is served from a small read-ahead list, so a pipeline
    pulling single records (an interleave, a per-record map) still scans the
    framing in C many records per call. The list is bounded in bytes by the room
    left on the stage's account and booked on it (one booking, one lock, per
    list) before it is held: the first record's length is read from its header
    and checked against the share before its payload is read; the others stop at
    the room left. The booking is returned when the list is used up (an
    over-count of at most one list, which keeps the cap); a served record is the
    next stage's to book, as any element that leaves a buffer.
    """

    def __init__(self, reader: TFRecordReader) -> None:
        self.reader = reader
        self.ahead: list[bytes] = []
        self.served = 0
        self.booking = NO_RESERVATION
        #: Offset of ``ahead[0]``, and the offsets of all of ``ahead`` once asked for
        #: (an element failed downstream, or a parallel map probes origins).
        self.ahead_offset = 0
        self.offsets: list[int] | None = None
        self.skipped_any = False  # corrupt records skipped (skip_corrupt=True) in the file
        #: Set by the file source once origins are tracked: each list read ahead is logged.
        self.log: OriginLog | None = None
        self.log_serial = 0  # the source's serial of this reader's first record
        self.read_count = 0  # records read ahead (all served: lists are served in order)

    def attach_log(self, log: OriginLog, serial: int) -> None:
        """Log from the next record served on: the rest of the list read ahead first."""
        self.log, self.log_serial, self.read_count = log, serial, 0
        rest = self.ahead[self.served :]
        if rest:
            offset = self.ahead_offset
            if offset >= 0:
                offset += sum(map(len, self.ahead[: self.served])) + (
                    RECORD_OVERHEAD_BYTES * self.served)
            log.span(serial, offset, lengths(rest), RECORD_OVERHEAD_BYTES)
            self.read_count = len(rest)

    def read_reserved(self, account: Buffer) -> tuple[bytes, Reservation] | None:
        if self.served == len(self.ahead):
            self._read_ahead(account)
            if not self.ahead:
                return None
        record = self.ahead[self.served]
        self.served += 1
        return record, NO_RESERVATION

    def _read_ahead(self, account: Buffer) -> None:
        self.release()
        reader = self.reader
        length = reader.next_length()
        if length is not None:  # refused from its header, before its payload is read
            try:
                account.expect(record_cost(length), what="one record")
            except MemoryBudgetError as error:
                raise refused_record(error, "record", reader.path or "<stream>",
                                     reader.next_offset, f"has {length} bytes",
                                     reader.compression_type) from None
        # One record always (held beside others only when readers share the account:
        # a zip of a dataset with itself); more only within the room left.
        room = account.room() - _READ_AHEAD_RECORDS * record_cost(0)
        self.ahead_offset = self.reader.next_offset
        skipped = self.reader.skipped_records
        records = self.reader.read_batch(_READ_AHEAD_RECORDS, max(room, 0))
        if self.reader.skipped_records != skipped:
            self.skipped_any = True
        if self.skipped_any:  # record indexes and offsets after a skip: unknown
            self.ahead_offset = -1
        if self.log is not None and records:
            self.log.span(self.log_serial + self.read_count, self.ahead_offset,
                          lengths(records), RECORD_OVERHEAD_BYTES)
            self.read_count += len(records)
        if records:
            nbytes = wire_bytes(records) + record_cost(0) * len(records)
            self.booking = account.admit(nbytes, elements=len(records))
        self.ahead = records

    def last_offset(self) -> int | None:
        """The offset of the record served last (one pass over the read-ahead list's
        lengths, once per list: a parallel map asks this for every record)."""
        offsets = self.offsets
        if offsets is None:
            if not self.served or self.ahead_offset < 0:
                return None
            sizes = [len(record) + RECORD_OVERHEAD_BYTES for record in self.ahead]
            offsets = self.offsets = list(accumulate(sizes, initial=self.ahead_offset))
        return offsets[self.served - 1]

    def watch(self, expect: Any) -> None:
        """Nothing to watch: a record's length is read from its header first."""

    def read_batch(self, max_records: int, max_bytes: int) -> list[bytes]:
        if self.served < len(self.ahead):  # what was read ahead first (the caller books it)
            records = self.ahead[self.served : self.served + max_records]
            self.served += len(records)
            return records
        self.release()
        if self.log is None:
            return self.reader.read_batch(max_records, max_bytes)
        offset, skipped = self.reader.next_offset, self.reader.skipped_records
        records = self.reader.read_batch(max_records, max_bytes)
        if self.reader.skipped_records != skipped:
            self.skipped_any = True
        if records:  # a batch's rows: where each came from
            self.log.span(self.log_serial + self.read_count, -1 if self.skipped_any else offset,
                          lengths(records), RECORD_OVERHEAD_BYTES)
            self.read_count += len(records)
        return records

    def next_length(self) -> int | None:
        if self.served < len(self.ahead):
            return None  # read_batch serves what was read ahead first
        return self.reader.next_length()

    def release(self) -> None:
        """Drop what was read ahead and give its booking back."""
        self.booking.release()
        self.booking = NO_RESERVATION
        self.ahead, self.served, self.offsets = [], 0, None

    close = release

    @property
    def next_offset(self) -> int:
        """The offset of the next record *served*: read-ahead records are framed after it."""
        unserved = self.ahead[self.served :]
        return self.reader.next_offset - sum(len(r) for r in unserved) - (
            RECORD_OVERHEAD_BYTES * len(unserved)
        )

    @property
    def skipped(self) -> tuple[int, int]:
        """Corrupt records skipped (``skip_corrupt=True``) and their bytes."""
        return self.reader.skipped_records, self.reader.skipped_bytes


def _split_runs(
    begins: np.ndarray[Any, Any],
    ends: np.ndarray[Any, Any],
    firsts: np.ndarray[Any, Any],
    lasts: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Cut runs of consecutive records into reads of at most ``_MAX_RUN_BYTES`` (a record
    larger than that is read alone)."""
    starts: list[int] = []
    sizes: list[int] = []
    counts: list[int] = []
    for first, last in zip(firsts.tolist(), lasts.tolist(), strict=True):
        while first <= last:
            end = first + 1
            while end <= last and ends[end] - begins[first] <= _MAX_RUN_BYTES:
                end += 1
            starts.append(int(begins[first]))
            sizes.append(int(ends[end - 1] - begins[first]))
            counts.append(end - first)
            first = end
    return np.array(starts), np.array(sizes), np.array(counts)


class _IndexedAccess(RandomAccess):
    """Record ``i`` of a list of indexed shards: one offset lookup, one positioned read."""

    def __init__(self, node: IndexedTFRecordNode) -> None:
        self.node = node
        # Loaded on first use (a plan is made more often than it is read), checked again
        # against the shard then; each costs 8 bytes a record and holds no descriptor.
        self.loaded: dict[int, TFRecordIndex] = {}
        self.starts = np.cumsum([0, *node.counts]).tolist()
        self.streams: dict[int, PooledStream] = {}
        self.ctx: Context | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def prepare(self, ctx: Context) -> None:
        self.ctx = ctx

    def _index(self, shard: int) -> TFRecordIndex:
        index = self.loaded.get(shard)
        if index is None:
            name = self.node.filenames[shard]
            known = self.node.known.get(name)
            if known is not None:
                self.loaded[shard] = known
                return known
            limiter = file_limiter(self.ctx) if self.ctx is not None else None
            index = self.loaded[shard] = load_index(name, limiter=limiter)
            if len(index) != self.node.counts[shard]:
                raise StaleIndexError(
                    f"index of {name} now lists {len(index)} records, "
                    f"{self.node.counts[shard]} when the dataset was built",
                    path=name,
                )
        return index

    def _stream(self, shard: int) -> PooledStream:
        stream = self.streams.get(shard)
        if stream is None:
            stream = get_default_pool().open(
                self.node.filenames[shard],
                limiter=file_limiter(self.ctx) if self.ctx is not None else None,
                buffer_size=_RANDOM_READ_BUFFER,
            )
            self.streams[shard] = stream
        return stream

    def get(self, index: int) -> Any:
        """One record: one positioned read (``get_many``'s grouping would cost more)."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        index_file, local = self._index(shard), index - self.starts[shard]
        offset = int(index_file.offsets[local])
        size = index_file.payload_length(local) + RECORD_OVERHEAD_BYTES
        (record,) = records_in_spans(
            self._stream(shard).pread_many([offset], [size]),
            [1],
            [offset],
            path=self.node.filenames[shard],
            verify_crc=self.node.verify_crc,
            max_record_bytes=self.node.max_record_bytes,
        )
        return record

    def origin(self, index: int) -> Origin | None:
        if not 0 <= index < len(self):
            return None
        shard = bisect.bisect_right(self.starts, index) - 1
        local = index - self.starts[shard]
        offset = int(self._index(shard).offsets[local])
        return Origin(self.node.filenames[shard], local, offset)

    def get_many(self, indices: range | np.ndarray[Any, Any]) -> Any:
        """Records at these indices, in this order: per shard front to back, consecutive
        records in one positioned read, all of a shard's reads under one descriptor
        check-out."""
        wanted = np.asarray(indices, dtype=np.int64)
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= len(self)):
            bad = wanted[(wanted < 0) | (wanted >= len(self))][0]
            raise IndexError(f"record {bad} of {len(self)}")
        unique, inverse = np.unique(wanted, return_inverse=True)  # sorted
        shards = np.searchsorted(self.starts, unique, side="right") - 1
        records: list[bytes] = []
        for shard in np.unique(shards).tolist():
            records += self._read_shard(shard, unique[shards == shard] - self.starts[shard])
        return object_array(records)[inverse.reshape(-1)]

    def _read_shard(self, shard: int, local: np.ndarray[Any, Any]) -> list[bytes]:
        """Records ``local`` (sorted, distinct) of one shard."""
        index = self._index(shard)
        offsets, following = index.offsets, local + 1
        begins = offsets[local].astype(np.int64)
        ends = np.where(
            following < len(offsets),
            offsets[np.minimum(following, len(offsets) - 1)].astype(np.int64),
            index.shard_size,
        )
        # runs of consecutive records, each fetched by one read
        firsts = np.flatnonzero(np.concatenate([[True], np.diff(local) != 1]))
        lasts = np.append(firsts[1:], len(local)) - 1
        starts, sizes = begins[firsts], ends[lasts] - begins[firsts]
        counts = lasts - firsts + 1
        if (sizes > _MAX_RUN_BYTES).any():  # split long runs (rare: big, consecutive records)
            starts, sizes, counts = _split_runs(begins, ends, firsts, lasts)
        start_list = starts.tolist()
        return records_in_spans(
            self._stream(shard).pread_many(start_list, sizes.tolist()),
            counts.tolist(),
            start_list,
            path=self.node.filenames[shard],
            verify_crc=self.node.verify_crc,
            max_record_bytes=self.node.max_record_bytes,
        )

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()


class IndexedTFRecordNode(SourceNode):
    """Uncompressed TFRecord shards with ``.hrx`` indexes, as a random-access dataset."""

    stage = "tfrecord_indexed"

    def read_files(self) -> list[str] | None:
        return self.filenames

    def with_files(self, files: list[str]) -> Node:
        """The same reader over ``files`` only (their indexes must already exist)."""
        return IndexedTFRecordNode(
            files,
            build_missing=False,
            verify_crc=self.verify_crc,
            max_record_bytes=self.max_record_bytes,
            known={name: self.known[name] for name in files if name in self.known},
        )

    def __init__(
        self,
        filenames: Any,
        *,
        build_missing: bool,
        verify_crc: bool,
        max_record_bytes: int,
        known: dict[str, TFRecordIndex] | None = None,
    ) -> None:
        super().__init__()
        self.filenames = filename_list(filenames)
        self.verify_crc = verify_crc
        self.max_record_bytes = max_record_bytes
        #: Indexes the caller already has, by file: used instead of loading the ``.hrx``
        #: (a saved dataset whose records all have one size computes its offsets, so
        #: reading it holds no 8 bytes a record).
        self.known = dict(known or {})
        # Check (and build) indexes now: a stale one is an error at build time.
        self.counts = [
            len(self.known[name]) if name in self.known else len(_index_for(name, build_missing))
            for name in self.filenames
        ]

    def params(self) -> tuple[Any, ...]:
        return (tuple(self.filenames), tuple(self.counts), self.verify_crc)

    def content(self) -> tuple[Any, ...]:
        return tuple(file_identity(name) for name in self.filenames)

    @property
    def element_spec(self) -> Any:
        return TensorSpec((), bytes)

    def cardinality(self) -> int:
        return sum(self.counts)

    def random_access(self) -> RandomAccess:
        return _IndexedAccess(self)


def _index_for(name: str, build_missing: bool) -> TFRecordIndex:
    """A shard's index: built when missing (if allowed), refused when stale."""
    if build_missing and objstore.is_remote(name):
        # an object's index cannot be built in place: it is uploaded with its shard
        # (save_tfrecords does), or built locally first
        return load_index(name)
    if build_missing and not os.path.exists(index_path_for(name)):
        return build_index(name)
    return load_index(name)


def tfrecord_node(
    filenames: Any,
    compression_type: str | None,
    buffer_size: int | None,
    *,
    indexed: bool,
    build_missing_indexes: bool,
    verify_crc: bool,
    max_record_bytes: int | None,
    skip_corrupt: bool,
) -> Node:
    """The node behind ``TFRecordDataset`` for one set of arguments (checked here)."""
    limit = DEFAULT_MAX_RECORD_BYTES if max_record_bytes is None else max_record_bytes
    if indexed:
        if compression_type not in (None, ""):
            raise InvalidArgumentError(
                "TFRecordDataset: indexed=True needs uncompressed files (a compressed "
                "stream cannot seek to a record)"
            )
        if skip_corrupt:
            raise InvalidArgumentError("TFRecordDataset: skip_corrupt needs indexed=False")
        return IndexedTFRecordNode(
            filenames,
            build_missing=build_missing_indexes,
            verify_crc=verify_crc,
            max_record_bytes=limit,
        )
    return TFRecordNode(
        filenames,
        compression_type,
        buffer_size,
        verify_crc=verify_crc,
        max_record_bytes=limit,
        skip_corrupt=skip_corrupt,
    )
