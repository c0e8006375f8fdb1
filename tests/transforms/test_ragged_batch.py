"""``ragged_batch``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import hr_list, tf_list

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf


# -- ragged_batch, batch(num_parallel_calls=...), from_generator(output_types=...) --------
@pytest.mark.parametrize("batch_size, drop", [(1, False), (2, False), (3, True), (4, False)])
def test_ragged_batch_matches_tf(batch_size: int, drop: bool) -> None:
    """ragged_batch_test: variable-length rows become values + row_splits; scalars dense."""
    tf_ds = tf.data.Dataset.range(7).map(lambda x: (x, tf.range(x))).ragged_batch(
        batch_size, drop_remainder=drop)
    hr_ds = hr.Dataset.range(7).map(lambda x: (x, np.arange(x))).ragged_batch(
        batch_size, drop_remainder=drop)
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert hr_ds.cardinality() == int(tf_ds.cardinality())
    assert_checkpoint_roundtrip(hr_ds)
