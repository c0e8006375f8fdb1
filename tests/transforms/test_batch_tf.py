"""``batch``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

from typing import Any

import pytest
import tensorflow as tf
from tf_compare import hr_list, tf_list

import headrace as hr

pytestmark = pytest.mark.tf


@pytest.mark.parametrize("num_parallel_calls", [None, 1, 4, hr.AUTOTUNE])
@pytest.mark.parametrize("deterministic", [None, True, False])
def test_batch_parallel_arguments(num_parallel_calls: Any, deterministic: Any) -> None:
    tf_ds = tf.data.Dataset.range(11).batch(
        3, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    hr_ds = hr.Dataset.range(11).map(lambda x: x + 0).batch(
        3, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    tf_out = tf_list(tf_ds)
    hr_out = hr_list(hr_ds)
    assert sorted(map(repr, hr_out)) == sorted(map(repr, tf_out))
    assert hr_out == tf_list(tf.data.Dataset.range(11).batch(3))  # always in order
    with pytest.raises(hr.InvalidArgumentError, match="num_parallel_calls"):
        hr.Dataset.range(3).batch(2, num_parallel_calls=0)
