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

import glob
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from headrace._state import StateReader
from headrace.errors import InvalidArgumentError, add_note
from headrace.io.filepool import FileLimiter, FilePool, PooledStream, get_default_pool
from headrace.io.streams import DEFAULT_BUFFER_SIZE, normalize_compression_type
from headrace.iterator import Context, Iterator
from headrace.memory.budget import StageAccount
from headrace.node import UNKNOWN, Node
from headrace.structure import TensorSpec

__all__ = ["FileRecordsNode", "RecordReader", "TextLineReader", "file_limiter", "list_files"]



class RecordReader(Protocol):
    """Reads records from one decompressed byte stream; knows the next record's offset."""

    def read_record(self) -> bytes | None:
        """The next record, or None at the end of the file."""

    def read_batch(self, max_records: int) -> list[bytes]:
        """Up to ``max_records`` records; an empty list at the end of the file."""

    @property
    def next_offset(self) -> int:
        """Byte offset (in the decompressed stream) of the next unread record."""


class TextLineReader:
    """Lines of a byte stream as tf.data's TextLineDataset splits them.

    Split on ``\\n``; one trailing ``\\r`` is stripped; a final line without a
    newline is still a line; a trailing ``\\n`` does not add an empty one.
    """

    def __init__(self, stream: PooledStream, start: int, buffer_bytes: int) -> None:
        self.stream = stream
        self.buffer_bytes = buffer_bytes
        stream.seek(start)
        self._offset = start
        self._buffer = b""
        self._position = 0
        self._eof = False

    @property
    def next_offset(self) -> int:
        return self._offset

    def read_batch(self, max_records: int) -> list[bytes]:
        lines = []
        for _ in range(max_records):
            line = self.read_record()
            if line is None:
                break
            lines.append(line)
        return lines

    def read_record(self) -> bytes | None:
        while True:
            newline = self._buffer.find(b"\n", self._position)
            if newline >= 0:
                line = self._buffer[self._position : newline]
                self._offset += newline + 1 - self._position
                self._position = newline + 1
                return line[:-1] if line.endswith(b"\r") else line
            if self._eof:
                if self._position >= len(self._buffer):
                    return None
                line = self._buffer[self._position :]
                self._offset += len(line)
                self._position = len(self._buffer)
                return line[:-1] if line.endswith(b"\r") else line
            chunk = self.stream.read(self.buffer_bytes)
            self._buffer = self._buffer[self._position :] + chunk
            self._position = 0
            self._eof = not chunk


class _BudgetCharge:
    """Lets the file pool book suspended decompressor state on a stage's budget share."""

    def __init__(self, account: StageAccount) -> None:
        self.account = account

    def charge(self, nbytes: int) -> None:
        self.account.charge(nbytes)

    def discharge(self, nbytes: int) -> None:
        self.account.release(nbytes)


def file_limiter(ctx: Context) -> FileLimiter | None:
    """The pipeline's own cap on descriptors (``Options.max_open_files``), shared by its readers."""
    if ctx.options.max_open_files is None:
        return None
    limiter: FileLimiter | None = ctx.shared.get("file_limiter")
    if limiter is None:
        limiter = get_default_pool().limiter(ctx.options.max_open_files)
        ctx.shared["file_limiter"] = limiter
    return limiter


def _filenames(filenames: Any) -> list[str]:
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


class FileRecordsNode(Node):
    """Records of each file in turn (a streaming source). Subclasses pick the reader."""

    stage = "files"
    record_spec: TensorSpec = TensorSpec((), bytes)

    def __init__(
        self, filenames: Any, compression_type: str | None, buffer_size: int | None
    ) -> None:
        super().__init__()
        self.filenames = _filenames(filenames)
        try:
            self.compression_type = normalize_compression_type(compression_type)
        except ValueError as error:
            raise InvalidArgumentError(str(error)) from None
        if buffer_size is not None and (not isinstance(buffer_size, int) or buffer_size <= 0):
            raise InvalidArgumentError(f"buffer_size must be a positive int, got {buffer_size!r}")
        self.buffer_bytes = buffer_size or DEFAULT_BUFFER_SIZE

    def params(self) -> tuple[Any, ...]:
        return (tuple(self.filenames), self.compression_type)

    @property
    def element_spec(self) -> Any:
        return self.record_spec

    def cardinality(self) -> int:
        return UNKNOWN

    def open_reader(self, stream: PooledStream, start: int) -> RecordReader:
        raise NotImplementedError

    def make_iterator(self, ctx: Context) -> Iterator:
        account = ctx.account(self, f"{self.stage} (suspended streams)", weight=0.25)
        return _FileRecordsIterator(self, ctx, account)

    def batched_iterator(self, ctx: Context, batch_size: int, drop_remainder: bool) -> Iterator:
        """``batch`` pushed into the reader: many records per call, no per-record Python."""
        return _RecordBatches(self.make_iterator(ctx), batch_size, drop_remainder)


def _object_array(records: list[bytes]) -> np.ndarray[Any, Any]:
    out = np.empty(len(records), dtype=object)
    out[:] = records
    return out


class _RecordBatches(Iterator):
    stage = "batch"

    def __init__(self, inner: Iterator, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(inner)
        assert isinstance(inner, _FileRecordsIterator)
        self.records = inner
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def __next__(self) -> Any:
        records = self.records.read_many(self.batch_size)
        if not records or (self.drop_remainder and len(records) < self.batch_size):
            raise StopIteration
        return _object_array(records)

    def get_state(self) -> dict[str, Any]:
        return {"records": self.records.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.records.set_state(StateReader(state, "batch").child("records"))


class _FileRecordsIterator(Iterator):
    def __init__(self, node: FileRecordsNode, ctx: Context, account: StageAccount) -> None:
        super().__init__()
        self.node, self.ctx, self.account = node, ctx, account
        self.stage = node.stage
        self.pool: FilePool = get_default_pool()
        self.file_index = 0
        self.start_offset = 0
        self.stream: PooledStream | None = None
        self.reader: RecordReader | None = None

    def _open(self) -> RecordReader:
        node = self.node
        self.stream = self.pool.open(
            node.filenames[self.file_index],
            node.compression_type,
            limiter=file_limiter(self.ctx),
            memory_account=_BudgetCharge(self.account),
            buffer_size=node.buffer_bytes,
        )
        self.reader = node.open_reader(self.stream, self.start_offset)
        return self.reader

    def __next__(self) -> Any:
        while self.file_index < len(self.node.filenames):
            reader = self.reader or self._open()
            try:
                record = reader.read_record()
            except Exception as error:
                self._skip_failed_file(error)
                raise
            if record is not None:
                return record
            self._next_file()
        raise StopIteration

    def read_many(self, count: int) -> list[bytes]:
        """Up to ``count`` records, across file boundaries (fewer only at the very end)."""
        records: list[bytes] = []
        while len(records) < count and self.file_index < len(self.node.filenames):
            reader = self.reader or self._open()
            try:
                batch = reader.read_batch(count - len(records))
            except Exception as error:
                if records:  # hand out the good records; the next call meets the error
                    return records
                self._skip_failed_file(error)
                raise
            if batch:
                records.extend(batch)
            else:
                self._next_file()
        return records

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
        self._close_file()
        self.file_index += 1
        self.start_offset = 0

    def _close_file(self) -> None:
        skipped = getattr(self.reader, "skipped", None)
        if skipped is not None and skipped[0]:
            totals = self.ctx.shared.setdefault("skipped", [0, 0])
            totals[0] += skipped[0]
            totals[1] += skipped[1]
        if self.stream is not None:
            self.stream.close()
        self.stream = None
        self.reader = None

    def get_state(self) -> dict[str, Any]:
        offset = self.reader.next_offset if self.reader is not None else self.start_offset
        return {"file": self.file_index, "offset": offset}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        files = len(self.node.filenames)
        file_index = reader.integer("file", high=files, why=f"there are {files} files")
        offset = reader.integer("offset")
        if file_index == files and offset:
            raise reader.error("offset", f"= {offset}, but 'file' says every file was read")
        if file_index < files and not self.node.compression_type:
            name = self.node.filenames[file_index]
            size = _size_or_none(name)
            if size is not None and offset > size:  # compressed offsets count decompressed bytes
                raise reader.error("offset", f"= {offset} is past the end of {name} ({size} bytes)")
        self._close_file()
        self.file_index, self.start_offset = file_index, offset

    def close(self) -> None:
        self._close_file()


def _size_or_none(path: str) -> int | None:
    """The file's size; None if it cannot be read now (opening it will say why)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return None


class TextLineNode(FileRecordsNode):
    """``TextLineDataset`` for one or more files read one after another."""

    stage = "text_lines"

    def open_reader(self, stream: PooledStream, start: int) -> RecordReader:
        return TextLineReader(stream, start, self.buffer_bytes)


def list_files(pattern: str | Sequence[str]) -> list[str]:
    """Paths matching a glob pattern (or several), sorted; an error if none match."""
    patterns = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    matches = sorted({path for p in patterns for path in glob.glob(os.fspath(p))})
    if not matches:
        raise InvalidArgumentError(f"list_files: no files match {patterns!r}")
    return matches
