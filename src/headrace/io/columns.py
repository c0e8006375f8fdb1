"""A column of ``bytes`` objects as one buffer plus int64 offsets, and back.

Why: a batch of records, ids or encoded images is an object array of ``bytes``.
Pickling it to another process walks every object twice (pickle, unpickle) in
Python's pickler, and costing it for the budget walks it once more; for 200 B
Examples that was more than parsing them. As one buffer of the values and the
``count + 1`` offsets between them, the column crosses a process boundary as
two plain buffers (in shared memory when large), and only the receiver's
``split`` makes the objects again, at C speed.

Each function uses the C extension when it is built and switched on (see
:mod:`headrace.io._native`) and has a pure-Python twin with identical results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace.io._native import native_module

__all__ = ["bytes_total", "join_bytes", "lengths", "object_array", "split_bytes", "wire_bytes"]


def object_array(items: Sequence[Any]) -> np.ndarray[Any, Any]:
    """A 1-D object array holding exactly these items (``bytes`` or ``str``: never an 'S'
    array that would drop trailing NULs). ``np.empty`` + slice assignment looks at each
    item for a nested sequence first: ~1.4x the time, paid per batch of records."""
    return np.fromiter(items, object, len(items))


def bytes_total(items: list[Any]) -> int:
    """The sum of the items' lengths, or -1 when an item is not exactly ``bytes``."""
    native = native_module()
    if native is not None:
        return int(native.bytes_total(items))
    if set(map(type, items)) - {bytes}:
        return -1
    return sum(map(len, items))


def wire_bytes(records: Sequence[Any]) -> int:
    """The sum of the records' lengths: in C for a list of ``bytes`` (what a reader's
    batch is; a Python ``sum(map(len, ...))`` cost a tenth of the read-and-parse speed
    of small records), else one ``len`` each."""
    if type(records) is list:
        total = bytes_total(records)
        if total >= 0:
            return total
    return sum(map(len, records))


def lengths(items: list[bytes]) -> memoryview:
    """The items' lengths as a read-only int64 view (8 bytes each, no Python int per
    item): what an origin log keeps of a batch of records."""
    native = native_module()
    packed = native.lengths(items) if native is not None else (
        np.fromiter(map(len, items), np.int64, len(items)).tobytes())
    return memoryview(packed).cast("q")


def join_bytes(items: list[Any]) -> tuple[bytes, bytes] | None:
    """``(values, offsets)``: the items end to end, and the ``len(items) + 1`` native
    int64 offsets where each begins (the last: where the values end); None when an
    item is not exactly ``bytes`` (a subclass, bytearray: left to pickle)."""
    native = native_module()
    if native is not None:
        return native.join_bytes(items)  # type: ignore[no-any-return]
    if set(map(type, items)) - {bytes}:
        return None
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, items), np.int64, len(items)), out=offsets[1:])
    return b"".join(items), offsets.tobytes()


def split_bytes(values: Any, offsets: Any) -> list[bytes]:
    """The ``bytes`` objects between consecutive ``offsets`` of ``values`` (both
    buffers: bytes, memoryview, NumPy arrays); ValueError when the offsets do not
    start at 0, decrease, or point past the values."""
    native = native_module()
    if native is not None:
        return native.split_bytes(values, offsets)  # type: ignore[no-any-return]
    data = bytes(values)
    ends = np.frombuffer(offsets, np.int64)
    if ends.size == 0 or ends[0] != 0:
        raise ValueError("split_bytes: offsets do not start at 0")
    steps = np.diff(ends)
    if steps.size and (steps.min() < 0 or ends[-1] > len(data)):
        bad = int(np.flatnonzero((steps < 0) | (ends[1:] > len(data)))[0]) + 1
        raise ValueError(
            f"split_bytes: offset {bad} ({int(ends[bad])}) is out of order or past the data "
            f"({len(data)} bytes)"
        )
    bounds = ends.tolist()
    return list(map(data.__getitem__, map(slice, bounds[:-1], bounds[1:])))
