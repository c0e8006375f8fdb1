"""tf.train.Example without TensorFlow or protobuf: build, serialize, inspect, and parse
batches of Examples into NumPy columns.

* :func:`serialize_example` / :func:`serialize_sequence_example` build the wire bytes from
  a dict. Map keys are sorted, so the output is deterministic and byte-identical to
  TensorFlow's ``SerializeToString(deterministic=True)``; TensorFlow's default
  serialization orders map entries by hash instead, which parses to equal content.
* :func:`decode_example` / :func:`decode_sequence_example` decode everything, for
  inspection (``headrace inspect``).
* :func:`parse_example` is ``tf.io.parse_example`` for a batch: one pass over the batch
  (in C when the extension is built) gathers each requested feature's values into one flat
  buffer, then NumPy reshapes them. Specs are this module's :class:`FixedLenFeature`,
  :class:`VarLenFeature`, :class:`FixedLenSequenceFeature` and :class:`RaggedFeature`,
  with tf.io's names and arguments.

Dtypes: ``np.float32`` (FloatList), ``np.int64`` (Int64List), ``bytes`` (BytesList).
Bytes come back as object arrays of exact ``bytes`` - never fixed-width ``'S'`` arrays,
which would drop trailing NUL bytes (G5).

Errors name the feature and the record's index in the batch (TensorFlow's batched fast
path only says "Can't parse serialized Example"); all are
:class:`~headrace.errors.ParseError`, spec mistakes :class:`~headrace.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from headrace.errors import InvalidArgumentError, ParseError
from headrace.io import _example_wire as wire
from headrace.io._native import native_module
from headrace.io._ragged import RaggedColumn

__all__ = [
    "FeatureSpec",
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "RaggedColumn",
    "RaggedFeature",
    "VarLenFeature",
    "decode_example",
    "decode_sequence_example",
    "parse_example",
    "serialize_example",
    "serialize_sequence_example",
]

Array = npt.NDArray[Any]
#: What :func:`decode_example` returns per feature: ``(kind, values)`` with kind one of
#: ``"bytes_list"``, ``"float_list"``, ``"int64_list"`` (the proto's oneof names).
DecodedFeature = tuple[str, Array]

_KIND_OF_NAME = {
    "bytes_list": wire.KIND_BYTES,
    "float_list": wire.KIND_FLOAT,
    "int64_list": wire.KIND_INT64,
}
_NAME_OF_KIND = {kind: name for name, kind in _KIND_OF_NAME.items()}
_DTYPE_OF_KIND: dict[int, np.dtype[Any]] = {
    wire.KIND_FLOAT: np.dtype(np.float32),
    wire.KIND_INT64: np.dtype(np.int64),
    wire.KIND_BYTES: np.dtype(object),
}
_TF_DTYPE_NAMES = {wire.KIND_FLOAT: "float", wire.KIND_INT64: "int64", wire.KIND_BYTES: "string"}

# --------------------------------------------------------------------------- values


def _bytes_array(values: Sequence[bytes]) -> Array:
    """An object array holding exactly these bytes objects (no 'S' truncation)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


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
        return _bytes_array([_as_bytes(item, name) for item in _flat_items(value)])
    dtype = _DTYPE_OF_KIND[kind]
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
        and value[0] in _KIND_OF_NAME
    ):
        kind = _KIND_OF_NAME[value[0]]
        return kind, values_as_array(value[1], kind, name)
    kind = _infer_kind(value, name)
    return kind, values_as_array(value, kind, name)


# --------------------------------------------------------------------------- serialize


def _encode_feature_value(value: Any, name: str) -> bytes:
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
        encoded[name] = _encode_feature_value(value, name)
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
            wire.encode_message_field(1, _encode_feature_value(step, name)) for step in steps
        )
        entry = wire.encode_message_field(1, name.encode("utf-8")) + wire.encode_message_field(
            2, feature_list
        )
        lists.append(wire.encode_message_field(1, entry))
    return wire.encode_message_field(1, _encode_features(context or {})) + (
        wire.encode_message_field(2, b"".join(lists))
    )


# --------------------------------------------------------------------------- decode


def _decoded_array(kind: int, values: bytearray | list[bytes]) -> Array:
    if isinstance(values, list):
        return _bytes_array(values)
    if kind == wire.KIND_NONE:
        return np.empty(0, dtype=np.float32)
    return np.frombuffer(values, dtype="<f4" if kind == wire.KIND_FLOAT else "<i8")


def _decoded_feature(kind: int, values: bytearray | list[bytes]) -> DecodedFeature:
    return _NAME_OF_KIND.get(kind, "none"), _decoded_array(kind, values)


def _decode_key(key: bytes, position_hint: str) -> str:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        raise ParseError(f"{position_hint}: feature name {key!r} is not UTF-8") from None


def decode_example(serialized: bytes) -> dict[str, DecodedFeature]:
    """Decode a serialized tf.train.Example to ``{name: (kind, values)}``, for inspection.

    ``kind`` is ``"bytes_list" | "float_list" | "int64_list"`` (``"none"`` for a Feature
    with no list); values are float32/int64 arrays or object arrays of bytes.
    """
    try:
        decoded = wire.decode_features(bytes(serialized))
    except wire.Malformed as malformed:
        raise ParseError(
            f"malformed Example: bad protobuf at byte {malformed.position} of {len(serialized)}"
        ) from None
    return {
        _decode_key(key, "Example"): _decoded_feature(kind, values)
        for key, (kind, values) in decoded.items()
    }


def decode_sequence_example(
    serialized: bytes,
) -> tuple[dict[str, DecodedFeature], dict[str, list[DecodedFeature]]]:
    """Decode a serialized tf.train.SequenceExample to ``(context, feature_lists)``."""
    data = bytes(serialized)
    try:
        context = wire.decode_features(data, map_field=1)
        lists = wire.decode_feature_list_map(data)
    except wire.Malformed as malformed:
        raise ParseError(
            f"malformed SequenceExample: bad protobuf at byte {malformed.position} of {len(data)}"
        ) from None
    return (
        {_decode_key(k, "context"): _decoded_feature(*v) for k, v in context.items()},
        {
            _decode_key(k, "feature_lists"): [_decoded_feature(*step) for step in steps]
            for k, steps in lists.items()
        },
    )


# --------------------------------------------------------------------------- specs


def _kind_of_spec_dtype(dtype: Any) -> int:
    """Accept NumPy dtypes, ``bytes``/``str``/``object``, names, and tf.DType objects."""
    if isinstance(dtype, str) and dtype in ("string", "bytes"):
        return wire.KIND_BYTES
    if dtype in (bytes, str, object):
        return wire.KIND_BYTES
    numpy_type = getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType
    try:
        normalized = np.dtype(numpy_type)
    except TypeError:
        normalized = None
    for kind, allowed in _DTYPE_OF_KIND.items():
        if normalized == allowed:
            return kind
    raise InvalidArgumentError(
        f"unsupported feature dtype {dtype!r}: use np.float32, np.int64 or bytes "
        "(the three list types an Example can hold)"
    )


def _shape_tuple(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    dims = tuple(shape)
    if any(not isinstance(dim, int | np.integer) or dim < 0 for dim in dims):
        raise InvalidArgumentError(
            f"feature shape must be fully defined non-negative ints, got {shape!r}"
        )
    return tuple(int(dim) for dim in dims)


@dataclass(frozen=True)
class FixedLenFeature:
    """A dense feature of fixed ``shape``; required unless ``default_value`` is given.

    The default is reshaped (not broadcast) to ``shape``, so it must hold exactly
    ``prod(shape)`` values, as in ``tf.io.FixedLenFeature``.
    """

    shape: Any
    dtype: Any
    default_value: Any = None


@dataclass(frozen=True)
class VarLenFeature:
    """A variable-length feature, returned as a :class:`RaggedColumn` (``to_sparse()`` is
    the ``tf.SparseTensor`` that ``tf.io.VarLenFeature`` gives). Missing = empty row."""

    dtype: Any


@dataclass(frozen=True)
class FixedLenSequenceFeature:
    """Rows of ``shape``, as many per record as it holds, padded to the batch's longest
    record with ``default_value`` (0 / b"" when None). Example parsing needs
    ``allow_missing=True``, as in TensorFlow."""

    shape: Any
    dtype: Any
    allow_missing: bool = False
    default_value: Any = None


@dataclass(frozen=True)
class _KeyedPartition:
    """A partition read from the int64 feature ``key`` of the same record."""

    key: str


class _RowLengths(_KeyedPartition):
    """Partition: ``key`` holds the length of each inner row."""


class _RowSplits(_KeyedPartition):
    """Partition: ``key`` holds the row splits (``0, ..., count``)."""


class _RowStarts(_KeyedPartition):
    """Partition: ``key`` holds where each row starts (the first at 0)."""


class _RowLimits(_KeyedPartition):
    """Partition: ``key`` holds where each row ends (the last at the count)."""


class _ValueRowIds(_KeyedPartition):
    """Partition: ``key`` holds each value's row (non-decreasing); a record has
    ``max + 1`` rows."""


@dataclass(frozen=True)
class _UniformRowLength:
    """Partition: every inner row has ``length`` values."""

    length: int


@dataclass(frozen=True)
class RaggedFeature:
    """A ragged feature, returned as a :class:`RaggedColumn` (``tf.io.RaggedFeature``).

    ``value_key`` defaults to the feature's name. ``partitions`` (outermost first) split
    each record's values further, as in TensorFlow: ``RowLengths``, ``RowSplits``,
    ``RowStarts``, ``RowLimits`` and ``ValueRowIds`` name an int64 feature of the same
    record; ``UniformRowLength(length)`` takes a number. ``row_splits_dtype`` is
    np.int32 (TensorFlow's default) or np.int64. Partitions are always checked (which
    TensorFlow does only with ``validate=True``): one that does not describe the record's
    values raises :class:`ParseError` naming the feature, the partition and the record.
    """

    dtype: Any
    value_key: str | None = None
    partitions: tuple[Any, ...] = ()
    row_splits_dtype: Any = np.int32
    validate: bool = False

    RowLengths = _RowLengths
    RowSplits = _RowSplits
    RowStarts = _RowStarts
    RowLimits = _RowLimits
    ValueRowIds = _ValueRowIds
    UniformRowLength = _UniformRowLength


# So that reprs read like TensorFlow's spelling of the same partitions.
for _partition in (*_KeyedPartition.__subclasses__(), _UniformRowLength):
    _partition.__qualname__ = "RaggedFeature." + _partition.__name__.lstrip("_")
del _partition


FeatureSpec = Union[FixedLenFeature, VarLenFeature, FixedLenSequenceFeature, RaggedFeature]  # noqa: UP007


# --------------------------------------------------------------------------- parse


@dataclass(frozen=True)
class _Column:
    """One requested feature's values across the batch, as the scan gathered them."""

    key: str
    kind: int
    values: Array
    counts: Array  # per record; -1 = missing


class _Plan:
    """Which raw features to gather (name -> kind), checked for conflicting uses."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}

    def need(self, key: str, kind: int, user: str) -> None:
        previous = self.kinds.setdefault(key, kind)
        if previous != kind:
            raise InvalidArgumentError(
                f"feature {key!r} is requested as {_TF_DTYPE_NAMES[previous]} and as "
                f"{_TF_DTYPE_NAMES[kind]} (by {user!r})"
            )


def _value_key(name: str, spec: FeatureSpec) -> str:
    if isinstance(spec, RaggedFeature) and spec.value_key is not None:
        return spec.value_key
    return name


def _plan(features: Mapping[str, FeatureSpec]) -> _Plan:
    plan = _Plan()
    for name, spec in features.items():
        if not isinstance(
            spec, FixedLenFeature | VarLenFeature | FixedLenSequenceFeature | RaggedFeature
        ):
            raise InvalidArgumentError(
                f"feature {name!r}: unsupported spec {spec!r}; use headrace.io.example's "
                "FixedLenFeature, VarLenFeature, FixedLenSequenceFeature or RaggedFeature"
            )
        if isinstance(spec, FixedLenSequenceFeature) and not spec.allow_missing:
            raise InvalidArgumentError(
                "Unsupported: FixedLenSequenceFeature requires allow_missing to be True."
            )
        plan.need(_value_key(name, spec), _kind_of_spec_dtype(spec.dtype), name)
        if isinstance(spec, RaggedFeature):
            for partition in spec.partitions:
                if isinstance(partition, _KeyedPartition):
                    plan.need(partition.key, wire.KIND_INT64, name)
                elif not isinstance(partition, _UniformRowLength):
                    raise InvalidArgumentError(
                        f"feature {name!r}: partition {partition!r} is not one of "
                        "RaggedFeature.RowLengths, RowSplits, RowStarts, RowLimits, "
                        "ValueRowIds or UniformRowLength"
                    )
    return plan


def _failure_message(args: tuple[Any, ...], keys: Sequence[str], batch_size: int) -> str:
    code, record_index, key_index, position, found_kind = args
    if code == wire.FAILURE_KIND:
        key = keys[key_index]
        found = _TF_DTYPE_NAMES.get(found_kind, "none")
        return (
            f"feature {key!r} in record {record_index} of the batch: data types don't match, "
            f"found {found} at byte {position}"
        )
    return (
        f"record {record_index} of the batch ({batch_size} records) is not a valid Example: "
        f"truncated or malformed protobuf at byte {position}"
    )


def _gather(serialized: Sequence[bytes], plan: _Plan) -> dict[str, _Column]:
    keys = list(plan.kinds)
    kinds = [plan.kinds[key] for key in keys]
    encoded_keys = [key.encode("utf-8") for key in keys]
    native = native_module()
    failures: tuple[type[ValueError], ...] = (wire.ParseFailure,)
    try:
        if native is not None:
            failures = (native.ParseFailure, wire.ParseFailure)
            raw: list[wire.RawColumn] = native.parse_example_columns(
                serialized, encoded_keys, kinds
            )
        else:
            raw = wire.scan_columns(serialized, encoded_keys, kinds)
    except failures as failure:
        raise ParseError(_failure_message(failure.args, keys, len(serialized))) from None
    columns = {}
    for key, kind, (values, counts) in zip(keys, kinds, raw, strict=True):
        columns[key] = _Column(key, kind, _decoded_array(kind, values), _counts_array(counts))
    return columns


def _counts_array(counts: bytearray) -> Array:
    return np.frombuffer(counts, dtype="<i8").astype(np.int64, copy=False)


def _default_array(spec: FixedLenFeature, name: str, kind: int, shape: tuple[int, ...]) -> Array:
    default = values_as_array(spec.default_value, kind, name)
    if default.size != math.prod(shape):
        raise InvalidArgumentError(
            f"feature {name!r}: default_value has {default.size} values but shape {shape} "
            f"needs {math.prod(shape)} (the default is reshaped, not broadcast)"
        )
    return default


def _first_record(mask: Array) -> int:
    return int(np.flatnonzero(mask)[0])


def _fixed_len(name: str, spec: FixedLenFeature, column: _Column) -> Array:
    shape = _shape_tuple(spec.shape)
    size = math.prod(shape)
    batch = len(column.counts)
    missing = column.counts < 0
    default = None if spec.default_value is None else _default_array(spec, name, column.kind, shape)
    if default is None and missing.any():
        raise ParseError(
            f"feature {name!r} (data type: {_TF_DTYPE_NAMES[column.kind]}) is required but "
            f"missing in record {_first_record(missing)} of the batch"
        )
    wrong = ~missing & (column.counts != size)
    if wrong.any():
        record = _first_record(wrong)
        raise ParseError(
            f"feature {name!r} in record {record} of the batch has {column.counts[record]} "
            f"{_TF_DTYPE_NAMES[column.kind]} values, expected {size} (shape {list(shape)})"
        )
    if not missing.any():
        return column.values.reshape((batch, *shape))
    out = np.empty((batch, size), dtype=column.values.dtype)
    out[~missing] = column.values.reshape(-1, size)
    out[missing] = default
    return out.reshape((batch, *shape))


def _row_splits(counts: Array, dtype: Any) -> Array:
    splits = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.maximum(counts, 0), out=splits[1:])
    return splits.astype(dtype, copy=False)


def _var_len(column: _Column) -> RaggedColumn:
    return RaggedColumn(column.values, _row_splits(column.counts, np.int64))


def _rows_of(name: str, counts: Array, width: int, what: str) -> Array:
    """Each record's ``counts`` values as rows of ``width``; a count that is not a multiple
    of it names the feature and the record."""
    uneven = counts % width != 0 if width else counts != 0
    if uneven.any():
        record = _first_record(uneven)
        raise ParseError(
            f"feature {name!r} in record {record} of the batch has {counts[record]} values, "
            f"not a multiple of {width} {what}"
        )
    return counts // width if width else np.zeros_like(counts)


def _fixed_len_sequence(name: str, spec: FixedLenSequenceFeature, column: _Column) -> Array:
    shape = _shape_tuple(spec.shape)
    rows = _rows_of(
        name, np.maximum(column.counts, 0), math.prod(shape), f"(row shape {list(shape)})"
    )
    default = spec.default_value
    if default is not None:
        default_values = values_as_array(default, column.kind, name)
        if default_values.size != 1:
            raise InvalidArgumentError(
                f"feature {name!r}: a FixedLenSequenceFeature default_value must be a scalar"
            )
        default = default_values[0]
    rows_values = column.values.reshape((-1, *shape))
    return RaggedColumn(rows_values, _row_splits(rows, np.int64)).to_dense(default)


def _ragged(name: str, spec: RaggedFeature, columns: dict[str, _Column]) -> RaggedColumn:
    splits_dtype = np.dtype(getattr(spec.row_splits_dtype, "as_numpy_dtype", spec.row_splits_dtype))
    if splits_dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise InvalidArgumentError(f"feature {name!r}: row_splits_dtype must be int32 or int64")
    column = columns[_value_key(name, spec)]
    inner: Array | RaggedColumn = column.values
    counts = np.maximum(column.counts, 0)
    for partition in reversed(spec.partitions):
        if isinstance(partition, _UniformRowLength):
            inner, counts = _apply_uniform(name, partition.length, inner, counts)
        else:
            lengths, rows = _row_lengths(name, partition, columns[partition.key], counts)
            inner, counts = _apply_row_lengths(name, partition, lengths, rows, inner, counts)
            inner = RaggedColumn(inner.values, inner.row_splits.astype(splits_dtype))
    return RaggedColumn(inner, _row_splits(counts, splits_dtype))


def _apply_uniform(
    name: str, length: int, inner: Array | RaggedColumn, counts: Array
) -> tuple[Array | RaggedColumn, Array]:
    rows = _rows_of(name, counts, length, "(its uniform row length)")
    if isinstance(inner, np.ndarray):
        return inner.reshape((-1, length, *inner.shape[1:])), rows
    total_rows = int(rows.sum())
    splits = np.arange(total_rows + 1, dtype=np.int64) * length
    return RaggedColumn(inner, splits.astype(inner.row_splits.dtype)), rows


#: At most this many rows per batch from ValueRowIds partitions (128 MiB of row splits).
_MAX_ROWS = 1 << 24


def _partition_error(name: str, partition: Any, record: int, what: str) -> ParseError:
    return ParseError(
        f"feature {name!r} in record {record} of the batch: {partition!r} {what}"
    )


def _row_lengths(name: str, partition: Any, column: _Column, counts: Array) -> tuple[Array, Array]:
    """Any keyed partition as the lengths of its rows (flat, across the batch) and the
    number of rows of each record. ``counts`` is how many values (or inner rows) each
    record has, which the partition must describe exactly."""
    given = column.values
    per_record = np.maximum(column.counts, 0)
    record_splits = _row_splits(per_record, np.int64)
    owner = np.repeat(np.arange(len(per_record)), per_record)  # record of each entry
    first = np.zeros(len(given), dtype=bool)
    first[record_splits[:-1][per_record > 0]] = True
    previous = np.concatenate([[0], given[:-1]]) if len(given) else given
    previous = np.where(first, 0, previous)  # each record starts again from offset 0

    def check(bad: Array, what: str) -> None:
        if bad.any():
            raise _partition_error(name, partition, int(owner[_first_record(bad)]), what)

    if isinstance(partition, _RowLengths):
        return given, per_record
    if isinstance(partition, _RowLimits):
        return given - previous, per_record
    if isinstance(partition, _RowSplits | _RowStarts):
        check(first & (given != 0), "must start at 0")
        if isinstance(partition, _RowSplits):  # n + 1 splits make n rows
            return (given - previous)[~first], np.maximum(per_record - 1, 0)
        # a row runs to the next row's start, the record's last row to its end
        ends = np.concatenate([given[1:], [0]]) if len(given) else given
        last = np.zeros(len(given), dtype=bool)
        last[record_splits[1:][per_record > 0] - 1] = True
        ends = np.where(last, np.repeat(counts, per_record), ends)
        return ends - given, per_record
    # ValueRowIds: one id per value, non-decreasing; ids up to max + 1 rows per record
    check(given < 0, "has a negative row id")
    check(~first & (given < previous), "must not decrease")
    # Rows between ids are empty, and each costs a row split: a corrupt or hostile id
    # must not make the parser allocate without bound (TensorFlow would try).
    too_many = f"implies more than {_MAX_ROWS:,} rows in the batch (8 bytes of row split each)"
    check(given >= _MAX_ROWS, too_many)
    present = per_record > 0
    rows = np.zeros(len(per_record), dtype=np.int64)
    rows[present] = given[record_splits[1:][present] - 1] + 1
    over = np.cumsum(rows) > _MAX_ROWS
    if over.any():
        raise _partition_error(name, partition, _first_record(over), too_many)
    offsets = _row_splits(rows, np.int64)
    lengths = np.bincount(given + offsets[owner], minlength=int(offsets[-1]))
    return lengths.astype(np.int64), rows


def _apply_row_lengths(
    name: str,
    partition: Any,
    lengths: Array,
    rows: Array,
    inner: Array | RaggedColumn,
    counts: Array,
) -> tuple[RaggedColumn, Array]:
    """Split each record's ``counts`` values into ``rows`` rows of these lengths."""
    record_splits = _row_splits(rows, np.int64)
    negative = np.flatnonzero(lengths < 0)
    if len(negative):
        record = int(np.searchsorted(record_splits, negative[0], "right")) - 1
        raise _partition_error(name, partition, record, "gives a row a negative length")
    cumulative = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    totals = cumulative[record_splits[1:]] - cumulative[record_splits[:-1]]
    mismatch = totals != counts
    if mismatch.any():
        record = _first_record(mismatch)
        raise _partition_error(
            name,
            partition,
            record,
            f"describes {totals[record]} values but the record has {counts[record]}",
        )
    return RaggedColumn(inner, cumulative), rows


def parse_example(
    serialized: Sequence[bytes],
    features: Mapping[str, FeatureSpec],
) -> dict[str, Array | RaggedColumn]:
    """Parse a batch of serialized Examples into columns, like ``tf.io.parse_example``.

    Returns, per name in ``features``: ``FixedLenFeature`` -> array ``(batch, *shape)``;
    ``FixedLenSequenceFeature`` -> array ``(batch, longest, *shape)`` padded with its
    default; ``VarLenFeature`` -> :class:`RaggedColumn` with int64 row splits;
    ``RaggedFeature`` -> :class:`RaggedColumn` (nested for ``RowLengths`` partitions).
    Numeric arrays may be read-only views of one shared buffer.
    """
    if isinstance(serialized, bytes | bytearray | memoryview):
        raise InvalidArgumentError("parse_example takes a batch (a sequence of bytes)")
    records = serialized if isinstance(serialized, list | tuple) else list(serialized)
    columns = _gather(records, _plan(features))
    parsed: dict[str, Array | RaggedColumn] = {}
    for name, spec in features.items():
        column = columns[_value_key(name, spec)]
        if isinstance(spec, FixedLenFeature):
            parsed[name] = _fixed_len(name, spec, column)
        elif isinstance(spec, VarLenFeature):
            parsed[name] = _var_len(column)
        elif isinstance(spec, FixedLenSequenceFeature):
            parsed[name] = _fixed_len_sequence(name, spec, column)
        else:
            parsed[name] = _ragged(name, spec, columns)
    return parsed
