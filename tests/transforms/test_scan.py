"""``scan``, proven against TensorFlow itself: the same pipeline under tf.data and
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


# -- scan / reduce (scan_test.py, reduce_test.py) ------------------------------------------
@pytest.mark.parametrize("start, step, take", [(0, 1, 10), (0, 1, 0), (10, 2, 10), (10, -1, 10)])
def test_scan_count_matches_tf(start: int, step: int, take: int) -> None:
    """scan_test.testCount: a running counter."""
    tf_ds = tf.data.Dataset.from_tensors(np.int64(0)).repeat().scan(
        np.int64(start), lambda s, _: (s + step, s)).take(take)
    hr_ds = hr.Dataset.from_tensors(np.int64(0)).repeat().scan(
        np.int64(start), lambda s, _: (s + step, s)).take(take)
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert hr_list(hr_ds) == [("int64", (), start + i * step) for i in range(take)]


def test_scan_fibonacci_and_tuple_state() -> None:
    """scan_test.testFibonacci: a tuple state carried through."""
    def fib(library: Any) -> Any:
        return library.range(1).repeat(None).scan(
            (np.int64(1), np.int64(1)), lambda s, _: ((s[1], s[0] + s[1]), s[1])
        ).take(10)

    expected = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89]
    assert [v[2] for v in tf_list(fib(tf.data.Dataset))] == expected
    assert [v[2] for v in hr_list(fib(hr.Dataset))] == expected
    assert_checkpoint_roundtrip(fib(hr.Dataset))


def test_scan_must_return_a_pair_and_keep_its_state_structure() -> None:
    with pytest.raises(hr.ElementSpecError, match=r"must return \(new_state, output\)"):
        list(hr.Dataset.range(3).scan(np.int64(0), lambda s, x: s + x))
    with pytest.raises(hr.ElementSpecError, match="changed the structure of the state"):
        list(hr.Dataset.range(3).scan(np.int64(0), lambda s, x: ((s, s), x)))


def test_the_state_may_change_its_dtype_where_tf_refuses() -> None:
    """docs/differences.md: the state is what scan_func returns (tf.data fixes its dtypes
    when it traces the function); the structure must stay, the dtype may go."""
    with pytest.raises(TypeError, match="must match the initial state"):
        tf.data.Dataset.range(3).scan(np.int64(0), lambda s, x: (tf.cast(s, tf.float32) + 0.5, s))
    ds = hr.Dataset.range(3).scan(np.int64(0), lambda s, x: (s + 0.5, s))
    assert [(float(v), np.asarray(v).dtype.kind) for v in ds] == [(0, "i"), (0.5, "f"), (1, "f")]
    assert_checkpoint_roundtrip(ds)
