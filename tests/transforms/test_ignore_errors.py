"""``ignore_errors``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import hr_list, tf_list

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf


def test_ignore_errors_matches_tf() -> None:
    """ignore_errors_test.testMapIgnoreError: elements whose map raised are dropped."""
    components = np.array([1.0, 2.0, 3.0, np.nan, 5.0], dtype=np.float32)
    tf_ds = tf.data.Dataset.from_tensor_slices(components).map(
        lambda x: tf.debugging.check_numerics(x, "message")).ignore_errors()

    def check_numerics(x: Any) -> Any:
        if not np.isfinite(x):
            raise ValueError("message")
        return x

    hr_ds = hr.Dataset.from_tensor_slices(components).map(check_numerics).ignore_errors()
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)
    with pytest.warns(hr.HeadraceWarning, match="dropped an element that raised ValueError"):
        list(hr.Dataset.from_tensor_slices(components).map(check_numerics)
             .ignore_errors(log_warning=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(hr_ds)
