"""Parsing tf.train.Example protos into NumPy columns, and decoding them for inspection.

* :func:`parse_example` is ``tf.io.parse_example`` for a batch: one pass over the batch
  (in C when the extension is built) gathers each requested feature's values into one flat
  buffer, then NumPy reshapes them. Specs come from :mod:`.specs`.
* :func:`decode_example` / :func:`decode_sequence_example` decode everything, for
  inspection (``headrace inspect``).

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
from typing import Any

import numpy as np
import numpy.typing as npt

from headrace.errors import InvalidArgumentError, ParseError
from headrace.io import _example_wire as wire
from headrace.io._native import native_module
from headrace.io._ragged import RaggedColumn
from headrace.io.example.encoding import bytes_array, values_as_array
from headrace.io.example.specs import (
    NAME_OF_KIND,
    TF_DTYPE_NAMES,
    FeatureSpec,
    FixedLenFeature,
    FixedLenSequenceFeature,
    RaggedFeature,
    VarLenFeature,
    _KeyedPartition,
    _RowLengths,
    _RowLimits,
    _RowSplits,
    _RowStarts,
    _UniformRowLength,
    kind_of_spec_dtype,
    shape_tuple,
)

__all__ = [
    "DecodedFeature",
    "decode_example",
    "decode_sequence_example",
    "parse_example",
]

Array = npt.NDArray[Any]
#: What :func:`decode_example` returns per feature: ``(kind, values)`` with kind one of
#: ``"bytes_list"``, ``"float_list"``, ``"int64_list"`` (the proto's oneof names).
DecodedFeature = tuple[str, Array]

# --------------------------------------------------------------------------- decode


def _decoded_array(kind: int, values: bytearray | list[bytes]) -> Array:
    if isinstance(values, list):
        return bytes_array(values)
    if kind == wire.KIND_NONE:
        return np.empty(0, dtype=np.float32)
    return np.frombuffer(values, dtype="<f4" if kind == wire.KIND_FLOAT else "<i8")


def _decoded_feature(kind: int, values: bytearray | list[bytes]) -> DecodedFeature:
    return NAME_OF_KIND.get(kind, "none"), _decoded_array(kind, values)


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
                f"feature {key!r} is requested as {TF_DTYPE_NAMES[previous]} and as "
                f"{TF_DTYPE_NAMES[kind]} (by {user!r})"
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
                f"feature {name!r}: unsupported spec {spec!r}; use headrace.io.example "
                "FixedLenFeature, VarLenFeature, FixedLenSequenceFeature or RaggedFeature"
            )
        if isinstance(spec, FixedLenSequenceFeature) and not spec.allow_missing:
            raise InvalidArgumentError(
                "Unsupported: FixedLenSequenceFeature requires allow_missing to be True."
            )
        plan.need(_value_key(name, spec), kind_of_spec_dtype(spec.dtype), name)
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
        found = TF_DTYPE_NAMES.get(found_kind, "none")
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
    shape = shape_tuple(spec.shape)
    size = math.prod(shape)
    batch = len(column.counts)
    missing = column.counts < 0
    default = None if spec.default_value is None else _default_array(spec, name, column.kind, shape)
    if default is None and missing.any():
        raise ParseError(
            f"feature {name!r} (data type: {TF_DTYPE_NAMES[column.kind]}) is required but "
            f"missing in record {_first_record(missing)} of the batch"
        )
    wrong = ~missing & (column.counts != size)
    if wrong.any():
        record = _first_record(wrong)
        raise ParseError(
            f"feature {name!r} in record {record} of the batch has {column.counts[record]} "
            f"{TF_DTYPE_NAMES[column.kind]} values, expected {size} (shape {list(shape)})"
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
    shape = shape_tuple(spec.shape)
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
