"""TFRecord reading: a batched, resumable, bounds-checked reader, and random access.

Compression (``"GZIP"`` / ``"ZLIB"``) applies to the *whole file stream*, as in TensorFlow,
so offsets in compressed files count decompressed bytes and such files resume by
re-reading and skipping.

Why batched: per-record Python overhead is what makes record-at-a-time readers slow, so
:meth:`TFRecordReader.read_batch` scans the framing of many records per call inside one
256 KiB buffer (TensorFlow's default), in C when the extension is built.

What can go wrong is never silent (design guarantee G5): a bad CRC or a truncated record
raises :class:`~headrace._errors.DataLossError` naming the file and byte offset; a declared
length above ``max_record_bytes`` raises :class:`~headrace._errors.RecordTooLargeError`
before anything is allocated for it; ``skip_corrupt=True`` skips instead, and counts.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from headrace._closing import ClosesOnExit
from headrace._errors import (
    DataLossError,
    HeadraceError,
    InvalidArgumentError,
    RecordTooLargeError,
)
from headrace.io._crc32c import masked_crc32c
from headrace.io.streams import DEFAULT_BUFFER_SIZE, normalize_compression_type, open_stream
from headrace.io.tfrecord.framing import (
    DEFAULT_MAX_RECORD_BYTES,
    FOOTER_BYTES,
    HEADER,
    HEADER_BYTES,
    RECORD_OVERHEAD_BYTES,
    U32,
    ScanResult,
    ScanStatus,
    scan_records,
    scanner,
)

__all__ = [
    "SkippedSpan",
    "TFRecordReader",
    "open_tfrecord",
    "read_record_at",
    "records_in_spans",
]

# Reads for one oversized record are issued in pieces of at most this size, so that a
# corrupt declared length allocates no more than the bytes that really exist.
_MAX_READ_PIECE = 16 * 1024 * 1024


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


class _SeekableReadable(_Readable, Protocol):
    def seek(self, offset: int, /) -> int: ...


def _decompression_errors() -> tuple[type[BaseException], ...]:
    return (EOFError, zlib.error, gzip.BadGzipFile)


# --------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class SkippedSpan:
    """Bytes that ``skip_corrupt=True`` dropped: where, how many, and why."""

    offset: int
    nbytes: int
    reason: str


class TFRecordReader(ClosesOnExit):
    """Reads TFRecord payloads from a binary stream, many per call.

    ``stream`` gives the *decompressed* record stream through ``read(n)`` and must be
    positioned at ``start_offset`` (use :func:`open_tfrecord` to open, decompress and
    seek a path). ``path`` and ``compression_type`` only serve error messages.

    ``next_offset`` is the stream offset of the next unread record: pass it back as
    ``start_offset`` to resume. When an error interrupts a batch, the records before the
    bad one are returned first and the error is raised by the next call, so
    ``next_offset`` then points exactly at the bad record.

    With ``skip_corrupt=True`` (opt-in), a bad data CRC skips that record; a bad length
    CRC or a truncation skips the rest of the stream (the framing cannot be trusted
    after it). Each skip is counted in ``skipped_records`` (one per skip event: how many
    records the rest of a file held is unknowable), ``skipped_bytes`` and ``skipped``.
    A length above ``max_record_bytes`` always raises: it is a limit, not corruption.
    """

    def __init__(
        self,
        stream: _Readable,
        *,
        path: str | os.PathLike[str] | None = None,
        start_offset: int = 0,
        compression_type: str | None = None,
        verify_crc: bool = True,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        skip_corrupt: bool = False,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        close_stream: bool = False,
    ) -> None:
        if start_offset < 0:
            raise InvalidArgumentError(f"start_offset must be >= 0, got {start_offset}")
        if max_record_bytes < 0:
            raise InvalidArgumentError(f"max_record_bytes must be >= 0, got {max_record_bytes}")
        if buffer_size <= 0:
            raise InvalidArgumentError(f"buffer_size must be > 0, got {buffer_size}")
        self._stream = stream
        self.path = os.fspath(path) if path is not None else None
        self.compression_type = normalize_compression_type(compression_type)
        self.verify_crc = verify_crc
        self.max_record_bytes = max_record_bytes
        self.skip_corrupt = skip_corrupt
        self.buffer_size = buffer_size
        self._close_stream = close_stream
        #: The bytes read and not yet scanned past: bytes, or a view of ``_area``.
        self._buf: bytes | memoryview = b""
        #: The buffer an uncompressed stream is read into, reused from refill to refill
        #: once a read has filled a whole buffer (``_refills``; see :meth:`_fill_into`).
        self._area: bytearray | None = None
        self._refills = False
        self._pos = 0
        self._buf_offset = start_offset  # stream offset of self._buf[0]
        self._stream_exhausted = False
        self._done = False
        self.skipped: list[SkippedSpan] = []

    # -- public API ---------------------------------------------------------------------

    @property
    def next_offset(self) -> int:
        """Offset (in the decompressed stream) of the next record this reader returns."""
        return self._buf_offset + self._pos

    @property
    def skipped_records(self) -> int:
        return len(self.skipped)

    @property
    def skipped_bytes(self) -> int:
        return sum(span.nbytes for span in self.skipped)

    def read_batch(self, max_records: int = 1024, max_bytes: int | None = None) -> list[bytes]:  # noqa: C901
        """Return up to ``max_records`` payloads; an empty list means end of stream.

        ``max_bytes`` bounds the payload total of the batch (at least one record is
        returned, however large, up to ``max_record_bytes``).
        """
        if max_records <= 0:
            raise InvalidArgumentError(f"max_records must be > 0, got {max_records}")
        remaining_bytes = (1 << 62) if max_bytes is None else max_bytes
        records: list[bytes] = []
        while not self._done and len(records) < max_records:
            start = self._pos
            found, self._pos, status, detail = scan_records(
                self._buf,
                start,
                max_records - len(records),
                remaining_bytes,
                self.verify_crc,
                self.max_record_bytes,
            )
            records.extend(found)
            remaining_bytes -= self._pos - start - RECORD_OVERHEAD_BYTES * len(found)
            if status == ScanStatus.LIMIT:
                break
            if status == ScanStatus.NEED_MORE:
                if records and detail - RECORD_OVERHEAD_BYTES > remaining_bytes:
                    break  # the next record is over the bound: leave its payload unread
                if not self._fill(detail):
                    self._handle_short_stream(records)
                    break
                if records and detail == HEADER_BYTES:
                    # Only the header was missing: the scan of the rest starts with an empty
                    # list of its own and would take its first record whatever its size.
                    following = self.next_length()
                    if following is not None and following > remaining_bytes:
                        break
            elif records:
                break  # return what is good now; the next call meets the bad record again
            else:
                self._handle_bad_record(ScanStatus(status), detail)
        if self._pos == len(self._buf) and self._buf:  # all consumed: keep no record's bytes
            self._buf_offset += self._pos
            self._buf, self._pos = b"", 0
        return records

    def next_length(self) -> int | None:
        """The payload length the next record's header declares, reading only the header.

        Lets a caller check a record against its memory budget before the payload is
        read. None at the end of the stream, and when the header is short, corrupt or
        over ``max_record_bytes`` (then :meth:`read_batch` raises, or skips, as usual).
        """
        if self._done or not self._fill(HEADER_BYTES):
            return None
        length, length_crc = HEADER.unpack_from(self._buf, self._pos)
        if self.verify_crc and masked_crc32c(self._buf[self._pos : self._pos + 8]) != length_crc:
            return None
        return int(length) if length <= self.max_record_bytes else None

    def read_record(self) -> bytes | None:
        """Return the next payload, or None at the end of the stream."""
        batch = self.read_batch(1)
        return batch[0] if batch else None

    def __iter__(self) -> Iterator[bytes]:
        while batch := self.read_batch():
            yield from batch

    def close(self) -> None:
        self._done = True
        self._buf = b""
        self._area = None
        self._pos = 0
        if self._close_stream:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()


    # -- buffering ------------------------------------------------------------------------

    def _available(self) -> int:
        return len(self._buf) - self._pos

    def _fill(self, needed: int) -> bool:
        """Make ``needed`` bytes available from the current position; False at EOF.

        Reads at least ``buffer_size`` at a time, and an oversized record in pieces of at
        most 16 MiB, so memory grows with bytes that exist, not with a declared length.
        """
        if self._available() >= needed:
            return True
        readinto = None if self.compression_type else getattr(self._stream, "readinto", None)
        if readinto is not None and self._refills:
            return self._fill_into(readinto, needed)
        pieces = [self._buf[self._pos :]]
        have = len(pieces[0])
        self._buf_offset += self._pos
        self._pos = 0
        while have < needed and not self._stream_exhausted:
            want = min(max(self.buffer_size, needed - have), _MAX_READ_PIECE)
            piece = self._read_stream(want)
            if not piece:
                self._stream_exhausted = True
                break
            pieces.append(piece)
            have += len(piece)
        self._buf = b"".join(pieces) if len(pieces) > 1 else pieces[0]
        # a whole buffer's worth came: more will follow, into a reused buffer (a file
        # smaller than one buffer is read in one piece and never makes one)
        self._refills = have >= self.buffer_size
        return have >= needed

    def _fill_into(self, readinto: Callable[[memoryview], int], needed: int) -> bool:
        """:meth:`_fill` for an uncompressed stream: the unscanned end moves to the front
        of a reused buffer and the stream reads straight into the rest of it.

        Joining the end with a fresh read copied the whole read, and allocating it
        faulted its pages in: a tenth of the CPU of reading and parsing 200-byte
        Examples. The buffer is ``buffer_size`` bytes, or a larger record's ``needed``
        for that one refill (not kept: the next refill makes a ``buffer_size`` one).
        Only a stream that filled a whole buffer gets one: a new buffer costs its
        zeroing and first touch, more than a small file's one read (an interleave over
        1,000 files of 40 KB read 26% fewer records per second when each made one).
        """
        size = max(self.buffer_size, needed)
        rest = bytes(self._buf[self._pos :])  # (a copy: it may overlap where it goes)
        area = self._area
        if area is None or len(area) != size:
            self._buf = b""  # (a view of the old buffer would keep it)
            area = bytearray(size)
        self._area = area if size == self.buffer_size else None
        have = len(rest)
        area[:have] = rest
        view = memoryview(area)
        self._buf_offset += self._pos
        self._pos = 0
        while have < needed and not self._stream_exhausted:
            count = readinto(view[have:])
            if not count:
                self._stream_exhausted = True
                break
            have += count
        self._buf = view[:have]
        return have >= needed

    def _read_stream(self, size: int) -> bytes:
        try:
            return self._stream.read(size)
        except _decompression_errors() as error:
            offset = self._buf_offset + len(self._buf)
            raise DataLossError(
                f"corrupted {self.compression_type} stream near offset {offset} "
                f"{self._offset_note()}in file {self._display_path()}: {error}",
                path=self.path,
                offset=offset,
            ) from error

    # -- errors and skipping -----------------------------------------------------------

    def _display_path(self) -> str:
        return self.path if self.path is not None else "<stream>"

    def _offset_note(self) -> str:
        if not self.compression_type:
            return ""
        return f"(counting decompressed bytes of the {self.compression_type} stream) "

    def _where(self) -> str:
        return f"at offset {self.next_offset} {self._offset_note()}in file {self._display_path()}"

    def _handle_short_stream(self, records: list[bytes]) -> None:
        """At EOF: a clean end if nothing is left, else a truncated record."""
        if self._available() == 0:
            self._done = True
        elif records:
            return  # hand out the good records first; the next call raises
        elif not self.skip_corrupt:
            raise DataLossError(
                f"truncated record {self._where()}", path=self.path, offset=self.next_offset
            )
        else:
            self._skip_rest("truncated record")

    def _handle_bad_record(self, status: ScanStatus, detail: int) -> None:
        offset = self.next_offset
        if status == ScanStatus.TOO_LARGE:
            raise RecordTooLargeError(
                f"record {self._where()} declares {detail} bytes, above "
                f"max_record_bytes={self.max_record_bytes}; nothing was allocated "
                "(raise max_record_bytes if the record is genuine)",
                path=self.path,
                offset=offset,
            )
        if not self.skip_corrupt:
            part = "length" if status == ScanStatus.BAD_LENGTH_CRC else "data"
            raise DataLossError(
                f"corrupted record {self._where()} (bad {part} checksum)",
                path=self.path,
                offset=offset,
            )
        if status == ScanStatus.BAD_DATA_CRC:
            record_bytes = RECORD_OVERHEAD_BYTES + detail
            self.skipped.append(SkippedSpan(offset, record_bytes, "bad data checksum"))
            self._pos += record_bytes
        else:
            self._skip_rest("bad length checksum")

    def _skip_rest(self, reason: str) -> None:
        """Drop everything up to EOF, counting it, in bounded reads."""
        offset = self.next_offset
        nbytes = self._available()
        while not self._stream_exhausted:
            piece = self._read_stream(self.buffer_size)
            if not piece:
                self._stream_exhausted = True
            nbytes += len(piece)
        self._buf_offset = offset + nbytes
        self._buf = b""
        self._pos = 0
        self._done = True
        self.skipped.append(SkippedSpan(offset, nbytes, f"{reason}; rest of file skipped"))


def _file_size(path: str) -> int:
    from headrace.io import objstore

    if objstore.is_remote(path):
        return objstore.object_size(path)
    return os.path.getsize(objstore.local_path(path))


def open_tfrecord(
    path: str | os.PathLike[str],
    *,
    compression_type: str | None = None,
    offset: int = 0,
    verify_crc: bool = True,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    skip_corrupt: bool = False,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> TFRecordReader:
    """Open a TFRecord file for reading from ``offset``, decompressing as TensorFlow does.

    Uncompressed files seek to ``offset``; compressed ones decompress and discard up to
    it (``offset`` counts decompressed bytes), which is why they resume more slowly.
    The returned reader owns the file: close it (or use ``with``).
    """
    compression = normalize_compression_type(compression_type)
    path_str = os.fspath(path)
    if offset < 0:
        raise InvalidArgumentError(f"offset must be >= 0, got {offset}")
    stream = open_stream(path_str, compression, buffer_size=buffer_size)
    try:
        if stream.seek(offset) != offset or (
            not compression and offset > 0 and offset > _file_size(path_str)
        ):
            raise DataLossError(
                f"cannot resume at offset {offset} in file {path_str}: the "
                f"{'decompressed ' if compression else ''}stream is shorter",
                path=path_str,
                offset=offset,
            )
    except BaseException:
        stream.close()
        raise
    return TFRecordReader(
        stream,
        path=path_str,
        start_offset=offset,
        compression_type=compression,
        verify_crc=verify_crc,
        max_record_bytes=max_record_bytes,
        skip_corrupt=skip_corrupt,
        buffer_size=buffer_size,
        close_stream=True,
    )


def records_in_spans(
    buffers: Sequence[bytes | memoryview],
    counts: Sequence[int],
    offsets: Sequence[int],
    *,
    path: str,
    verify_crc: bool = True,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> list[bytes]:
    """The records framed back to back in each buffer (``counts[i]`` of them in
    ``buffers[i]``, read from byte ``offsets[i]`` of ``path`` where an index says they
    are): exactly those records, checked, or an error naming the file and the byte where
    they go wrong. One loop for a whole batch: random access reads one record per buffer."""
    scan = scanner()  # once per batch, not per buffer
    out: list[bytes] = []
    for buf, count, offset in zip(buffers, counts, offsets, strict=True):
        found = scan(buf, 0, count, 1 << 62, verify_crc, max_record_bytes)
        if len(found[0]) != count or found[1] != len(buf):
            raise _span_error(found, buf, offset, path, max_record_bytes)
        out += found[0]
    return out


def _span_error(
    found: ScanResult, buf: bytes | memoryview, offset: int, path: str, max_record_bytes: int
) -> HeadraceError:
    records, stop, status, detail = found
    where = offset + stop
    if status == ScanStatus.TOO_LARGE:
        return RecordTooLargeError(
            f"record at offset {where} in file {path} declares {detail} bytes, above "
            f"max_record_bytes={max_record_bytes}",
            path=path,
            offset=where,
        )
    if status in (ScanStatus.BAD_LENGTH_CRC, ScanStatus.BAD_DATA_CRC):
        part = "length" if status == ScanStatus.BAD_LENGTH_CRC else "data"
        return DataLossError(
            f"corrupted record at offset {where} in file {path} (bad {part} checksum)",
            path=path,
            offset=where,
        )
    if status == ScanStatus.NEED_MORE:
        return DataLossError(
            f"truncated record at offset {where} in file {path}", path=path, offset=where
        )
    return DataLossError(
        f"record at offset {where - len(records[-1]) - RECORD_OVERHEAD_BYTES} in file {path} "
        f"ends at byte {where}, not at byte {offset + len(buf)} where the index puts the "
        "next record: the index does not describe this file",
        path=path,
        offset=where,
    )


def read_record_at(
    file: _SeekableReadable,
    offset: int,
    *,
    path: str | None = None,
    verify_crc: bool = True,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> bytes:
    """Read the one record that starts at ``offset`` of an uncompressed, seekable file.

    The random-access primitive under index files: two reads, no buffering beyond the
    record itself.
    """
    display = path if path is not None else getattr(file, "name", "<stream>")
    file.seek(offset)
    header = file.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise DataLossError(
            f"truncated record at offset {offset} in file {display}", path=path, offset=offset
        )
    return _read_payload(file, header, offset, str(display), verify_crc, max_record_bytes)


def _read_payload(
    file: _SeekableReadable,
    header: bytes,
    offset: int,
    display: str,
    verify_crc: bool,
    max_record_bytes: int,
) -> bytes:
    length, length_crc = HEADER.unpack(header)
    if verify_crc and masked_crc32c(header[:8]) != length_crc:
        raise DataLossError(
            f"corrupted record at offset {offset} in file {display} (bad length checksum)",
            path=display,
            offset=offset,
        )
    if length > max_record_bytes:
        raise RecordTooLargeError(
            f"record at offset {offset} in file {display} declares {length} bytes, above "
            f"max_record_bytes={max_record_bytes}",
            path=display,
            offset=offset,
        )
    body = file.read(length + FOOTER_BYTES)
    if len(body) < length + FOOTER_BYTES:
        raise DataLossError(
            f"truncated record at offset {offset} in file {display}", path=display, offset=offset
        )
    data = body[:length]
    if verify_crc and masked_crc32c(data) != U32.unpack_from(body, length)[0]:
        raise DataLossError(
            f"corrupted record at offset {offset} in file {display} (bad data checksum)",
            path=display,
            offset=offset,
        )
    return data

