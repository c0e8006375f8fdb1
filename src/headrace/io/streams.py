"""Byte streams of (possibly compressed) files that can give their descriptor back and resume.

Why this exists: a pipeline over thousands of shards cannot keep one OS descriptor per
shard (tf.data's "Too many open files"). A :class:`SuspendableStream` can *suspend* — close
its descriptor but keep exactly what it needs to continue — and later *resume* at the same
byte, producing the same bytes as if it had never stopped. :mod:`headrace.io.filepool`
decides when; this module only knows how.

What a suspended stream keeps:

* uncompressed: its offset (a few bytes of Python state);
* ``"GZIP"`` / ``"ZLIB"``: the offset of the first *compressed* byte the decompressor has
  not consumed, the decompressor itself (zlib's 32 KiB window plus ~7 KiB of inflate
  state) and the decompressed bytes not yet returned. :attr:`SuspendableStream.suspended_nbytes`
  reports that, so the caller can charge it to its memory budget.

Compression follows TensorFlow: it applies to the whole file, never per record. A file may
hold several concatenated members (``cat a.gz b.gz``); all of them are read, in order, as
one stream. ``tell()`` counts *decompressed* bytes.

Only the standard library is used; descriptors are read with ``os.pread`` at an explicit
offset, so no hidden file position has to be restored on resume (POSIX only).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import zlib
from typing import Any

from headrace._closing import ClosesOnExit
from headrace._errors import DataLossError, InvalidArgumentError

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "ZLIB_STATE_NBYTES",
    "SuspendableStream",
    "make_stream",
    "normalize_compression_type",
    "open_stream",
]

DEFAULT_BUFFER_SIZE = 256 * 1024
"""Bytes read (or decompressed) per refill; tf.data's reader default, 256 KiB."""

ZLIB_STATE_NBYTES = 32 * 1024 + 8 * 1024
"""Conservative size of one zlib inflate state: the 32 KiB window of ``wbits=15`` plus
``struct inflate_state`` (~7.1 KiB on 64-bit, mostly decoding tables) and the object."""

#: Buffers one preadv call takes at most (Linux's IOV_MAX).
_IOV_MAX = 1024
COMPRESSED_READ_SIZE = 64 * 1024
"""Compressed bytes read per refill. Small, because the decompressor keeps a reference to
the unconsumed tail of the last chunk, which a suspended stream must account for."""

_MAX_READ_SIZE = 16 * 1024 * 1024
"""Largest single ``pread``: CPython allocates the whole request up front, so a huge
``read(n)`` on a small file must not allocate ``n`` bytes before learning the file is short."""

_SPENT_DECOMPRESSOR = zlib.decompressobj()
"""Stands in for the decompressor of closed streams, so closing frees the real one."""

_WBITS = {"GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}
_COMPRESSION_TYPES = {None: "", "": "", "GZIP": "GZIP", "ZLIB": "ZLIB"}


def normalize_compression_type(compression_type: str | None) -> str:
    """Map TensorFlow's ``None | "" | "GZIP" | "ZLIB"`` to ``"" | "GZIP" | "ZLIB"``."""
    try:
        return _COMPRESSION_TYPES[compression_type]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"compression_type must be None, '', 'GZIP' or 'ZLIB' (as in TensorFlow), "
            f"got {compression_type!r}"
        ) from None


class SuspendableStream(ClosesOnExit):
    """The decompressed bytes of one file, readable with ``read(n)``, suspendable at any byte.

    A new stream holds no descriptor: call :meth:`resume` (or use :func:`open_stream`).
    ``read`` and ``seek`` on a suspended stream raise ``ValueError`` instead of reopening
    silently, because whoever owns the descriptor budget (the file pool) must decide when a
    descriptor is opened. Not thread-safe: one thread at a time, which the pool ensures.
    """

    def __init__(self, path: str | os.PathLike[str], *, buffer_size: int) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise InvalidArgumentError(f"buffer_size must be a positive int, got {buffer_size!r}")
        self._path = os.fspath(path)
        self._buffer_size = buffer_size
        self._descriptor: int | None = None
        self._buffer = b""  # decompressed bytes read ahead; unread from _buffer_start on
        self._buffer_start = 0
        self._position = 0  # logical (decompressed) offset of the next byte read() returns
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def path(self) -> str:
        return self._path

    @property
    def compression_type(self) -> str:
        """``""``, ``"GZIP"`` or ``"ZLIB"``."""
        return ""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def holds_descriptor(self) -> bool:
        """Whether an OS descriptor is open right now (False when suspended or closed)."""
        return self._descriptor is not None

    @property
    def suspended_nbytes(self) -> int:
        """Bytes this stream keeps while it holds no descriptor; 0 when open or closed.

        Charged to a memory budget by the caller: it is memory that outlives the
        descriptor, and with thousands of suspended compressed shards it adds up.
        """
        return 0

    # ------------------------------------------------------------------ lifecycle
    def attach_pool(self, pool: Any, limiter: Any) -> None:
        """Told by the file pool that opens it: a stream that makes requests of its
        own in the background (an object store's read-ahead) takes a slot of ``pool``
        (and ``limiter``) for each, so they count against the caps too (G2)."""

    def attach_successor(self, successor: Any, on_last_range: Any) -> None:
        """Told by the file source that reads a list of objects: an object store's
        stream takes its metadata and first range from ``successor`` (read ahead), and
        calls ``on_last_range()`` when it reads its last range (see
        :class:`headrace.io.objstore.Successor`). A local file needs neither."""

    def resume(self) -> None:
        """Open the descriptor again (no-op if open); reading continues at the same byte.

        Raises whatever ``os.open`` raises (``FileNotFoundError``, ``OSError(EMFILE)``), or
        ``IsADirectoryError`` naming the path (a directory opens, but cannot be read);
        the stream stays suspended and intact in that case, so the call can be retried.
        """
        self._check_not_closed()
        if self._descriptor is None:
            self._descriptor = self._open_descriptor()

    def _open_descriptor(self) -> int:
        """Open the file; an object-store stream (:mod:`headrace.io.objstore`) opens its
        object instead and reads through :meth:`_pread` / :meth:`_pread_into`."""
        descriptor = os.open(self._path, os.O_RDONLY)
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            # (Linux opens a directory for reading; the first read would then fail
            # with EISDIR and no file name)
            os.close(descriptor)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self._path)
        return descriptor

    def _pread(self, descriptor: int, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the end of the file)."""
        return os.pread(descriptor, size, offset)

    def _pread_into(self, descriptor: int, buffer: memoryview, offset: int) -> int:
        """Read the bytes at ``offset`` into ``buffer``; how many (0 at the end)."""
        return os.preadv(descriptor, [buffer], offset)

    def _pread_scatter(self, descriptor: int, buffers: list[memoryview], offset: int) -> int:
        """Read the bytes at ``offset`` into ``buffers``, one after another; how many."""
        return os.preadv(descriptor, buffers[:_IOV_MAX], offset)

    def suspend(self) -> None:
        """Close the descriptor, keeping what is needed to resume at the same byte."""
        if self._descriptor is None:
            return
        self._save_for_suspension()
        self._close_descriptor()

    def close(self) -> None:
        """Close the descriptor and drop all saved state. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buffer = b""
        self._buffer_start = 0
        self._drop_saved_state()
        self._close_descriptor()


    # ------------------------------------------------------------------ reading
    def read(self, size: int = -1, /) -> bytes:
        """Return the next ``size`` decompressed bytes; fewer only at the end of the stream.

        ``size < 0`` reads to the end of the stream.
        """
        self._check_not_closed()
        pieces: list[bytes] = []
        self._advance(size if size >= 0 else sys.maxsize, pieces)
        return b"".join(pieces)

    def readinto(self, buffer: memoryview, /) -> int:
        """Read the next bytes into ``buffer``; how many, fewer than its length only at
        the end of the stream. An uncompressed stream reads straight into it (see
        :class:`PlainStream`); here the bytes are read, then copied."""
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        """The logical offset: decompressed bytes returned (or skipped) so far."""
        self._check_not_closed()
        return self._position

    def seek(self, offset: int, /) -> int:
        """Move to decompressed byte ``offset`` and return the new position."""
        self._check_not_closed()
        if offset < 0:
            raise InvalidArgumentError(f"seek offset must be >= 0, got {offset}")
        self._seek_to(offset)
        return self._position

    def pread_many(self, offsets: list[int], sizes: list[int]) -> list[bytes]:
        """The ``sizes[i]`` bytes at each ``offsets[i]``, read in place (uncompressed only)."""
        raise InvalidArgumentError(
            f"positioned reads need an uncompressed file; {self._path!r} is "
            f"{self.compression_type}"
        )

    def pread_scatter(self, offset: int, buffers: list[memoryview]) -> int:
        """Read the bytes at ``offset`` into ``buffers`` one after another (uncompressed
        only); how many, fewer only at the end of the file."""
        raise InvalidArgumentError(
            f"positioned reads need an uncompressed file; {self._path!r} is "
            f"{self.compression_type}"
        )

    def pread_into(self, offset: int, buffer: memoryview) -> int:
        """Read the bytes at ``offset`` into ``buffer`` (uncompressed only); how many were
        read, fewer than ``len(buffer)`` only at the end of the file. The stream's own
        position and read-ahead are untouched."""
        raise InvalidArgumentError(
            f"positioned reads need an uncompressed file; {self._path!r} is "
            f"{self.compression_type}"
        )

    # ------------------------------------------------------------------ for subclasses
    def _read_chunk(self, descriptor: int, wanted: int) -> bytes:
        """Return the next decompressed bytes (at least one, up to about ``wanted``);
        ``b""`` only at the end of the stream."""
        raise NotImplementedError

    def _seek_to(self, offset: int) -> None:
        raise NotImplementedError

    def _save_for_suspension(self) -> None:
        """Reduce the in-memory state to what resuming needs; the descriptor closes next."""

    def _drop_saved_state(self) -> None:
        """Release everything kept for resuming (on close)."""

    # ------------------------------------------------------------------ helpers
    def _advance(self, nbytes: int, sink: list[bytes] | None) -> None:
        """Move forward ``nbytes`` (or to the end), appending the bytes to ``sink`` if given.

        Shared by ``read`` and forward seeks of compressed streams, which discard.
        """
        remaining = nbytes
        while remaining > 0:
            if self._buffer_start >= len(self._buffer):
                wanted = min(remaining, _MAX_READ_SIZE)
                chunk = self._read_chunk(self._require_descriptor(), wanted)
                if not chunk:
                    return
                self._buffer, self._buffer_start = chunk, 0
            end = min(len(self._buffer), self._buffer_start + remaining)
            if sink is not None:
                whole = self._buffer_start == 0 and end == len(self._buffer)
                sink.append(self._buffer if whole else self._buffer[self._buffer_start : end])
            taken = end - self._buffer_start
            self._buffer_start = end
            self._position += taken
            remaining -= taken

    def _drop_buffer(self) -> None:
        self._buffer = b""
        self._buffer_start = 0

    def _unread_nbytes(self) -> int:
        return len(self._buffer) - self._buffer_start

    def _require_descriptor(self) -> int:
        if self._descriptor is None:
            raise ValueError(f"stream of {self._path!r} is suspended: call resume() before reading")
        return self._descriptor

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ValueError(f"I/O operation on closed stream of {self._path!r}")

    def _close_descriptor(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            self._release_descriptor(descriptor)

    def _release_descriptor(self, descriptor: int) -> None:
        os.close(descriptor)


class PlainStream(SuspendableStream):
    """An uncompressed file: the logical offset *is* the file offset, so seeking is free
    and suspending keeps nothing but the offset."""

    def __init__(self, path: str | os.PathLike[str], *, buffer_size: int) -> None:
        super().__init__(path, buffer_size=buffer_size)
        self._file_offset = 0  # offset in the file of the first byte not yet read ahead

    def _read_chunk(self, descriptor: int, wanted: int) -> bytes:
        chunk = self._pread(descriptor, max(self._buffer_size, wanted), self._file_offset)
        self._file_offset += len(chunk)
        return chunk

    def _seek_to(self, offset: int) -> None:
        self._drop_buffer()
        self._file_offset = self._position = offset

    def readinto(self, buffer: memoryview, /) -> int:
        """Read the next bytes into ``buffer`` (a caller's reused buffer): the read-ahead
        of an earlier :meth:`read` first, then one positioned read into the rest — no
        bytes object is made, so there are no fresh pages to fault in per read and no
        copy to join a record's start with its end (a TFRecord reader's refills)."""
        self._check_not_closed()
        total = min(self._unread_nbytes(), len(buffer))
        if total:
            start = self._buffer_start
            buffer[:total] = memoryview(self._buffer)[start : start + total]
            self._buffer_start += total
        if total < len(buffer):
            count = self.pread_into(self._file_offset, buffer[total:])
            self._file_offset += count
            total += count
        self._position += total
        return total

    def pread_many(self, offsets: list[int], sizes: list[int]) -> list[bytes]:
        """The ``sizes[i]`` bytes at each ``offsets[i]``, read where they are (fewer only at
        the end of the file); the stream's own position and read-ahead are untouched."""
        self._check_not_closed()
        descriptor = self._require_descriptor()
        out = []
        for offset, size in zip(offsets, sizes, strict=True):
            piece = self._pread(descriptor, size, offset)
            while 0 < len(piece) < size:  # a short read before the end: ask for the rest
                more = self._pread(descriptor, size - len(piece), offset + len(piece))
                if not more:
                    break
                piece += more
            out.append(piece)
        return out

    def pread_into(self, offset: int, buffer: memoryview) -> int:
        """Read the bytes at ``offset`` into ``buffer`` (a caller's reused buffer: no
        allocation, so no fresh pages to fault in per read); fewer only at the end."""
        self._check_not_closed()
        descriptor = self._require_descriptor()
        total, size = 0, len(buffer)
        while total < size:  # a short read before the end: ask for the rest
            count = self._pread_into(descriptor, buffer[total:], offset + total)
            if not count:
                break
            total += count
        return total

    def pread_scatter(self, offset: int, buffers: list[memoryview]) -> int:
        """Read the bytes at ``offset`` into ``buffers``, filled one after another (a run
        of records straight into the rows they become: one system call, no buffer in
        between); how many, fewer only at the end. The position stays."""
        self._check_not_closed()
        descriptor = self._require_descriptor()
        total, pending = 0, [buffer for buffer in buffers if len(buffer)]
        while pending:
            count = self._pread_scatter(descriptor, pending, offset + total)
            if not count:
                break
            total += count
            while pending and count >= len(pending[0]):  # drop the buffers filled
                count -= len(pending.pop(0))
            if pending and count:  # one filled in part: the rest of it next
                pending[0] = pending[0][count:]
        return total

    def _save_for_suspension(self) -> None:
        # Re-reading the read-ahead on resume is cheaper than keeping up to 256 KiB per
        # suspended stream, and keeps a suspended plain stream at (almost) zero bytes.
        self._seek_to(self._position)


class CompressedStream(SuspendableStream):
    """A GZIP or ZLIB file, decompressed incrementally with bounded output per step.

    ``_input`` holds compressed bytes read but not yet consumed by the decompressor and
    ``_input_offset`` is the file offset of its first byte: together with the decompressor
    (which holds every consumed byte's effect) that is the whole resumable state, so
    suspending drops ``_input`` and resuming re-reads from ``_input_offset``.
    """

    _compressed_read_size = COMPRESSED_READ_SIZE  # (an object store's is larger)

    def __init__(
        self, path: str | os.PathLike[str], compression_type: str, *, buffer_size: int
    ) -> None:
        super().__init__(path, buffer_size=buffer_size)
        self._compression_type = compression_type
        self._decompressor = self._new_decompressor()
        self._input = b""
        self._input_offset = 0
        self._members_finished = 0

    @property
    def compression_type(self) -> str:
        return self._compression_type

    @property
    def suspended_nbytes(self) -> int:
        if self._closed or self._descriptor is not None:
            return 0
        # The decompressor keeps references to the unconsumed tail of the last chunk it
        # was fed; count them, with the read-ahead not yet returned, as bytes held.
        referenced = len(self._decompressor.unconsumed_tail) + len(self._decompressor.unused_data)
        return ZLIB_STATE_NBYTES + referenced + sys.getsizeof(self._buffer)

    def _new_decompressor(self) -> zlib._Decompress:
        return zlib.decompressobj(_WBITS[self._compression_type])

    def _read_chunk(self, descriptor: int, wanted: int) -> bytes:
        # ``wanted`` is ignored: output is bounded by buffer_size, which bounds memory even
        # for a decompression bomb.
        while True:
            if self._decompressor.eof and not self._start_next_member(descriptor):
                return b""
            at_end_of_file = not self._input and not self._refill_input(descriptor)
            output = self._decompress()
            if output:
                return output
            if at_end_of_file and not self._decompressor.eof:
                self._check_clean_end()
                return b""

    def _refill_input(self, descriptor: int) -> bool:
        """Read the next compressed chunk; False at the end of the file."""
        self._input = self._pread(descriptor, self._compressed_read_size, self._input_offset)
        return bool(self._input)

    def _decompress(self) -> bytes:
        decompressor = self._decompressor
        try:
            output = decompressor.decompress(self._input, self._buffer_size)
        except zlib.error as error:
            raise self._data_loss(f"corrupt {self._compression_type} data ({error})") from None
        rest = decompressor.unused_data if decompressor.eof else decompressor.unconsumed_tail
        self._input_offset += len(self._input) - len(rest)
        self._input = rest
        return output

    def _start_next_member(self, descriptor: int) -> bool:
        """After a member ends, start the next one if the file has more bytes (``cat``-ed
        gzip files are one stream to TensorFlow); False when the file ends cleanly here."""
        if not self._input and not self._refill_input(descriptor):
            return False
        self._decompressor = self._new_decompressor()
        self._members_finished += 1
        return True

    def _check_clean_end(self) -> None:
        """The file ended inside a member: an empty file is an empty stream, anything else
        is a truncated one."""
        if self._input_offset > 0 or self._members_finished > 0:
            raise self._data_loss(
                f"truncated {self._compression_type} stream: the file ends at compressed "
                f"byte {self._input_offset} before the end of member {self._members_finished}"
            )

    def _data_loss(self, what: str) -> DataLossError:
        return DataLossError(
            f"{what} in {self._path!r} at decompressed offset {self._position} "
            f"(offsets count decompressed bytes of the {self._compression_type} stream)",
            path=self._path,
            offset=self._position,
        )

    def _seek_to(self, offset: int) -> None:
        # Compressed streams cannot jump: go back by starting over, forward by
        # decompressing and discarding. A seek past the end stops at the end.
        if offset < self._position:
            self._restart()
        self._advance(offset - self._position, None)

    def _restart(self) -> None:
        self._drop_buffer()
        self._decompressor = self._new_decompressor()
        self._input = b""
        self._input_offset = self._position = self._members_finished = 0

    def _save_for_suspension(self) -> None:
        # The decompressor object itself is the saved state: nothing touches it while the
        # stream is suspended, so a copy() would only allocate a second window. Compressed
        # input is re-read from _input_offset; unread output is kept, trimmed to what is
        # unread, because it cannot be recomputed without the bytes before it.
        self._input = b""
        self._buffer = self._buffer[self._buffer_start :]
        self._buffer_start = 0

    def _drop_saved_state(self) -> None:
        self._input = b""
        self._decompressor = _SPENT_DECOMPRESSOR  # frees the window; a closed stream never reads


def make_stream(
    path: str | os.PathLike[str],
    compression_type: str | None = None,
    *,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> SuspendableStream:
    """A stream at offset 0 that holds no descriptor yet (for callers that count them)."""
    normalized = normalize_compression_type(compression_type)
    if isinstance(path, str) and "://" in path:
        from headrace.io import objstore

        if objstore.is_remote(path):
            stream: SuspendableStream = objstore.make_remote_stream(
                path, normalized, buffer_size=buffer_size
            )
            return stream
        path = objstore.local_path(path)
    if normalized:
        return CompressedStream(path, normalized, buffer_size=buffer_size)
    return PlainStream(path, buffer_size=buffer_size)


def open_stream(
    path: str | os.PathLike[str],
    compression_type: str | None = None,
    *,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> SuspendableStream:
    """Like :func:`make_stream`, but opened: ready to read, outside any file pool."""
    stream = make_stream(path, compression_type, buffer_size=buffer_size)
    stream.resume()
    return stream
