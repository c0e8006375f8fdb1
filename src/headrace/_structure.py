"""Nested elements: flattening, packing, and the spec (shape + dtype) of each leaf.

An element is a leaf (NumPy array or scalar, Python scalar, ``bytes``, ``str``)
or a nest of dicts, tuples and namedtuples of elements. Following tf.data, a
*list* is a leaf: ``from_tensor_slices([1, 2, 3])`` slices one array, while a
tuple is a structure of components. The one exception is tf.data's too: a list
that a user function *returns* at its top (``map(lambda x: [x, x * 10])``) is a
tuple of components (:func:`returned`); lists inside it are leaves again. Dict keys are visited in sorted order so
that two dicts with the same keys always flatten the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError

__all__ = [
    "TensorSpec",
    "encode_str",
    "flatten",
    "integer_scalar",
    "map_structure",
    "pack_as",
    "returned",
    "spec_of",
    "structure_paths",
]


def _numpy_dtype(dtype: Any) -> Any:
    """A NumPy dtype, or ``bytes`` for strings, from what a user may pass as a dtype.

    TensorFlow's dtypes (``tf.float32``, ``tf.string``) are accepted by duck typing
    (``as_numpy_dtype``), so a spec written for tf.data ports without importing
    TensorFlow here; ``tf.string`` is ``bytes``, as tf.data yields it.
    """
    numpy_type = getattr(dtype, "as_numpy_dtype", None)
    if numpy_type is not None and not isinstance(dtype, (type, np.dtype)):
        if getattr(dtype, "name", None) == "string":
            return bytes
        return numpy_type
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one component; ``None`` in ``shape`` is an unknown size.

    ``shape=None`` is an unknown rank (tf.data's ``TensorSpec(shape=None)``): any
    shape matches. ``dtype`` is a NumPy dtype (or a TensorFlow one, converted);
    strings and bytes are ``object`` (headrace never squeezes them into
    fixed-width ``S``/``U`` dtypes, which drop trailing NULs), with ``kind``
    telling which of the two ("bytes" or "str"). A ``None`` component has kind
    "none" (tf.data's ``NoneTensorSpec``): it has no dimensions to batch or
    unbatch, so it passes through those unchanged.
    """

    shape: tuple[int | None, ...] | None
    dtype: np.dtype[Any]
    kind: str = "numeric"

    def __init__(self, shape: Any = (), dtype: Any = np.float32, kind: str | None = None) -> None:
        dims: tuple[int | None, ...] | None
        if shape is None or getattr(shape, "rank", 0) is None:  # also tf.TensorShape(None)
            dims = None
        else:
            raw = shape.as_list() if hasattr(shape, "as_list") else shape
            raw = (raw,) if isinstance(raw, (int, np.integer)) else tuple(raw)
            dims = tuple(None if d is None or d == -1 else int(d) for d in raw)
        object.__setattr__(self, "shape", dims)
        dtype = _numpy_dtype(dtype)
        if kind == "none":
            resolved, resolved_kind = np.dtype(object), "none"
        elif dtype in (bytes, "bytes", "string") or kind == "bytes":
            resolved, resolved_kind = np.dtype(object), "bytes"
        elif dtype in (str, "str") or kind == "str":
            resolved, resolved_kind = np.dtype(object), "str"
        else:
            resolved, resolved_kind = np.dtype(dtype), kind or "numeric"
            if resolved.kind in "SUO":
                resolved_kind = "str" if resolved.kind == "U" else "bytes"
                resolved = np.dtype(object)
        object.__setattr__(self, "dtype", resolved)
        object.__setattr__(self, "kind", resolved_kind)

    def __repr__(self) -> str:
        if self.kind == "none":
            return "NoneTensorSpec()"
        dtype = self.kind if self.kind in ("bytes", "str") else str(self.dtype)
        return f"TensorSpec(shape={self.shape}, dtype={dtype})"

    @property
    def rank(self) -> int | None:
        """The number of dimensions, or None when unknown."""
        return None if self.shape is None else len(self.shape)

    def is_compatible_with(self, value: Any) -> bool:
        """True if ``value`` has this spec's dtype and a shape it allows."""
        other = spec_of(value)
        if other.kind != self.kind:
            return False
        if self.kind == "numeric" and other.dtype != self.dtype:
            return False
        return shape_allows(self.shape, other.shape)

    def most_specific_common(self, other: TensorSpec) -> TensorSpec:
        """The spec that admits both: differing sizes become ``None``, differing ranks unknown."""
        if self.shape is None or other.shape is None or len(self.shape) != len(other.shape):
            return TensorSpec(None, self.dtype, self.kind)
        shape = tuple(a if a == b else None for a, b in zip(self.shape, other.shape, strict=True))
        return TensorSpec(shape, self.dtype, self.kind)

    def with_leading(self, size: int | None) -> TensorSpec:
        """This spec with one more (outer) dimension, as after ``batch``."""
        if self.shape is None:
            return self
        return TensorSpec((size, *self.shape), self.dtype, self.kind)

    def without_leading(self) -> TensorSpec:
        """This spec with its outer dimension removed, as after ``unbatch``."""
        if self.shape is None or self.kind == "none":
            return self
        if not self.shape:
            raise ElementSpecError(f"cannot remove a dimension from a scalar spec {self}")
        return TensorSpec(self.shape[1:], self.dtype, self.kind)


def shape_allows(want: tuple[int | None, ...] | None, got: tuple[int | None, ...] | None) -> bool:
    """Whether a spec shape ``want`` (None: any rank; None sizes: any size) admits ``got``."""
    if want is None:
        return True
    if got is None or len(want) != len(got):
        return False
    return all(a is None or a == b for a, b in zip(want, got, strict=True))


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def is_nest(value: Any) -> bool:
    """True for the containers that make a structure (dict, tuple, namedtuple)."""
    return isinstance(value, (Mapping, tuple))


def flatten(element: Any) -> list[Any]:
    """The leaves of ``element`` in a fixed order (dicts by sorted key)."""
    if isinstance(element, Mapping):
        out: list[Any] = []
        for key in sorted(element):
            out.extend(flatten(element[key]))
        return out
    if isinstance(element, tuple):
        out = []
        for item in element:
            out.extend(flatten(item))
        return out
    return [element]


def returned(value: Any) -> Any:
    """What a user function returned, as an element: a top-level ``list`` becomes a
    tuple of components, as tf.data packs it (``map(lambda x: [x, x * 10]).batch(2)``
    gives two columns, and ``tf.io.decode_csv``'s list of columns is a tuple). Only
    an exact ``list`` at the top: nested lists stay leaves (one array each)."""
    return tuple(value) if type(value) is list else value


def pack_as(structure: Any, leaves: list[Any]) -> Any:
    """Rebuild ``structure``'s nesting with ``leaves`` (the inverse of :func:`flatten`)."""
    iterator = iter(leaves)
    result = _pack(structure, iterator)
    for _ in iterator:
        raise ElementSpecError("more leaves than the structure has components")
    return result


def _pack(structure: Any, leaves: Any) -> Any:
    if isinstance(structure, Mapping):
        packed = {key: _pack(structure[key], leaves) for key in sorted(structure)}
        return {key: packed[key] for key in structure}
    if _is_namedtuple(structure):
        return type(structure)(*[_pack(item, leaves) for item in structure])
    if isinstance(structure, tuple):
        return tuple(_pack(item, leaves) for item in structure)
    try:
        return next(leaves)
    except StopIteration:
        raise ElementSpecError("fewer leaves than the structure has components") from None


def map_structure(fn: Callable[..., Any], *elements: Any) -> Any:
    """Apply ``fn`` leaf-wise over one or more elements of the same structure."""
    first = elements[0]
    if isinstance(first, Mapping):
        for other in elements[1:]:
            if not isinstance(other, Mapping) or set(other) != set(first):
                raise ElementSpecError(
                    f"structures differ: dict keys {sorted(first)} vs "
                    f"{sorted(other) if isinstance(other, Mapping) else type(other).__name__}"
                )
        return {key: map_structure(fn, *(e[key] for e in elements)) for key in first}
    if isinstance(first, tuple):
        for other in elements[1:]:
            if not isinstance(other, tuple) or len(other) != len(first):
                raise ElementSpecError(
                    f"structures differ: tuple of {len(first)} vs {_describe(other)}"
                )
        items = [map_structure(fn, *parts) for parts in zip(*elements, strict=True)]
        return type(first)(*items) if _is_namedtuple(first) else tuple(items)
    for other in elements[1:]:
        if is_nest(other):
            raise ElementSpecError(f"structures differ: leaf vs {_describe(other)}")
    return fn(*elements)


def structure_paths(element: Any, prefix: str = "") -> list[str]:
    """Human-readable path of every leaf, in :func:`flatten` order (for error messages)."""
    if isinstance(element, Mapping):
        out: list[str] = []
        for key in sorted(element):
            out.extend(structure_paths(element[key], f"{prefix}[{key!r}]"))
        return out
    if isinstance(element, tuple):
        out = []
        for index, item in enumerate(element):
            out.extend(structure_paths(item, f"{prefix}[{index}]"))
        return out
    return [prefix or "element"]


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"dict with keys {sorted(value)}"
    if isinstance(value, tuple):
        return f"tuple of {len(value)}"
    return type(value).__name__


def leaf_spec(value: Any) -> TensorSpec:
    """The spec of one leaf, using NumPy's dtype rules (a Python int becomes int64)."""
    if value is None:
        return TensorSpec((), np.dtype(object), "none")
    if isinstance(value, bytes):
        return TensorSpec((), np.dtype(object), "bytes")
    if isinstance(value, str):
        return TensorSpec((), np.dtype(object), "str")
    array = value if isinstance(value, (np.ndarray, np.generic)) else np.asarray(value)
    if array.dtype.kind in "SO":
        return TensorSpec(tuple(array.shape), np.dtype(object), _object_kind(array))
    if array.dtype.kind == "U":
        return TensorSpec(tuple(array.shape), np.dtype(object), "str")
    return TensorSpec(tuple(array.shape), array.dtype)


def _object_kind(array: Any) -> str:
    if array.dtype.kind == "S":
        return "bytes"
    flat = np.asarray(array).ravel()
    if flat.size and isinstance(flat[0], str):
        return "str"
    return "bytes"


def spec_of(element: Any) -> Any:
    """The nested spec of an element: same structure, a :class:`TensorSpec` per leaf."""
    return map_structure(leaf_spec, element)


def to_leaf_array(value: Any) -> Any:
    """Convert a user-given leaf to an array, keeping bytes/str as exact Python objects."""
    if value is None:  # a None component stays None (tf.data's NoneTensorSpec)
        return None
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "SU":
            return _exact_object_array(value)
        return value
    if isinstance(value, (bytes, str)):
        return value
    array = np.asarray(value)
    if array.dtype.kind in "SU":
        return _object_array_from_nested(value, array.shape)
    if array.dtype.kind in "fO" and isinstance(value, (list, tuple)):
        _refuse_lossy_ints(value if array.ndim == 1 else list(_iter_leaves(value)))
    return array


#: The Python ints an int64 holds (what tf.data converts Python ints to).
_INT64 = range(-(1 << 63), 1 << 63)


def _refuse_lossy_ints(leaves: list[Any] | tuple[Any, ...]) -> None:
    """A list that NumPy converts to floats (or objects) because a Python int in it
    does not fit int64 would change that int silently: refused, as tf.data does.
    (A list of floats is looked at once, in C: ``set(map(type, ...))``.)"""
    if int not in set(map(type, leaves)):
        return
    for leaf in leaves:
        if type(leaf) is int and leaf not in _INT64:
            raise ElementSpecError(
                f"the Python int {leaf} does not fit int64, which Python ints become (as in "
                "tf.data); converted with the others it would become a float and lose its "
                "value. Pass a NumPy array of the dtype you want (np.uint64, float, object)")


def _exact_object_array(array: Any) -> Any:
    # Fixed-width 'S' arrays have already lost trailing NULs; 'U' arrays trailing
    # '\0' characters. Converting preserves what is left, as Python objects.
    out = np.empty(array.shape, dtype=object)
    out[...] = array.tolist() if array.ndim else array.item()
    return out


def _object_array_from_nested(value: Any, shape: tuple[int, ...]) -> Any:
    out = np.empty(shape, dtype=object)
    if not shape:
        out[()] = value
        return out
    flat = out.reshape(-1)
    flat[:] = list(_iter_leaves(value))
    return out


def _iter_leaves(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _iter_leaves(item)
    else:
        yield value


def encode_str(value: Any) -> Any:
    """``value`` with ``str`` (alone, in lists, in arrays) encoded as UTF-8 ``bytes``.

    tf.data has one string type, bytes: a Python ``str`` given as a component,
    a padding value or a generator's output declared bytes comes out encoded.
    """
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "U" or (
            value.dtype.kind == "O" and any(isinstance(item, str) for item in value.flat)
        ):
            out = np.empty(value.shape, dtype=object)
            out.reshape(-1)[:] = [
                item.encode() if isinstance(item, str) else item for item in value.flat
            ]
            return out
        return value
    if isinstance(value, list):
        return [encode_str(item) for item in value]
    return value


def integer_scalar(value: Any, what: str) -> int:
    """``value`` (a Python or NumPy integer, or a 0-d integer array) as an int.

    Anything else is an :class:`ElementSpecError` saying ``what`` had to be an
    integer scalar and what it was: keys, choices and lengths returned by user
    functions are checked where they are used, as tf.data checks their dtype.
    """
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ElementSpecError(
            f"{what} must be an integer scalar, got {type(value).__name__} {value!r:.60}"
        )
    return int(value)
