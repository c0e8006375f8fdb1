"""Encoding tf.train.Example protos without TensorFlow or protobuf.

* :func:`serialize_example` / :func:`serialize_sequence_example` build the wire bytes from
  a dict. Map keys are sorted, so the output is deterministic and byte-identical to
  TensorFlow's ``SerializeToString(deterministic=True)``; TensorFlow's default
  serialization orders map entries by hash instead, which parses to equal content.
* :func:`encode_example_columns` serializes many rows given as columns, byte-identical
  to :func:`serialize_example` row by row and many times faster: per-element Python work
  is the bottleneck of Example writers (TensorFlow's
  ``tf.train.Example(...).SerializeToString()`` loop manages ~30 k records/s), so numeric
  columns with one dtype and shape are converted in one NumPy call (floats as one
  ``tobytes``, int64 varints vectorized), and the fixed protobuf headers around each value
  are computed once per distinct length. Anything irregular (lists, ragged shapes, mixed
  types) falls back to the per-value encoder.

Values: floating -> FloatList as float32; integer/bool -> Int64List; bytes/str/object ->
BytesList; arrays of rank >= 2 flattened row-major, as example.proto prescribes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import add as _add
from typing import Any

import numpy as np
import numpy.typing as npt

from headrace._errors import InvalidArgumentError
from headrace.io import _example_wire as wire
from headrace.io.columns import object_array
from headrace.io.example.specs import DTYPE_OF_KIND, KIND_OF_NAME

__all__ = [
    "encode_example_columns",
    "encode_feature_value",
    "serialize_example",
    "serialize_sequence_example",
    "values_as_array",
]

Array = npt.NDArray[Any]

_LEN = 2  # protobuf wire type "length-delimited"
_BYTES_VALUE_TAG = wire.encode_varint(1 << 3 | _LEN)  # BytesList.value / packed field 1
_UINT64_SHIFTS = np.arange(0, 70, 7, dtype=np.uint64)  # the 10 varint groups of a uint64

# --------------------------------------------------------------------------- values


def _as_bytes(value: Any, name: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview, np.bytes_)):
        return bytes(value)
    raise InvalidArgumentError(
        f"feature {name!r}: cannot store {type(value).__name__} in a BytesList"
    )


def _kind_of_dtype(dtype: np.dtype[Any], name: str) -> int:
    if dtype.kind == "f":
        return wire.KIND_FLOAT
    if dtype.kind in "iub":
        return wire.KIND_INT64
    if dtype.kind in "SUO":
        return wire.KIND_BYTES
    raise InvalidArgumentError(f"feature {name!r}: unsupported dtype {dtype}")


def _infer_kind(value: Any, name: str) -> int:
    """The list kind a Python/NumPy value maps to (float -> FloatList, int/bool ->
    Int64List, bytes/str -> BytesList)."""
    if isinstance(value, np.ndarray | np.generic):
        return _kind_of_dtype(value.dtype, name)
    if isinstance(value, bytes | bytearray | memoryview | str):
        return wire.KIND_BYTES
    if isinstance(value, bool | int):
        return wire.KIND_INT64
    if isinstance(value, float):
        return wire.KIND_FLOAT
    if isinstance(value, list | tuple):
        if not value:
            raise InvalidArgumentError(
                f"feature {name!r}: an empty list has no type; pass an empty NumPy array "
                "with a dtype, or ('float_list' | 'int64_list' | 'bytes_list', [])"
            )
        kinds = {_infer_kind(item, name) for item in value}
        if kinds == {wire.KIND_FLOAT, wire.KIND_INT64}:
            return wire.KIND_FLOAT  # [1, 2.5] is a float list, as in NumPy
        if len(kinds) > 1:
            raise InvalidArgumentError(f"feature {name!r}: values mix bytes and numbers")
        return kinds.pop()
    raise InvalidArgumentError(
        f"feature {name!r}: cannot store {type(value).__name__} in an Example"
    )


def _flat_items(value: Any) -> list[Any]:
    if isinstance(value, np.ndarray):
        return list(value.reshape(-1))
    if isinstance(value, list | tuple):
        return [item for element in value for item in _flat_items(element)]
    return [value]


def values_as_array(value: Any, kind: int, name: str) -> Array:
    """Flatten ``value`` (row-major) into the 1-D array a list of ``kind`` holds."""
    if kind == wire.KIND_BYTES:
        return object_array([_as_bytes(item, name) for item in _flat_items(value)])
    dtype = DTYPE_OF_KIND[kind]
    too_big_for_int64 = (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint64
        and value.size > 0
        and value.max() > np.iinfo(np.int64).max
    )
    if kind == wire.KIND_INT64 and too_big_for_int64:
        raise InvalidArgumentError(f"feature {name!r}: uint64 value above int64 range")
    try:
        return np.asarray(value, dtype=dtype).reshape(-1)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidArgumentError(f"feature {name!r}: {error}") from None


def _kind_and_values(value: Any, name: str) -> tuple[int, Array]:
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and value[0] in KIND_OF_NAME
    ):
        kind = KIND_OF_NAME[value[0]]
        return kind, values_as_array(value[1], kind, name)
    kind = _infer_kind(value, name)
    return kind, values_as_array(value, kind, name)


# --------------------------------------------------------------------------- serialize


def encode_feature_value(value: Any, name: str) -> bytes:
    kind, values = _kind_and_values(value, name)
    if kind == wire.KIND_FLOAT:
        payload = wire.encode_float_payload(values.astype("<f4").tobytes())
    elif kind == wire.KIND_INT64:
        payload = wire.encode_int64_payload(values.tolist())
    else:
        payload = wire.encode_bytes_payload(values.tolist())
    return wire.encode_feature(kind, payload)


def _encode_features(features: Mapping[str, Any]) -> bytes:
    encoded = {}
    for name, value in features.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"feature names must be str, got {name!r}")
        encoded[name] = encode_feature_value(value, name)
    return wire.encode_features(encoded)


def serialize_example(features: Mapping[str, Any]) -> bytes:
    """Serialize ``{name: value}`` as a tf.train.Example.

    A value is a NumPy array or scalar (floating -> FloatList as float32; integer/bool ->
    Int64List; bytes/str/object -> BytesList), a Python scalar or (nested) list of them,
    or an explicit ``(kind, values)`` pair such as ``("float_list", [])`` - the only way
    to write an empty Python list, whose type cannot be guessed. Arrays of rank >= 2 are
    flattened row-major, as example.proto prescribes.
    """
    return wire.encode_message_field(1, _encode_features(features))


def serialize_sequence_example(
    context: Mapping[str, Any] | None = None,
    feature_lists: Mapping[str, Sequence[Any]] | None = None,
) -> bytes:
    """Serialize a tf.train.SequenceExample: ``context`` features plus, per name in
    ``feature_lists``, a sequence of feature values (one Feature per time step)."""
    lists = []
    for name in sorted(feature_lists or {}):
        steps = (feature_lists or {})[name]
        if isinstance(steps, np.ndarray) and steps.ndim == 0:
            raise InvalidArgumentError(f"feature list {name!r} must be a sequence of steps")
        feature_list = b"".join(
            wire.encode_message_field(1, encode_feature_value(step, name)) for step in steps
        )
        entry = wire.encode_message_field(1, name.encode("utf-8")) + wire.encode_message_field(
            2, feature_list
        )
        lists.append(wire.encode_message_field(1, entry))
    return wire.encode_message_field(1, _encode_features(context or {})) + (
        wire.encode_message_field(2, b"".join(lists))
    )


# --------------------------------------------------------------------------- columns


def _varint_lengths(values: Array) -> Array:
    """Bytes of each uint64's varint (1..10)."""
    lengths: Array = 1 + (values[:, None] >= (np.uint64(1) << _UINT64_SHIFTS[1:])).sum(axis=1)
    return lengths


def _encode_varints(values: Array) -> tuple[bytes, Array]:
    """Varints of int64 ``values`` (negatives as 10-byte uint64, as protobuf), concatenated,
    and the length of each, in one vectorized pass."""
    unsigned = values.astype(np.int64, copy=False).view(np.uint64).reshape(-1)
    lengths = _varint_lengths(unsigned)
    groups = ((unsigned[:, None] >> _UINT64_SHIFTS) & np.uint64(0x7F)).astype(np.uint8)
    positions = np.arange(10)
    groups[positions < (lengths[:, None] - 1)] |= 0x80
    return groups[positions < lengths[:, None]].tobytes(), lengths


class _EntryHeads:
    """The bytes before a value in one ``Features.feature`` map entry, cached by length.

    An entry is ``{1: key, 2: Feature{kind: list payload}}``; everything but the payload
    depends only on the key, the kind and the payload's length, so it is computed once per
    distinct length instead of once per record.
    """

    def __init__(self, key: str, kind: int) -> None:
        self._key_field = wire.encode_message_field(1, key.encode("utf-8"))
        self._kind_tag = wire.encode_varint(kind << 3 | _LEN)
        self._cache: dict[int, bytes] = {}

    def feature_head(self, feature_length: int) -> bytes:
        """Head of an entry whose encoded ``Feature`` message has ``feature_length`` bytes."""
        value_head = wire.encode_varint(2 << 3 | _LEN) + wire.encode_varint(feature_length)
        entry_length = len(self._key_field) + len(value_head) + feature_length
        return (
            wire.encode_varint(1 << 3 | _LEN)
            + wire.encode_varint(entry_length)
            + self._key_field
            + value_head
        )

    def __call__(self, payload_length: int) -> bytes:
        """Head of an entry whose list payload (inside the Feature) has this length."""
        head = self._cache.get(payload_length)
        if head is None:
            kind_head = self._kind_tag + wire.encode_varint(payload_length)
            head = self.feature_head(len(kind_head) + payload_length) + kind_head
            self._cache[payload_length] = head
        return head


def _packed_head(raw_length: int) -> bytes:
    """Head of a packed list (FloatList/Int64List field 1); empty lists are written empty."""
    return _BYTES_VALUE_TAG + wire.encode_varint(raw_length) if raw_length else b""


def _float_entries(key: str, rows: Array) -> list[bytes]:
    count = len(rows)
    width = 4 * (rows.size // count)
    if width == 0:
        return [_EntryHeads(key, wire.KIND_FLOAT)(0)] * count
    raw = np.ascontiguousarray(rows, dtype="<f4").tobytes()
    packed = _packed_head(width)
    head = _EntryHeads(key, wire.KIND_FLOAT)(len(packed) + width) + packed
    return [head + raw[start : start + width] for start in range(0, count * width, width)]


def _int64_entries(key: str, rows: Array) -> list[bytes]:
    if rows.dtype == np.uint64 and rows.size and rows.max() > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"feature {key!r}: uint64 value above int64 range")
    count = len(rows)
    raw, lengths = _encode_varints(rows.astype(np.int64, copy=False))
    per_row = rows.size // count
    ends = np.cumsum(lengths.reshape(count, per_row).sum(axis=1)).tolist()
    heads = _EntryHeads(key, wire.KIND_INT64)
    full_heads: dict[int, bytes] = {}  # raw length -> entry head + packed head
    entries = []
    start = 0
    for end in ends:
        length = end - start
        head = full_heads.get(length)
        if head is None:
            packed = _packed_head(length)
            head = full_heads[length] = heads(len(packed) + length) + packed
        entries.append(head + raw[start:end])
        start = end
    return entries


def _bytes_entries(key: str, rows: Sequence[Any]) -> list[Any]:
    """Entries of a BytesList column: ``rows`` holds one bytes per row, or a list per row.

    An entry is bytes, or ``(head, memoryview)`` for a row given as a view: joined into
    its record by :func:`encode_example_columns` (the only caller), never copied before.
    """
    heads = _EntryHeads(key, wire.KIND_BYTES)
    entries = []
    single_cache: dict[int, bytes] = {}
    for row in rows:
        if isinstance(row, (bytes, memoryview)):  # one value, head cached by its length
            head = single_cache.get(len(row))
            if head is None:
                value_head = _BYTES_VALUE_TAG + wire.encode_varint(len(row))
                head = heads(len(value_head) + len(row)) + value_head
                single_cache[len(row)] = head
            # a view (a row of a byte array) stays one: the record copies it, once
            entries.append((head, row) if type(row) is memoryview else head + row)
        else:
            payload = wire.encode_bytes_payload(row)
            entries.append(heads(len(payload)) + payload)
    return entries


def _as_bytes_list(values: list[Any]) -> list[bytes | memoryview] | None:
    """``values`` as bytes (str encoded as UTF-8; a 1-D byte ``memoryview`` kept as it
    is), or None if any is not one of these."""
    out: list[bytes | memoryview] = []
    for value in values:
        if isinstance(value, bytes):
            out.append(bytes(value) if type(value) is not bytes else value)
        elif isinstance(value, memoryview) and value.ndim == 1 and value.itemsize == 1 and (
                value.c_contiguous):
            out.append(value)  # (a row of a byte array, copied once: into its record)
        elif isinstance(value, str):
            out.append(value.encode("utf-8"))
        else:
            return None
    return out


def _array_entries(key: str, rows: Array) -> list[bytes] | None:
    """Entries of a stacked column ``(rows, *shape)``; None when only the slow path can."""
    kind = rows.dtype.kind
    if kind == "f":
        return _float_entries(key, rows)
    if kind in "iub":
        return _int64_entries(key, rows)
    if kind in "SUO" and rows.ndim >= 1:
        flat = rows.reshape(len(rows), -1)
        if flat.shape[1] == 1:
            scalars = _as_bytes_list(flat[:, 0].tolist())
            return None if scalars is None else _bytes_entries(key, scalars)
        lists = [_as_bytes_list(row) for row in flat.tolist()]
        if any(row is None for row in lists):
            return None
        return _bytes_entries(key, [row for row in lists if row is not None])
    return None


_NUMPY_VALUE = (np.ndarray, np.generic)


def _stack(values: Sequence[Any]) -> Array | None:
    """Stack one column's per-row values into ``(rows, *shape)`` if they share a type,
    dtype and shape (so one conversion gives what per-value serialization would)."""
    first = values[0]
    first_type = type(first)
    if any(type(value) is not first_type for value in values):
        return None
    if first_type is float:
        return np.asarray(values, dtype=np.float64)
    if first_type is int or first_type is bool:
        try:
            return np.asarray(values, dtype=np.int64)
        except OverflowError:
            return None
    if isinstance(first, _NUMPY_VALUE):
        dtype, shape = first.dtype, first.shape
        if dtype.kind == "O" or any(
            value.dtype != dtype or value.shape != shape for value in values
        ):
            return None
        return np.stack(values)
    return None


def _slow_entries(key: str, values: Sequence[Any], describe: Callable[[int], str]) -> list[bytes]:
    """Per-value encoding through :mod:`headrace.io.example`: anything it accepts."""
    heads = _EntryHeads(key, wire.KIND_NONE)
    entries = []
    for row, value in enumerate(values):
        try:
            feature = encode_feature_value(value, key)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{describe(row)}: {error}") from error
        entries.append(heads.feature_head(len(feature)) + feature)
    return entries


def _column_entries(
    key: str, values: Array | Sequence[Any], describe: Callable[[int], str]
) -> list[bytes]:
    """One column's map entries, one per row: fast paths first, the slow path otherwise."""
    try:
        if isinstance(values, np.ndarray):
            stacked: Array | None = values
        else:
            scalars = _as_bytes_list(list(values))
            if scalars is not None:
                return _bytes_entries(key, scalars)
            stacked = _stack(values)
        if stacked is not None:
            entries = _array_entries(key, stacked)
            if entries is not None:
                return entries
    except InvalidArgumentError:
        pass  # the slow path raises the same error, naming the row
    rows = list(values) if isinstance(values, np.ndarray) else values
    return _slow_entries(key, rows, describe)


def _checked_columns(columns: Mapping[str, Any]) -> tuple[list[str], int]:
    """The columns' names, sorted as Features' keys are, and their one row count;
    refused without columns, with a name that is not str, or with uneven counts."""
    if not columns:
        raise InvalidArgumentError("encode_example_columns needs at least one column")
    for name in columns:
        if not isinstance(name, str):
            raise InvalidArgumentError(f"feature names must be str, got {name!r}")
    names = sorted(columns)
    counts = {name: len(columns[name]) for name in names}
    if len(set(counts.values())) != 1:
        raise InvalidArgumentError(f"all columns must have the same number of rows, got {counts}")
    return names, counts[names[0]]


def encode_example_columns(
    columns: Mapping[str, Array | Sequence[Any]],
    *,
    describe: Callable[[int], str] = lambda row: f"row {row}",
) -> list[bytes]:
    """Serialize rows given as columns (``{name: values}``, one value per row) as Examples.

    Byte-identical to ``[serialize_example(row) for row in rows]``, many times faster for
    regular columns. Every column must hold the same number of rows; ``describe(row)`` is
    how an error names a failing row.
    """
    names, rows = _checked_columns(columns)
    if not rows:
        return []
    per_column = [_column_entries(name, columns[name], describe) for name in names]
    example_tag = wire.encode_varint(1 << 3 | _LEN)
    heads: dict[int, bytes] = {}
    records = []
    # Each record joined once from its head and entries; an entry of a byte-array row
    # is (its head, a view of the row), so that row is copied once, into the record
    split = any(tuple in set(map(type, entries)) for entries in per_column)
    if split:
        for entries in zip(*per_column, strict=True):
            entries = tuple(piece for entry in entries for piece in (
                entry if type(entry) is tuple else (entry,)))
            length = sum(map(len, entries))
            head = heads.get(length)
            if head is None:
                head = heads[length] = example_tag + wire.encode_varint(length)
            records.append(b"".join((head, *entries)))
        return records
    # Each record's length, column by column: loops in C (per record, a sum() over a
    # map() cost a tenth of encoding a small Example)
    lengths = list(map(len, per_column[0]))
    for column in per_column[1:]:
        lengths = list(map(_add, lengths, map(len, column)))
    for entries, length in zip(zip(*per_column, strict=True), lengths, strict=True):
        head = heads.get(length)
        if head is None:
            head = heads[length] = example_tag + wire.encode_varint(length)
        records.append(b"".join((head, *entries)))
    return records
