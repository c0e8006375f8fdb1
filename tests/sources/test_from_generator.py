"""``from_generator``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import hr_list, tf_list

import headrace as hr

pytestmark = pytest.mark.tf


def test_from_generator_output_types_and_shapes() -> None:
    """from_generator_test: the older output_types/output_shapes, args, str as bytes."""
    def gen(n: Any) -> Any:
        for i in range(int(n)):
            yield np.full(i, i, np.int64), f"row {i}"

    tf_ds = tf.data.Dataset.from_generator(
        gen, output_types=(tf.int64, tf.string), output_shapes=([None], []), args=(4,))
    hr_ds = hr.Dataset.from_generator(
        gen, output_types=(tf.int64, tf.string), output_shapes=([None], []), args=(4,))
    assert hr_list(hr_ds) == tf_list(tf_ds)
    unknown = hr.Dataset.from_generator(gen, output_types=(np.int64, bytes), args=(3,))
    assert unknown.element_spec[0].shape is None  # no shapes: unknown rank, as tf.data
    assert hr_list(unknown) == hr_list(hr_ds.take(3))
    with pytest.raises(hr.InvalidArgumentError, match="not both"):
        hr.Dataset.from_generator(gen, output_types=np.int64,
                                  output_signature=hr.TensorSpec((), np.int64))
