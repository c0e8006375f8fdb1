"""Index files for uncompressed TFRecord shards: O(1) random access to record ``i``.

An index is the byte offset of every record plus a cheap *fingerprint* of the shard
(size, mtime_ns, CRC32 of its first and last 4 KiB), stored next to the shard as
``<shard>.hrx``. The fingerprint is what makes an index safe to trust later: if the shard
was rewritten, appended to or truncated, :func:`load_index` refuses the index and names
both files, instead of reading records at wrong offsets (G5).

File layout (all little-endian; 56-byte header, so the offsets are 8-byte aligned)::

    8s  magic b"HRTFRIDX"     u32 version (1)        u32 fingerprint window (4096)
    u64 shard size            i64 shard mtime_ns     u32 CRC32 of the shard's head
    u32 CRC32 of its tail     u64 record count       u32 CRC32 of the offsets  u32 0
    u64 offsets[record count]

Compressed shards cannot be indexed: their records cannot be reached without
decompressing everything before them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import zlib
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from headrace._errors import DataLossError, RecordTooLargeError
from headrace.io import objstore
from headrace.io._crc32c import masked_crc32c
from headrace.io.filepool import FileLimiter, get_default_pool
from headrace.io.files import require_regular_file
from headrace.io.tfrecord.framing import DEFAULT_MAX_RECORD_BYTES, RECORD_OVERHEAD_BYTES
from headrace.io.tfrecord.reader import read_record_at

__all__ = [
    "INDEX_SUFFIX",
    "StaleIndexError",
    "TFRecordIndex",
    "build_index",
    "index_path_for",
    "load_index",
    "load_or_build_index",
    "write_index",
]

INDEX_SUFFIX = ".hrx"
_MAGIC = b"HRTFRIDX"
_VERSION = 1
_WINDOW = 4096
_HEADER = struct.Struct("<8sIIQqIIQII")
_LENGTH = struct.Struct("<Q")
_LENGTH_CRC = struct.Struct("<I")


class StaleIndexError(DataLossError):
    """An index file is missing, unreadable, or no longer matches its shard.

    Rebuild it with :func:`build_index` (or use :func:`load_or_build_index`).
    """


@dataclass(frozen=True)
class _Fingerprint:
    size: int
    mtime_ns: int
    head_crc: int
    tail_crc: int


def _fingerprint(file: IO[bytes]) -> _Fingerprint:
    """Size, mtime and CRC32 of the first and last 4 KiB: cheap, and catches rewrites
    that keep the size (a mtime can be preserved by copying tools; the bytes cannot)."""
    stat = os.fstat(file.fileno())
    file.seek(0)
    head = file.read(_WINDOW)
    file.seek(max(0, stat.st_size - _WINDOW))
    tail = file.read(_WINDOW)
    return _Fingerprint(stat.st_size, stat.st_mtime_ns, zlib.crc32(head), zlib.crc32(tail))


def _slot(limiter: FileLimiter | None) -> contextlib.AbstractContextManager[None]:
    """A file-pool slot for a descriptor opened and closed at once (G2): an index is
    read whole, a shard only fingerprinted, yet each is one more file while open."""
    return get_default_pool().borrow(limiter)


def index_path_for(shard_path: str | os.PathLike[str]) -> str:
    """Where the index of ``shard_path`` lives: next to it, with ``.hrx`` appended."""
    return os.fspath(shard_path) + INDEX_SUFFIX


@dataclass(frozen=True, eq=False)
class TFRecordIndex:
    """Offsets of every record of one shard; ``offsets`` is a read-only uint64 array."""

    shard_path: str
    offsets: npt.NDArray[np.uint64]
    shard_size: int

    def __len__(self) -> int:
        return len(self.offsets)

    def payload_length(self, record_index: int) -> int:
        """Payload bytes of record ``record_index``, from the offsets alone."""
        end = (
            int(self.offsets[record_index + 1])
            if record_index + 1 < len(self.offsets)
            else self.shard_size
        )
        return end - int(self.offsets[record_index]) - RECORD_OVERHEAD_BYTES

    def read(self, file: IO[bytes], record_index: int, *, verify_crc: bool = True) -> bytes:
        """Read record ``record_index`` from ``file`` (the shard, opened in binary mode)."""
        return read_record_at(
            file,
            int(self.offsets[record_index]),
            path=self.shard_path,
            verify_crc=verify_crc,
            max_record_bytes=self.payload_length(record_index),
        )


def _scan_offsets(view: Any, size: int, path: str, max_record_bytes: int) -> npt.NDArray[np.uint64]:
    """Walk the framing only (headers, skipping payloads), checking each length's CRC."""
    offsets: list[int] = []
    position = 0
    while position < size:
        if size - position < RECORD_OVERHEAD_BYTES:
            raise DataLossError(
                f"truncated record at offset {position} in file {path}", path=path, offset=position
            )
        (length,) = _LENGTH.unpack_from(view, position)
        (length_crc,) = _LENGTH_CRC.unpack_from(view, position + 8)
        if masked_crc32c(view[position : position + 8]) != length_crc:
            raise DataLossError(
                f"corrupted record at offset {position} in file {path} (bad length checksum)",
                path=path,
                offset=position,
            )
        if length > max_record_bytes:
            raise RecordTooLargeError(
                f"record at offset {position} in file {path} declares {length} bytes, above "
                f"max_record_bytes={max_record_bytes}",
                path=path,
                offset=position,
            )
        if length > size - position - RECORD_OVERHEAD_BYTES:
            raise DataLossError(
                f"truncated record at offset {position} in file {path}", path=path, offset=position
            )
        offsets.append(position)
        position += RECORD_OVERHEAD_BYTES + length
    return np.asarray(offsets, dtype=np.uint64)


def write_atomically(path: str, chunks: list[bytes]) -> None:
    temp_path = os.path.join(
        os.path.dirname(os.path.abspath(path)),
        f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp",
    )
    try:
        with open(temp_path, "xb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_path, path)
    except BaseException:
        if os.path.exists(temp_path):
            os.unlink(temp_path)
        raise


def build_index(
    shard_path: str | os.PathLike[str],
    *,
    write: bool = True,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    limiter: FileLimiter | None = None,
) -> TFRecordIndex:
    """Scan an uncompressed shard's framing and return (and by default save) its index.

    Only headers are read and length checksums verified; payload checksums are checked
    when records are read. Raises DataLossError for truncated or corrupt framing,
    StaleIndexError if the shard changes while it is scanned, and InvalidArgumentError
    for a path that is not a regular file (a device, a FIFO: nothing is written next
    to it). Its descriptors count against the file pool's caps (``limiter``: a
    pipeline's share).
    """
    path = os.fspath(shard_path)
    require_regular_file(
        path, "build_index",
        " (an index is written next to the file it indexes and gives offsets into it)",
    )
    with _slot(limiter), open(path, "rb") as file:
        before = _fingerprint(file)
        if before.size == 0:
            offsets = np.zeros(0, dtype=np.uint64)
        else:
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
                offsets = _scan_offsets(view, before.size, path, max_record_bytes)
        if _fingerprint(file) != before:
            raise StaleIndexError(f"file {path} changed while it was being indexed", path=path)
    if write:
        with _slot(limiter):
            _save(path, offsets, before)
    offsets.flags.writeable = False
    return TFRecordIndex(path, offsets, before.size)


def _save(path: str, offsets: npt.NDArray[np.uint64], fingerprint: _Fingerprint) -> None:
    offsets_bytes = offsets.astype("<u8").tobytes()
    header = _HEADER.pack(
        _MAGIC,
        _VERSION,
        _WINDOW,
        fingerprint.size,
        fingerprint.mtime_ns,
        fingerprint.head_crc,
        fingerprint.tail_crc,
        len(offsets),
        zlib.crc32(offsets_bytes),
        0,
    )
    write_atomically(index_path_for(path), [header, offsets_bytes])


def write_index(shard_path: str | os.PathLike[str], offsets: npt.ArrayLike) -> None:
    """Save the index of a shard its writer just finished, from the offsets it wrote at.

    No scan: the writer knows where every record starts. The shard's fingerprint is
    taken now, so the index is refused later if the shard changes.
    """
    path = os.fspath(shard_path)
    with _slot(None):
        with open(path, "rb") as file:
            fingerprint = _fingerprint(file)
        _save(path, np.asarray(offsets, dtype=np.uint64), fingerprint)


def _stale(message: str, shard_path: str) -> StaleIndexError:
    return StaleIndexError(
        f"{message}; rebuild it with headrace.io.tfrecord_index.build_index({shard_path!r})",
        path=shard_path,
    )


def load_index(
    shard_path: str | os.PathLike[str],
    *,
    index_path: str | os.PathLike[str] | None = None,
    size_only: bool = False,
    limiter: FileLimiter | None = None,
) -> TFRecordIndex:
    """Load the index of ``shard_path``, refusing it if it no longer matches the shard.

    ``size_only``: compare only the shard's size, not its mtime and the CRCs of its
    first and last 4 KiB — for a reader that checks every record's framing and CRCs
    against the index anyway (a cache reading its own file), so that a flipped byte is
    reported at its record's offset rather than as a stale index.

    The offsets are read into memory (8 bytes a record) and the index file is closed
    at once: a memory map would hold a descriptor for as long as the index lives,
    outside the file pool's cap, and 600 indexed shards would exhaust a
    RLIMIT_NOFILE of 64 (G2). Their CRC is checked once, as they are read. The index
    file and the shard are opened one after the other, each in a file-pool slot
    (``limiter``: a pipeline's share), so they count against the caps too.
    """
    path = os.fspath(shard_path)
    index_file = os.fspath(index_path) if index_path is not None else index_path_for(path)
    if objstore.is_remote(path):
        return _load_remote_index(path, index_file, size_only, limiter)
    try:
        with _slot(limiter), open(index_file, "rb") as file:
            header = file.read(_HEADER.size)
            index_size = os.fstat(file.fileno()).st_size
            if len(header) < _HEADER.size:
                raise _stale(f"index file {index_file} is truncated", path)
            magic, version, window, size, mtime_ns, head_crc, tail_crc, count, offsets_crc, _ = (
                _HEADER.unpack(header)
            )
            if magic != _MAGIC or version != _VERSION or window != _WINDOW:
                raise _stale(f"{index_file} is not a version-{_VERSION} headrace index", path)
            if index_size != _HEADER.size + 8 * count:
                raise _stale(f"index file {index_file} is truncated or has trailing bytes", path)
            offsets_bytes = file.read(8 * count)
    except FileNotFoundError:
        raise _stale(f"no index file {index_file} for {path}", path) from None
    if len(offsets_bytes) != 8 * count:
        raise _stale(f"index file {index_file} is truncated (it shrank while read)", path)
    with _slot(limiter), open(path, "rb") as shard:
        current = _fingerprint(shard)
    recorded = _Fingerprint(size, mtime_ns, head_crc, tail_crc)
    if current.size != size or (not size_only and current != recorded):
        raise _stale(
            f"index file {index_file} is stale: {path} changed since it was indexed "
            f"(size {size} -> {current.size}, mtime_ns {mtime_ns} -> {current.mtime_ns})",
            path,
        )
    if zlib.crc32(offsets_bytes) != offsets_crc:
        raise _stale(f"index file {index_file} is corrupt (offsets checksum)", path)
    # frombuffer over bytes: read-only, and no copy of the 8 bytes a record
    offsets: npt.NDArray[np.uint64] = np.frombuffer(offsets_bytes, dtype="<u8")
    return TFRecordIndex(path, offsets, size)


def _load_remote_index(
    path: str, index_file: str, size_only: bool, limiter: FileLimiter | None
) -> TFRecordIndex:
    """:func:`load_index` of an object: the index read whole in one ranged GET, the
    shard fingerprinted by its size and the CRCs of its first and last 4 KiB (two
    more); its mtime is not compared, since an upload has a time of its own. Each
    request runs on a file-pool slot (G2)."""
    try:
        with _slot(limiter):
            info = objstore.object_info(index_file)
            data = objstore.read_whole(info)
    except FileNotFoundError:
        raise _stale(f"no index file {index_file} for {path}", path) from None
    header = data[: _HEADER.size]
    if len(header) < _HEADER.size:
        raise _stale(f"index file {index_file} is truncated", path)
    magic, version, window, size, _, head_crc, tail_crc, count, offsets_crc, _ = (
        _HEADER.unpack(header)
    )
    if magic != _MAGIC or version != _VERSION or window != _WINDOW:
        raise _stale(f"{index_file} is not a version-{_VERSION} headrace index", path)
    if len(data) != _HEADER.size + 8 * count:
        raise _stale(f"index file {index_file} is truncated or has trailing bytes", path)
    offsets_bytes = data[_HEADER.size :]
    with _slot(limiter):
        shard = objstore.object_info(path)
        head = tail = b""
        if not size_only and shard.size == size:
            head = objstore.read_whole(shard, 0, _WINDOW)
            tail = objstore.read_whole(shard, max(0, shard.size - _WINDOW), _WINDOW)
    if shard.size != size or (
        not size_only and (zlib.crc32(head), zlib.crc32(tail)) != (head_crc, tail_crc)
    ):
        raise _stale(
            f"index file {index_file} is stale: {path} changed since it was indexed "
            f"(size {size} -> {shard.size}, or its first or last 4 KiB)", path,
        )
    if zlib.crc32(offsets_bytes) != offsets_crc:
        raise _stale(f"index file {index_file} is corrupt (offsets checksum)", path)
    offsets: npt.NDArray[np.uint64] = np.frombuffer(offsets_bytes, dtype="<u8")
    return TFRecordIndex(path, offsets, size)


def load_or_build_index(shard_path: str | os.PathLike[str]) -> TFRecordIndex:
    """Load the shard's index, rebuilding (and saving) it when missing or stale."""
    try:
        return load_index(shard_path)
    except StaleIndexError:
        return build_index(shard_path)
