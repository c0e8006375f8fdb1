"""``batch``, ``padded_batch``, ``unbatch`` and ``rebatch``, with tf.data's orders.

Batching a random-access input is one slice (consecutive rows) or one gather
(shuffled rows) per batch — no per-row Python work. Batching a stream books
every element on the stage's share of the budget while the batch is being
assembled, plus the output: that pair is the stage's minimum working set, and
a batch that cannot fit raises :class:`MemoryBudgetError` instead of
over-running the budget.

Bytes and strings batch into NumPy ``object`` arrays of the exact Python
objects (fixed-width ``S``/``U`` would drop trailing NULs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace.errors import (
    DataLossError,
    ElementSpecError,
    InvalidArgumentError,
    MemoryBudgetError,
)
from headrace.iterator import Context, Iterator
from headrace.memory.budget import Reservation, StageAccount, release_all
from headrace.node import INFINITE, UNKNOWN, IndexPlan, Node, check_positive
from headrace.options import format_bytes
from headrace.structure import (
    TensorSpec,
    flatten,
    map_structure,
    pack_as,
    structure_paths,
)
from headrace.transforms.indexing import GatherBatchIterator

__all__ = [
    "BatchNode",
    "PaddedBatchNode",
    "RebatchNode",
    "UnbatchNode",
    "stack_elements",
]


def _stack_leaf(values: list[Any], path: str, stage: str, first_index: int) -> Any:
    first = values[0]
    if type(first) in (bytes, str) and all(type(value) is type(first) for value in values):
        out = np.empty(len(values), dtype=object)  # scalars: no shapes to compare
        out[:] = values
        return out
    if isinstance(first, (bytes, str)) or (
        isinstance(first, np.ndarray) and first.dtype == object
    ):
        out = np.empty((len(values), *np.shape(first)), dtype=object)
        for row, value in enumerate(values):
            _check_same_shape(value, first, row, path, stage, first_index)
            out[row] = value
        return out
    try:
        return np.stack(values)
    except ValueError:
        for row, value in enumerate(values):
            _check_same_shape(value, first, row, path, stage, first_index)
        raise


def _check_same_shape(
    value: Any, first: Any, row: int, path: str, stage: str, first_index: int
) -> None:
    if np.shape(value) != np.shape(first):
        raise ElementSpecError(
            f"{stage}: element {first_index + row} has shape {np.shape(value)} for component "
            f"{path}, but element {first_index} of the same batch has shape {np.shape(first)}; "
            "all elements of a batch need equal shapes (use padded_batch for variable sizes)"
        )


def stack_elements(elements: Sequence[Any], *, stage: str, first_index: int = 0) -> Any:
    """One batched element from a list of elements of equal structure and shapes."""
    structure = elements[0]
    if not isinstance(structure, (dict, tuple)):
        return _stack_leaf(list(elements), "element", stage, first_index)
    columns = list(zip(*(flatten(element) for element in elements), strict=True))
    paths = structure_paths(structure)
    return pack_as(
        structure,
        [
            _stack_leaf(list(column), path, stage, first_index)
            for column, path in zip(columns, paths, strict=True)
        ],
    )


def _batched_spec(spec: Any, batch_size: int, drop_remainder: bool) -> Any:
    size = batch_size if drop_remainder else None
    return map_structure(lambda leaf: leaf.with_leading(size), spec)


class BatchNode(Node):
    stage = "batch"

    def __init__(self, source: Node, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(source)
        self.batch_size = check_positive("batch: batch_size", batch_size)
        self.drop_remainder = bool(drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.drop_remainder)

    @property
    def element_spec(self) -> Any:
        return _batched_spec(self.inputs[0].element_spec, self.batch_size, self.drop_remainder)

    def cardinality(self) -> int:
        return _batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def index_plan(self) -> IndexPlan | None:
        return None  # a batch is one element made of many: not addressable by one index

    def make_iterator(self, ctx: Context) -> Iterator:
        account = ctx.account(self, "batch", weight=2)
        plan = self.inputs[0].index_plan()
        if plan is not None:
            access, make_stream = plan
            access.prepare(ctx)
            return _ChargedBatches(
                GatherBatchIterator(
                    access, make_stream(ctx), self.batch_size, self.drop_remainder
                ),
                ctx,
                account,
            )
        pushed = self.inputs[0].batched_iterator(ctx, self.batch_size, self.drop_remainder)
        if pushed is not None:
            return _ChargedBatches(pushed, ctx, account)
        return _BatchIterator(
            self.inputs[0].make_iterator(ctx), ctx, account, self.batch_size, self.drop_remainder
        )


def _batched_cardinality(inner: int, batch_size: int, drop_remainder: bool) -> int:
    if inner in (INFINITE, UNKNOWN):
        return inner
    return inner // batch_size if drop_remainder else -(-inner // batch_size)


class _ChargedBatches(Iterator):
    """Books each batch made below (a gather, a reader) on the batch stage's share."""

    stage = "batch"

    def __init__(self, inner: Iterator, ctx: Context, account: StageAccount) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account

    def next_reserved(self) -> tuple[Any, Reservation]:
        batch = next(self.inner)
        return batch, self.account.hold(self.ctx.sizeof(batch), what="one batch")

    def __next__(self) -> Any:
        return next(self.inner)


class _Assembler(Iterator):
    """Shared by the streaming batchers: pull and book up to N elements of a batch."""

    def __init__(self, inner: Iterator, ctx: Context, account: StageAccount) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account
        self.position = 0  # elements consumed, for error messages

    def pull(self, count: int) -> tuple[list[Any], list[Reservation]]:
        """Up to ``count`` elements, booked on this stage's share.

        Elements a buffering stage booked move here at once (keeping them on
        that stage's share while waiting for more would stall it); the others
        are booked together at the end, with one lock.
        """
        elements: list[Any] = []
        reservations: list[Reservation] = []
        unbooked = 0
        sizeof, account = self.ctx.sizeof, self.account
        what = f"a batch of {count} elements"
        try:
            for _ in range(count):
                element, reservation = self.inner.next_reserved()
                elements.append(element)
                if reservation.account is None:
                    unbooked += sizeof(element)
                else:
                    reservations.append(reservation.move_to(account, sizeof(element)))
                if account.held + unbooked > account.limit:
                    raise MemoryBudgetError(
                        f"stage {account.name!r} needs more than its share of the memory "
                        f"budget ({format_bytes(account.limit)} of "
                        f"{format_bytes(account.budget.total)}) for {what}. Raise "
                        "Options(memory_budget=...) or use a smaller batch."
                    )
        except StopIteration:
            pass
        except BaseException:
            release_all(reservations)
            raise
        if unbooked:
            reservations.append(account.hold(unbooked, what=what))
        return elements, reservations

    def finish(
        self, batch: Any, reservations: list[Reservation], count: int
    ) -> tuple[Any, Reservation]:
        try:
            booked = self.account.hold(
                self.ctx.sizeof(batch), what=f"a batch of {count} elements plus its output"
            )
        finally:
            release_all(reservations)
        return batch, booked

    def get_state(self) -> dict[str, Any]:
        return {"inner": self.inner.get_state(), "position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        self.inner.set_state(state["inner"])
        self.position = int(state["position"])


class _BatchIterator(_Assembler):
    stage = "batch"

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: StageAccount,
        batch_size: int,
        drop_remainder: bool,
    ) -> None:
        super().__init__(inner, ctx, account)
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def next_reserved(self) -> tuple[Any, Reservation]:
        elements, reservations = self.pull(self.batch_size)
        first = self.position
        self.position += len(elements)
        if not elements or (self.drop_remainder and len(elements) < self.batch_size):
            release_all(reservations)
            raise StopIteration
        try:
            batch = stack_elements(elements, stage="batch", first_index=first)
        except BaseException:
            release_all(reservations)
            raise
        return self.finish(batch, reservations, len(elements))


def _normalize_shape(shape: Any, path: str) -> tuple[int | None, ...]:
    if shape is None:
        return ()
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(None if d is None or d == -1 else int(d) for d in shape)
    except TypeError:
        raise InvalidArgumentError(
            f"padded_batch: padded shape for {path} must be a sequence of ints/None, got {shape!r}"
        ) from None
    return dims


def _default_padding(spec: TensorSpec) -> Any:
    if spec.kind == "bytes":
        return b""
    if spec.kind == "str":
        return ""
    if spec.dtype == np.bool_:
        return False
    return spec.dtype.type(0)


class PaddedBatchNode(Node):
    stage = "padded_batch"

    def __init__(
        self,
        source: Node,
        batch_size: int,
        padded_shapes: Any,
        padding_values: Any,
        drop_remainder: bool,
    ) -> None:
        super().__init__(source)
        self.batch_size = check_positive("padded_batch: batch_size", batch_size)
        self.drop_remainder = bool(drop_remainder)
        spec = source.element_spec
        spec_leaves = flatten(spec)
        paths = structure_paths(spec)
        if padded_shapes is None:
            # Unknown sizes pad to the batch's largest; a statically known size is kept.
            shapes: list[tuple[int | None, ...]] = [tuple(leaf.shape) for leaf in spec_leaves]
        else:
            given = (
                [padded_shapes] if not isinstance(spec, (dict, tuple)) else flatten(
                    _shape_structure(padded_shapes)
                )
            )
            if len(given) != len(spec_leaves):
                raise InvalidArgumentError(
                    f"padded_batch: padded_shapes has {len(given)} components, the elements "
                    f"have {len(spec_leaves)} ({spec})"
                )
            # Explicit None/-1 pad to the batch's largest and leave the size unknown (tf.data).
            shapes = [_normalize_shape(s, p) for s, p in zip(given, paths, strict=True)]
        for shape, leaf, path in zip(shapes, spec_leaves, paths, strict=True):
            if len(shape) != len(leaf.shape):
                raise InvalidArgumentError(
                    f"padded_batch: padded shape {shape} for {path} has rank {len(shape)}, "
                    f"but the component has rank {len(leaf.shape)} ({leaf})"
                )
            for fixed, known in zip(shape, leaf.shape, strict=True):
                if fixed is not None and known is not None and known > fixed:
                    raise InvalidArgumentError(
                        f"padded_batch: padded shape {shape} for {path} is smaller than the "
                        f"component's static shape {leaf.shape}"
                    )
        if padding_values is None:
            pads = [_default_padding(leaf) for leaf in spec_leaves]
        elif not isinstance(spec, (dict, tuple)):
            pads = [padding_values]
        else:
            pads = flatten(padding_values)
            if len(pads) == 1 and len(spec_leaves) > 1:
                pads = pads * len(spec_leaves)
            if len(pads) != len(spec_leaves):
                raise InvalidArgumentError(
                    f"padded_batch: padding_values has {len(pads)} components, the elements "
                    f"have {len(spec_leaves)}"
                )
        self.shapes, self.pads, self.paths = shapes, pads, paths

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.drop_remainder, tuple(self.shapes), repr(self.pads))

    @property
    def element_spec(self) -> Any:
        spec = self.inputs[0].element_spec
        size = self.batch_size if self.drop_remainder else None
        leaves = [
            TensorSpec((size, *shape), leaf.dtype, leaf.kind)
            for shape, leaf in zip(self.shapes, flatten(spec), strict=True)
        ]
        return pack_as(spec, leaves)

    def cardinality(self) -> int:
        return _batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def make_iterator(self, ctx: Context) -> Iterator:
        return _PaddedBatchIterator(
            self.inputs[0].make_iterator(ctx), ctx, ctx.account(self, "padded_batch", weight=2),
            self,
        )


def _shape_structure(padded_shapes: Any) -> Any:
    """Treat list/tuple-of-int shapes as leaves when flattening a nested padded_shapes."""
    if isinstance(padded_shapes, dict):
        return {key: _shape_structure(value) for key, value in padded_shapes.items()}
    if isinstance(padded_shapes, tuple) and not all(
        d is None or isinstance(d, int) for d in padded_shapes
    ):
        return tuple(_shape_structure(value) for value in padded_shapes)
    return _ShapeLeaf(padded_shapes)


class _ShapeLeaf(list[Any]):
    def __init__(self, shape: Any) -> None:
        super().__init__([] if shape is None else list(shape) if not isinstance(shape, int) else [shape])


class _PaddedBatchIterator(_Assembler):
    stage = "padded_batch"

    def __init__(
        self, inner: Iterator, ctx: Context, account: StageAccount, node: PaddedBatchNode
    ) -> None:
        super().__init__(inner, ctx, account)
        self.node = node

    def next_reserved(self) -> tuple[Any, Reservation]:
        node = self.node
        elements, reservations = self.pull(node.batch_size)
        first = self.position
        self.position += len(elements)
        if not elements or (node.drop_remainder and len(elements) < node.batch_size):
            release_all(reservations)
            raise StopIteration
        try:
            columns = zip(*(flatten(e) for e in elements), strict=True)
            leaves = [
                self._pad(list(column), shape, pad, path, first)
                for column, shape, pad, path in zip(
                    columns, node.shapes, node.pads, node.paths, strict=True
                )
            ]
            batch = pack_as(elements[0], leaves)
        except BaseException:
            release_all(reservations)
            raise
        return self.finish(batch, reservations, len(elements))

    @staticmethod
    def _pad(
        values: list[Any], shape: tuple[int | None, ...], pad: Any, path: str, first: int
    ) -> Any:
        arrays = [v if isinstance(v, np.ndarray) else np.asarray(v) for v in values]
        sample = arrays[0]
        dtype = object if sample.dtype.kind in "OSU" else sample.dtype
        target = []
        for axis, fixed in enumerate(shape):
            largest = max(a.shape[axis] for a in arrays)
            if fixed is not None and largest > fixed:
                row = next(i for i, a in enumerate(arrays) if a.shape[axis] > fixed)
                raise DataLossError(
                    "padded_batch: Attempted to pad to a smaller size than the input element: "
                    f"element {first + row}, component {path} has shape {arrays[row].shape}, "
                    f"padded shape is {shape}"
                )
            target.append(largest if fixed is None else fixed)
        out = np.empty((len(arrays), *target), dtype=dtype)
        out[...] = pad
        for row, array in enumerate(arrays):
            if array.ndim != len(shape):
                raise ElementSpecError(
                    f"padded_batch: element {first + row}, component {path} has rank "
                    f"{array.ndim}, expected {len(shape)}"
                )
            region: tuple[Any, ...] = (row, *(slice(0, n) for n in array.shape))
            out[region] = array
        return out


class UnbatchNode(Node):
    stage = "unbatch"

    def __init__(self, source: Node) -> None:
        super().__init__(source)
        for leaf, path in zip(
            flatten(source.element_spec), structure_paths(source.element_spec), strict=True
        ):
            if not leaf.shape:
                raise InvalidArgumentError(
                    f"unbatch: component {path} is a scalar; the input must be batched "
                    "(every component needs rank >= 1)"
                )

    @property
    def element_spec(self) -> Any:
        return map_structure(lambda leaf: leaf.without_leading(), self.inputs[0].element_spec)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if inner == INFINITE:
            return INFINITE
        rows = {leaf.shape[0] for leaf in flatten(self.inputs[0].element_spec)}
        if inner >= 0 and len(rows) == 1 and None not in rows:
            return inner * int(rows.pop())  # every batch has the same static size
        return UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        return _UnbatchIterator(
            self.inputs[0].make_iterator(ctx), ctx.account(self, "unbatch", weight=1)
        )


class _Rows:
    """Rows of one batched element, handed out one (or a block) at a time."""

    def __init__(self, batch: Any, reservation: Reservation) -> None:
        self.structure = batch
        self.leaves = flatten(batch)
        sizes = {len(leaf) for leaf in self.leaves}
        if len(sizes) > 1:
            raise ElementSpecError(
                f"unbatch: components of one batch have different first dimensions {sorted(sizes)}"
            )
        self.size = sizes.pop()
        self.position = 0
        self.reservation = reservation
        self.single = not isinstance(batch, (dict, tuple))

    def row(self) -> Any:
        index = self.position
        self.position += 1
        if self.single:
            return self.leaves[0][index]
        return pack_as(self.structure, [leaf[index] for leaf in self.leaves])

    def empty(self) -> list[Any]:
        """A zero-row block with this batch's dtypes and row shapes."""
        return [leaf[:0] for leaf in self.leaves]

    def block(self, count: int) -> list[Any]:
        start = self.position
        stop = min(start + count, self.size)
        self.position = stop
        return [leaf[start:stop] for leaf in self.leaves]


class _RowSource(Iterator):
    """Pulls batches from the input, keeping the current one booked while its rows go out."""

    def __init__(self, inner: Iterator, account: StageAccount) -> None:
        super().__init__(inner)
        self.inner, self.account = inner, account
        self.current: _Rows | None = None
        self.last_rows: _Rows | None = None  # shapes for empty batches, after the data ends
        self.batches = 0  # batches fully or partly consumed, for resume
        self.rows_taken = 0  # rows consumed from the current batch

    def _advance(self) -> _Rows:
        while self.current is None or self.current.position >= self.current.size:
            if self.current is not None:
                self.current.reservation.release()
                self.current = None
            batch, reservation = self.inner.next_reserved()
            if reservation.account is not None:
                reservation = reservation.move_to(self.account, reservation.nbytes)
            self.current = self.last_rows = _Rows(batch, reservation)
            self.batches += 1
        return self.current

    def get_state(self) -> dict[str, Any]:
        # The input's state *before* the current batch is what lets us re-read it.
        return {
            "inner_before_current": self._before_current,
            "rows_taken": 0 if self.current is None else self.current.position,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.close_current()
        self.inner.set_state(state["inner_before_current"])
        self._before_current = state["inner_before_current"]
        rows = int(state["rows_taken"])
        if rows:
            current = self._advance_recording()
            current.position = rows

    def _advance_recording(self) -> _Rows:
        if self.current is None or self.current.position >= self.current.size:
            self.close_current()
            self._before_current = self.inner.get_state()
        return self._advance()

    _before_current: dict[str, Any]

    def close_current(self) -> None:
        if self.current is not None:
            self.current.reservation.release()
            self.current = None

    def close(self) -> None:
        self.close_current()
        super().close()


class _UnbatchIterator(_RowSource):
    stage = "unbatch"

    def __init__(self, inner: Iterator, account: StageAccount) -> None:
        super().__init__(inner, account)
        self._before_current = inner.get_state()

    def __next__(self) -> Any:
        return self._advance_recording().row()


class RebatchNode(Node):
    stage = "rebatch"

    def __init__(self, source: Node, batch_size: int | Sequence[int], drop_remainder: bool) -> None:
        super().__init__(source)
        sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size)
        if not sizes:
            raise InvalidArgumentError("rebatch: batch_size must not be empty")
        # Zeros in a list make empty batches (tf.data); all zeros would never end.
        self.sizes = [check_positive("rebatch: batch_size", size, allow_zero=True) for size in sizes]
        if not any(self.sizes):
            raise InvalidArgumentError(f"rebatch: batch_size must have a size > 0, got {sizes}")
        self.drop_remainder = bool(drop_remainder)
        for leaf, path in zip(
            flatten(source.element_spec), structure_paths(source.element_spec), strict=True
        ):
            if not leaf.shape:
                raise InvalidArgumentError(
                    f"rebatch: component {path} is a scalar; the input must be batched "
                    "(rank >= 1)"
                )

    def params(self) -> tuple[Any, ...]:
        return (tuple(self.sizes), self.drop_remainder)

    @property
    def element_spec(self) -> Any:
        spec = self.inputs[0].element_spec
        return map_structure(lambda leaf: leaf.without_leading().with_leading(self._static()), spec)

    def _static(self) -> int | None:
        """The batch size every output has, if that is known without reading (tf.data's rule)."""
        if len(set(self.sizes)) != 1:
            return None
        size = self.sizes[0]
        if self.drop_remainder:
            return size
        rows = {leaf.shape[0] for leaf in flatten(self.inputs[0].element_spec)}
        known = rows.pop() if len(rows) == 1 else None
        return size if known is not None and known % size == 0 else None

    def make_iterator(self, ctx: Context) -> Iterator:
        return _RebatchIterator(
            self.inputs[0].make_iterator(ctx), ctx, ctx.account(self, "rebatch", weight=2), self
        )


class _RebatchIterator(_RowSource):
    """``unbatch().batch(N)`` with N cycling through the sizes, copying each row once."""

    stage = "rebatch"

    def __init__(
        self, inner: Iterator, ctx: Context, account: StageAccount, node: RebatchNode
    ) -> None:
        super().__init__(inner, account)
        self.ctx, self.node = ctx, node
        self.batch_number = 0
        self._before_current = inner.get_state()

    def next_reserved(self) -> tuple[Any, Reservation]:
        sizes = self.node.sizes
        wanted = sizes[self.batch_number % len(sizes)]
        pieces: list[list[Any]] = []
        structure: Any = None
        have = 0
        while have < wanted:
            try:
                rows = self._advance_recording()
            except StopIteration:
                break
            structure = rows.structure
            block = rows.block(wanted - have)
            have += len(block[0])
            pieces.append(block)
        if wanted == 0 and self.last_rows is not None:  # an empty batch, shaped like the data
            structure, pieces = self.last_rows.structure, [self.last_rows.empty()]
        elif have == 0 or (self.node.drop_remainder and have < wanted):
            raise StopIteration
        self.batch_number += 1
        leaves = [
            np.concatenate([piece[k] for piece in pieces]) if len(pieces) > 1 else pieces[0][k]
            for k in range(len(pieces[0]))
        ]
        batch = pack_as(structure, leaves)
        return batch, self.account.charge(self.ctx.sizeof(batch))

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "batch_number": self.batch_number}

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.batch_number = int(state["batch_number"])
