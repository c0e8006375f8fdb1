"""RaggedColumn: a batch of variable-length rows as flat values plus row splits.

It holds exactly what ``tf.RaggedTensor`` holds (``values`` and ``row_splits``), so rows
are never Python lists and converting to TensorFlow, PyTorch nested tensors or padded
NumPy is a cheap vectorized step.

Mapping to TensorFlow:

* ``RaggedColumn(values, row_splits)`` == ``tf.RaggedTensor.from_row_splits(values,
  row_splits)``; nested columns (``values`` itself a RaggedColumn) are ragged_rank > 1,
  and a ``values`` array with more than one dimension holds uniform inner dimensions.
* ``to_sparse()`` == ``ragged.to_sparse()``, and for a ``VarLenFeature`` column it is
  exactly the ``tf.SparseTensor`` that ``tf.io.parse_example`` returns: ``indices`` int64
  ``(nnz, ndim)`` in row-major order, ``values``, ``dense_shape`` int64 with the longest
  row as its ragged extent.
* ``to_dense(default_value)`` == ``ragged.to_tensor(default_value)`` (padded).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import numpy.typing as npt

__all__ = ["RaggedColumn"]

Array = npt.NDArray[Any]


@dataclass(frozen=True, eq=False)
class RaggedColumn:
    """``nrows`` rows; row ``i`` is ``values[row_splits[i]:row_splits[i + 1]]``."""

    values: Union[Array, RaggedColumn]  # noqa: UP007 - a forward reference in a union
    row_splits: Array

    @property
    def nrows(self) -> int:
        return len(self.row_splits) - 1

    def __len__(self) -> int:
        return self.nrows

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of the innermost values."""
        return self.flat_values.dtype

    @property
    def flat_values(self) -> Array:
        values = self.values
        while isinstance(values, RaggedColumn):
            values = values.values
        return values

    def row_lengths(self) -> Array:
        return np.diff(self.row_splits)

    def __getitem__(self, row: int) -> Array | RaggedColumn:
        """One row: an array, or a RaggedColumn when there are nested ragged dimensions."""
        if not -self.nrows <= row < self.nrows:
            raise IndexError(f"row {row} out of range for {self.nrows} rows")
        row %= self.nrows
        start, stop = int(self.row_splits[row]), int(self.row_splits[row + 1])
        if isinstance(self.values, RaggedColumn):
            inner = self.values
            splits = inner.row_splits[start : stop + 1]
            return RaggedColumn(inner.values, splits)
        return self.values[start:stop]

    def to_list(self) -> list[Any]:
        """Nested Python lists, like ``tf.RaggedTensor.to_list()``."""
        inner = self.values.to_list() if isinstance(self.values, RaggedColumn) else self.values
        splits = self.row_splits.tolist()
        if isinstance(inner, np.ndarray):
            inner = inner.tolist()
        return [inner[start:stop] for start, stop in itertools.pairwise(splits)]

    def _row_ids_and_columns(self) -> tuple[Array, Array]:
        """For each inner element: the row it belongs to and its position in that row."""
        lengths = self.row_lengths()
        row_ids = np.repeat(np.arange(self.nrows, dtype=np.int64), lengths)
        starts = np.repeat(self.row_splits[:-1].astype(np.int64), lengths)
        columns = np.arange(len(row_ids), dtype=np.int64) - starts
        return row_ids, columns

    def to_dense(self, default_value: Any = None) -> Array:
        """Pad every ragged dimension to its longest row with ``default_value``
        (0, or b"" for bytes, when None) — ``tf.RaggedTensor.to_tensor``."""
        inner = (
            self.values.to_dense(default_value)
            if isinstance(self.values, RaggedColumn)
            else self.values
        )
        lengths = self.row_lengths()
        width = int(lengths.max()) if len(lengths) else 0
        fill = default_value
        if fill is None:
            fill = b"" if inner.dtype == object else 0
        out = np.full((self.nrows, width, *inner.shape[1:]), fill, dtype=inner.dtype)
        row_ids, columns = self._row_ids_and_columns()
        out[row_ids, columns] = inner
        return out

    def to_sparse(self) -> tuple[Array, Array, Array]:
        """``(indices, values, dense_shape)`` of the equivalent ``tf.SparseTensor``."""
        if isinstance(self.values, RaggedColumn):
            inner_indices, flat, inner_shape = self.values.to_sparse()
        else:
            dense = self.values
            inner_indices = np.indices(dense.shape, dtype=np.int64).reshape(dense.ndim, -1).T
            flat = dense.reshape(-1)
            inner_shape = np.asarray(dense.shape, dtype=np.int64)
        row_ids, columns = self._row_ids_and_columns()
        outer_row = inner_indices[:, 0]
        indices = np.concatenate(
            [row_ids[outer_row, None], columns[outer_row, None], inner_indices[:, 1:]], axis=1
        )
        lengths = self.row_lengths()
        width = int(lengths.max()) if len(lengths) else 0
        dense_shape = np.concatenate([[self.nrows, width], inner_shape[1:]]).astype(np.int64)
        return indices.astype(np.int64), flat, dense_shape
