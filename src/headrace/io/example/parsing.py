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
:class:`~headrace._errors.ParseError`, spec mistakes :class:`~headrace._errors.InvalidArgumentError`.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from headrace._errors import InvalidArgumentError, ParseError, mark_batch_row
from headrace.io import _example_wire as wire
from headrace.io._native import native_module
from headrace.io._ragged import RaggedColumn
from headrace.io._sparse import SparseColumn
from headrace.io.columns import object_array, wire_bytes
from headrace.io.example.deferred import DeferredRecord
from headrace.io.example.encoding import values_as_array
from headrace.io.example.specs import (
    DTYPE_OF_KIND,
    NAME_OF_KIND,
    TF_DTYPE_NAMES,
    FeatureSpec,
    FixedLenFeature,
    FixedLenSequenceFeature,
    KeyedPartition,
    RaggedFeature,
    RowLengths,
    RowLimits,
    RowSplits,
    RowStarts,
    SparseFeature,
    UniformRowLength,
    VarLenFeature,
    kind_of_spec_dtype,
    shape_tuple,
)

__all__ = [
    "DecodedFeature",
    "decode_example",
    "decode_sequence_example",
    "parse_example",
    "parse_sequence_example",
    "parse_single_example",
    "parse_single_sequence_example",
]

Array = npt.NDArray[Any]
#: What :func:`decode_example` returns per feature: ``(kind, values)`` with kind one of
#: ``"bytes_list"``, ``"float_list"``, ``"int64_list"`` (the proto's oneof names).
DecodedFeature = tuple[str, Array]

# --------------------------------------------------------------------------- decode


def _decoded_array(kind: int, values: bytearray | list[bytes]) -> Array:
    if isinstance(values, list):
        return object_array(values)
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


def _decode_features(data: bytes, map_field: int = 1) -> dict[bytes, wire.DecodedFeature]:
    """``_example_wire.decode_features`` (the same dict, the same ``Malformed``), in C
    where the extension is built: the Python walk of the wire cost an image pipeline's
    map 10-25 us a record with the GIL held."""
    native = native_module()
    decode = getattr(native, "decode_features", None)  # (None: an older build lacks it)
    if decode is None:
        return wire.decode_features(data, map_field)
    try:
        return cast(dict[bytes, wire.DecodedFeature], decode(data, map_field))
    except native.ParseFailure as failure:  # type: ignore[union-attr]
        raise wire.Malformed(failure.args[3]) from None


def decode_example(serialized: bytes) -> dict[str, DecodedFeature]:
    """Decode a serialized tf.train.Example to ``{name: (kind, values)}``, for inspection.

    ``kind`` is ``"bytes_list" | "float_list" | "int64_list"`` (``"none"`` for a Feature
    with no list); values are float32/int64 arrays or object arrays of bytes.
    """
    try:
        decoded = _decode_features(bytes(serialized))
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
        context = _decode_features(data, map_field=1)
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
    raw_counts: bytes | bytearray  # little-endian int64 per record; -1 = missing

    @functools.cached_property
    def counts(self) -> Array:
        return np.frombuffer(self.raw_counts, dtype="<i8").astype(np.int64, copy=False)

    def uniform(self, count: int) -> bool:
        """Whether every record has exactly ``count`` values: for a batch of up to
        :data:`_UNIFORM_RECORDS`, one memcmp against a cached pattern, where the NumPy
        comparison and reduction cost a fixed-length feature ~1.5 us a batch."""
        records = len(self.raw_counts) // 8
        if records > _UNIFORM_RECORDS:
            return bool((self.counts == count).all())
        return self.raw_counts == _uniform_counts(count, records)


#: What an array object costs beside its data (memory.sizeof's figure; io sits below it).
ARRAY_HEADER_BYTES = sys.getsizeof(np.empty(0))


def _column_nbytes(column: _Column) -> int:
    """What one gathered column holds: its values (their objects too) and counts."""
    values = column.values
    nbytes = ARRAY_HEADER_BYTES + values.nbytes + len(column.raw_counts)
    if values.dtype.hasobject:
        nbytes += sum(map(sys.getsizeof, values.tolist()))
    return nbytes


#: Batches up to this many records compare their counts with a cached pattern (4 of them
#: at most, 128 KiB each: memory outside any budget, so kept small).
_UNIFORM_RECORDS = 16384


@functools.lru_cache(maxsize=4)
def _uniform_counts(count: int, records: int) -> bytes:
    return np.full(records, count, dtype="<i8").tobytes()


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
    if isinstance(spec, SparseFeature):
        return spec.value_key
    return name


_SPEC_TYPES = (
    FixedLenFeature, VarLenFeature, FixedLenSequenceFeature, RaggedFeature, SparseFeature
)


def _plan(features: Mapping[str, FeatureSpec]) -> _Plan:
    plan = _Plan()
    for name, spec in features.items():
        if not isinstance(spec, _SPEC_TYPES):
            raise InvalidArgumentError(
                f"feature {name!r}: unsupported spec {spec!r}; use headrace.io.example's "
                "FixedLenFeature, VarLenFeature, FixedLenSequenceFeature, RaggedFeature or "
                "SparseFeature"
            )
        if isinstance(spec, FixedLenSequenceFeature) and not spec.allow_missing:
            raise InvalidArgumentError(
                "Unsupported: FixedLenSequenceFeature requires allow_missing to be True."
            )
        plan.need(_value_key(name, spec), kind_of_spec_dtype(spec.dtype), name)
        if isinstance(spec, SparseFeature):
            spec.dense_size  # noqa: B018 - checks the index keys against the size
            for index_key in spec.index_keys:
                plan.need(index_key, wire.KIND_INT64, name)
        if isinstance(spec, RaggedFeature):
            for partition in spec.partitions:
                if isinstance(partition, KeyedPartition):
                    plan.need(partition.key, wire.KIND_INT64, name)
                elif not isinstance(partition, UniformRowLength):
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


def _gather(
    serialized: Sequence[bytes], keys: list[str], kinds: list[int], encoded_keys: list[bytes]
) -> dict[str, _Column]:
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
        columns[key] = _Column(key, kind, _decoded_array(kind, values), counts)
    return columns


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


def _fixed_len(name: str, spec: FixedLenFeature, column: _Column, shape: tuple[int, ...]) -> Array:
    size = math.prod(shape)
    batch = len(column.raw_counts) // 8
    if column.uniform(size):  # every record has it, at its size: one check
        return column.values.reshape((batch, *shape))
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
        if isinstance(partition, UniformRowLength):
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

    if isinstance(partition, RowLengths):
        return given, per_record
    if isinstance(partition, RowLimits):
        return given - previous, per_record
    if isinstance(partition, RowSplits | RowStarts):
        check(first & (given != 0), "must start at 0")
        if isinstance(partition, RowSplits):  # n + 1 splits make n rows
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


def _sparse(name: str, spec: SparseFeature, columns: dict[str, _Column]) -> SparseColumn:
    """Indices from the record's own index features, sorted row-major (stably) unless
    ``already_sorted``; not checked against ``size`` and duplicates kept, as TensorFlow."""
    values = columns[spec.value_key]
    counts = np.maximum(values.counts, 0)
    index_columns = [columns[key] for key in spec.index_keys]
    for key, column in zip(spec.index_keys, index_columns, strict=True):
        mismatch = np.maximum(column.counts, 0) != counts
        if mismatch.any():
            record = _first_record(mismatch)
            raise ParseError(
                f"feature {name!r} (SparseFeature) in record {record} of the batch: index "
                f"feature {key!r} has {max(int(column.counts[record]), 0)} values but value "
                f"feature {spec.value_key!r} has {int(counts[record])}; they must be as many"
            )
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    indices = np.stack([rows, *(column.values for column in index_columns)], axis=1)
    flat = values.values
    if not spec.already_sorted and len(rows):
        order = np.lexsort(indices.T[::-1])  # stable: equal indices keep record order
        indices, flat = indices[order], flat[order]
    dense_shape = np.array([len(counts), *spec.dense_size], dtype=np.int64)
    return SparseColumn(indices.astype(np.int64, copy=False), flat, dense_shape)


def parse_example(
    serialized: Sequence[bytes],
    features: Mapping[str, FeatureSpec],
) -> dict[str, Array | RaggedColumn | SparseColumn]:
    """Parse a batch of serialized Examples into columns, like ``tf.io.parse_example``.

    Returns, per name in ``features``: ``FixedLenFeature`` -> array ``(batch, *shape)``;
    ``FixedLenSequenceFeature`` -> array ``(batch, longest, *shape)`` padded with its
    default; ``VarLenFeature`` -> :class:`RaggedColumn` with int64 row splits;
    ``RaggedFeature`` -> :class:`RaggedColumn` (nested for ``RowLengths`` partitions);
    ``SparseFeature`` -> :class:`SparseColumn` (``tf.SparseTensor``).
    Numeric arrays may be read-only views of one shared buffer.
    """
    if isinstance(serialized, bytes | bytearray | memoryview):
        raise InvalidArgumentError("parse_example takes a batch (a sequence of bytes)")
    records = serialized if isinstance(serialized, list | tuple) else list(serialized)
    return BatchParser(features)(records)


class BatchParser:
    """``parse_example`` for one ``features`` mapping, its plan made once.

    Why: a dataset's ``parse_examples`` parses every batch with the same spec, and
    planning it again each time (checking the specs, encoding the keys, working out
    shapes) was a third of the Python around the C scan of a 1,024-record batch.
    Checks the spec on construction, with the errors :func:`parse_example` raises.
    """

    def __init__(self, features: Mapping[str, FeatureSpec]) -> None:
        self.features = dict(features)
        plan = _plan(self.features)
        self.keys = list(plan.kinds)
        self.kinds = [plan.kinds[key] for key in self.keys]
        self.encoded_keys = [key.encode("utf-8") for key in self.keys]
        self.steps = [
            (name, spec, _value_key(name, spec),
             shape_tuple(spec.shape) if isinstance(spec, FixedLenFeature) else None)
            for name, spec in self.features.items()
        ]

    def __getstate__(self) -> dict[str, Any]:
        return {"features": self.features}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["features"])  # type: ignore[misc]

    def __call__(self, records: Sequence[bytes]) -> dict[str, Array | RaggedColumn | SparseColumn]:
        try:
            return self._parse(records)
        except ParseError as error:  # "record 3 of the batch": a map names that row's origin
            raise mark_batch_row(error)  # noqa: B904 - the same error

    def fixed_nbytes(self, rows: int) -> int:
        """The bytes of the FixedLen features' arrays for ``rows`` records (exact)."""
        total = 0
        for _name, spec, _key, shape in self.steps:
            if shape is not None:
                itemsize = 8 if spec.dtype is bytes or np.dtype(spec.dtype).hasobject else (
                    np.dtype(spec.dtype).itemsize)
                total += ARRAY_HEADER_BYTES + rows * math.prod(shape) * itemsize
        return total

    def most_nbytes(self, records: Sequence[bytes]) -> int:
        """The most the values of ``records`` can cost once parsed, from their sizes
        alone: an int64 takes at least one byte on the wire and 8 parsed, a float 4 and
        4, a bytes value at least 2 and a Python object of 41 plus its length."""
        total = wire_bytes(records)
        kinds = set(self.kinds)
        most = 0
        if wire.KIND_INT64 in kinds:
            most += 8 * total
        if wire.KIND_FLOAT in kinds:
            most += total
        if wire.KIND_BYTES in kinds:
            most += total + 39 * (total // 2 + len(records))
        per_record = 32 * len(self.keys)  # counts and row splits
        return most + len(records) * per_record + 2 * ARRAY_HEADER_BYTES * len(self.steps)

    def values_nbytes(self, records: Sequence[bytes]) -> int | None:
        """What the values of ``records`` cost once parsed, counted by gathering them
        (then dropped); None if the records do not parse (the parse itself says why)."""
        try:
            columns = _gather(records, self.keys, self.kinds, self.encoded_keys)
        except ParseError:
            return None
        return sum(_column_nbytes(column) for column in columns.values())

    def _parse(self, records: Sequence[bytes]) -> dict[str, Array | RaggedColumn | SparseColumn]:
        columns = _gather(records, self.keys, self.kinds, self.encoded_keys)
        parsed: dict[str, Array | RaggedColumn | SparseColumn] = {}
        for name, spec, key, shape in self.steps:
            if shape is not None:
                parsed[name] = _fixed_len(name, cast(FixedLenFeature, spec), columns[key], shape)
            else:
                parsed[name] = _finish(name, spec, columns[key], columns)
        return parsed


def _finish(
    name: str, spec: FeatureSpec, column: _Column, columns: dict[str, _Column]
) -> Array | RaggedColumn | SparseColumn:
    """A feature other than a FixedLenFeature, from its gathered column(s)."""
    if isinstance(spec, VarLenFeature):
        return _var_len(column)
    if isinstance(spec, FixedLenSequenceFeature):
        return _fixed_len_sequence(name, spec, column)
    if isinstance(spec, SparseFeature):
        return _sparse(name, spec, columns)
    assert isinstance(spec, RaggedFeature)
    return _ragged(name, spec, columns)


# --------------------------------------------------------------------------- one record


def _single_bytes(serialized: Any, what: str) -> bytes:
    if isinstance(serialized, np.ndarray) and serialized.ndim == 0:
        serialized = serialized.item()
    if isinstance(serialized, bytes | bytearray | memoryview):
        return bytes(serialized)
    raise InvalidArgumentError(
        f"{what} takes one serialized record (bytes), got {type(serialized).__name__}; for a "
        "batch of records use parse_example (or Dataset.batch(n).parse_examples(spec))"
    )


def _first_row(value: Array | RaggedColumn | SparseColumn) -> Any:
    """A one-record batch's only row, as parse_single_example gives it (an array, also
    for a scalar feature: 0-d, like TensorFlow's scalar tensor)."""
    if isinstance(value, np.ndarray):
        return value[0, ...]
    return value[0]


def _count_of(kind: int, values: bytearray | list[bytes]) -> int:
    if isinstance(values, list):
        return len(values)
    return len(values) // (4 if kind == wire.KIND_FLOAT else 8)


def _feature_error(
    key: str, spec: FeatureSpec, kind: int, values: Any, prefix: str
) -> ParseError | None:
    """What is wrong with one feature of the record (``kind`` and ``values`` as decoded,
    ``KIND_NONE`` when missing), in tf.io.parse_single_example's words; None if nothing."""
    expected = kind_of_spec_dtype(spec.dtype)
    expected_name = TF_DTYPE_NAMES[expected]
    found = kind != wire.KIND_NONE
    if found and kind != expected:
        actual = TF_DTYPE_NAMES[kind]
        if isinstance(spec, (FixedLenFeature, FixedLenSequenceFeature)):  # dense, in TF
            return ParseError(
                f"{prefix}Key: {key}.  Data types don't match. Data type: {actual} but "
                f"expected type: {expected_name}"
            )
        return ParseError(
            f"{prefix}Key: {key}.  Data types don't match. Expected type: {expected_name}, "
            f"Actual type: {actual}"
        )
    count = _count_of(kind, values) if found else 0
    if isinstance(spec, FixedLenFeature):
        shape = shape_tuple(spec.shape)
        if not found and spec.default_value is None:
            return ParseError(
                f"{prefix}Feature: {key} (data type: {expected_name}) is required but could "
                "not be found."
            )
        if found and count != math.prod(shape):
            return ParseError(
                f"{prefix}Key: {key}.  Number of {expected_name} values != expected.  "
                f"Values size: {count} but output shape: {list(shape)}"
            )
    elif isinstance(spec, FixedLenSequenceFeature):
        shape = shape_tuple(spec.shape)
        stride = math.prod(shape)
        if stride and count % stride:  # tf.io.parse_single_example's own words
            return ParseError(
                f"{prefix}Error while parsing feature with key {key}: number of elements "
                f"should be divisible by {stride}, found {count} instead"
            )
        if not stride and count:  # (TensorFlow divides by zero here: SIGFPE)
            dims = ",".join(["?", *map(str, shape)])
            return ParseError(
                f"{prefix}Key: {key}.  Number of {expected_name} values is not a multiple "
                f"of stride length. Saw {count} values but output shape is: [{dims}]"
            )
    return None


def _single_record_error(
    serialized: bytes, features: Mapping[str, FeatureSpec], batch_error: ParseError, prefix: str
) -> ParseError:
    """What was wrong with the one record, in tf.io.parse_single_example's words.

    Runs only after the columnar parse refused the record: it decodes the record whole
    and checks each feature in the order of ``features``.
    """
    try:
        decoded = _decode_features(serialized)
    except wire.Malformed as malformed:
        preview = serialized[:32] + (b"..." if len(serialized) > 32 else b"")
        return ParseError(
            f"{prefix}Could not parse example input, value: {preview!r} (truncated or "
            f"malformed protobuf at byte {malformed.position} of {len(serialized)})"
        )
    for name, spec in features.items():
        key = _value_key(name, spec)
        kind, values = decoded.get(key.encode("utf-8"), (wire.KIND_NONE, bytearray()))
        error = _feature_error(key, spec, kind, values, prefix)
        if error is not None:
            return error
    message = str(batch_error).replace(" in record 0 of the batch", "")
    return ParseError(prefix + message.replace("record 0 of the batch (1 records)", "the record"))


def parse_single_example(
    serialized: Any,
    features: Mapping[str, FeatureSpec],
    example_names: Any = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Parse one serialized Example, like ``tf.io.parse_single_example``.

    Returns, per name: ``FixedLenFeature`` -> array of its ``shape``;
    ``VarLenFeature`` -> a 1-D array of the values (TensorFlow's SparseTensor holds
    exactly these, at indices 0..n-1); ``FixedLenSequenceFeature`` -> array
    ``(rows, *shape)``; ``RaggedFeature`` -> array, or :class:`RaggedColumn` with
    partitions; ``SparseFeature`` -> :class:`SparseColumn` of rank ``len(size)``. Errors
    are :class:`~headrace._errors.ParseError` with TensorFlow's wording (``"Feature: a (data
    type: float) is required but could not be found."``); ``example_names`` (one name)
    prefixes them as ``"Name: <name>, "``. ``name`` (a TensorFlow op name) is ignored.

    Written as ``dataset.map(lambda r: parse_single_example(r, spec)).batch(n)``, the
    parse runs once per batch, columnar: see ``Dataset.map``.
    """
    if isinstance(serialized, DeferredRecord):
        _plan(features)  # a spec mistake shows now, as it would on the first record
        return serialized.parse(features)
    record = _single_bytes(serialized, "parse_single_example")
    try:
        batch = parse_example([record], features)
    except ParseError as error:
        prefix = "" if example_names is None else f"Name: {_single_name(example_names)}, "
        raise _single_record_error(record, features, error, prefix) from None
    return {key: _first_row(value) for key, value in batch.items()}


def _single_name(example_names: Any) -> str:
    if isinstance(example_names, bytes):
        return example_names.decode("utf-8", "replace")
    if isinstance(example_names, str):
        return example_names
    names = list(np.asarray(example_names, dtype=object).reshape(-1))
    if len(names) != 1:
        raise InvalidArgumentError("parse_single_example: example_names must name one record")
    return _single_name(names[0])


# --------------------------------------------------------------------------- sequences


def _step_arrays(
    key: str, kind: int, steps: list[wire.DecodedFeature], record: int
) -> list[Array]:
    arrays = []
    for step_kind, values in steps:
        if step_kind not in (kind, wire.KIND_NONE):
            raise ParseError(
                f"Name: <unknown>, Feature list: {key}, Index: {record}.  Data types don't "
                f"match. Expected type: {TF_DTYPE_NAMES[kind]}"
            )
        if step_kind == wire.KIND_NONE:
            arrays.append(np.empty(0, dtype=DTYPE_OF_KIND[kind]))
        else:
            arrays.append(_decoded_array(kind, values))
    return arrays


def _concatenated(kind: int, arrays: list[Array]) -> Array:
    if not arrays:
        return np.empty(0, dtype=DTYPE_OF_KIND[kind])
    if kind == wire.KIND_BYTES:
        return object_array([item for array in arrays for item in array])
    return np.concatenate(arrays)


def _feature_lists(records: Sequence[bytes]) -> list[dict[bytes, list[wire.DecodedFeature]]]:
    decoded = []
    for index, record in enumerate(records):
        data = bytes(record)
        try:
            decoded.append(wire.decode_feature_list_map(data))
        except wire.Malformed as malformed:
            raise ParseError(
                f"record {index} of the batch is not a valid SequenceExample: truncated or "
                f"malformed protobuf at byte {malformed.position} of {len(data)}"
            ) from None
    return decoded


def _sequence_column(
    name: str,
    spec: FeatureSpec,
    lists: list[dict[bytes, list[wire.DecodedFeature]]],
) -> tuple[Array | RaggedColumn, Array | None]:
    """One sequence feature across the batch, and its lengths (FixedLenSequence only)."""
    if isinstance(spec, RaggedFeature) and spec.partitions:
        raise InvalidArgumentError(
            f"sequence feature {name!r}: RaggedFeature partitions are not supported in "
            "sequence_features (parse the record's steps with a plain RaggedFeature)"
        )
    if not isinstance(spec, FixedLenSequenceFeature | VarLenFeature | RaggedFeature):
        raise InvalidArgumentError(
            f"sequence feature {name!r}: use FixedLenSequenceFeature, VarLenFeature or "
            f"RaggedFeature in sequence_features, got {type(spec).__name__}"
        )
    key = _value_key(name, spec)
    kind = kind_of_spec_dtype(spec.dtype)
    per_record: list[list[Array]] = []
    for record, decoded in enumerate(lists):
        steps = decoded.get(key.encode("utf-8"))
        if steps is None and isinstance(spec, FixedLenSequenceFeature) and not spec.allow_missing:
            raise ParseError(
                f"Name: <unknown>, Feature list '{key}' is required but could not be found "
                f"(in record {record} of the batch); pass allow_missing=True to treat a "
                "missing list as empty"
            )
        per_record.append(_step_arrays(key, kind, steps or [], record))
    if isinstance(spec, FixedLenSequenceFeature):
        shape = shape_tuple(spec.shape)
        stride = math.prod(shape)
        totals = np.array([sum(len(a) for a in arrays) for arrays in per_record], dtype=np.int64)
        for total in totals.tolist():
            if (total % stride if stride else total) != 0:
                dims = ",".join(["?", *map(str, shape)])
                raise ParseError(
                    f"Feature list '{key}' has an unexpected number of values.  Total values "
                    f"size: {total} is not consistent with output shape: [{dims}]"
                )
        rows = totals // stride if stride else np.zeros_like(totals)
        flat = _concatenated(kind, [a for arrays in per_record for a in arrays])
        dense = RaggedColumn(flat.reshape((-1, *shape)), _row_splits(rows, np.int64))
        return dense.to_dense(None), rows
    splits_dtype: Any = np.int64
    if isinstance(spec, RaggedFeature):
        splits_dtype = np.dtype(
            getattr(spec.row_splits_dtype, "as_numpy_dtype", spec.row_splits_dtype)
        )
    step_lengths = np.array([len(a) for arrays in per_record for a in arrays], dtype=np.int64)
    step_counts = np.array([len(arrays) for arrays in per_record], dtype=np.int64)
    flat = _concatenated(kind, [a for arrays in per_record for a in arrays])
    inner = RaggedColumn(flat, _row_splits(step_lengths, splits_dtype))
    return RaggedColumn(inner, _row_splits(step_counts, splits_dtype)), None


def parse_sequence_example(
    serialized: Sequence[bytes],
    context_features: Mapping[str, FeatureSpec] | None = None,
    sequence_features: Mapping[str, FeatureSpec] | None = None,
    example_names: Any = None,
    name: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Array]]:
    """Parse a batch of SequenceExamples, like ``tf.io.parse_sequence_example``.

    Returns ``(context, feature_lists, lengths)``. Context features parse as in
    :func:`parse_example`. Sequence features: ``FixedLenSequenceFeature`` ->
    ``(batch, longest, *shape)`` padded with 0 / b"" (a record's values across its steps,
    in rows of ``shape``), its row counts in ``lengths``; ``VarLenFeature`` /
    ``RaggedFeature`` -> a :class:`RaggedColumn` of records, of steps, of values (the
    ``SparseTensor`` / ``RaggedTensor`` TensorFlow gives). Feature lists are decoded in
    Python (context features by the columnar parser).
    """
    if isinstance(serialized, bytes | bytearray | memoryview):
        raise InvalidArgumentError(
            "parse_sequence_example takes a batch (a sequence of bytes); for one record use "
            "parse_single_sequence_example"
        )
    records = list(serialized)
    context = dict(parse_example(records, context_features)) if context_features else {}
    lists = _feature_lists(records) if sequence_features else []
    columns: dict[str, Any] = {}
    lengths: dict[str, Array] = {}
    for feature_name, spec in (sequence_features or {}).items():
        column, rows = _sequence_column(feature_name, spec, lists)
        columns[feature_name] = column
        if rows is not None:
            lengths[feature_name] = rows
    return context, columns, lengths


def parse_single_sequence_example(
    serialized: Any,
    context_features: Mapping[str, FeatureSpec] | None = None,
    sequence_features: Mapping[str, FeatureSpec] | None = None,
    example_name: Any = None,
    name: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One SequenceExample, like ``tf.io.parse_single_sequence_example``: ``(context,
    feature_lists)`` without the batch dimension (a VarLen or Ragged feature list is a
    :class:`RaggedColumn` of steps)."""
    record = _single_bytes(serialized, "parse_single_sequence_example")
    context, columns, _ = parse_sequence_example([record], context_features, sequence_features)
    return (
        {key: _first_row(value) for key, value in context.items()},
        {key: _first_row(value) for key, value in columns.items()},
    )
