"""CSV files as a source: ``CsvDataset`` records, or columnar batches, under the budget.

Files are read through the process-wide file pool (G2) in *blocks* of whole
records (``block_bytes``, 4 MiB by default): each block is parsed at once into
one NumPy array per column — by pyarrow's C++ parser when the ``[arrow]``
extra is installed and the block is one it reads exactly as TensorFlow does,
otherwise by :mod:`headrace._csv.reader`'s pure parser — and the parsed block is
booked on the stage's share of the budget before it is held (G1), as is the
reused buffer an uncompressed file's text is read into. Where the share cannot
hold a block (its text or its parsed columns), the block is read again cut to a
quarter of the size, down to 1 KiB: the minimum working set is one record, not
``block_bytes`` (a 4 MiB block of 40-byte rows is about 13 MiB parsed). Records
are handed out from the block one by one (``CsvDataset``) or, when a ``batch``
follows, as slices copied into each batch (no per-record Python). Batches are copies,
not views of the block: a consumer that keeps some batches keeps their rows,
never a whole block per batch (a view would pin, and by the core's rule cost,
its whole block; the copy is ~4% of the time of the parse).

Where it is (G4): the byte offset of the block's first record, the index of
that record in its file, and how many of the block's records were handed
out. Restoring reads from that offset and skips what was handed out, across
several blocks where they are cut smaller than when the state was taken (a
tighter budget); for compressed files the offset counts decompressed bytes.

Bad records (G5): records before a bad one are handed out first; then its
error (:class:`~headrace._csv.reader.CsvError`: TensorFlow's message, plus file,
record, line and column); the next ``next()`` goes on with the next record,
as ``CsvDataset`` does. Under a ``batch``, as in tf.data, the rows gathered before
a bad record are dropped, the error takes the batch's place, and the next batch
starts right after the record.

A UTF-8 byte-order mark at the start of a file is skipped (TensorFlow keeps
it as part of the first field, which then fails to parse as a number).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import headrace._csv.reader as csvfmt
from headrace._csv.reader import CsvColumn, CsvError, CsvFormat
from headrace._errors import (
    InvalidArgumentError,
    MemoryBudgetError,
    RecordTooLargeError,
    add_note,
)
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES, sizeof
from headrace._memory.units import format_bytes
from headrace._sources.files import BudgetCharge, FileRecordsNode, file_limiter
from headrace._structure import TensorSpec
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN
from headrace.core.state import StateReader
from headrace.io import objstore
from headrace.io.filepool import FilePool, PooledStream, file_at_fault, get_default_pool

__all__ = ["DEFAULT_BLOCK_BYTES", "ENGINES", "CsvCursor", "CsvNode", "CsvSpec", "read_first_record"]

#: Bytes of text parsed at once (at most: a tight budget cuts less). Large enough for
#: pyarrow to run at full speed, small enough that the parse's temporaries stay well
#: inside G1's measured slack.
DEFAULT_BLOCK_BYTES = 4 << 20
#: Longest record (a quoted field may span lines): beyond it, RecordTooLargeError.
DEFAULT_MAX_RECORD_BYTES = 64 << 20
ENGINES = ("auto", "arrow", "pure")
#: The smallest block a tight budget cuts the text into (see CsvCursor.block_bytes).
_MIN_BLOCK_BYTES = 1 << 10
_BOM = b"\xef\xbb\xbf"
_BYTES_HEADER = sys.getsizeof(b"")


@dataclass(frozen=True)
class CsvSpec:
    """What to read from each record and how (everything but the files)."""

    columns: tuple[CsvColumn, ...]
    fmt: CsvFormat
    select_cols: tuple[int, ...] = ()
    exclude_cols: tuple[int, ...] = ()
    header: bool = False
    #: Output names: elements are dicts by these names; None gives tuples (CsvDataset).
    names: tuple[str, ...] | None = None
    engine: str = "auto"
    #: Skip bad records (counted in ``stats()``), as ``make_csv_dataset(ignore_errors=True)``.
    ignore_errors: bool = False
    block_bytes: int = DEFAULT_BLOCK_BYTES
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidArgumentError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "arrow" and not csvfmt.arrow_available():
            raise InvalidArgumentError(
                "engine='arrow' needs pyarrow: pip install 'headrace[arrow]'"
            )
        if self.select_cols and self.exclude_cols:
            raise InvalidArgumentError("Either select_cols or exclude_cols should be empty")
        if self.select_cols and len(self.select_cols) != len(self.columns):
            raise InvalidArgumentError("select_cols should match output size")
        for name, value in (("block_bytes", self.block_bytes),
                            ("max_record_bytes", self.max_record_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if self.names is not None and len(self.names) != len(self.columns):
            raise InvalidArgumentError(
                f"{len(self.names)} names for {len(self.columns)} columns"
            )

    def pack(self, values: list[Any]) -> Any:
        if self.names is None:
            return tuple(values)
        return dict(zip(self.names, values, strict=True))

    @property
    def use_arrow(self) -> bool:
        return self.engine == "arrow" or (self.engine == "auto" and csvfmt.arrow_available())


class CsvNode(FileRecordsNode):
    """Records of CSV files, one file after another (a streaming source)."""

    stage = "csv"

    def __init__(self, filenames: Any, compression_type: str | None, buffer_size: int | None,
                 spec: CsvSpec) -> None:
        super().__init__(filenames, compression_type, buffer_size)
        self.spec = spec

    def params(self) -> tuple[Any, ...]:
        spec = self.spec
        # The block size is part of where a state points (blocks are cut from it);
        # the engine is not (both engines give the same records).
        return (*super().params(), spec.columns, spec.fmt, spec.select_cols, spec.exclude_cols,
                spec.header, spec.names, spec.block_bytes, spec.ignore_errors)

    @property
    def element_spec(self) -> Any:
        return self.spec.pack([
            TensorSpec((), bytes) if c.kind == "string" else TensorSpec((), c.dtype)
            for c in self.spec.columns
        ])

    def cardinality(self) -> int:
        return UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        account = ctx.account(self, f"{self.stage} (parsed block)")
        return _CsvRecords(CsvCursor(self, ctx, account))

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator:
        block_account = ctx.account(self, f"{self.stage} (parsed block)")
        return _CsvBatches(CsvCursor(self, ctx, block_account), batch_size, drop_remainder,
                           account)


def read_first_record(path: str, compression_type: str | None, fmt: CsvFormat, *,
                      max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> list[bytes] | None:
    """The fields of the first record of ``path`` (a header), split as ``CsvDataset``
    splits records, a UTF-8 byte-order mark skipped; None for an empty file.

    Read through the file pool (G2) in growing windows, so a header of any length up
    to ``max_record_bytes`` is read whole; errors name the file (a missing file or a
    directory: ``OSError`` with its name; a malformed or endless record: :class:`CsvError`
    or :class:`RecordTooLargeError` with the file, line and byte offset).
    """
    stream = get_default_pool().open(path, compression_type)
    try:
        data = b""
        want = 1 << 16
        while True:
            chunk = stream.read(want - len(data))
            data += chunk
            whole = len(data) < want
            start = len(_BOM) if data.startswith(_BOM) else 0
            scanned = csvfmt.scan_records(data, fmt, start=start, final=whole, max_records=1)
            if scanned.ends:
                if scanned.errors[0] is not None:
                    column, message = scanned.errors[0]
                    raise CsvError(message, path=path, record=0, line=1, column=column,
                                   offset=start)
                return scanned.fields[0]
            if whole:
                return None
            if want >= max_record_bytes:
                raise RecordTooLargeError(
                    f"the first CSV record (the header) of {path} is longer than "
                    f"max_record_bytes={max_record_bytes} (an unclosed quote?)",
                    path=path, offset=0,
                )
            want *= 2
    finally:
        stream.close()


@dataclass
class _Block:
    """Parsed records of one block: the good ones, then maybe one bad one's error."""

    offset: int  # stream offset of its first record
    record: int  # index (in the file) of its first record
    line: int  # line number (from 1) of its first record
    columns: list[np.ndarray[Any, Any]]
    good: int
    error: CsvError | None
    next_offset: int  # where the following block starts (past the bad record, if any)
    next_line: int
    booking: Reservation = field(default=NO_RESERVATION)
    taken: int = 0
    error_raised: bool = False


class _PastShare(Exception):
    """A block (its text or its parsed columns) the stage's share cannot hold as it is.
    Holding it anyway would raise the stage's minimum working set to the whole block
    and take from the minima of the stages after it (a batch); a block is divisible,
    so it is read again cut smaller (:meth:`CsvCursor._smaller_blocks`). Internal."""


class _BlockReader:
    """Blocks of whole records from one stream, from ``offset`` on.

    The bytes not yet parsed are ``_buffer[_start:_stop]``: parsing reads them in
    place (pyarrow gets a zero-copy view), and consuming a block moves ``_start``,
    so a block's text is never copied before the parse. An uncompressed file is
    read a block at a time straight into one reused buffer, from the block's first
    byte (the partial record left by the last block is read again rather than
    joined to the next read): no allocation per block, so no fresh pages to fault
    in (a 4 MiB read into new memory costs as much again as the read). That buffer
    lives as long as the reader and is booked on the stage's account (G1).
    """

    def __init__(self, stream: PooledStream, spec: CsvSpec, path: str, offset: int,
                 record: int, line: int, account: Buffer, block_bytes: int) -> None:
        self.stream, self.spec, self.path = stream, spec, path
        #: The text parsed at once: ``spec.block_bytes``, or less where the budget's
        #: share cannot hold that (see :meth:`CsvCursor.current`).
        self.block_bytes = block_bytes
        self.offset, self.record, self.line = offset, record, line
        self.account = account
        self._buffer: bytes | bytearray = b""
        self._start = self._stop = 0
        self._eof = False
        self._scratch = bytearray()
        self._scratch_booking: Reservation = NO_RESERVATION
        self._booked = 0  # the window of text booked (see _book_text)
        self._seekable = not stream.compression_type
        #: A header that could not be parsed (and was skipped): the cursor raises it once.
        self.header_error: CsvError | None = None
        if not self._seekable:
            stream.seek(offset)
        if offset == 0:
            try:
                self._skip_bom_and_header()
            except BaseException:
                self.close()  # the caller never gets this reader to close
                raise

    def close(self) -> None:
        self._buffer = self._scratch = bytearray()
        self._scratch_booking.release()
        self._scratch_booking, self._booked = NO_RESERVATION, 0

    def _fill(self, at_least: int) -> None:
        """Read until ``at_least`` bytes are unparsed or the stream ends."""
        have = self._stop - self._start
        if have >= at_least or self._eof:
            return
        size = max(at_least, self.block_bytes)
        if self._seekable:
            if len(self._scratch) < size:
                self._scratch = bytearray()
                self._book_text(size)
                self._scratch = bytearray(size)
            count = self.stream.pread_into(self.offset, memoryview(self._scratch)[:size])
            self._buffer, self._start, self._stop = self._scratch, 0, count
            self._eof = count < size
            return
        self._book_text(size)  # (the window read: never more than that is held)
        pieces = [self._buffer[self._start:self._stop]] if have else []
        read = have
        while read < at_least and not self._eof:
            chunk = self.stream.read(size - read)
            if not chunk:
                self._eof = True
                break
            pieces.append(chunk)
            read += len(chunk)
        self._buffer = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._start, self._stop = 0, len(self._buffer)

    def _book_text(self, size: int) -> None:
        """Book a window of ``size`` bytes of text before it is read (G1).

        A record that does not fit the share is refused here, once the window that
        would hold it cannot be booked: it is never read whole."""
        if size <= self._booked:
            return
        self._scratch_booking.release()
        self._scratch_booking, self._booked = NO_RESERVATION, 0
        if (size <= self._window() + 1 and self.block_bytes > _MIN_BLOCK_BYTES
                and size + ARRAY_HEADER_BYTES > self.account.room()):
            raise _PastShare  # a plain block: cut smaller, not the stage's minimum raised
        try:
            self._scratch_booking = self.account.admit(size + ARRAY_HEADER_BYTES,
                                                       together=self.where(size))
        except MemoryBudgetError as error:
            if size <= self._window() + 1:  # a plain block (and the byte past it)
                raise
            raise self._refused(error) from None
        self._booked = size

    def _refused(self, error: MemoryBudgetError) -> MemoryBudgetError:
        """``error`` naming the record that could not fit: its file, record, line, the
        column it was in when reading stopped, and its byte offset."""
        partial = bytes(memoryview(self._buffer)[self._start:self._stop])
        index = self._field_reached(partial)
        column = ""
        if index is not None:
            name = self._column_name(index)
            column = f", column {index}" + (f" ({name!r})" if name else "")
        return MemoryBudgetError(
            f"CSV record {self.record} (line {self.line}{column}) at offset {self.offset} in "
            f"file {self.path} has more than {len(partial)} bytes: it cannot fit the memory "
            f"budget, so it was not read further. {error}")

    def _field_reached(self, partial: bytes) -> int | None:
        """The index (among the file's fields) of the field ``partial``, the start of a
        record read so far, ends in."""
        scanned = csvfmt.scan_records(partial, self.spec.fmt, final=True, max_records=1)
        if scanned.errors and scanned.errors[0] is not None:
            return scanned.errors[0][0]
        if scanned.fields:
            return len(scanned.fields[0]) - 1
        return None

    def _fields_before(self, partial: bytes, field: int | None) -> tuple[bytes, ...]:
        """The whole fields of ``partial`` (a record's start) before field ``field``."""
        if not field:
            return ()
        scanned = csvfmt.scan_records(partial, self.spec.fmt, final=True, max_records=1)
        if not scanned.fields:
            return ()
        return tuple(bytes(value) for value in scanned.fields[0][:field])

    def _column_name(self, field: int) -> str | None:
        """The output name of the file's field ``field``, where it has one."""
        spec = self.spec
        if spec.names is None:
            return None
        if spec.select_cols:
            kept = list(spec.select_cols)
        else:
            kept = [i for i in range(len(spec.columns) + len(spec.exclude_cols))
                    if i not in spec.exclude_cols]
        return spec.names[kept.index(field)] if field in kept else None

    def where(self, size: int) -> str:
        """What a booking of ``size`` bytes of this file's text is for, with where the
        block starts (a MemoryBudgetError then names the file and the line)."""
        long = (f": a record of more than {format_bytes(size // 2)}"
                if size > self._window() + 1 else "")
        return (f"the text of one CSV block of {self.path} from line {self.line} "
                f"(byte offset {self.offset}){long}")

    def _consume(self, nbytes: int, records: int, lines: int) -> None:
        self._start += nbytes
        self.offset += nbytes
        self.record += records
        self.line += lines
        if not self._seekable and self._start:
            # keep only the leftover: the consumed block's text is not held between pulls
            self._buffer = self._buffer[self._start:self._stop]
            self._start, self._stop = 0, len(self._buffer)

    def _skip_bom_and_header(self) -> None:
        self._fill(len(_BOM))
        bom = self._buffer.startswith(_BOM, self._start, self._stop)
        if bom:
            self._consume(len(_BOM), 0, 0)
        if not self.spec.header:
            return
        want = min(self.block_bytes, 1 << 16)  # a header is short: copy little
        while True:
            self._fill(want)
            stop = min(self._stop, self._start + want)
            unparsed = bytes(memoryview(self._buffer)[self._start:stop])
            whole = self._eof and stop == self._stop
            scanned = csvfmt.scan_records(unparsed, self.spec.fmt, final=whole,
                                          max_records=1)
            if scanned.ends:
                end = scanned.ends[0]
                self._consume(end, 0, unparsed.count(b"\n", 0, end) or 1)
                if scanned.errors[0] is not None:
                    # skipped as a bad record is: TensorFlow raises once, then reads on
                    self.header_error = CsvError("Can't read header of file", path=self.path,
                                                 offset=0, line=1)
                return
            if whole:
                break
            want = self._grow(want)
        if not bom:  # (a file of a byte-order mark alone is a header to TensorFlow)
            raise CsvError("Can't read header of file", path=self.path, offset=0, line=1)

    def _grow(self, want: int) -> int:
        """The next, larger window to look for a whole record in (the one of ``want``
        bytes held none), unless the record is past ``max_record_bytes``."""
        if min(self._stop - self._start, want) >= self.spec.max_record_bytes:
            partial = bytes(memoryview(self._buffer)[self._start:self._start + want])
            field = self._field_reached(partial)
            error = RecordTooLargeError(
                f"CSV record {self.record} (line {self.line}"
                + ("" if field is None else f", field {field}")
                + f") at offset {self.offset} in file {self.path} is longer than "
                f"max_record_bytes={self.spec.max_record_bytes} (an unclosed quote?); pass "
                "max_record_bytes=... to read longer records",
                path=self.path, offset=self.offset,
            )
            error.field = field
            # the record's whole fields before that one (a type inference still counts them)
            error.fields_before = self._fields_before(partial, field)
            raise error
        return want * 2

    def _window(self) -> int:
        """The bytes a block is first cut from (grown only for a longer record)."""
        size = self.block_bytes
        return size if self.spec.use_arrow else max(size // 4, min(size, 1 << 16))

    def read_block(self) -> _Block | None:
        """The next block of records, or None at the end of the stream."""
        want = self._window()
        while True:
            # One byte past the window: the stream's end is then known exactly when it is
            # inside the window, however much was read ahead before.
            self._fill(want + 1)
            start, size = self._start, self._stop
            if start >= size and self._eof:
                return None
            # Cut from the first `want` bytes only, whatever else was read ahead, and grow
            # the window by a rule that depends on nothing else either (not on how much a
            # compressed stream had read ahead): a block is then the same after a restore,
            # which reads from its start (G4).
            final = self._eof and size - start <= want
            block = self._parse(self._buffer, start, size if final else start + want, final)
            if block is not None:
                return block
            if final:
                return None
            want = self._grow(want)

    def _parse(self, data: bytes | bytearray, start: int, stop: int,
               final: bool) -> _Block | None:
        """Parse the records that end in ``data[start:stop]`` (searched in place)."""
        spec = self.spec
        fmt = spec.fmt
        quoted = fmt.use_quote_delim and data.find(b'"', start, stop) >= 0
        simple = not quoted and data.find(b"\r", start, stop) < 0
        if spec.use_arrow and quoted and data.find(b"\r", start, stop) < 0:
            end = csvfmt.quoted_block_end(data, start, stop, final, fmt)
            columns = None if end is None else csvfmt.arrow_parse_block(
                data, spec.columns, fmt, spec.select_cols, spec.exclude_cols, start=start,
                end=end, quoted=True)
            if columns is not None:
                assert end is not None
                # Records end at the newlines outside quotes: pyarrow's rows. Lines count
                # every newline, those inside quoted fields too.
                return self._finish(columns, len(columns[0]), None, end - start,
                                    data.count(b"\n", start, end))
        if spec.use_arrow and simple:
            end = stop if final else data.rfind(b"\n", start, stop) + 1
            if end <= start:
                return None
            columns = csvfmt.arrow_parse_block(data, spec.columns, fmt, spec.select_cols,
                                               spec.exclude_cols, start=start, end=end)
            if columns is not None:
                # Without quotes or \r, a record is a line: pyarrow's rows are the lines.
                count = len(columns[0])
                return self._finish(columns, count, None, end - start, count)
        piece = bytes(memoryview(data)[start:stop])
        scanned = csvfmt.scan_records(piece, fmt, final=final)
        if not scanned.ends:
            return None
        return self._parse_scanned(piece, scanned)

    def _parse_scanned(self, data: bytes, scanned: csvfmt.BlockRecords) -> _Block:
        spec = self.spec
        width = len(spec.columns)
        rows = [csvfmt.select_fields(f, spec.select_cols, spec.exclude_cols)
                for f in scanned.fields]
        bad = next((i for i, (row, error) in enumerate(zip(rows, scanned.errors, strict=True))
                    if error is not None or len(row) != width), len(rows))
        try:
            columns = csvfmt.parse_columns(rows[:bad], spec.columns, spec.fmt,
                                           message_style="dataset")
        except CsvError as error:
            assert error.record is not None
            bad = error.record
            columns = csvfmt.parse_columns(rows[:bad], spec.columns, spec.fmt,
                                           message_style="dataset")
        if bad == len(rows):
            ends = scanned.ends
            return self._finish(columns, bad, None, ends[-1], data.count(b"\n", 0, ends[-1]))
        problem = csvfmt.record_error(scanned.fields[bad], scanned.errors[bad], spec.columns,
                                      spec.fmt, spec.select_cols, spec.exclude_cols)
        assert problem is not None
        message, column = problem
        start = scanned.ends[bad - 1] if bad else 0
        end = scanned.ends[bad]
        line = self.line + data.count(b"\n", 0, start)
        located = CsvError(
            message, path=self.path, record=self.record + bad, line=line, column=column,
            column_name=spec.names[column] if spec.names and column is not None else None,
            offset=self.offset + start,
        )
        return self._finish(columns, bad, located, end, data.count(b"\n", 0, end))

    def _finish(self, columns: list[np.ndarray[Any, Any]], good: int, error: CsvError | None,
                end: int, lines: int) -> _Block:
        block = _Block(self.offset, self.record, self.line, columns, good, error,
                       self.offset + end, self.line + lines)
        self._consume(end, good + (error is not None), lines)
        return block


class CsvCursor:
    """Where a CSV source is: file, block and position in it; shared by both iterators."""

    def __init__(self, node: CsvNode, ctx: Context, account: Buffer) -> None:
        self.node, self.ctx, self.account = node, ctx, account
        self.spec = node.spec
        self.pool: FilePool = get_default_pool()
        self.file_index = 0
        # Where the next block starts in the current file (offset, record, line).
        self.start = (0, 0, 1)
        self.skip = 0  # records of the block at `start` already handed out (restore)
        self.stream: PooledStream | None = None
        self.reader: _BlockReader | None = None
        self.block: _Block | None = None
        self.remote_booking: Reservation | None = None  # an object's read-ahead, while open
        #: The text parsed at once: ``block_bytes`` until the share refuses a block, then
        #: a quarter of it each time, down to _MIN_BLOCK_BYTES (a longer record still
        #: grows its window: the floor is one record).
        self.block_bytes = self.spec.block_bytes

    # -- reading ---------------------------------------------------------------------------
    def _open(self) -> _BlockReader:
        node = self.node
        name = node.filenames[self.file_index]
        size = node.buffer_bytes
        if objstore.is_remote(name):
            # the stream's block and the block read ahead (the parser's own buffer is
            # booked by the block reader): the stage's bytes while the object is open
            ranges = objstore.READ_AHEAD_RANGES - 1
            if self.remote_booking is None:  # (beside the block of text being parsed)
                size = node.object_buffer(
                    max(0, self.account.share() - self.block_bytes), ranges)
                self.remote_booking = self.account.admit(
                    size * ranges, together=f"the read-ahead of {name}", elements=0)
            else:  # (reopened: the size it was booked at)
                size = self.remote_booking.nbytes // ranges
        self.stream = self.pool.open(
            node.filenames[self.file_index], node.compression_type,
            limiter=file_limiter(self.ctx), memory_account=BudgetCharge(self.account),
            buffer_size=size,
        )
        offset, record, line = self.start
        self.reader = _BlockReader(self.stream, self.spec, node.filenames[self.file_index],
                                   offset, record, line, self.account, self.block_bytes)
        return self.reader

    def _open_or_skip(self) -> _BlockReader | None:
        """Open the current file; one that cannot be opened (missing, a directory, not
        readable) or whose header cannot be read (an empty file too) is skipped, its
        error raised once in its place, as ``CsvDataset`` does (raised as is, it would
        come again at every call and the files after it would never be read). With
        ``ignore_errors`` a bad header is skipped and counted like a bad record: None.

        A header that ends but cannot be parsed is skipped as a bad record is and its
        error raised once; the file is then read on, from after it, as TensorFlow does."""
        try:
            reader = self._open()
        except CsvError as error:
            self._close_file()
            self._next_file()
            if self.spec.ignore_errors:
                self.ctx.run.skipped_records += 1
                return None
            add_note(error, "headrace: the file is skipped; the next record comes from the "
                            "next file")
            raise
        except OSError as error:
            if not file_at_fault(error):
                raise
            self._close_file()
            add_note(error, f"headrace: file {self.node.filenames[self.file_index]} could "
                            "not be opened and is skipped; the next record comes from the "
                            "next file")
            self._next_file()
            raise
        self._header_error(reader)
        return reader

    def _header_error(self, reader: _BlockReader) -> None:
        """Raise the error of the header ``reader`` skipped, if any, once (with
        ``ignore_errors``, count it as a skipped record instead)."""
        error = reader.header_error
        if error is None:
            return
        reader.header_error = None
        # a state taken now resumes after the header, without raising it again
        self.start = (reader.offset, reader.record, reader.line)
        if not self.spec.ignore_errors:
            raise error
        self.ctx.run.skipped_records += 1

    def current(self) -> _Block | None:
        """The block with records (or an error) left to hand out; None at the very end."""
        while True:
            block = self.block
            if block is not None and (block.taken < block.good or (
                    block.error is not None and not block.error_raised)):
                return block
            self._drop_block()
            if self.file_index >= len(self.node.filenames):
                return None
            block = None
            try:
                reader = self.reader or self._open_or_skip()
                if reader is None:
                    continue
                block = reader.read_block()
                if block is None:
                    self._next_file()
                    continue
                size = sizeof(block.columns)
                if size > self.account.room() and self.block_bytes > _MIN_BLOCK_BYTES:
                    raise _PastShare
                block.booking = self.account.admit(
                    size, together=f"the parsed CSV block of "
                    f"{self.node.filenames[self.file_index]} from line {block.line} (byte "
                    f"offset {block.offset}; its text was cut at {self.block_bytes} bytes)")
            except BaseException as error:
                if block is not None:  # (read, not handed out: a state points at it)
                    self.start = (block.offset, block.record, block.line)
                if not isinstance(error, MemoryBudgetError | _PastShare) or (
                        not self._smaller_blocks()):
                    raise
                continue
            self._skip_into(block)
            self.block = block  # (returned above unless the skip took all of it)

    def _smaller_blocks(self) -> bool:
        """After the share refused a block (its text or its parsed columns): read it
        again in smaller blocks, from where it starts, unless they are as small as
        they go. G1: the minimum working set is one record, not ``block_bytes``."""
        if self.block_bytes <= _MIN_BLOCK_BYTES:
            return False
        self.block_bytes = max(_MIN_BLOCK_BYTES, self.block_bytes // 4)
        self._close_file()  # (reopened at self.start, the refused block's first byte)
        return True

    def _skip_into(self, block: _Block) -> None:
        """Skip what a restored state says was handed out of ``block`` (``self.skip``
        records, its error counting as one); what is left of the skip is in the next
        blocks (they may be cut smaller than the ones the state was taken on)."""
        if self.skip <= block.good:
            block.taken, self.skip = self.skip, 0
            return
        block.taken = block.good
        block.error_raised = block.error is not None
        self.skip -= block.good + block.error_raised

    def take(self, count: int) -> tuple[list[np.ndarray[Any, Any]], int]:
        """Views of up to ``count`` records of the current block (fewer at its end);
        raises the block's error when the good records before it are all taken."""
        block = self.current()
        if block is None:
            return [], 0
        while block.taken >= block.good:
            assert block.error is not None
            if not self.spec.ignore_errors:
                # a fresh copy each time: a kept exception would collect tracebacks that
                # hold this cursor alive (the caller says when it was raised: error_raised)
                raise block.error.located()
            block.error_raised = True
            self.ctx.run.skipped_records += 1
            block = self.current()
            if block is None:
                return [], 0
        first = block.taken
        last = min(block.good, first + count)
        block.taken = last
        return [column[first:last] for column in block.columns], last - first

    def error_raised(self) -> None:
        """The current block's error reached the user: the next record follows it."""
        if self.block is not None:
            self.block.error_raised = True

    def _drop_block(self) -> None:
        block = self.block
        if block is not None:
            block.booking.release()
            self.start = (block.next_offset, block.record + block.good + (
                block.error is not None), block.next_line)
            self.block = None

    def _next_file(self) -> None:
        self._close_file()
        self.file_index += 1
        self.start = (0, 0, 1)

    def _close_file(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.stream is not None:
            self.stream.close()
        self.stream = None
        self.reader = None
        if self.remote_booking is not None:
            self.remote_booking.release()
            self.remote_booking = None

    # -- state -------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        block = self.block
        if block is not None:
            handed = block.taken + (1 if block.error_raised else 0)
            return {"file": self.file_index, "offset": block.offset, "record": block.record,
                    "line": block.line, "skip": handed}
        offset, record, line = self.start
        return {"file": self.file_index, "offset": offset, "record": record, "line": line,
                "skip": self.skip}

    def set_state(self, state: dict[str, Any], stage: str) -> None:
        reader = StateReader(state, stage)
        files = len(self.node.filenames)
        file_index = reader.integer("file", high=files, why=f"there are {files} files")
        offset = reader.integer("offset")
        record = reader.integer("record")
        line = reader.integer("line", low=1)
        skip = reader.integer("skip")
        if file_index == files and (offset or skip):
            raise reader.error("offset", f"= {offset}, but 'file' says every file was read")
        if file_index < files and not self.node.compression_type:
            name = self.node.filenames[file_index]
            try:
                size = os.path.getsize(name)
            except OSError:
                size = None
            if size is not None and offset > size:
                raise reader.error("offset", f"= {offset} is past the end of {name} ({size} bytes)")
        self.close()
        self.file_index, self.start, self.skip = file_index, (offset, record, line), skip

    def close(self) -> None:
        if self.block is not None:
            self.block.booking.release()
            self.block = None
        self._close_file()


class _CsvRecords(Iterator):
    """``CsvDataset``: one record per element (a tuple, or a dict by column name)."""

    stage = "csv"

    def __init__(self, cursor: CsvCursor) -> None:
        super().__init__()
        self.cursor = cursor

    def pull(self) -> tuple[Any, Reservation]:
        try:
            columns, count = self.cursor.take(1)
        except CsvError:
            self.cursor.error_raised()
            raise
        if not count:
            raise StopIteration
        return self.cursor.spec.pack([column[0] for column in columns]), NO_RESERVATION

    def get_state(self) -> dict[str, Any]:
        return self.cursor.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.cursor.set_state(state, self.stage)

    def close(self) -> None:
        self.cursor.close()


class _CsvBatches(Iterator):
    """``CsvDataset(...).batch(n)`` read as columns: slices of parsed blocks, copied into
    each batch (booked on the batch stage's share before the copy)."""

    stage = "batch"

    def __init__(self, cursor: CsvCursor, batch_size: int, drop_remainder: bool,
                 account: Buffer) -> None:
        super().__init__()
        self.cursor, self.batch_size, self.drop_remainder = cursor, batch_size, drop_remainder
        self.account = account
        self._container_cost: int | None = None
        columns = cursor.spec.columns
        # A whole batch cut from one block costs the same every time, plus, for a string
        # column, its strings' bytes.
        self._whole_cost = (sizeof(cursor.spec.pack([None] * len(columns)))
                            + sum(ARRAY_HEADER_BYTES + batch_size * c.dtype.itemsize
                                  for c in columns))
        self._string_columns = [i for i, c in enumerate(columns) if c.dtype.hasobject]
        self._whole_what = f"one batch of {batch_size} CSV records"

    def pull(self) -> tuple[Any, Reservation]:  # noqa: C901
        block = self.cursor.block
        if block is not None:
            first = block.taken
            last = first + self.batch_size
            if last <= block.good:  # the common case, without the general loop below
                cost = self._whole_cost + sum(
                    _BYTES_HEADER * self.batch_size + sum(map(len, block.columns[i][first:last]))
                    for i in self._string_columns)
                booking = self.account.admit(cost, together=self._whole_what)
                try:
                    batch = [column[first:last].copy() for column in block.columns]
                except BaseException:
                    booking.release()
                    raise
                block.taken = last
                return self.cursor.spec.pack(batch), booking
        pieces: list[list[np.ndarray[Any, Any]]] = []
        bookings: list[Reservation] = []
        rows = 0
        try:
            while rows < self.batch_size:
                try:
                    columns, count = self.cursor.take(self.batch_size - rows)
                except CsvError:
                    # As tf.data's batch: the rows gathered before a bad record are
                    # dropped (their bookings released below), the error is raised once
                    # in the batch's place, and the next batch starts after the record.
                    self.cursor.error_raised()
                    raise
                if not count:
                    break
                # Copied out and booked now: the block it comes from is released when the
                # next one is read, and a batch of many blocks must be refused at its share.
                bookings.append(self.account.admit(
                    self._columns_cost([columns], count),
                    together=f"one batch of {self.batch_size} CSV records "
                             f"({rows + count} read so far; a smaller batch_size fits)"))
                pieces.append([column.copy() for column in columns])
                rows += count
            if not rows or (self.drop_remainder and rows < self.batch_size):
                raise StopIteration
            if len(pieces) == 1:
                booking = self.account.admit(self._container(pieces[0]),
                                             together=f"one batch of {rows} CSV records")
                batch = pieces[0]
            else:  # the parts are given back once joined
                booking = self.account.admit(
                    self._container(pieces[0]) + self._columns_cost(pieces, rows),
                    together=f"one batch of {rows} CSV records")
                batch = [np.concatenate(parts) for parts in zip(*pieces, strict=True)]
        except BaseException:
            for part in bookings:
                part.release()
            raise
        for part in bookings:
            if len(pieces) == 1:
                booking = booking.absorb(part)
            else:
                part.release()
        return self.cursor.spec.pack(batch), booking

    def _container(self, columns: list[np.ndarray[Any, Any]]) -> int:
        """What the batch's container (tuple or dict of columns) costs."""
        if self._container_cost is None:
            self._container_cost = sizeof(self.cursor.spec.pack([None] * len(columns)))
        return self._container_cost

    def _columns_cost(self, pieces: list[list[np.ndarray[Any, Any]]], rows: int) -> int:
        """What the columns joined from ``pieces`` will cost once copied: computed from the
        pieces' sizes, not with ``sizeof`` of the pieces (views of a whole parsed block,
        which it would charge in full to every batch cut from the block)."""
        total = 0
        for index, first in enumerate(pieces[0]):
            total += ARRAY_HEADER_BYTES + rows * first.itemsize
            if first.dtype.hasobject:  # the batch keeps its strings (bytes) alive too
                # getsizeof of a bytes object is a fixed header plus its length: summing
                # the lengths costs half as much per string as calling getsizeof
                total += sum(_BYTES_HEADER * len(piece[index]) + sum(map(len, piece[index]))
                             for piece in pieces)
        return total

    def get_state(self) -> dict[str, Any]:
        return {"records": self.cursor.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.cursor.set_state(StateReader(state, self.stage).child("records"), "csv")

    def close(self) -> None:
        self.cursor.close()
