"""Feature specs for parsing tf.train.Example protos, with tf.io's names and arguments.

:class:`FixedLenFeature`, :class:`VarLenFeature`, :class:`FixedLenSequenceFeature` and
:class:`RaggedFeature` say what :mod:`.parsing` extracts; the tables here map the three
list kinds an Example can hold to their NumPy dtypes and TensorFlow names.

Dtypes: ``np.float32`` (FloatList), ``np.int64`` (Int64List), ``bytes`` (BytesList);
TensorFlow's ``tf.float32`` / ``tf.int64`` / ``tf.string`` are accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from headrace._errors import InvalidArgumentError
from headrace.io import _example_wire as wire

__all__ = [
    "DTYPE_OF_KIND",
    "KIND_OF_NAME",
    "NAME_OF_KIND",
    "TF_DTYPE_NAMES",
    "FeatureSpec",
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "RaggedFeature",
    "SparseFeature",
    "VarLenFeature",
    "kind_of_spec_dtype",
    "shape_tuple",
]

Array = npt.NDArray[Any]

KIND_OF_NAME = {
    "bytes_list": wire.KIND_BYTES,
    "float_list": wire.KIND_FLOAT,
    "int64_list": wire.KIND_INT64,
}
NAME_OF_KIND = {kind: name for name, kind in KIND_OF_NAME.items()}
DTYPE_OF_KIND: dict[int, np.dtype[Any]] = {
    wire.KIND_FLOAT: np.dtype(np.float32),
    wire.KIND_INT64: np.dtype(np.int64),
    wire.KIND_BYTES: np.dtype(object),
}
TF_DTYPE_NAMES = {wire.KIND_FLOAT: "float", wire.KIND_INT64: "int64", wire.KIND_BYTES: "string"}

def kind_of_spec_dtype(dtype: Any) -> int:
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
    for kind, allowed in DTYPE_OF_KIND.items():
        if normalized == allowed:
            return kind
    raise InvalidArgumentError(
        f"unsupported feature dtype {dtype!r}: use np.float32, np.int64 or bytes "
        "(the three list types an Example can hold)"
    )


def shape_tuple(shape: Any) -> tuple[int, ...]:
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
class KeyedPartition:
    """A partition read from the int64 feature ``key`` of the same record."""

    key: str


class RowLengths(KeyedPartition):
    """Partition: ``key`` holds the length of each inner row."""


class RowSplits(KeyedPartition):
    """Partition: ``key`` holds the row splits (``0, ..., count``)."""


class RowStarts(KeyedPartition):
    """Partition: ``key`` holds where each row starts (the first at 0)."""


class RowLimits(KeyedPartition):
    """Partition: ``key`` holds where each row ends (the last at the count)."""


class _ValueRowIds(KeyedPartition):
    """Partition: ``key`` holds each value's row (non-decreasing); a record has
    ``max + 1`` rows."""


@dataclass(frozen=True)
class UniformRowLength:
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

    RowLengths = RowLengths
    RowSplits = RowSplits
    RowStarts = RowStarts
    RowLimits = RowLimits
    ValueRowIds = _ValueRowIds
    UniformRowLength = UniformRowLength


# So that reprs read like TensorFlow's spelling of the same partitions.
for _partition in (*KeyedPartition.__subclasses__(), UniformRowLength):
    _partition.__qualname__ = "RaggedFeature." + _partition.__name__.lstrip("_")
del _partition


@dataclass(frozen=True)
class SparseFeature:
    """A sparse feature built from the record's own indices (``tf.io.SparseFeature``),
    parsed to a :class:`~headrace.io._sparse.SparseColumn`.

    ``index_key`` names the int64 feature(s) holding each value's index (a list of names
    for a ``size`` of several dimensions), ``value_key`` the values; both must hold as
    many entries as each other in every record. Indices are sorted (row-major) unless
    ``already_sorted``; as in TensorFlow they are not checked against ``size``, and
    duplicates are kept.
    """

    index_key: Any
    value_key: str
    dtype: Any
    size: Any
    already_sorted: bool = False

    @property
    def index_keys(self) -> tuple[str, ...]:
        return (self.index_key,) if isinstance(self.index_key, str) else tuple(self.index_key)

    @property
    def dense_size(self) -> tuple[int, ...]:
        sizes = shape_tuple(self.size)
        if len(sizes) != len(self.index_keys):
            raise InvalidArgumentError(
                f"SparseFeature: {len(self.index_keys)} index keys but size {list(sizes)} has "
                f"{len(sizes)} dimensions; give one size per index key"
            )
        return sizes


FeatureSpec = Union[  # noqa: UP007
    FixedLenFeature, VarLenFeature, FixedLenSequenceFeature, RaggedFeature, SparseFeature
]
"""Any of the parsing specs ``parse_example`` takes for one feature."""
