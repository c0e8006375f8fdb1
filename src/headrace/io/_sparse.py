"""SparseColumn: what ``tf.SparseTensor`` holds, as NumPy arrays.

``tf.io.SparseFeature`` parses to a SparseTensor whose indices come from the record
itself (``index_key``), so neither a dense array nor a :class:`RaggedColumn` can hold it
without losing information (duplicate or out-of-range indices stay as they are, as in
TensorFlow). ``to_dense()`` is ``tf.sparse.to_dense``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from headrace._errors import InvalidArgumentError

__all__ = ["SparseColumn"]

Array = npt.NDArray[Any]


@dataclass(frozen=True, eq=False)
class SparseColumn:
    """``indices`` int64 ``(nnz, rank)`` in row-major order, ``values`` ``(nnz,)``,
    ``dense_shape`` int64 ``(rank,)``: a ``tf.SparseTensor``."""

    indices: Array
    values: Array
    dense_shape: Array

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.values.dtype

    def __getitem__(self, row: int) -> SparseColumn:
        """Row ``row`` of the outer dimension, one rank less (as indexing a batch)."""
        count = int(self.dense_shape[0])
        if not -count <= row < count:
            raise IndexError(f"row {row} out of range for {count} rows")
        row %= count
        mask = self.indices[:, 0] == row
        return SparseColumn(self.indices[mask, 1:], self.values[mask], self.dense_shape[1:])

    def __len__(self) -> int:
        return int(self.dense_shape[0])

    def to_dense(self, default_value: Any = None) -> Array:
        """``tf.sparse.to_dense``: ``default_value`` (0 / b"") where no index names a cell.
        An index out of bounds or named twice is an error, as in TensorFlow."""
        fill = default_value
        if fill is None:
            fill = b"" if self.values.dtype == object else 0
        shape = tuple(int(dim) for dim in self.dense_shape)
        out = np.full(shape, fill, dtype=self.values.dtype)
        if len(self.values):
            bad = (self.indices < 0) | (self.indices >= np.asarray(shape, dtype=np.int64))
            if bad.any():
                entry = int(np.flatnonzero(bad.any(axis=1))[0])
                raise InvalidArgumentError(
                    f"index {self.indices[entry].tolist()} (entry {entry}) is out of bounds "
                    f"for dense shape {list(shape)}"
                )
            flat = np.ravel_multi_index(tuple(self.indices.T), shape)
            _, first, counts = np.unique(flat, return_index=True, return_counts=True)
            if (counts > 1).any():
                repeated = np.flatnonzero(flat == flat[first[counts > 1][0]])[1]
                raise InvalidArgumentError(
                    f"indices[{repeated}] = [{','.join(map(str, self.indices[repeated].tolist()))}]"
                    " is repeated"
                )
            out[tuple(self.indices.T)] = self.values
        return out
