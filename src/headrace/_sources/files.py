"""File sources: records read file after file through the process-wide file pool.

Every descriptor comes from :mod:`headrace.io.filepool`, which caps open files
per process (and per pipeline with ``Options(max_open_files=...)``): a reader
that loses its descriptor to another resumes at its byte offset, so a
pipeline over 10,000 shards never sees "Too many open files". Suspended
compressed streams keep their decompressor state, booked on the budget.

The state of a file source is (file index, byte offset of the next record) —
for compressed files the offset counts decompressed bytes, and restoring
decompresses up to it (a compressed stream cannot seek).
"""

from __future__ import annotations

import bisect
import copy
import glob
import os
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from headrace._errors import (
    InvalidArgumentError,
    MemoryBudgetError,
    Origin,
    RecordTooLargeError,
    add_note,
)
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES
from headrace._structure import TensorSpec
from headrace.core.fingerprint import file_identity
from headrace.core.iterator import BatchToken, Context, Iterator
from headrace.core.node import UNKNOWN, Node, SourceNode
from headrace.core.state import StateReader
from headrace.io import objstore
from headrace.io.columns import object_array, wire_bytes
from headrace.io.filepool import (
    FileLimiter,
    FilePool,
    PooledStream,
    file_at_fault,
    get_default_pool,
)
from headrace.io.streams import DEFAULT_BUFFER_SIZE, normalize_compression_type

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "FileRecordsNode",
    "OriginLog",
    "RecordReader",
    "TextLineReader",
    "file_limiter",
    "list_files",
    "record_cost",
    "refused_record",
]



#: What a ``bytes`` record costs besides its payload (33 B on CPython 3.11).
_BYTES_HEADER = sys.getsizeof(b"")
#: Longest text line read by default: long enough for any sane line (a JSON document
#: per line included), short enough that a file without newlines (a binary file, a
#: one-line dump) fails fast instead of filling memory. It also bounds what a reader
#: holds before a line can be booked, within G1's measured slack of 64 MiB.
DEFAULT_MAX_LINE_BYTES = 64 << 20


def record_cost(payload_bytes: int) -> int:
    """What a record of ``payload_bytes`` costs the budget once read (a ``bytes`` object)."""
    return payload_bytes + _BYTES_HEADER


def refused_record(
    error: MemoryBudgetError, kind: str, path: str, offset: int, size: str,
    compression: str = "",
) -> MemoryBudgetError:
    """``error`` (a record that cannot fit its stage's share) with where the record is.

    ``kind`` names the record ("line"), ``size`` what is known of its size ("has at
    least 5000000 bytes"). Readers raise this before they read the record whole."""
    counted = f" (counting decompressed bytes of the {compression} stream)" if compression else ""
    refused = MemoryBudgetError(
        f"{kind} at offset {offset}{counted} in file {path} {size}: it cannot fit the "
        f"memory budget, so it was not read further. {error}"
    )
    refused.stage = error.stage
    return refused


class RecordReader(Protocol):
    """Reads records from one decompressed byte stream; knows the next record's offset.

    What a reader holds for its caller (records read ahead) is booked on the stage's
    account (``account``) before it is held; what it holds for itself (its read buffer)
    is bounded by its buffer size and the largest record it may return.

    ``log`` (None until the source tracks origins) is where the reader notes the
    offsets of the records it reads (:meth:`OriginLog.span`), numbering them from
    ``log_serial``.
    """

    log: OriginLog | None
    log_serial: int

    def attach_log(self, log: OriginLog, serial: int) -> None:
        """Log from the next record served on, numbered ``serial`` (origins asked for
        while the file was open: an interleave's slot that starts reading ahead)."""

    def read_reserved(self, account: Buffer) -> tuple[bytes, Reservation] | None:
        """The next record and its booking on ``account`` (none when the reader keeps
        the booking of what it read ahead), or None at the end of the file."""

    def watch(self, expect: Callable[[int], None]) -> None:
        """Call ``expect`` with what a record being gathered would cost so far, when
        its length is not known before it is read: it raises
        :class:`MemoryBudgetError` once the record cannot fit, and reading stops."""

    def read_batch(self, max_records: int, max_bytes: int) -> list[bytes]:
        """Up to ``max_records`` records; an empty list at the end of the file.

        Their payloads total at most ``max_bytes``, except that one record is always
        returned, however large (up to the reader's own limit).
        """

    def next_length(self) -> int | None:
        """The payload length of the next record when known before reading it, else None."""

    def close(self) -> None:
        """Drop (and give back the booking of) whatever the reader holds; the caller
        closes the stream."""

    @property
    def next_offset(self) -> int:
        """Byte offset (in the decompressed stream) of the next unread record."""

    def last_offset(self) -> int | None:
        """Byte offset of the record :meth:`read_reserved` returned last (None before
        any): asked when an element fails downstream, to name where it came from."""


def _without_cr(line: bytes) -> bytes:
    """``line`` with every carriage return dropped, as TensorFlow's ``ReadLine`` does."""
    return line.replace(b"\r", b"") if b"\r" in line else line


class TextLineReader:
    """Lines of a byte stream as tf.data's TextLineDataset splits them.

    Split on ``\\n``; every ``\\r`` is dropped (TensorFlow's line reader keeps no
    carriage return, lone ones inside a line included); a final line without a
    newline is still a line unless nothing but ``\\r`` is left of it; a trailing
    ``\\n`` does not add an empty one.

    A line longer than ``max_line_bytes`` (its bytes before the ``\\n``) raises
    :class:`RecordTooLargeError` naming the file and the line's byte offset, once
    that many bytes were seen without a newline: memory stays bounded. The lines
    before it are delivered first (a batch stops short of the bad line), and
    ``next_offset`` stays at the bad line. Time is linear in the line's length:
    a long line is gathered as a list of chunks and joined once.

    A line that cannot fit its stage's share of the budget is refused as it is
    gathered (see :meth:`watch`): :class:`MemoryBudgetError` names the file and
    the line's offset once about a share's worth of it was read, not the whole.
    """

    def __init__(
        self,
        stream: PooledStream,
        start: int,
        buffer_bytes: int,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        self.stream = stream
        self.buffer_bytes = buffer_bytes
        self.max_line_bytes = max_line_bytes
        stream.seek(start)
        self._offset = start
        self._last_offset: int | None = None
        #: Set by the file source once origins are tracked: each line read is logged.
        self.log: OriginLog | None = None
        self.log_serial = 0  # the source's serial of this reader's first line
        self.lines = 0
        self._buffer = b""
        self._position = 0
        self._eof = False
        self._error: RecordTooLargeError | MemoryBudgetError | None = None
        self._expect: Callable[[int], None] | None = None
        self._gathered: list[bytes] | None = None  # the lines of a batch read so far

    @property
    def next_offset(self) -> int:
        return self._offset

    def next_length(self) -> int | None:
        return None  # a line's length is known only once its newline is found

    def last_offset(self) -> int | None:
        return self._last_offset

    def close(self) -> None:
        self._buffer, self._position = b"", 0

    def attach_log(self, log: OriginLog, serial: int) -> None:
        self.log, self.log_serial, self.lines = log, serial, 0

    def watch(self, expect: Callable[[int], None]) -> None:
        self._expect = expect

    def read_reserved(self, account: Buffer) -> tuple[bytes, Reservation] | None:
        """The next line; one longer than the read buffer (gathered from several reads:
        memory the buffer's bound does not cover) is booked on ``account``."""
        self._last_offset = offset = self._offset
        line = self.read_record()
        if line is None:
            return None
        if self.log is not None:
            self.log.span(self.log_serial + self.lines, offset, None, 0)
            self.lines += 1
        if len(line) < self.buffer_bytes:
            return line, NO_RESERVATION
        return line, account.admit(record_cost(len(line)))

    def read_batch(self, max_records: int, max_bytes: int = 1 << 62) -> list[bytes]:
        lines: list[bytes] = []
        total = 0
        log = self.log
        self._gathered = lines  # held beside a long line being gathered (see _check_room)
        try:
            while len(lines) < max_records and (not lines or total < max_bytes):
                offset = self._offset
                try:
                    line = self.read_record()
                except (RecordTooLargeError, MemoryBudgetError):
                    if lines:
                        break  # deliver the lines before the bad one; it raises again next call
                    raise
                if line is None:
                    break
                lines.append(line)
                total += len(line)
                if log is not None:  # (a batch's rows: their origins)
                    log.span(self.log_serial + self.lines, offset, None, 0)
                    self.lines += 1
        finally:
            self._gathered = None
        return lines

    def read_record(self) -> bytes | None:
        if self._error is not None:
            raise self._error
        newline = self._buffer.find(b"\n", self._position)
        if newline < 0:
            return self._read_spanning_line()
        length = newline - self._position
        if length > self.max_line_bytes:
            raise self._too_long(length)
        line = self._buffer[self._position : newline]
        self._offset += length + 1
        self._position = newline + 1
        return _without_cr(line)

    def _read_spanning_line(self) -> bytes | None:
        """A line that does not end inside the buffer: gather chunks until its newline."""
        pieces = [self._buffer[self._position :]]
        length = len(pieces[0])
        self._buffer, self._position = b"", 0
        while True:
            if length > self.max_line_bytes:
                raise self._too_long(length)  # kept: every later call raises it again
            if length >= self.buffer_bytes and self._expect is not None:
                self._check_room(length)
            chunk = b"" if self._eof else self.stream.read(self.buffer_bytes)
            if not chunk:
                self._eof = True
                if not length:
                    return None
                line = _without_cr(b"".join(pieces))
                self._offset += length
                return line or None  # only carriage returns after the last newline
            newline = chunk.find(b"\n")
            if newline < 0:
                pieces.append(chunk)
                length += len(chunk)
                continue
            length += newline
            if length > self.max_line_bytes:
                raise self._too_long(length)
            pieces.append(chunk[:newline])
            self._buffer, self._position = chunk, newline + 1
            line = b"".join(pieces)
            self._offset += length + 1
            return _without_cr(line)

    def _check_room(self, length: int) -> None:
        """Refuse the line being gathered once its ``length`` bytes cannot fit the share.

        Kept as the reader's error: the stream is inside the line, so every later
        call raises it again rather than hand out the line's tail as a line."""
        assert self._expect is not None
        try:
            gathered = self._gathered or ()
            self._expect(sum(map(record_cost, map(len, gathered))) + record_cost(length))
        except MemoryBudgetError as error:
            self._error = refused_record(
                error, "line", self.stream.path, self._offset,
                f"has at least {length} bytes before its newline", self.stream.compression_type)
            raise self._error from None

    def _too_long(self, length: int) -> RecordTooLargeError:
        path = self.stream.path
        compression = self.stream.compression_type
        counted = f" (counting decompressed bytes of the {compression} stream)" if compression else ""
        self._error = RecordTooLargeError(
            f"line at offset {self._offset}{counted} in file {path} is longer than "
            f"max_line_bytes={self.max_line_bytes} (at least {length} bytes without a "
            "newline); pass TextLineDataset(..., max_line_bytes=...) to read longer lines",
            path=path,
            offset=self._offset,
        )
        return self._error


class BudgetCharge:
    """Lets the file pool book suspended decompressor state on a stage's budget share."""

    def __init__(self, account: Buffer) -> None:
        self.account = account

    def charge(self, nbytes: int) -> None:
        self.account.admit(nbytes)

    def discharge(self, nbytes: int) -> None:
        self.account.release(nbytes)


def file_limiter(ctx: Context) -> FileLimiter | None:
    """The pipeline's own cap on descriptors (``Options.max_open_files``), shared by its readers."""
    run = ctx.run
    if run.file_limiter is None:  # (a served run is given its producer's shared one)
        if ctx.options.max_open_files is None:
            return None
        run.file_limiter = get_default_pool().limiter(ctx.options.max_open_files)
    return run.file_limiter


def filename_list(filenames: Any) -> list[str]:
    if isinstance(filenames, (str, bytes, os.PathLike)):
        filenames = [filenames]
    if isinstance(filenames, np.ndarray):
        filenames = filenames.tolist()
    try:
        names = [os.fsdecode(name) for name in filenames]
    except TypeError:
        raise InvalidArgumentError(
            f"filenames must be a path or a sequence of paths, got {filenames!r:.100}"
        ) from None
    if not names:
        raise InvalidArgumentError("filenames must not be empty")
    return names


class FileRecordsNode(SourceNode):
    """Records of each file in turn (a streaming source). Subclasses pick the reader."""

    stage = "files"
    record_spec: TensorSpec = TensorSpec((), bytes)
    shared_capabilities = ("cardinality",)  # (and SourceNode's)

    def read_files(self) -> list[str] | None:
        return self.filenames

    def with_files(self, files: list[str]) -> Node:
        clone = copy.copy(self)
        clone.__dict__.pop("_fingerprint", None)
        clone.filenames = files
        return clone

    def __init__(
        self, filenames: Any, compression_type: str | None, buffer_size: int | None
    ) -> None:
        super().__init__()
        self.filenames = filename_list(filenames)
        try:
            self.compression_type = normalize_compression_type(compression_type)
        except ValueError as error:
            raise InvalidArgumentError(str(error)) from None
        if buffer_size is not None and (
            isinstance(buffer_size, bool)
            or not isinstance(buffer_size, (int, np.integer))
            or buffer_size < 0
        ):
            raise InvalidArgumentError(
                f"buffer_size must be an int >= 0 (0 or None: the default), got {buffer_size!r}"
            )
        # tf.data reads 0 as "no read buffer"; the size of headrace's read buffer changes
        # no byte of the output, so 0 means the default here.
        # An object store's read is a round trip: the default reads 8 MiB per request
        # there (booked on the stage's budget while the object is open, see _open).
        remote = any(objstore.is_remote(name) for name in self.filenames)
        self.buffer_bytes = int(
            buffer_size or (objstore.REMOTE_BUFFER_SIZE if remote else DEFAULT_BUFFER_SIZE)
        )
        self.buffer_chosen = bool(buffer_size)  # (else the default fits the stage's share)

    def object_buffer(self, share: int, ranges: int) -> int:
        """The read size for an object, on a stage of ``share`` bytes that holds
        ``ranges`` such buffers while it is open: the user's ``buffer_size`` as given,
        else a default that fits the share (:func:`~headrace.io.objstore.fitting_buffer`)."""
        if self.buffer_chosen:
            return self.buffer_bytes
        return objstore.fitting_buffer(share, ranges)

    def params(self) -> tuple[Any, ...]:
        return (tuple(self.filenames), self.compression_type)

    def content(self) -> tuple[Any, ...]:
        return tuple(file_identity(name) for name in self.filenames)

    @property
    def element_spec(self) -> Any:
        return self.record_spec

    def cardinality(self) -> int:
        return UNKNOWN

    def open_reader(self, stream: PooledStream, start: int, buffer_bytes: int) -> RecordReader:
        raise NotImplementedError

    def make_iterator(self, ctx: Context) -> Iterator:
        account = ctx.account(self, f"{self.stage} (read-ahead)")
        return _FileRecordsIterator(self, ctx, account)

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator:
        """``batch`` pushed into the reader: many records per call, no per-record Python.

        The batch is booked on ``account`` (the batch stage's) as it is read, each
        record before its payload is read where its length is known (TFRecord).
        """
        return _RecordBatches(self.make_iterator(ctx), batch_size, drop_remainder, account)


class _RecordBatches(Iterator):
    stage = "batch"

    def __init__(
        self, inner: Iterator, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> None:
        super().__init__(inner)
        assert isinstance(inner, _FileRecordsIterator)
        self.records = inner
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self.account = account
        self.last = range(0)  # the source's tokens of the records of the last batch

    def origin(self) -> Origin | None:
        return self.origin_of(self.origin_token())

    def origin_token(self) -> BatchToken:
        return BatchToken(self.records.origin_of, self.last)

    def origin_of(self, token: Any) -> Origin | None:
        return token.origin() if isinstance(token, BatchToken) else None

    def track_origins(self, tokens: bool = True) -> bool:
        return self.records.track_origins(True)  # a batch's rows: the log says where

    def pull(self) -> tuple[Any, Reservation]:
        served = self.records.served
        records, booked = self.records.read_many(self.batch_size, self.account)
        self.last = range(served + 1, self.records.served + 1)  # (tokens count from 1)
        if not records or (self.drop_remainder and len(records) < self.batch_size):
            booked.release()
            raise StopIteration
        try:
            array_cost = ARRAY_HEADER_BYTES + 8 * len(records)  # the object array's pointers
            booked = booked.absorb(self.account.admit(array_cost, together="one batch of records"))
        except BaseException:
            booked.release()
            raise
        return object_array(records), booked

    def get_state(self) -> dict[str, Any]:
        return {"records": self.records.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.records.set_state(StateReader(state, "batch").child("records"))


#: Spans an :class:`OriginLog` keeps (a read-ahead list of up to 64 records, a line, or
#: a whole batch read at once), and records they may cover together (a batch's lengths
#: are kept as 8 bytes each: 2 MiB at most in all), counted back from the newest: records
#: further back have no offset, only a file and a record index.
_SPANS_KEPT = 4096
_RECORDS_KEPT = 1 << 18


class OriginLog:
    """Where the records a file source served came from, kept once a stage above holds
    origin tokens (a shuffle, a parallel map): records are numbered by ``serial`` (how
    many the source served before them), and the log maps a serial to its file, its
    index in the file and its byte offset.

    ``files``: (first serial, file index, index of its first record or -1 if unknown),
    one entry per opening. ``spans``: (first serial, byte offset of that record (-1:
    unknown), payload lengths of the following records (an int64 view, see
    :func:`headrace.io.columns.lengths`) or None for one record, framing bytes around
    each), one per read-ahead list or batch read (TFRecord) or per line (text), the last
    :data:`_SPANS_KEPT` of them covering no more than :data:`_RECORDS_KEPT` records. A
    reader appends spans through :meth:`span` as it reads.
    """

    def __init__(self) -> None:
        self.files: list[tuple[int, int, int]] = []
        self.spans: deque[tuple[int, int, Sequence[int] | None, int]] = deque()
        self.records = 0  # how many the spans cover

    def opened(self, serial: int, file_index: int, first_record: int) -> None:
        if self.files and self.files[-1][0] == serial:
            self.files.pop()  # nothing was served from the previous opening
        self.files.append((serial, file_index, first_record))

    def span(self, serial: int, offset: int, lengths: Sequence[int] | None, framing: int) -> None:
        spans = self.spans
        spans.append((serial, offset, lengths, framing))
        self.records += 1 if lengths is None else len(lengths)
        while len(spans) > 1 and (self.records > _RECORDS_KEPT or len(spans) > _SPANS_KEPT):
            dropped = spans.popleft()[2]
            self.records -= 1 if dropped is None else len(dropped)

    def find(self, serial: int) -> tuple[int, int, int] | None:
        """(file index, record index, byte offset) of record ``serial``, where known.

        Asked on failure only, maybe while a read-ahead thread (a prefetch above the
        source) appends: both are copied first (in C, under the GIL), since a deque
        mutated while Python code iterates it raises."""
        files, spans = list(self.files), tuple(self.spans)
        at = bisect.bisect_right(files, serial, key=lambda entry: entry[0]) - 1
        if at < 0:
            return None
        first_serial, file_index, first_record = files[at]
        if first_record < 0:
            return None
        # the last span starting at or before it (spans are appended in serial order)
        at = bisect.bisect_right(spans, serial, key=lambda entry: entry[0]) - 1
        if at < 0:
            return None
        start, offset, lengths, framing = spans[at]
        position = serial - start
        if offset < 0 or (lengths is None and position) or (
            lengths is not None and position >= len(lengths)
        ):
            return None
        if lengths is not None:
            offset += sum(lengths[:position]) + framing * position
        return file_index, first_record + serial - first_serial, offset


class _FileRecordsIterator(Iterator):
    def __init__(self, node: FileRecordsNode, ctx: Context, account: Buffer) -> None:
        super().__init__()
        self.node, self.ctx, self.account = node, ctx, account
        self.stage = node.stage
        self.pool: FilePool = get_default_pool()
        self.file_index = 0
        self.start_offset = 0
        #: Index in its file of the next record served; unknown (``record_known``) after
        #: restoring a state saved before states carried it: no origin is named then.
        self.served = 0  # records served by this iterator: the origin tokens
        #: The file's records are counted from ``served`` as it was when the file was
        #: started (or restored at record ``first_record``): one counter per record.
        #: Unknown (``record_known``) after restoring a state saved before states
        #: carried the record index: no origin is named then.
        self.first_record, self.first_serial = 0, 0
        self.record_known = True
        self.log: OriginLog | None = None  # kept once a stage above asks for tokens
        self.stream: PooledStream | None = None
        self.reader: RecordReader | None = None
        #: Set while :meth:`read_many` reads a batch: its stage, and what it assembles.
        self._batch: tuple[Buffer, str] | None = None
        #: The read buffer of the object being read, booked while it is open, and kept
        #: from its close to the next object's open while that one is read ahead.
        self.remote_booking: Reservation | None = None
        #: The next object, read ahead while this one is on its last range (its first
        #: range and metadata), in the range read-ahead this one no longer needs.
        self.successor: objstore.Successor | None = None

    def _expect(self, nbytes: int) -> None:
        """Whether a record being gathered (``nbytes`` so far) can still fit: alone on the
        read-ahead share, or with the rows of the batch :meth:`read_many` assembles."""
        if self._batch is None:
            self.account.expect(nbytes, what="one record")
        else:
            self._batch[0].expect(nbytes, together=self._batch[1])

    def _open(self) -> RecordReader:
        node = self.node
        name = node.filenames[self.file_index]
        size = node.buffer_bytes
        if objstore.is_remote(name):
            # the reader's buffer of an object is large (up to 8 MiB), and the next
            # range is read ahead: booked as the stage's bytes while the object is
            # open, refused by name if they cannot fit
            ranges = objstore.READ_AHEAD_RANGES
            if self.remote_booking is None:
                size = node.object_buffer(self.account.share(), ranges)
                self.remote_booking = self.account.admit(
                    size * ranges, together=f"the read buffer and read-ahead of {name}",
                    elements=0,
                )
            else:  # (reopened, or read ahead: the size it was booked at)
                size = self.remote_booking.nbytes // ranges
        successor = self.successor
        if successor is not None and successor.url != name:  # (not this one's: never
            successor = None  # so by construction; dropped with the booking, below)
        if successor is None and self.remote_booking is not None and self.start_offset == 0:
            first = objstore.first_range_size(node.compression_type, size)
            if first <= size:  # opened at its start: its first range and its metadata in
                # one GET, not a HEAD then a GET (an interleave's slots open this way)
                successor = objstore.Successor(name, first, None, None, ahead=False)
        try:
            self.stream = self.pool.open(
                name,
                node.compression_type,
                limiter=file_limiter(self.ctx),
                memory_account=BudgetCharge(self.account),
                buffer_size=size,
                successor=successor,
                on_last_range=self._read_next_ahead if self.remote_booking else None,
            )
        finally:
            if successor is not None and successor.claimed:
                self.successor = None  # (its bytes are the stream's now)
        self.reader = reader = node.open_reader(self.stream, self.start_offset, size)
        reader.watch(self._expect)
        if self.log is not None:
            self.log.opened(self.served, self.file_index, self.record if self.record_known else -1)
            reader.log, reader.log_serial = self.log, self.served
        return reader

    def _read_next_ahead(self) -> None:
        """The object being read is on its last range: read the next one's first range
        and metadata in the background, in the range read-ahead this one no longer
        needs (its booking is kept until the next is opened or dropped: G1), on a slot
        of the file pool (G2)."""
        node = self.node
        following = self.file_index + 1
        booking = self.remote_booking
        if self.successor is not None or booking is None or following >= len(node.filenames):
            return
        name = node.filenames[following]
        size = booking.nbytes // objstore.READ_AHEAD_RANGES
        first = objstore.first_range_size(node.compression_type, size)
        if not objstore.is_remote(name) or first > size:  # (a local file; a compressed
            return  # stream's first read larger than the slot it would use)
        try:
            self.successor = objstore.Successor(name, first, self.pool, file_limiter(self.ctx))
        except InvalidArgumentError:
            return  # a malformed URL: its open says so, in its turn

    def _release_remote(self) -> None:
        """Give back the object's booking, once the object read ahead (if any) is gone."""
        booking, self.remote_booking = self.remote_booking, None
        successor, self.successor = self.successor, None
        if booking is None:
            if successor is not None:
                successor.drop(lambda: None)
        elif successor is None:
            booking.release()
        else:
            successor.drop(booking.release)

    def pull(self) -> tuple[Any, Reservation]:
        while self.file_index < len(self.node.filenames):
            reader = self.reader or self._open_or_skip()
            try:
                pair = reader.read_reserved(self.account)
            except MemoryBudgetError:
                raise
            except Exception as error:
                self._skip_failed_file(error)
                raise
            if pair is not None:
                self.served += 1
                return pair
            self._next_file()
        raise StopIteration

    @property
    def record(self) -> int:
        """The index in its file of the next record served."""
        return self.first_record + self.served - self.first_serial

    def origin(self) -> Origin | None:
        """The file, index and byte offset of the record :meth:`pull` returned last."""
        reader = self.reader
        offset = None if reader is None else reader.last_offset()
        if offset is None or not self.record_known:
            return None
        return self._origin(self.file_index, self.record - 1, offset)

    def _origin(self, file_index: int, record: int, offset: int) -> Origin:
        return Origin(
            self.node.filenames[file_index], record, offset, 1, bool(self.node.compression_type)
        )

    def track_origins(self, tokens: bool = True) -> bool:
        """With ``tokens``, keep an :class:`OriginLog`: a token is then the count of
        records served (an attribute read), and the log says where each came from."""
        if tokens and self.log is None:
            self.log = OriginLog()
            if self.reader is not None:  # asked with a file open (an interleave's slot
                # that starts reading ahead): logged from its next record on
                self.log.opened(
                    self.served, self.file_index, self.record if self.record_known else -1
                )
                self.reader.attach_log(self.log, self.served)
        return True

    def origin_token(self) -> int:
        return self.served

    def origin_of(self, token: Any) -> Origin | None:
        found = None if self.log is None or not token else self.log.find(token - 1)
        return None if found is None else self._origin(*found)

    def read_many(self, count: int, account: Buffer) -> tuple[list[bytes], Reservation]:  # noqa: C901
        """Up to ``count`` records across file boundaries (fewer only at the very end),
        booked together on ``account``: they are one batch, which must fit its share.

        Each read is bounded by the room left on the share; a record whose length is
        known before it is read (TFRecord) is booked first, so one that cannot fit
        raises :class:`MemoryBudgetError` before its payload is read.
        """
        records: list[bytes] = []
        booked = NO_RESERVATION
        what = f"a batch of {count} records"
        self._batch = account, what
        try:
            while len(records) < count and self.file_index < len(self.node.filenames):
                if self.reader is None and records:  # (the next file may not open: its
                    # error comes at the next call, after these records)
                    try:
                        self._open()
                    except OSError as error:
                        if not file_at_fault(error):
                            raise
                        self._close_file()
                        return records, booked
                reader = self.reader or self._open_or_skip()
                try:
                    length = reader.next_length()
                    if length is not None:  # refused before its payload is read
                        cost = record_cost(length)  # the batch's need, at this record's size:
                        whole = (booked.nbytes + cost) * count // (len(records) + 1)  # (said)
                        self._expect_known(reader, length, account, what, whole)
                    wanted = count - len(records)
                    room = account.room() - _BYTES_HEADER * wanted
                    batch = reader.read_batch(wanted, max(room, 0))
                except MemoryBudgetError:
                    raise
                except Exception as error:
                    if records:  # hand out the good records; the next call meets the error
                        return records, booked
                    self._skip_failed_file(error)
                    raise
                if not batch:
                    self._next_file()
                    continue
                records.extend(batch)
                self.served += len(batch)
                cost = wire_bytes(batch) + _BYTES_HEADER * len(batch)
                booked = booked.absorb(account.admit(cost, together=what))
        except BaseException:
            booked.release()
            raise
        finally:
            self._batch = None
        return records, booked

    def _expect_known(self, reader: RecordReader, length: int, account: Buffer, what: str,
                      whole: int = 0) -> None:
        """Refuse the next record, whose ``length`` its header gave, if it cannot join
        the batch: the budget splits again to make room, or this raises, naming where
        (and ``whole``, what the batch needs at this size)."""
        try:
            account.expect(record_cost(length), together=what, whole=whole)
        except MemoryBudgetError as error:
            raise refused_record(
                error, "record", self.node.filenames[self.file_index], reader.next_offset,
                f"has {length} bytes", self.node.compression_type) from None

    def _open_or_skip(self) -> RecordReader:
        """Open the current file; one that cannot be opened (missing, a directory, not
        readable) is skipped, its error raised in its place: raised as is, it would come
        again on every later call, and the files after it would never be read."""
        try:
            return self._open()
        except OSError as error:
            if not file_at_fault(error):  # the descriptor cap, say: the file is not at fault
                raise
            self._close_file()
            add_note(error, f"headrace: file {self.node.filenames[self.file_index]} could "
                            "not be opened and is skipped; the next element comes from the "
                            "next file")
            self._next_file()
            raise

    def _skip_failed_file(self, error: Exception) -> None:
        """After a read error, go on with the next file, as tf.data does (raised as is,
        the error would come again on every later call and the files after it would
        never be read). Every earlier record of the file was handed out."""
        add_note(
            error,
            f"headrace: the rest of file {self.node.filenames[self.file_index]} is skipped; "
            "the next element comes from the next file (as in tf.data)",
        )
        self._next_file()

    def _next_file(self) -> None:
        self._close_file(keep_successor=True)
        self.file_index += 1
        self.start_offset = 0
        self.first_record, self.first_serial = 0, self.served

    def _close_file(self, keep_successor: bool = False) -> None:
        """Close the file; with ``keep_successor``, the next object read ahead stays,
        and with it the booking it lives in."""
        skipped = getattr(self.reader, "skipped", None)
        if skipped is not None and skipped[0]:
            self.ctx.run.skipped_records += skipped[0]
            self.ctx.run.skipped_bytes += skipped[1]
        if self.reader is not None:
            self.reader.close()  # gives back what it read ahead
        if self.stream is not None:
            self.stream.close()
        self.stream = None
        self.reader = None
        if not (keep_successor and self.successor is not None):
            self._release_remote()

    def get_state(self) -> dict[str, Any]:
        offset = self.reader.next_offset if self.reader is not None else self.start_offset
        return {
            "file": self.file_index,
            "offset": offset,
            "record": self.record if self.record_known else -1,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        files = len(self.node.filenames)
        file_index = reader.integer("file", high=files, why=f"there are {files} files")
        offset = reader.integer("offset")
        record = reader.integer("record", low=-1) if "record" in state else -1
        if file_index == files and offset:
            raise reader.error("offset", f"= {offset}, but 'file' says every file was read")
        if file_index < files and not self.node.compression_type:
            name = self.node.filenames[file_index]
            size = _size_or_none(name)
            if size is not None and offset > size:  # compressed offsets count decompressed bytes
                raise reader.error("offset", f"= {offset} is past the end of {name} ({size} bytes)")
        self._close_file()
        self.file_index, self.start_offset = file_index, offset
        self.first_record, self.first_serial = (0 if offset == 0 else max(record, 0)), self.served
        self.record_known = offset == 0 or record >= 0

    def close(self) -> None:
        self._close_file()


def _size_or_none(path: str) -> int | None:
    """The file's size; None if it cannot be read now (opening it will say why)."""
    try:
        if objstore.is_remote(path):
            return objstore.object_size(path)
        return os.path.getsize(objstore.local_path(path))
    except OSError:
        return None


class TextLineNode(FileRecordsNode):
    """``TextLineDataset`` for one or more files read one after another."""

    stage = "text_lines"

    def __init__(
        self,
        filenames: Any,
        compression_type: str | None,
        buffer_size: int | None,
        max_line_bytes: int | None = None,
    ) -> None:
        super().__init__(filenames, compression_type, buffer_size)
        if max_line_bytes is None:
            max_line_bytes = DEFAULT_MAX_LINE_BYTES
        if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or (
            max_line_bytes <= 0
        ):
            raise InvalidArgumentError(
                f"TextLineDataset: max_line_bytes must be a positive int, got {max_line_bytes!r}"
            )
        self.max_line_bytes = max_line_bytes

    def open_reader(self, stream: PooledStream, start: int, buffer_bytes: int) -> RecordReader:
        return TextLineReader(stream, start, buffer_bytes, self.max_line_bytes)


def list_files(pattern: str | Sequence[str]) -> list[str]:
    """Paths matching a glob pattern (or several), sorted; an error if none match, or if a
    pattern without wildcards (a file's name) names no file: it would be left out in
    silence, and its rows with it."""
    patterns = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    found: set[str] = set()
    for named in patterns:
        name = os.fspath(named)
        if objstore.is_remote(name):  # listed page by page under the literal prefix
            matches = objstore.glob_objects(name)
            if not matches and not glob.has_magic(name):
                raise InvalidArgumentError(f"list_files: no object {name!r} (of {patterns!r})")
            found.update(matches)
            continue
        name = objstore.local_path(name)
        if not glob.has_magic(name) and not os.path.lexists(name):
            raise InvalidArgumentError(f"list_files: no file {name!r} (of {patterns!r})")
        found.update(glob.glob(name))
    if not found:
        raise InvalidArgumentError(f"list_files: no files match {patterns!r}")
    return sorted(found)
