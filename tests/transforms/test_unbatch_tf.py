"""``unbatch``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from tf_compare import SWEEP, hr_list, tf_list

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf


# -- rebatch with empty splits (rebatch_test.py: testEmptySplits) --------------------------
@given(
    count=st.integers(1, 20), batch=st.integers(1, 6),
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=5).filter(any),
)
@SWEEP
def test_rebatch_with_empty_splits_matches_tf(count: int, batch: int, sizes: list[int]) -> None:
    """Empty batches where a size is 0, a leading one too, none once the input ended."""
    tf_ds = tf.data.Dataset.range(count).batch(batch).rebatch(sizes)
    hr_ds = hr.Dataset.range(count).batch(batch).rebatch(sizes)
    assert hr_list(hr_ds) == tf_list(tf_ds)


def test_rebatch_with_empty_splits_checkpoints() -> None:
    assert_checkpoint_roundtrip(hr.Dataset.range(9).batch(4).rebatch([0, 2, 0, 3]))
