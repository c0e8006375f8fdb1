"""TFRecord framing: the record layout, its checks and its encoding, on bytes in memory.

A TFRecord file (``tensorflow/core/lib/io/record_writer.h``) is a sequence of::

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

This module cuts records out of a buffer (:func:`scan_records`, in C when the extension
is built, with a pure-Python twin giving the same results) and frames records
(:func:`encode_records`). It does no I/O: :mod:`.reader` and :mod:`.writer` own the files.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from enum import IntEnum

from headrace.io._crc32c import masked_crc32c
from headrace.io._native import native_module

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "FOOTER_BYTES",
    "HEADER",
    "HEADER_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "U32",
    "ScanResult",
    "ScanStatus",
    "encode_records",
    "frame_record",
    "scan_records",
    "scan_records_py",
    "scanner",
]

#: Declared lengths above this are refused before allocation. 1 GiB holds any sane
#: record (TensorFlow's protos are limited to 2 GiB) yet stops a garbage length of 2**60.
DEFAULT_MAX_RECORD_BYTES = 1 << 30
HEADER_BYTES = 12
FOOTER_BYTES = 4
#: Bytes of framing around each record's payload.
RECORD_OVERHEAD_BYTES = HEADER_BYTES + FOOTER_BYTES

_U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
HEADER = struct.Struct("<QI")


class ScanStatus(IntEnum):
    """Why :func:`scan_records` stopped; shared with the C implementation."""

    LIMIT = 0  # max_records or max_bytes reached
    NEED_MORE = 1  # detail = bytes needed from the stop position to finish the next record
    BAD_LENGTH_CRC = 2
    BAD_DATA_CRC = 3  # detail = the record's payload length
    TOO_LARGE = 4  # detail = the declared length


ScanResult = tuple[list[bytes], int, int, int]


def scan_records_py(
    buf: bytes | memoryview,
    pos: int,
    max_records: int,
    max_bytes: int,
    verify_crc: bool,
    max_record_bytes: int,
) -> ScanResult:
    """Cut complete records out of ``buf`` from ``pos``; the C twin is ``_hrio.scan_records``.

    Returns ``(records, stop_position, status, detail)``. Records are taken while the batch
    is empty or the payload total stays within ``max_bytes``.
    """
    records: list[bytes] = []
    total = 0
    end = len(buf)
    while len(records) < max_records:
        if end - pos < HEADER_BYTES:
            return records, pos, ScanStatus.NEED_MORE, HEADER_BYTES
        length, length_crc = HEADER.unpack_from(buf, pos)
        if verify_crc and masked_crc32c(buf[pos : pos + 8]) != length_crc:
            return records, pos, ScanStatus.BAD_LENGTH_CRC, 0
        if length > max_record_bytes:
            return records, pos, ScanStatus.TOO_LARGE, length
        if end - pos < RECORD_OVERHEAD_BYTES + length:
            return records, pos, ScanStatus.NEED_MORE, RECORD_OVERHEAD_BYTES + length
        if records and total + length > max_bytes:
            break
        data = bytes(buf[pos + HEADER_BYTES : pos + HEADER_BYTES + length])
        if verify_crc:
            (data_crc,) = U32.unpack_from(buf, pos + HEADER_BYTES + length)
            if masked_crc32c(data) != data_crc:
                return records, pos, ScanStatus.BAD_DATA_CRC, length
        records.append(data)
        total += length
        pos += RECORD_OVERHEAD_BYTES + length
    return records, pos, ScanStatus.LIMIT, 0


def scan_records(
    buf: bytes | memoryview,
    pos: int,
    max_records: int,
    max_bytes: int,
    verify_crc: bool,
    max_record_bytes: int,
) -> ScanResult:
    """Scan TFRecord framing in a buffer: C when available, else pure Python (same results)."""
    return scanner()(buf, pos, max_records, max_bytes, verify_crc, max_record_bytes)


def scanner() -> Callable[[bytes | memoryview, int, int, int, bool, int], ScanResult]:
    """The C scanner when the extension is enabled, else its pure-Python twin."""
    native = native_module()
    return native.scan_records if native is not None else scan_records_py


def frame_record(record: bytes | bytearray | memoryview) -> bytes:
    header = _U64.pack(len(record))
    return b"".join(
        (header, U32.pack(masked_crc32c(header)), record, U32.pack(masked_crc32c(record)))
    )


def encode_records(records: Sequence[bytes]) -> bytes:
    """Return the TFRecord framing of ``records``, concatenated (what a file would hold)."""
    native = native_module()
    if native is not None:
        framed: bytes = native.frame_records(list(records))
        return framed
    return b"".join(frame_record(record) for record in records)

