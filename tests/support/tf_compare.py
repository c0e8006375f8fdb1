"""Run one pipeline recipe under tf.data and headrace and compare what comes out."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, settings

import headrace as hr

#: Hypothesis settings for the sweeps that draw further parameters against TensorFlow.
SWEEP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def py(value: Any) -> Any:
    """A nested value as Python data with dtype names and shapes, the same for both."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {key: py(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(py(item) for item in value)
    if hasattr(value, "row_splits") and hasattr(value, "values"):  # ragged, either side
        values = value.values.numpy() if hasattr(value.values, "numpy") else value.values
        splits = value.row_splits.numpy() if hasattr(value.row_splits, "numpy") else value.row_splits
        return ("ragged", py(values), np.asarray(splits).tolist())
    if isinstance(value, tf.Tensor):
        value = value.numpy()
    if isinstance(value, bytes):  # a scalar string, raw or as np.bytes_: alike on both sides
        return ("bytes", (), value)
    array = np.asarray(value)
    kind = "bytes" if array.dtype.kind in "OSU" else array.dtype.name
    return (kind, array.shape, array.tolist())


def tf_list(dataset: tf.data.Dataset) -> list[Any]:
    return [py(element) for element in dataset]


def hr_list(dataset: hr.Dataset) -> list[Any]:
    return [py(element) for element in dataset]


def both(build: Any) -> tuple[list[Any], list[Any]]:
    """``build(Dataset)`` under TensorFlow and headrace, as lists of Python data."""
    return (
        [py(element) for element in build(tf.data.Dataset)],
        [py(element) for element in build(hr.Dataset)],
    )


def outcome(build: Any, dataset: Any) -> Any:
    """The elements ``build(dataset)`` yields, or ``("error", type name)`` if it raises
    (while building or iterating; tf.data 2.21's ``rebatch([])`` raises IndexError)."""
    try:
        return [py(element) for element in build(dataset)]
    except (tf.errors.OpError, hr.HeadraceError, ValueError, TypeError, IndexError) as error:
        return ("error", type(error).__name__)


def without_dtypes(value: Any) -> Any:
    """``value`` (from :func:`py`) with every dtype name dropped: values and shapes only."""
    if isinstance(value, list):
        return [without_dtypes(item) for item in value]
    if isinstance(value, dict):
        return {key: without_dtypes(item) for key, item in value.items()}
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], str):
        return value[1:]
    if isinstance(value, tuple):
        return tuple(without_dtypes(item) for item in value)
    return value
