"""Helpers for testing pipelines — public, so users can check their own pipelines too.

:func:`assert_checkpoint_roundtrip` is the check every transformation in
headrace passes: checkpoint at (nearly) every step, restore into a fresh
iterator, and verify that the rest of the stream is identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from headrace._dataset import Dataset

__all__ = ["assert_checkpoint_roundtrip", "assert_elements_equal", "take_elements"]


def assert_elements_equal(actual: Any, expected: Any, *, where: str = "element") -> None:
    """Assert two elements are equal in structure, values, dtypes and shapes."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: expected a dict, got {type(actual)}"
        assert sorted(actual) == sorted(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_elements_equal(actual[key], expected[key], where=f"{where}[{key!r}]")
        return
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), (
            f"{where}: expected a tuple of {len(expected)}, got {actual!r:.80}"
        )
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_elements_equal(a, e, where=f"{where}[{index}]")
        return
    if hasattr(expected, "row_splits") and hasattr(expected, "values"):  # a RaggedColumn
        assert type(actual) is type(expected), f"{where}: expected {type(expected).__name__}"
        assert_elements_equal(actual.row_splits, expected.row_splits, where=f"{where}.row_splits")
        assert_elements_equal(actual.values, expected.values, where=f"{where}.values")
        return
    actual_array, expected_array = np.asarray(actual), np.asarray(expected)
    assert actual_array.shape == expected_array.shape, (
        f"{where}: shape {actual_array.shape} != {expected_array.shape}"
    )
    assert actual_array.dtype == expected_array.dtype, (
        f"{where}: dtype {actual_array.dtype} != {expected_array.dtype}"
    )
    if expected_array.dtype == object:
        assert actual_array.tolist() == expected_array.tolist(), f"{where}: values differ"
    else:
        np.testing.assert_array_equal(actual_array, expected_array, err_msg=where)


def take_elements(iterator: Any, count: int) -> list[Any]:
    """Up to ``count`` elements from ``iterator``."""
    out = []
    for _ in range(count):
        try:
            out.append(next(iterator))
        except StopIteration:
            break
    return out


def _checkpoints(total: int, max_checkpoints: int) -> list[int]:
    if total + 1 <= max_checkpoints:
        return list(range(total + 1))
    return sorted({round(i * total / (max_checkpoints - 1)) for i in range(max_checkpoints)})


def assert_checkpoint_roundtrip(
    dataset: Dataset | None = None,
    *,
    max_elements: int = 10_000,
    max_checkpoints: int = 60,
    open_iterator: Callable[[], Any] | None = None,
) -> None:
    """Checkpoint at many steps, restore into a fresh iterator, compare the rest.

    For each checkpoint step k: advance a fresh iterator k elements, take its
    state (which must survive a JSON round trip), continue it to the end, then
    restore the state into *another* fresh iterator and assert that it yields
    exactly the same remaining elements. Steps cover the start, the end and
    (with ``repeat``) epoch boundaries. Infinite datasets are cut at
    ``max_elements``.

    ``open_iterator``: makes the fresh iterators instead of ``iter(dataset)``, for
    iterators made otherwise (a served consumer's ``headrace.connect(...)``): each
    must have ``get_state``/``set_state`` and be a context manager.
    """
    if open_iterator is None:
        if dataset is None:
            raise TypeError("assert_checkpoint_roundtrip needs a dataset or open_iterator")
        source = dataset

        def open_iterator() -> Any:
            return iter(source)

    with open_iterator() as reference_iterator:
        total = len(take_elements(reference_iterator, max_elements))
    for step in _checkpoints(total, max_checkpoints):
        with open_iterator() as original:
            take_elements(original, step)
            state = json.loads(json.dumps(original.get_state()))
            expected = take_elements(original, total - step)
        with open_iterator() as restored:
            restored.set_state(state)
            actual = take_elements(restored, total - step)
        assert len(actual) == len(expected), (
            f"after restoring at step {step}: {len(actual)} elements, expected {len(expected)}"
        )
        for offset, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_elements_equal(a, e, where=f"restored at step {step}, element {step + offset}")
