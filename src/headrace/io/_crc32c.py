"""CRC32C (Castagnoli), as TFRecord framing needs it, with masking.

Backends, fastest first: headrace's own C extension (AVX-512 carry-less folding, else the
SSE4.2 crc32 instruction on three streams, as the CPU allows; a table otherwise), ``google-crc32c`` (Apache-2.0, the ``headrace[tfrecord]`` extra),
and a pure-Python table loop that is correct but slow (~10 MB/s), so it warns once. The
PyPI ``crc32c`` package is LGPL and deliberately not used.
"""

from __future__ import annotations

from collections.abc import Callable

from headrace._warn import warn_user
from headrace.io._native import native_module

__all__ = ["crc32c", "mask_crc", "masked_crc32c", "unmask_crc"]

_MASK_DELTA = 0xA282EAD8
_UINT32 = 0xFFFFFFFF
_CASTAGNOLI_REVERSED = 0x82F63B78


def _make_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CASTAGNOLI_REVERSED if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _make_table()


def _crc32c_table(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Reference implementation: one table lookup per byte."""
    table = _TABLE
    crc ^= _UINT32
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _UINT32


def _pick_library_backend() -> Callable[[bytes | bytearray | memoryview, int], int]:
    try:
        import google_crc32c
    except ImportError:
        return _crc32c_slow_with_warning
    if getattr(google_crc32c, "implementation", "c") != "c":
        return _crc32c_slow_with_warning

    def extend(data: bytes | bytearray | memoryview, crc: int) -> int:
        return int(google_crc32c.extend(crc, bytes(data)))

    return extend


_warned_slow = False


def _crc32c_slow_with_warning(data: bytes | bytearray | memoryview, crc: int) -> int:
    global _warned_slow
    if not _warned_slow:
        _warned_slow = True
        warn_user(
            "headrace is computing CRC32C in pure Python (~10 MB/s): build the C extension "
            "(pip install headrace) or install google-crc32c (pip install 'headrace[tfrecord]')",
            RuntimeWarning,
        )
    return _crc32c_table(data, crc)


_library_backend = _pick_library_backend()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Return the CRC32C of ``data``, continuing from ``crc`` (0 to start)."""
    native = native_module()
    if native is not None:
        return int(native.crc32c(data, crc))
    return _library_backend(data, crc)


def mask_crc(crc: int) -> int:
    """TFRecord's mask: rotate right by 15 bits, then add a constant (mod 2**32).

    TFRecord stores masked CRCs because a CRC of data that itself contains CRCs is weak.
    """
    return ((((crc >> 15) | (crc << 17)) & _UINT32) + _MASK_DELTA) & _UINT32


def unmask_crc(masked: int) -> int:
    """Invert :func:`mask_crc`."""
    rotated = (masked - _MASK_DELTA) & _UINT32
    return ((rotated >> 17) | (rotated << 15)) & _UINT32


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    """The masked CRC32C that TFRecord stores after a length or a payload."""
    return mask_crc(crc32c(data))
