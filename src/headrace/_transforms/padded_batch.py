"""``padded_batch(batch_size, padded_shapes=None, padding_values=None, drop_remainder=False)``.

Elements of different shapes are padded per component: to the batch's largest
size where the padded shape says ``None``/-1, to a fixed size where it gives
one (an element larger than that is an error naming the element, like
tf.data's "Attempted to pad to a smaller size than the input element").
Padding defaults to 0, ``b""``/``""`` or False.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from headrace._errors import DataLossError, ElementSpecError, EmptyInputError, InvalidArgumentError
from headrace._memory.buffer import Buffer, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES
from headrace._structure import (
    TensorSpec,
    flatten,
    map_structure,
    pack_as,
    spec_of,
    structure_paths,
)
from headrace._transforms.batch import Assembler, batched_cardinality
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import (
    Node,
    ShardRole,
    Traits,
    batching_role,
    check_positive,
    known_spec,
    spec_sampling,
)

__all__ = ["PaddedBatchNode"]


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


def _defaults_for_none(padding: Any, spec: Any) -> Any:
    """``padding`` with each ``None`` in it replaced by the defaults of the part of the
    element it stands for (tf.data: ``padding_values=(-1, None)`` pads the second
    component, or every component under it, with 0 / ``b""`` / False)."""
    if padding is None:
        return map_structure(_default_padding, spec)
    if isinstance(padding, Mapping) and isinstance(spec, Mapping) and set(padding) == set(spec):
        return {key: _defaults_for_none(padding[key], spec[key]) for key in padding}
    if (isinstance(padding, tuple) and isinstance(spec, tuple)
            and len(padding) == len(spec)):
        return tuple(_defaults_for_none(p, s) for p, s in zip(padding, spec, strict=True))
    return padding


def _default_padding(spec: TensorSpec) -> Any:
    if spec.kind == "bytes":
        return b""
    if spec.kind == "str":
        return ""
    if spec.dtype == np.bool_:
        return False
    return spec.dtype.type(0)


class _Layout(NamedTuple):
    """Per component: the padded shape (None: the batch's largest), the padding value
    and the path named in errors."""

    shapes: list[tuple[int | None, ...]]
    pads: list[Any]
    paths: list[str]


class PaddedBatchNode(Node):
    stage = "padded_batch"
    budget_weight = 2

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # tf.data addresses only batch(drop_remainder=True)

    def traits(self) -> Traits:
        return Traits(groups=True)

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
        self.padded_shapes, self.padding_values = padded_shapes, padding_values
        self.layout: _Layout | None = None
        # Checked now when the input's spec is known without reading data (building a
        # pipeline never runs user code); otherwise when the spec is first needed.
        spec = known_spec(source)
        if spec is not None:
            self.layout = self._lay_out(spec)

    def shard_role(self) -> ShardRole:
        return batching_role(self.inputs[0], self.drop_remainder)

    def _lay_out(self, spec: Any) -> _Layout:
        """The padded shape, padding value and path of each component, from the input spec."""
        spec_leaves = flatten(spec)
        paths = structure_paths(spec)
        shapes = _padded_shapes(self.padded_shapes, spec, spec_leaves, paths)
        _check_fits(shapes, spec_leaves, paths)
        pads = _padding_values(self.padding_values, spec, spec_leaves)
        # a str padding value for bytes components is encoded, as tf.data's strings are bytes
        pads = [
            pad.encode() if isinstance(pad, str) and leaf.kind == "bytes" else pad
            for pad, leaf in zip(pads, spec_leaves, strict=True)
        ]
        return _Layout(shapes, pads, paths)

    def params(self) -> tuple[Any, ...]:
        return (
            self.batch_size, self.drop_remainder, repr(self.padded_shapes),
            repr(self.padding_values),
        )

    @property
    def element_spec(self) -> Any:
        spec = self.inputs[0].element_spec
        if self.layout is None:
            self.layout = self._lay_out(spec)
        size = self.batch_size if self.drop_remainder else None
        leaves = [
            TensorSpec((size, *shape), leaf.dtype, leaf.kind)
            for shape, leaf in zip(self.layout.shapes, flatten(spec), strict=True)
        ]
        return pack_as(spec, leaves)

    def lay_out_from(self, element: Any) -> _Layout:
        """The layout where the input's spec could not be learnt (its input was empty
        when sampled, yet this run has an element): from ``element``'s structure,
        dtypes and ranks, every size open, so each batch pads to its own largest."""

        def opened(leaf: TensorSpec) -> TensorSpec:
            shape = None if leaf.shape is None else (None,) * len(leaf.shape)
            return TensorSpec(shape, leaf.dtype, leaf.kind)

        return self._lay_out(map_structure(opened, spec_of(element)))

    def cardinality(self) -> int:
        return batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.layout is None:
            try:
                with spec_sampling(ctx.options):  # reads a first element, under this run's budget
                    self.layout = self._lay_out(self.inputs[0].element_spec)
            except EmptyInputError:
                # The spec is learnt from an element and the input has none: the stream
                # is empty and yields nothing, as in tf.data; should an element come
                # after all, the iterator lays out from it.
                pass
        return _PaddedBatchIterator(
            self.inputs[0].make_iterator(ctx),
            ctx,
            ctx.account(self),
            self,
        )


def _padded_shapes(padded_shapes: Any, spec: Any, spec_leaves: list[Any],
                   paths: list[str]) -> list[tuple[int | None, ...]]:
    """Each component's padded shape: as given (None/-1: the batch's largest, the size
    left unknown, as in tf.data), or without ``padded_shapes`` the spec's own shape
    (unknown sizes pad to the batch's largest; a statically known size is kept)."""
    if padded_shapes is None:
        for leaf, path in zip(spec_leaves, paths, strict=True):
            if leaf.shape is None:
                raise InvalidArgumentError(
                    f"padded_batch: component {path} has an unknown rank; pass "
                    "padded_shapes, or a spec with a known rank"
                )
        return [tuple(leaf.shape) for leaf in spec_leaves]
    given = (
        [padded_shapes]
        if not isinstance(spec, (dict, tuple))
        else flatten(_shape_structure(padded_shapes))
    )
    if len(given) != len(spec_leaves):
        raise InvalidArgumentError(
            f"padded_batch: padded_shapes has {len(given)} components, the elements "
            f"have {len(spec_leaves)} ({spec})"
        )
    return [_normalize_shape(s, p) for s, p in zip(given, paths, strict=True)]


def _check_fits(shapes: list[tuple[int | None, ...]], spec_leaves: list[Any],
                paths: list[str]) -> None:
    """Refuse a padded shape of another rank than its component, or smaller than its
    static shape."""
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


def _padding_values(padding_values: Any, spec: Any, spec_leaves: list[Any]) -> list[Any]:
    """Each component's padding value: the default of its kind, or as given (one value
    for all, or one per component; None for a component's default)."""
    if padding_values is None:
        return [_default_padding(leaf) for leaf in spec_leaves]
    if not isinstance(spec, (dict, tuple)):
        return [padding_values]
    pads = flatten(_defaults_for_none(padding_values, spec))
    if len(pads) == 1 and len(spec_leaves) > 1:
        pads = pads * len(spec_leaves)
    if len(pads) != len(spec_leaves):
        raise InvalidArgumentError(
            f"padded_batch: padding_values has {len(pads)} components, the elements "
            f"have {len(spec_leaves)}"
        )
    return pads


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
        super().__init__(
            [] if shape is None else list(shape) if not isinstance(shape, int) else [shape]
        )


class _PaddedBatchIterator(Assembler):
    stage = "padded_batch"

    def __init__(
        self, inner: Iterator, ctx: Context, account: Buffer, node: PaddedBatchNode
    ) -> None:
        super().__init__(inner, ctx, account)
        self.node = node
        self.layout = node.layout  # None: laid out from the first element pulled

    def pull(self) -> tuple[Any, Reservation]:
        node = self.node
        what = f"a batch of {node.batch_size} elements plus its padded output"
        elements, assembly = self.pull_many(node.batch_size, what)
        first = self.position
        self.position += len(elements)
        try:
            if not elements or (node.drop_remainder and len(elements) < node.batch_size):
                raise StopIteration
            if self.layout is None:
                self.layout = node.lay_out_from(elements[0])
            layout = self.layout
            columns = list(zip(*(flatten(e) for e in elements), strict=True))
            plans = [
                self._target(list(column), shape, path, first)
                for column, shape, path in zip(columns, layout.shapes, layout.paths,
                                               strict=True)
            ]
            # The output's size is known before it exists: book it first (G1).
            assembly.reserve(
                sum(
                    ARRAY_HEADER_BYTES + len(elements) * int(np.prod(target)) * dtype.itemsize
                    for _, target, dtype in plans
                ),
                elements=1,
            )
            leaves = [
                self._fill(arrays, target, dtype, pad, shape, path, first)
                for (arrays, target, dtype), pad, shape, path in zip(
                    plans, layout.pads, layout.shapes, layout.paths, strict=True
                )
            ]
        except BaseException:
            assembly.abandon()
            raise
        if not any(dtype.hasobject for _, _, dtype in plans):
            assembly.drop_rows()  # copied into the output; objects stay referenced
        return pack_as(elements[0], leaves), assembly.finish()

    @staticmethod
    def _target(
        values: list[Any], shape: tuple[int | None, ...], path: str, first: int
    ) -> tuple[list[np.ndarray[Any, Any]], tuple[int, ...], np.dtype[Any]]:
        """The arrays of one component, the padded row shape, and the output dtype."""
        arrays = [v if isinstance(v, np.ndarray) else _as_array(v) for v in values]
        sample = arrays[0]
        dtype = np.dtype(object) if sample.dtype.kind in "OSU" else sample.dtype
        for row, array in enumerate(arrays):
            if array.ndim != len(shape):
                raise ElementSpecError(
                    f"padded_batch: element {first + row}, component {path} has rank "
                    f"{array.ndim}, expected {len(shape)}"
                )
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
        return arrays, tuple(target), dtype

    @staticmethod
    def _fill(
        arrays: list[np.ndarray[Any, Any]],
        target: tuple[int, ...],
        dtype: np.dtype[Any],
        pad: Any,
        shape: tuple[int | None, ...],
        path: str,
        first: int,
    ) -> np.ndarray[Any, Any]:
        out = np.empty((len(arrays), *target), dtype=dtype)
        out[...] = pad
        for row, array in enumerate(arrays):
            if not array.ndim:  # a scalar: store the item (a 0-d array would nest)
                out[row] = array[()]
                continue
            region: tuple[Any, ...] = (row, *(slice(0, n) for n in array.shape))
            out[region] = array
        return out


def _as_array(value: Any) -> np.ndarray[Any, Any]:
    """``value`` as an array; bytes and str stay exact Python objects (G5): NumPy's
    fixed-width ``S``/``U`` dtypes would drop trailing NULs (b"a\\x00" -> b"a")."""
    array = np.asarray(value)
    if array.dtype.kind in "SU":
        return np.array(value, dtype=object)
    return array
