"""``range_and_random``, proven against TensorFlow itself: the same pipeline under tf.data and
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


# -- random, range(output_type), get_single_element, ignore_errors ------------------------
def test_random_is_int64_reproducible_and_resumable() -> None:
    tf_spec = tf.data.Dataset.random(seed=4).element_spec
    ds = hr.Dataset.random(seed=4)
    assert ds.element_spec == hr.TensorSpec((), tf_spec.dtype.as_numpy_dtype)
    assert ds.cardinality() == int(tf.data.Dataset.random(seed=4).cardinality()) == hr.INFINITE
    first = [int(v) for v in ds.take(50)]
    assert first == [int(v) for v in ds.take(50)]  # every iteration the same, as tf.data
    assert all(0 <= v < 2**32 for v in first) and len(set(first)) == 50
    assert [int(v) for v in hr.Dataset.random(seed=5).take(50)] != first
    rerandomized = hr.Dataset.random(seed=4, rerandomize_each_iteration=True).take(20)
    assert [int(v) for v in rerandomized] != [int(v) for v in rerandomized]
    assert_checkpoint_roundtrip(ds.take(5000), max_checkpoints=8)


@pytest.mark.parametrize("output_type", [tf.int32, tf.int64, tf.float32, np.int16])
def test_range_output_type(output_type: Any) -> None:
    """range_test.testRangeWithOutputType (TF dtypes accepted as they are)."""
    tf_ds = tf.data.Dataset.range(2, 11, 3, output_type=output_type)
    hr_ds = hr.Dataset.range(2, 11, 3, output_type=output_type)
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert hr_list(hr_ds.batch(2)) == tf_list(tf_ds.batch(2))
