"""Stacking equal-structure elements into one batched element (NumPy, exact bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError
from headrace._structure import flatten, pack_as, structure_paths
from headrace.io.columns import object_array

__all__ = ["row_item", "stack_elements"]


def row_item(value: Any) -> Any:
    """What a batch's row holds for ``value``: the item of a 0-d array (``bytes`` for
    ``np.array(b"x", dtype=object)``, as ``np.stack`` and tf.data give), else ``value``.
    Assigned whole to one slot of an object array, a 0-d array would be kept as an
    array inside the batch, and its rows would not be ``bytes``."""
    if isinstance(value, np.ndarray) and not value.ndim:
        return value[()]
    return value


def _stack_leaf(values: list[Any], path: str, stage: str, first_index: int) -> Any:
    first = values[0]
    if type(first) in (bytes, str) and all(type(value) is type(first) for value in values):
        return object_array(values)  # scalars: no shapes to compare
    if isinstance(first, (bytes, str)) or (isinstance(first, np.ndarray) and first.dtype == object):
        out = np.empty((len(values), *np.shape(first)), dtype=object)
        for row, value in enumerate(values):
            _check_same_shape(value, first, row, path, stage, first_index)
            out[row] = row_item(value)
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
