"""Byte sizes: parsing what users write ("512MiB", "2 GB") and printing sizes for people."""

from __future__ import annotations

import re

import numpy as np

from headrace._errors import InvalidArgumentError

__all__ = ["format_apart", "format_bytes", "is_byte_count", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2 GB"``, ``"1.5GiB"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
    GB, TB) powers of 1000, so a budget means exactly what it says.
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"a byte size must be an int or a string, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidArgumentError(f"a byte size must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise InvalidArgumentError(f"a byte size must be an int or a string, got {value!r}")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(
            f"cannot parse byte size {value!r}: expected a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MiB'"
        )
    number = float(match.group(1)) * _UNITS[unit]
    if number == float("inf"):  # 400 digits: no size, and int() would overflow
        raise InvalidArgumentError(f"byte size {value[:40]!r} is too large")
    size = int(number)
    if size <= 0:
        raise InvalidArgumentError(f"a byte size must be positive, got {value!r}")
    return size


def format_bytes(size: float) -> str:
    """A short human-readable size (binary units) for messages and reports."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_apart(first: int, second: int) -> tuple[str, str]:
    """Two sizes compared in one message, each as :func:`format_bytes` writes it, or in
    exact bytes where that rounding would show them equal ("needs 64.0 MiB, more than
    64.0 MiB" said nothing)."""
    a, b = format_bytes(first), format_bytes(second)
    if a == b and first != second:
        return f"{first:,} B", f"{second:,} B"
    return a, b


def is_byte_count(value: object) -> bool:
    """Whether ``value`` is a number of bytes a user's sizer or hint may answer: a
    finite number of at least 0 (not a bool; a negative one would credit the budget)."""
    return bool(not isinstance(value, bool)
                and isinstance(value, (int, float, np.integer, np.floating))
                and 0 <= value < float("inf"))
