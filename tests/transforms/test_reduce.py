"""``reduce``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import py

import headrace as hr

pytestmark = pytest.mark.tf


@pytest.mark.parametrize("n", range(10))
def test_reduce_sum_matches_tf(n: int) -> None:
    """reduce_test.testSum."""
    tf_value = tf.data.Dataset.range(1, n + 1).reduce(np.int64(0), lambda s, x: s + x)
    hr_value = hr.Dataset.range(1, n + 1).reduce(np.int64(0), lambda s, x: s + x)
    assert int(hr_value) == int(tf_value) == n * (n + 1) // 2


def test_reduce_dict_state() -> None:
    """reduce_test.testNested: a dict state."""
    def step(state: Any, value: Any) -> Any:
        return {"dense": state["dense"] + value, "count": state["count"] + 1}

    init = {"dense": np.int64(0), "count": np.int64(0)}
    tf_value = tf.data.Dataset.range(5).reduce(init, step)
    hr_value = hr.Dataset.range(5).reduce(init, step)
    assert py(hr_value) == py({k: v for k, v in tf_value.items()})
