"""Compressed blocks for record files that are read by offset (compressed snapshots).

A TFRecord file compressed as one stream (TensorFlow's GZIP / ZLIB files) can only be
read from its start: no record can be fetched by its offset. A file of *blocks* can:
each block is one TFRecord record whose payload is the compressed bytes of a run of
TFRecord-framed records (a chunk of small ones, or one large one). The ``.hrx`` index
gives every block's offset, the file's manifest how many records each block holds and
its size once decompressed, so a reader fetches one block with one positioned read.

Checks, before anything is trusted (G5): the block's own framing CRCs (a flipped byte
in the compressed data is found before it reaches the decompressor), the codec's magic
bytes, the decompressed size against the manifest's (for GZIP and ZLIB bounded while
decompressing: a forged block cannot inflate past it), and then every record's CRCs
inside the block.
Each error names the file and the block's offset.

Codecs: ``GZIP`` and ``ZLIB`` (the standard library's zlib), and ``SNAPPY`` when the
``cramjam`` package is installed (``pip install 'headrace[snappy]'``; MIT licence).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

from headrace._errors import DataLossError, InvalidArgumentError

__all__ = ["BLOCK_CODECS", "BlockCodec", "block_codec"]

#: The compressions a block file may use (``None``: uncompressed records, no blocks).
BLOCK_CODECS = ("GZIP", "ZLIB", "SNAPPY")
_SNAPPY_STREAM = b"\xff\x06\x00\x00sNaPpY"  # the snappy framing format's stream identifier


class BlockCodec:
    """Compresses a block's bytes and checks and decompresses them back."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cramjam: Any = None
        if name == "SNAPPY":
            try:
                import cramjam
            except ImportError:
                raise InvalidArgumentError(
                    "compression 'SNAPPY' needs the cramjam package: pip install "
                    "'headrace[snappy]' (or use 'GZIP' or 'ZLIB', which need nothing)"
                ) from None
            self._cramjam = cramjam

    def work_bytes(self, nbytes: int) -> int:
        """Most memory compressing ``nbytes`` of parts takes: the output (incompressible
        data grows a little), and for SNAPPY a copy of each view it is given."""
        output = nbytes + nbytes // 100 + 1024
        return output + (nbytes if self._cramjam is not None else 0)

    def compress(self, parts: Iterable[bytes | memoryview]) -> bytes:
        """The compressed bytes of ``parts`` joined (never joined uncompressed here)."""
        if self._cramjam is not None:
            compressor = self._cramjam.snappy.Compressor()
            for part in parts:  # (it takes bytes only: a view is copied, see work_bytes)
                compressor.compress(part if isinstance(part, bytes) else bytes(part))
            return bytes(compressor.finish())
        engine = zlib.compressobj(6, zlib.DEFLATED, 31 if self.name == "GZIP" else 15)
        pieces = [engine.compress(part) for part in parts]
        pieces.append(engine.flush())
        return b"".join(pieces)

    def decompress(self, block: bytes | memoryview, size: int, *, path: str, offset: int) -> bytes:
        """``block`` decompressed, which must be exactly ``size`` bytes (the manifest's)."""
        data = memoryview(block)
        problem = ""
        raw: bytes = b""
        if not self._magic_ok(data):
            problem = f"not a {self.name} block (its first bytes are {bytes(data[:4])!r})"
        else:
            try:
                raw = self._decompress(data, size)
            except (zlib.error, ValueError, OSError) as error:
                problem = f"{self.name} block does not decompress ({error})"
            else:
                if len(raw) != size:
                    problem = (
                        f"{self.name} block decompresses to {len(raw)} bytes where the manifest "
                        f"says {size}"
                    )
        if problem:
            raise DataLossError(
                f"corrupted {problem} at offset {offset} in file {path}", path=path, offset=offset
            )
        return raw

    def _magic_ok(self, data: memoryview) -> bool:
        if self.name == "GZIP":
            return bytes(data[:2]) == b"\x1f\x8b"
        if self.name == "ZLIB":
            return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        return bytes(data[: len(_SNAPPY_STREAM)]) == _SNAPPY_STREAM

    def _decompress(self, data: memoryview, size: int) -> bytes:
        if self._cramjam is not None:
            try:  # (cramjam takes the size as a hint only: it is checked after)
                return bytes(self._cramjam.snappy.decompress(data, output_len=size))
            except self._cramjam.DecompressionError as error:
                raise ValueError(str(error)) from None
        engine = zlib.decompressobj(31 if self.name == "GZIP" else 15)
        raw = engine.decompress(data, size)  # never more than the manifest's size
        if not engine.eof:
            raise ValueError("the stream is truncated, or longer than the manifest's size")
        if engine.unused_data:
            raise ValueError(f"{len(engine.unused_data)} bytes after the end of the stream")
        return raw


def block_codec(compression: str | None) -> BlockCodec | None:
    """The codec for ``compression`` (None, ``""``, ``"NONE"``: uncompressed)."""
    if compression in (None, "", "NONE"):
        return None
    if compression not in BLOCK_CODECS:
        raise InvalidArgumentError(
            f"compression {compression!r} is not supported: use None, {', '.join(map(repr, BLOCK_CODECS))}"
        )
    return BlockCodec(compression)
