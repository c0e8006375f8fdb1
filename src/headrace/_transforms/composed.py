"""tf.data transformations that are compositions of other stages, and their helpers.

``bucket_by_sequence_length`` is ``group_by_window`` keyed by bucket with a
padded batch per window (tf.data builds it the same way); ``reduce`` is a run
of ``scan``; ``choose_from_datasets``/``sample_from_datasets`` build their nodes
from facades. They work on :class:`~headrace.Dataset` facades handed in, and
are handed the facade's class where they must build one (``dataset.py`` imports
this module, never the reverse).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import ElementSpecError, InvalidArgumentError
from headrace._structure import (
    TensorSpec,
    flatten,
    integer_scalar,
    map_structure,
    pack_as,
    returned,
    spec_of,
)
from headrace._transforms.map import apply_fn
from headrace._transforms.scan import scan_step
from headrace.core.fingerprint import function_name

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = [
    "bucket_by_sequence_length_impl",
    "choose_from_datasets_impl",
    "dataset_of",
    "generator_signature",
    "reduce_impl",
    "sample_from_datasets_impl",
]


def dataset_of(facade: type[Dataset], elements: list[Any]) -> Dataset:
    """A small dataset over ``elements`` (a window, a group): sliced views of one stacked
    copy when their shapes agree, else a list replayed with a relaxed spec."""
    from headrace._sources.arrays import TensorSlicesNode

    leaves = [flatten(element) for element in elements]
    try:
        stacked = [
            np.stack([np.asarray(row[k]) for row in leaves]) for k in range(len(leaves[0]))
        ]
    except ValueError:  # shapes differ: the rows as they are
        spec = spec_of(elements[0])
        for element in elements[1:]:
            spec = map_structure(
                lambda a, b: a.most_specific_common(b), spec, spec_of(element)
            )
        return facade.from_generator(_Replay(elements), output_signature=spec)
    return facade(TensorSlicesNode(pack_as(elements[0], stacked)))


class _Replay:
    def __init__(self, elements: list[Any]) -> None:
        self.elements = elements
        self.__qualname__ = f"window_of_{len(elements)}"

    def __call__(self) -> Any:
        return iter(self.elements)


def generator_signature(output_types: Any, output_shapes: Any, output_signature: Any) -> Any:
    """``from_generator``'s signature from tf.data's older ``output_types``/``output_shapes``."""
    if output_signature is not None:
        if output_types is not None or output_shapes is not None:
            raise InvalidArgumentError(
                "from_generator: pass output_signature, or output_types (with optional "
                "output_shapes), not both"
            )
        return output_signature
    if output_types is None:
        if output_shapes is not None:
            raise InvalidArgumentError(
                "from_generator: output_shapes needs output_types (or use output_signature)"
            )
        return None
    if output_shapes is None:
        return map_structure(lambda dtype: TensorSpec(None, dtype), output_types)
    shapes = _shapes_like(output_types, output_shapes)
    return map_structure(lambda dtype, shape: TensorSpec(shape, dtype), output_types, shapes)


def _shapes_like(types: Any, shapes: Any) -> Any:
    """``shapes`` in ``types``' structure: a shape is a list/tuple of sizes, a leaf here."""
    if isinstance(types, dict):
        return {key: _shapes_like(types[key], shapes[key]) for key in types}
    if isinstance(types, tuple):
        return tuple(_shapes_like(t, s) for t, s in zip(types, shapes, strict=True))
    return _Shape(shapes)


class _Shape:
    """A shape as one leaf of a structure (a tuple would be read as a structure)."""

    def __init__(self, dims: Any) -> None:
        self.dims = dims

    def __iter__(self) -> Any:
        return iter(()) if self.dims is None else iter(self.dims)

    @property
    def rank(self) -> int | None:
        return None if self.dims is None else len(list(self.dims))

    def as_list(self) -> list[Any]:
        return list(self.dims)


def reduce_impl(dataset: Dataset, initial_state: Any, reduce_func: Callable[..., Any]) -> Any:
    """tf.data's ``reduce``: ``reduce_func(state, element)`` over every element."""
    if not callable(reduce_func):
        raise InvalidArgumentError(f"reduce: reduce_func must be callable, got {reduce_func!r}")
    state = initial_state
    name = f"reduce({function_name(reduce_func)})"

    def step(state: Any, element: Any) -> tuple[Any, None]:
        return returned(reduce_func(state, element)), None

    with iter(dataset) as iterator:
        for element in iterator:
            state, _ = scan_step(step, state, element, name)
    return state


def choose_from_datasets_impl(
    facade: type[Dataset],
    datasets: Sequence[Dataset],
    choice_dataset: Dataset,
    stop_on_empty_dataset: bool,
) -> Dataset:
    from headrace._transforms.choose import ChooseNode

    nodes = _nodes(facade, datasets, "choose_from_datasets")
    if not isinstance(choice_dataset, facade):
        raise InvalidArgumentError("choose_from_datasets: choice_dataset must be a Dataset")
    spec = choice_dataset.node.element_spec if choice_dataset.cardinality() != 0 else None
    if spec is not None and (
        not isinstance(spec, TensorSpec) or spec.shape != () or spec.dtype != np.int64
    ):
        raise ElementSpecError(
            f"choose_from_datasets: choice_dataset must be a dataset of int64 scalars, got {spec}"
        )
    node = ChooseNode(nodes, choice_dataset.node, stop_on_empty_dataset)
    return datasets[0].derive(node)


def sample_from_datasets_impl(
    facade: type[Dataset],
    datasets: Sequence[Dataset],
    weights: Sequence[float] | None,
    seed: int | None,
    stop_on_empty_dataset: bool,
    rerandomize_each_iteration: bool | None,
) -> Dataset:
    from headrace._transforms.choose import SampleNode

    nodes = _nodes(facade, datasets, "sample_from_datasets")
    node = SampleNode(nodes, weights, seed, stop_on_empty_dataset, rerandomize_each_iteration)
    return datasets[0].derive(node)


def _nodes(facade: type[Dataset], datasets: Sequence[Dataset], stage: str) -> list[Any]:
    datasets = list(datasets)
    if not datasets or not all(isinstance(d, facade) for d in datasets):
        raise InvalidArgumentError(f"{stage}: datasets must be a non-empty list of Datasets")
    return [d.node for d in datasets]


# -- bucket_by_sequence_length ------------------------------------------------------------


class _BucketKey:
    """``key_func``: the bucket of an element's length (picklable, fingerprinted by value)."""

    def __init__(self, length_func: Callable[..., Any], boundaries: list[int]) -> None:
        self.length_func, self.boundaries = length_func, boundaries
        self.__qualname__ = f"bucket_of({function_name(length_func)}, {boundaries})"

    def __call__(self, *components: Any) -> Any:
        element = components[0] if len(components) == 1 else components
        length = integer_scalar(
            apply_fn(self.length_func, element),
            "bucket_by_sequence_length: what element_length_func returns",
        )
        # tf.data: bucket i holds lengths in [boundaries[i-1], boundaries[i])
        return np.int64(bisect.bisect_right(self.boundaries, length))


class _BucketSize:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.__qualname__ = f"bucket_batch_size({sizes})"

    def __call__(self, key: Any) -> int:
        return self.sizes[int(key)]


class _BucketBatch:
    """``reduce_func``: one bucket's window as (padded) batches."""

    def __init__(self, sizes: list[int], boundaries: list[int], padded_shapes: Any,
                 padding_values: Any, pad_to_boundary: bool, no_padding: bool,
                 drop_remainder: bool) -> None:
        self.sizes, self.boundaries = sizes, boundaries
        self.padded_shapes, self.padding_values = padded_shapes, padding_values
        self.pad_to_boundary, self.no_padding = pad_to_boundary, no_padding
        self.drop_remainder = drop_remainder
        self.__qualname__ = (
            f"bucket_batch({sizes}, {boundaries}, {padded_shapes!r}, {padding_values!r}, "
            f"{pad_to_boundary}, {no_padding}, {drop_remainder})"
        )

    def __call__(self, key: Any, window: Dataset) -> Dataset:
        bucket = int(key)
        size = self.sizes[bucket]
        if self.no_padding:
            return window.batch(size, drop_remainder=self.drop_remainder)
        shapes = self.padded_shapes
        if self.pad_to_boundary:
            boundary = self.boundaries[bucket] - 1 if bucket < len(self.boundaries) else None
            if boundary is None:
                raise InvalidArgumentError(
                    "bucket_by_sequence_length: with pad_to_bucket_boundary=True every length "
                    f"must be below the last boundary {self.boundaries[-1]} (tf.data's rule); "
                    "add a larger boundary"
                )
            spec = window.element_spec
            shapes = map_structure(
                lambda leaf: None if leaf.shape is None else
                tuple([boundary, *([None] * (len(leaf.shape) - 1))]) if leaf.shape else (),
                spec,
            )
        return window.padded_batch(
            size, padded_shapes=shapes, padding_values=self.padding_values,
            drop_remainder=self.drop_remainder,
        )


def bucket_by_sequence_length_impl(
    dataset: Dataset,
    element_length_func: Callable[..., Any],
    bucket_boundaries: Sequence[int],
    bucket_batch_sizes: Sequence[int],
    padded_shapes: Any,
    padding_values: Any,
    pad_to_bucket_boundary: bool,
    no_padding: bool,
    drop_remainder: bool,
) -> Dataset:
    boundaries = [int(b) for b in bucket_boundaries]
    sizes = [int(s) for s in bucket_batch_sizes]
    if len(sizes) != len(boundaries) + 1:
        raise InvalidArgumentError(
            f"bucket_by_sequence_length: len(bucket_batch_sizes) must equal "
            f"len(bucket_boundaries) + 1, got {len(sizes)} and {len(boundaries)}"
        )
    if boundaries != sorted(set(boundaries)) or any(b <= 0 for b in boundaries):
        raise InvalidArgumentError(
            f"bucket_by_sequence_length: bucket_boundaries must be positive and increasing, "
            f"got {boundaries}"
        )
    if any(s <= 0 for s in sizes):
        raise InvalidArgumentError(
            f"bucket_by_sequence_length: bucket_batch_sizes must be positive, got {sizes}"
        )
    return dataset.group_by_window(
        _BucketKey(element_length_func, boundaries),
        _BucketBatch(sizes, boundaries, padded_shapes, padding_values, pad_to_bucket_boundary,
                     no_padding, drop_remainder),
        window_size_func=_BucketSize(sizes),
    )
