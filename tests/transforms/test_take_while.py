"""``take_while``, proven against TensorFlow itself: the same pipeline under tf.data and
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


# -- take_while (take_while_test.py) -------------------------------------------------------
@pytest.mark.parametrize("num_elements, upper_bound", [(14, 2), (15, 2), (100, 99), (4, 0), (0, 5)])
def test_take_while_matches_tf(num_elements: int, upper_bound: int) -> None:
    tf_ds = tf.data.Dataset.range(num_elements).take_while(lambda x: x < upper_bound)
    hr_ds = hr.Dataset.range(num_elements).take_while(lambda x: x < upper_bound)
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)


def test_take_while_strings_and_stops_reading() -> None:
    """take_while_test.testTakeWhileDatasetString; the input is not read past the false."""
    words = np.array([b"this", b"is", b"the", b"test", b"example"], dtype=object)
    tf_ds = tf.data.Dataset.from_tensor_slices(words).take_while(lambda w: w != b"test")
    hr_ds = hr.Dataset.from_tensor_slices(words).take_while(lambda w: w != b"test")
    assert hr_list(hr_ds) == tf_list(tf_ds)
    reads: list[int] = []

    def counted() -> Any:
        for i in range(100):
            reads.append(i)
            yield np.int64(i)

    gen = hr.Dataset.from_generator(counted, output_signature=hr.TensorSpec((), np.int64))
    assert len(list(gen.take_while(lambda x: x < 3))) == 3
    assert reads == [0, 1, 2, 3]


def test_take_while_predicate_must_be_a_scalar_bool() -> None:
    with pytest.raises(hr.ElementSpecError, match=r"take_while.*scalar bool"):
        list(hr.Dataset.range(3).take_while(lambda x: np.array([True, False])))
