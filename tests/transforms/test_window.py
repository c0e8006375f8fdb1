"""``window``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from tf_compare import SWEEP, hr_list, tf_list

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf


# -- window (window_test.py) ----------------------------------------------------------------
WINDOW_CASES = [  # (count, size, shift, stride, drop_remainder), from testWindowDataset
    (20, 14, 7, 1, False), (20, 17, 9, 1, False), (20, 14, 14, 1, False),
    (20, 10, 14, 1, False), (20, 14, 7, 2, False), (20, 7, 1, 1, False),
    (20, 14, 7, 1, True), (20, 17, 9, 1, True), (20, 10, 14, 1, True),
    (20, 14, 19, 1, True), (20, 4, 4, 3, True), (20, 4, 4, 3, False),
    (1, 10, 4, 1, False), (0, 3, 1, 1, False), (7, 3, None, 1, False),
]


def _windows(library: Any, count: int, size: int, shift: Any, stride: int, drop: bool) -> Any:
    components = (np.arange(count, dtype=np.int64), np.arange(count, dtype=np.float32) * 2)
    dataset = library.data.Dataset if library is tf else hr.Dataset
    ds = dataset.from_tensor_slices(components).window(size, shift, stride, drop)
    return ds.flat_map(lambda a, b: dataset.zip((a.batch(size), b.batch(size))))


@pytest.mark.parametrize("count, size, shift, stride, drop", WINDOW_CASES)
def test_window_matches_tf(count: int, size: int, shift: Any, stride: int, drop: bool) -> None:
    expected = tf_list(_windows(tf, count, size, shift, stride, drop))
    assert hr_list(_windows(hr, count, size, shift, stride, drop)) == expected
    tf_ds = tf.data.Dataset.range(count).window(size, shift, stride, drop)
    hr_ds = hr.Dataset.range(count).window(size, shift, stride, drop)
    assert hr_ds.cardinality() == int(tf_ds.cardinality())


@given(
    count=st.integers(0, 30), size=st.integers(1, 6), shift=st.integers(1, 8),
    stride=st.integers(1, 4), drop=st.booleans(),
)
@SWEEP
def test_window_sweep_against_tf(count: int, size: int, shift: int, stride: int, drop: bool) -> None:
    tf_ds = tf.data.Dataset.range(count).window(size, shift, stride, drop)
    hr_ds = hr.Dataset.range(count).window(size, shift, stride, drop)
    assert hr_list(hr_ds.flat_map(lambda w: w.batch(size))) == tf_list(
        tf_ds.flat_map(lambda w: w.batch(size))
    )


@pytest.mark.parametrize("argument", ["size", "shift", "stride"])
def test_window_arguments_must_be_positive(argument: str) -> None:
    kwargs = {"size": 2, "shift": 1, "stride": 1, argument: 0}
    with pytest.raises(tf.errors.InvalidArgumentError):
        list(tf.data.Dataset.range(4).window(**kwargs))
    with pytest.raises(hr.InvalidArgumentError, match=f"window: {argument} must be > 0"):
        hr.Dataset.range(4).window(**kwargs)


def test_window_checkpoints_and_dict_windows() -> None:
    ds = hr.Dataset.range(23).window(4, shift=3, stride=2).flat_map(lambda w: w.batch(4))
    assert_checkpoint_roundtrip(ds)
    rows = {"a": np.arange(6), "b": np.arange(6) * 10}
    tf_ds = tf.data.Dataset.from_tensor_slices(rows).window(2).flat_map(
        lambda w: tf.data.Dataset.zip((w["a"].batch(2), w["b"].batch(2)))
    )
    hr_ds = hr.Dataset.from_tensor_slices(rows).window(2).flat_map(
        lambda w: hr.Dataset.zip((w["a"].batch(2), w["b"].batch(2)))
    )
    assert hr_list(hr_ds) == tf_list(tf_ds)


def test_window_books_what_it_holds() -> None:
    rows = np.zeros((40, 64 << 10), np.uint8)  # 64 KiB rows
    ds = hr.Dataset.from_generator(
        lambda: iter(rows), output_signature=hr.TensorSpec((64 << 10,), np.uint8)
    ).window(8, shift=1).flat_map(lambda w: w.batch(8))
    with iter(ds.with_options(hr.Options(memory_budget="8MiB"))) as iterator:
        next(iterator)
        stage = next(s for s in iterator.stats().stages if s.name == "window")
        assert stage.held >= 7 * (64 << 10)
    with pytest.raises(hr.MemoryBudgetError, match="window"):
        list(ds.with_options(hr.Options(memory_budget="512KiB")))
