"""``ragged_batch(batch_size, drop_remainder=False)``: batch elements of different lengths, unpadded.

headrace's element model has no ``tf.RaggedTensor``; a ragged batch is a
:class:`~headrace.io.example.RaggedColumn` (the flat ``values`` and
``row_splits`` a RaggedTensor holds: converting is one call, see
``headrace.io._ragged``). A component of rank >= 1 becomes a RaggedColumn
ragged in its first dimension (row ``i`` is element ``i``; inner dimensions
must agree), as tf.data makes it a RaggedTensor; scalars batch into a plain
array, as in tf.data. ``row_splits`` are int64 (``row_splits_dtype``: int32 or
int64). The elements of a batch are booked on the stage's share while it is
gathered. The output is booked beside them before it is made (rows and output
are the stage's minimum working set), then it replaces them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from headrace._errors import ElementSpecError, InvalidArgumentError
from headrace._memory.buffer import Assembly, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES
from headrace._structure import (
    TensorSpec,
    flatten,
    map_structure,
    pack_as,
    structure_paths,
    to_leaf_array,
)
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    ShardRole,
    Traits,
    UnaryNode,
    batching_role,
    check_positive,
)
from headrace.core.state import INNER, StateReader
from headrace.io._ragged import RaggedColumn

__all__ = ["RaggedBatchNode"]


class RaggedBatchNode(UnaryNode):
    stage = "ragged_batch"
    budget_weight = 1.0

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # tf.data addresses only batch(drop_remainder=True)

    def traits(self) -> Traits:
        return Traits(groups=True)

    def __init__(
        self, source: Node, batch_size: int, drop_remainder: bool, row_splits_dtype: Any
    ) -> None:
        super().__init__(source)
        self.batch_size = check_positive("ragged_batch: batch_size", batch_size)
        self.drop_remainder = bool(drop_remainder)
        dtype = TensorSpec((), row_splits_dtype).dtype
        if dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise InvalidArgumentError(
                f"ragged_batch: row_splits_dtype must be int32 or int64, got {row_splits_dtype!r}"
            )
        self.row_splits_dtype = dtype

    def shard_role(self) -> ShardRole:
        return batching_role(self.inputs[0], self.drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.drop_remainder, str(self.row_splits_dtype))

    @property
    def element_spec(self) -> Any:
        size = self.batch_size if self.drop_remainder else None

        def batched(leaf: TensorSpec) -> TensorSpec:
            if leaf.shape == ():
                return leaf.with_leading(size)
            inner = None if leaf.shape is None else leaf.shape[1:]
            return TensorSpec(None if inner is None else (size, None, *inner), leaf.dtype, leaf.kind)

        return map_structure(batched, self.inputs[0].element_spec)

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def make_iterator(self, ctx: Context) -> Iterator:
        return _RaggedBatchIterator(self, self.inputs[0].make_iterator(ctx), ctx)


def _exact_array(value: Any) -> np.ndarray[Any, Any]:
    """``value`` as an array; bytes and str stay exact Python objects (G5): NumPy's
    fixed-width ``S``/``U`` dtypes would drop trailing NULs (b"a\\x00" -> b"a")."""
    if isinstance(value, (bytes, str)):
        return np.asarray(value, dtype=object)
    return np.asarray(to_leaf_array(value))


def _ragged(values: list[Any], path: str, splits_dtype: np.dtype[Any]) -> Any:
    arrays = [_exact_array(value) for value in values]
    if all(array.ndim == 0 for array in arrays):
        return np.stack(arrays)
    if any(array.ndim == 0 for array in arrays):
        raise ElementSpecError(f"ragged_batch: component {path} mixes scalars and arrays")
    try:
        flat = np.concatenate(arrays)
    except ValueError:
        shapes = sorted({array.shape[1:] for array in arrays})
        raise ElementSpecError(
            f"ragged_batch: component {path} has elements whose inner dimensions differ "
            f"({shapes}); only the first dimension may vary"
        ) from None
    splits = np.zeros(len(arrays) + 1, dtype=splits_dtype)
    np.cumsum([len(array) for array in arrays], out=splits[1:])
    return RaggedColumn(flat, splits)


class _RaggedBatchIterator(Iterator):
    stage = "ragged_batch"

    def __init__(self, node: RaggedBatchNode, inner: Iterator, ctx: Context) -> None:
        super().__init__(inner)
        self.node, self.inner, self.ctx = node, inner, ctx
        self.account = ctx.account(node)

    def pull(self) -> tuple[Any, Reservation]:
        node = self.node
        rows: list[Any] = []
        assembly = Assembly(self.account, f"a ragged batch of {node.batch_size} plus its output")
        admit, rows_cost = self.ctx.admit, 0
        try:
            while len(rows) < node.batch_size:
                try:
                    element, upstream = self.inner.pull()
                except StopIteration:
                    break
                element, cost = admit(element)
                assembly.take(cost, upstream)
                rows.append(element)
                rows_cost += cost
            if not rows or (node.drop_remainder and len(rows) < node.batch_size):
                raise StopIteration
            leaves = [flatten(row) for row in rows]
            paths = structure_paths(rows[0])
            # The output copies the rows: at most their bytes, plus each component's
            # row splits and headers. Booked before it is made (G1).
            splits = (len(rows) + 1) * node.row_splits_dtype.itemsize + 2 * ARRAY_HEADER_BYTES
            assembly.reserve(rows_cost + len(paths) * splits, elements=1)
            columns = [
                _ragged([leaf[k] for leaf in leaves], paths[k], node.row_splits_dtype)
                for k in range(len(paths))
            ]
            batch = pack_as(rows[0], columns)
        except BaseException:
            assembly.abandon()
            raise
        if not any(column.dtype.hasobject for column in columns):
            assembly.drop_rows()  # copied; objects stay referenced by the output
        return batch, assembly.finish()

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.inner.set_state(StateReader(state, self.stage).child(INNER))
