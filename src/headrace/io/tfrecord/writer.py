"""TFRecord writing: an atomic writer (a file appears under its name only when complete),
uncompressed or compressed as TensorFlow compresses (GZIP / ZLIB over the whole stream)."""

from __future__ import annotations

import gzip
import os
import secrets
import struct
import zlib
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import IO

from headrace._errors import InvalidArgumentError
from headrace.io._crc32c import crc32c, mask_crc, masked_crc32c
from headrace.io.streams import DEFAULT_BUFFER_SIZE, normalize_compression_type
from headrace.io.tfrecord.framing import RECORD_OVERHEAD_BYTES, U32, encode_records, frame_record

__all__ = ["TFRecordWriter", "fsync_directory", "record_frame", "write_tfrecord"]

_U64 = struct.Struct("<Q")


class _ZlibWriter:
    """``write`` / ``close`` over a zlib (RFC 1950) compressor, as TensorFlow's ZLIB writes."""

    def __init__(self, raw: IO[bytes], level: int) -> None:
        self._raw = raw
        self._compressor = zlib.compressobj(level)

    def write(self, data: bytes | memoryview) -> int:
        self._raw.write(self._compressor.compress(data))
        return len(data)

    def close(self) -> None:
        self._raw.write(self._compressor.flush())


def record_frame(parts: Sequence[bytes | memoryview]) -> tuple[bytes, bytes]:
    """The TFRecord header (length, its CRC) and footer (the data's CRC) of one record
    made of ``parts``, computed over the parts in place."""
    header = _U64.pack(sum(len(part) for part in parts))
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    return header + U32.pack(masked_crc32c(header)), U32.pack(mask_crc(crc))


class TFRecordWriter:
    """Writes a TFRecord file atomically: it appears under ``path`` only when complete.

    Records go to a temporary file in the same directory (same file system, so the final
    rename is atomic); :meth:`close` flushes, fsyncs and renames it to ``path``. An
    exception inside ``with``, or :meth:`abort`, removes the temporary file and leaves any
    previous ``path`` untouched, so a crashed write never looks complete (G5).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        compression_type: str | None = None,
        *,
        compression_level: int = 6,
    ) -> None:
        self.path = os.fspath(path)
        self.compression_type = normalize_compression_type(compression_type)
        directory, name = os.path.split(os.path.abspath(self.path))
        self._temp_path = os.path.join(
            directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        )
        descriptor = os.open(self._temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._file: IO[bytes] | None = open(descriptor, "wb", buffering=DEFAULT_BUFFER_SIZE)  # noqa: SIM115
        self._sink: _ZlibWriter | gzip.GzipFile | IO[bytes] = self._file
        if self.compression_type == "GZIP":
            self._sink = gzip.GzipFile(
                filename="", mode="wb", fileobj=self._file, compresslevel=compression_level, mtime=0
            )
        elif self.compression_type == "ZLIB":
            self._sink = _ZlibWriter(self._file, compression_level)
        self.records_written = 0

    def write(self, record: bytes | bytearray | memoryview) -> None:
        """Append one record."""
        self._check_open()
        self._sink.write(frame_record(record))
        self.records_written += 1

    def write_many(self, records: Sequence[bytes]) -> None:
        """Append many records with one framing pass (in C when available) and one write."""
        self._check_open()
        self._sink.write(encode_records(records))
        self.records_written += len(records)

    def write_parts(self, parts: Sequence[bytes | memoryview]) -> int:
        """Append one record made of ``parts`` (bytes or 1-D byte views), framed around
        them and written piece by piece: a large record is never joined into one more
        copy in memory. Returns the bytes the record takes in the file (uncompressed)."""
        self._check_open()
        header, footer = record_frame(parts)
        self._sink.write(header)
        for part in parts:
            self._sink.write(part)
        self._sink.write(footer)
        self.records_written += 1
        return sum(len(part) for part in parts) + RECORD_OVERHEAD_BYTES

    def write_framed(self, pieces: Sequence[bytes | memoryview], records: int) -> int:
        """Append ``records`` records already framed (headers, payloads, footers, in
        ``pieces``, written as they are): for a writer that keeps each record's footer
        (its data CRC). Returns the bytes written (uncompressed)."""
        self._check_open()
        for piece in pieces:
            self._sink.write(piece)
        self.records_written += records
        return sum(len(piece) for piece in pieces)

    def close(self) -> None:
        """Finish the file and move it to ``path``; a no-op when already closed."""
        if self._file is None:
            return
        try:
            if self._sink is not self._file:
                self._sink.close()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._temp_path, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_directory(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Discard everything written; ``path`` is not created or changed."""
        file, self._file = self._file, None
        if file is not None:
            file.close()
        if os.path.exists(self._temp_path):
            os.unlink(self._temp_path)

    def _check_open(self) -> None:
        if self._file is None:
            raise InvalidArgumentError(f"TFRecordWriter for {self.path} is closed")

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # Never finished with close(): the file is incomplete, so it must not appear.
        try:
            if getattr(self, "_file", None) is not None:
                self.abort()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def fsync_directory(directory: str) -> None:
    """Make the rename durable; some platforms cannot open directories, which is fine."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_tfrecord(
    path: str | os.PathLike[str],
    records: Iterable[bytes],
    compression_type: str | None = None,
) -> int:
    """Write ``records`` to ``path`` atomically; return how many were written."""
    with TFRecordWriter(path, compression_type) as writer:
        batch: list[bytes] = []
        for record in records:
            batch.append(record)
            if len(batch) == 1024:
                writer.write_many(batch)
                batch = []
        writer.write_many(batch)
        return writer.records_written

