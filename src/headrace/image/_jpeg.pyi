"""Type stub of the optional C extension built from ``_ext/jpeg.c`` (links libjpeg)."""

from collections.abc import Sequence
from typing import Any

def crop_resize(
    data: bytes | bytearray | memoryview,
    out: Any,
    box: tuple[float, float, float, float],
    shape: tuple[int, int, int],
    denom: int,
    antialias: bool,
    flip: bool,
    mul: Sequence[float],
    add: Sequence[float],
    strict: bool,
    /,
) -> bool: ...
def resample(
    pixels: Any,
    in_shape: tuple[int, ...],
    out: Any,
    box: tuple[float, float, float, float],
    shape: tuple[int, ...],
    antialias: bool,
    flip: bool,
    mul: Sequence[float],
    add: Sequence[float],
    /,
) -> None: ...
def decode(
    data: bytes | bytearray | memoryview,
    out: Any,
    shape: tuple[int, int, int],
    denom: int,
    strict: bool,
    /,
) -> bool: ...
def to_float(src: Any, out: Any, mul: float, /) -> None: ...
