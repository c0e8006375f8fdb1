"""``unique``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import hr_list, tf_list

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf


# -- unique (unique_test.py) ---------------------------------------------------------------
UNIQUE_CASES = [[], [1], [1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4], [1, 2, 4, 3, 2, 1, 2, 3, 4],
                [[1], [1, 1], [1, 1, 1]], [[1, 1], [1, 1], [2, 2], [3, 3], [1, 1]]]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case", UNIQUE_CASES)
def test_unique_matches_tf(dtype: Any, case: list[Any]) -> None:
    flat = np.array([v for row in case for v in (row if isinstance(row, list) else [row])],
                    dtype=dtype)
    tf_ds = tf.data.Dataset.from_tensor_slices(flat).unique()
    hr_ds = hr.Dataset.from_tensor_slices(flat).unique()
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)


def test_unique_strings_and_bad_types() -> None:
    words = ["hello", "world", "hello", "", "world", "!"]
    tf_ds = tf.data.Dataset.from_tensor_slices(words).unique()
    hr_ds = hr.Dataset.from_tensor_slices(words).unique()
    assert hr_list(hr_ds) == tf_list(tf_ds)
    with pytest.raises(TypeError):
        tf.data.Dataset.range(3).map(lambda x: tf.cast(x, tf.float32)).unique()
    with pytest.raises(hr.ElementSpecError, match="single integer or string tensors"):
        hr.Dataset.from_tensor_slices(np.arange(3.0)).unique()


def test_unique_books_the_values_it_has_seen() -> None:
    ds = hr.Dataset.range(20_000).unique().with_options(hr.Options(memory_budget="16MiB"))
    with iter(ds) as iterator:
        for _ in range(10_000):
            next(iterator)
        stage = next(s for s in iterator.stats().stages if s.name == "unique")
        assert stage.held >= 10_000 * 27
    tight = hr.Dataset.range(200_000).unique().with_options(hr.Options(memory_budget="1MiB"))
    with pytest.raises(hr.MemoryBudgetError, match="unique"):
        list(tight)


def _gen_ds(rows: list[list[Any]], dtype: Any, ndim: int) -> tuple[Any, Any]:
    """The same stream of arrays (shapes varying) under tf.data and headrace."""
    arrays = [np.array(row, dtype=dtype).reshape((-1,) + (1,) * (ndim - 1)) if ndim > 1
              else np.array(row, dtype=dtype) for row in rows]
    tf_dtype = tf.string if dtype is object else tf.as_dtype(dtype)
    tf_ds = tf.data.Dataset.from_generator(
        lambda: iter(arrays), output_signature=tf.TensorSpec((None,) * ndim, tf_dtype))
    hr_ds = hr.Dataset.from_generator(lambda: iter(arrays), output_signature=hr.TensorSpec(
        (None,) * ndim, bytes if dtype is object else dtype))
    return tf_ds, hr_ds


@pytest.mark.parametrize("dtype", [np.int32, np.int64, object])
@pytest.mark.parametrize("seed", range(6))
def test_unique_of_arrays_of_any_shape_matches_tf(dtype: Any, seed: int) -> None:
    """tf.data compares whole tensors, shape included, and a stream may mix shapes."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 3, rng.integers(0, 4)).tolist() for _ in range(40)]
    if dtype is object:
        rows = [[str(v).encode() for v in row] for row in rows]
    for ndim in (1, 2):
        tf_ds, hr_ds = _gen_ds(rows, dtype, ndim)
        assert hr_list(hr_ds.unique()) == tf_list(tf_ds.unique())
        assert_checkpoint_roundtrip(hr_ds.unique())


def test_unique_tells_shapes_apart_as_tf_does() -> None:
    values = [np.array([[1, 2]]), np.array([[1], [2]]), np.array([[1, 2]])]
    tf_ds = tf.data.Dataset.from_generator(
        lambda: iter(values), output_signature=tf.TensorSpec((None, None), tf.int64))
    hr_ds = hr.Dataset.from_generator(
        lambda: iter(values), output_signature=hr.TensorSpec((None, None), np.int64))
    assert hr_list(hr_ds.unique()) == tf_list(tf_ds.unique())
    assert len(hr_list(hr_ds.unique())) == 2


def test_unique_refuses_structures_and_floats_as_tf_does() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError):
        list(tf.data.Dataset.from_tensor_slices(([1, 1], [2, 2])).unique())
    with pytest.raises(hr.ElementSpecError, match="single integer or string tensors"):
        hr.Dataset.from_tensor_slices(([1, 1], [2, 2])).unique()
    with pytest.raises(hr.ElementSpecError, match="single integer or string tensors"):
        hr.Dataset.from_tensor_slices(np.ones((2, 2), np.float32)).unique()


def test_unique_books_the_arrays_it_has_seen() -> None:
    """Vectors are keyed by their shape and bytes, and booked as such: a stream of more
    distinct vectors than the budget holds is refused, naming the stage."""
    vectors = np.arange(40_000).reshape(-1, 4)
    ds = hr.Dataset.from_tensor_slices(vectors).unique().with_options(
        hr.Options(memory_budget="16MiB"))
    with iter(ds) as iterator:
        for _ in range(5_000):
            next(iterator)
        stage = next(s for s in iterator.stats().stages if s.name == "unique")
        assert stage.held >= 5_000 * (32 + 27)  # at least the bytes and a set slot each
    tight = hr.Dataset.from_tensor_slices(vectors).unique().with_options(
        hr.Options(memory_budget="1MiB"))
    with pytest.raises(hr.MemoryBudgetError, match="unique"):
        list(tight)
