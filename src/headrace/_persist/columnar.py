"""Batches decoded column by column from a run of cached records (internal).

``cache(filename).batch(n)`` reads a second epoch from records that are almost
always alike: one skeleton (:mod:`headrace.io.elements`), and leaves of fixed size
(arrays, NumPy scalars, Python numbers). Such a run of records is a matrix of bytes,
one row per record, and each leaf is the same columns of every row: one strided copy
per leaf into the batch's output replaces a decode, a ``sizeof`` and a row copy per
element. The copy gives what batching the decoded elements gives, byte for byte:
the same dtypes (a Python ``int`` becomes int64, a NumPy scalar its native dtype, an
array keeps its stored byte order), shapes and nesting.

Elements whose leaves need Python objects (``bytes``, ``str``, ``None``, object
arrays, lists, ints beyond int64) have no such layout: :func:`layout_for` returns
None and the reader decodes them one by one, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._memory.sizeof import ARRAY_HEADER_BYTES
from headrace.io.elements import namedtuple_class

__all__: list[str] = []  # internal: used by headrace._persist.records

_MAX_LAYOUTS = 1024
_layouts: dict[bytes, Layout | None] = {}

# Python scalars: (stored dtype, the dtype batching gives them).
_PYTHON_LEAVES: dict[str, np.dtype[Any]] = {
    "i": np.dtype("<i8"),
    "f": np.dtype("<f8"),
    "c": np.dtype("<c16"),
    "b": np.dtype("u1"),
}
_BATCHED: dict[str, np.dtype[Any]] = {
    "i": np.dtype(np.int64),
    "f": np.dtype(np.float64),
    "c": np.dtype(np.complex128),
    "b": np.dtype(np.bool_),
}
_NUMERIC_KINDS = frozenset("biufcmM")


class Leaf:
    """One fixed-size leaf: where it lies in the record's data, how it is batched."""

    __slots__ = (
        "copy_bytes", "dtype", "nbytes", "offset", "out_bytes", "shape", "stored", "truth"
    )

    def __init__(
        self, offset: int, stored: np.dtype[Any], dtype: np.dtype[Any],
        shape: tuple[int, ...], truth: bool = False,
    ) -> None:
        self.offset = offset
        self.stored, self.dtype, self.shape = stored, dtype, shape
        size = int(np.prod(shape, dtype=np.int64))
        self.nbytes = size * stored.itemsize
        #: A row of the batch's column (computed once: each batch books it).
        self.out_bytes = size * dtype.itemsize
        #: A ``bool`` is any non-zero byte: compared, not copied.
        self.truth = truth
        #: The batch's bytes are the record's bytes (same dtype, same byte order).
        self.copy_bytes = not truth and stored.str == dtype.str

    def row_bytes(self) -> int:
        return self.out_bytes


class Layout:
    """Where each leaf of one skeleton lies, and how to nest the batched columns."""

    def __init__(self, leaves: list[Leaf], build: Callable[[Any], Any]) -> None:
        self.leaves = leaves
        self.data_bytes = sum(leaf.nbytes for leaf in leaves)
        self.build = build

    def allocate(self, rows: int) -> list[np.ndarray[Any, Any]]:
        return [np.empty((rows, *leaf.shape), dtype=leaf.dtype) for leaf in self.leaves]

    def output_bytes(self, rows: int) -> int:
        """What the batch's columns cost, as the element-by-element batcher books them."""
        return sum(ARRAY_HEADER_BYTES + rows * leaf.row_bytes() for leaf in self.leaves)

    def fill(
        self,
        outputs: list[np.ndarray[Any, Any]],
        at: int | slice | np.ndarray[Any, Any],
        data: np.ndarray[Any, Any],
    ) -> None:
        """Copy the leaves of ``data`` (rows of record data bytes) into the outputs' rows
        ``at``: from that row on (an int), or the rows a slice or an index array names
        (a loaded batch interleaves its shards' records)."""
        rows = len(data)
        where = slice(at, at + rows) if isinstance(at, int) else at
        for leaf, out in zip(self.leaves, outputs, strict=True):
            if not leaf.nbytes:
                continue
            block = data[:, leaf.offset : leaf.offset + leaf.nbytes]
            if leaf.truth:
                out[where] = block[:, 0] != 0
            elif leaf.copy_bytes:
                # (as one opaque item per row: one memcpy each, not a loop over bytes)
                item = f"V{leaf.nbytes}"
                items = out.reshape(len(out), -1).view(np.uint8).view(item)
                items[where, 0] = block.view(item)[:, 0]
            else:  # another byte order: converted as the element's scalar would be
                values = np.ascontiguousarray(block).view(leaf.stored)
                out[where] = values.reshape((rows, *leaf.shape))


class _NotColumnar(Exception):
    pass


def layout_for(head: bytes) -> Layout | None:
    """The layout of records whose payload starts with ``head`` (the u32 length and the
    skeleton), or None when a leaf needs per-element Python objects."""
    try:
        return _layouts[head]
    except KeyError:
        pass
    try:
        tree = json.loads(head[4:])
        leaves: list[Leaf] = []
        build = _compile(tree, leaves, top=True)
        layout: Layout | None = Layout(leaves, build) if leaves else None
    except (_NotColumnar, ValueError, TypeError, KeyError, IndexError):
        layout = None  # (a malformed skeleton: the element decoder names the problem)
    if len(_layouts) >= _MAX_LAYOUTS:
        _layouts.clear()
    _layouts[head] = layout
    return layout


def _offset(leaves: list[Leaf]) -> int:
    return sum(leaf.nbytes for leaf in leaves)


def _compile(tree: Any, leaves: list[Leaf], top: bool = False) -> Callable[[Any], Any]:  # noqa: C901
    """Append ``tree``'s leaves; return what nests their columns (given as an iterator,
    in the leaves' order)."""
    if isinstance(tree, str):
        if tree not in _PYTHON_LEAVES:
            raise _NotColumnar(tree)
        leaves.append(
            Leaf(_offset(leaves), _PYTHON_LEAVES[tree], _BATCHED[tree], (), truth=tree == "b")
        )
        return _take_one
    if not isinstance(tree, list) or not tree:
        raise _NotColumnar(tree)
    kind = tree[0]
    if kind == "a" and len(tree) == 3:
        stored = _numeric(tree[1])
        shape = tree[2]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _NotColumnar(shape)
        leaves.append(Leaf(_offset(leaves), stored, stored, tuple(shape)))
        return _take_one
    if kind == "g" and len(tree) == 2:
        stored = _numeric(tree[1])
        leaves.append(Leaf(_offset(leaves), stored, stored.newbyteorder("="), ()))
        return _take_one
    if kind == "d" and len(tree) == 3:
        keys, children = tree[1], tree[2]
        if not isinstance(keys, list) or not isinstance(children, list):
            raise _NotColumnar(tree)
        if len(keys) != len(children) or not all(isinstance(key, str) for key in keys):
            raise _NotColumnar(tree)
        parts = [_compile(child, leaves) for child in children]

        def mapping(columns: Any) -> Any:
            return {key: part(columns) for key, part in zip(keys, parts, strict=True)}

        return mapping
    if kind == "t" and len(tree) == 2 and isinstance(tree[1], list):
        parts = [_compile(child, leaves) for child in tree[1]]
        return lambda columns: tuple([part(columns) for part in parts])
    if kind == "N" and len(tree) == 4 and isinstance(tree[3], list):
        name, fields = tree[1], tree[2]
        if not isinstance(name, str) or not isinstance(fields, list):
            raise _NotColumnar(tree)
        if not all(isinstance(field, str) for field in fields) or len(fields) != len(tree[3]):
            raise _NotColumnar(tree)
        cls = namedtuple_class(name, tuple(fields))
        parts = [_compile(child, leaves) for child in tree[3]]
        return lambda columns: cls(*[part(columns) for part in parts])
    # lists are one leaf to the batcher (and str, bytes, None, object arrays need objects)
    raise _NotColumnar(tree)


def _take_one(columns: Any) -> Any:
    return next(columns)


def _numeric(raw: Any) -> np.dtype[Any]:
    if not isinstance(raw, str):
        raise _NotColumnar(raw)
    dtype = np.dtype(raw)
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or not dtype.itemsize:
        raise _NotColumnar(raw)  # str/bytes arrays batch into objects
    return dtype
