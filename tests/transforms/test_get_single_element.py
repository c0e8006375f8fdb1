"""``get_single_element``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

import pytest
import tensorflow as tf
from tf_compare import py

import headrace as hr

pytestmark = pytest.mark.tf


def test_get_single_element_matches_tf() -> None:
    """get_single_element_test: one element, empty, more than one."""
    assert py(hr.Dataset.range(1).map(lambda x: (x, {"y": x * 2})).get_single_element()) == \
        py(tf.data.Dataset.range(1).map(lambda x: (x, {"y": x * 2})).get_single_element())
    with pytest.raises(tf.errors.InvalidArgumentError, match="empty"):
        tf.data.Dataset.range(0).get_single_element()
    with pytest.raises(hr.InvalidArgumentError, match="was empty"):
        hr.Dataset.range(0).get_single_element()
    with pytest.raises(tf.errors.InvalidArgumentError, match="more than one"):
        tf.data.Dataset.range(2).get_single_element()
    with pytest.raises(hr.InvalidArgumentError, match="more than one element"):
        hr.Dataset.range(2).get_single_element()
