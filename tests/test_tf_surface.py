"""The last corners of tf.data's surface, each run under TensorFlow and headrace.

None components through unbatch/rebatch, what ``global_shuffle`` accepts and
refuses, ``map(deterministic=False)``, generators released when ``take`` ends,
and rebatch's empty splits — compared element for element with TensorFlow 2.21.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf

SWEEP = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def py(value: Any) -> Any:
    """A nested value as Python data with dtype names and shapes, the same for both."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {key: py(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(py(item) for item in value)
    if isinstance(value, tf.Tensor):
        value = value.numpy()
    array = np.asarray(value)
    kind = "bytes" if array.dtype.kind in "OSU" else array.dtype.name
    return (kind, array.shape, array.tolist())


def both(build: Any) -> tuple[list[Any], list[Any]]:
    """``build(Dataset)`` under TensorFlow and headrace, as lists of Python data."""
    return (
        [py(element) for element in build(tf.data.Dataset)],
        [py(element) for element in build(hr.Dataset)],
    )


# -- 1. unbatch / rebatch of elements with None components -----------------------------------
NONE_CASES = {
    "tuple": lambda D: D.from_tensors((np.arange(3), None)).unbatch(),
    "dict": lambda D: D.from_tensors({"a": np.arange(3), "b": None}).unbatch(),
    "after map": lambda D: D.range(7).batch(3).map(lambda x: (x, None)).unbatch(),
    "nested": lambda D: D.range(6).batch(2).map(lambda x: {"a": (x, None), "b": None}).unbatch(),
    "rebatch": lambda D: D.range(6).batch(3).map(lambda x: (x, None)).rebatch(2),
    "rebatch empty splits": lambda D: D.range(5).batch(3).map(lambda x: (x, None)).rebatch([0, 2]),
}


@pytest.mark.parametrize("case", sorted(NONE_CASES))
def test_none_components_pass_through_unbatch_like_tf(case: str) -> None:
    expected, got = both(NONE_CASES[case])
    assert got == expected


def test_none_component_spec_and_checkpoint() -> None:
    ds = hr.Dataset.range(7).batch(3).map(lambda x: (x, None)).unbatch()
    assert repr(ds.element_spec) == "(TensorSpec(shape=(), dtype=int64), NoneTensorSpec())"
    assert ds.element_spec[1].kind == "none"
    assert_checkpoint_roundtrip(ds)


def test_unbatch_of_only_none_is_refused() -> None:
    """tf.data cannot even build such a dataset; headrace says what is wrong."""
    with pytest.raises(hr.InvalidArgumentError, match="every component is None"):
        hr.Dataset.from_tensors((None,)).unbatch()
    with pytest.raises(hr.ElementSpecError, match="every component of this batch is None"):
        list(hr.Dataset.range(6).batch(3).map(lambda x: (None,)).unbatch())
    with pytest.raises(hr.InvalidArgumentError, match=r"component \[0\] is a scalar"):
        hr.Dataset.from_tensors((np.int64(3), None)).unbatch()


# -- 5. rebatch with empty splits (rebatch_test.py: testEmptySplits and friends) -------------
@pytest.mark.parametrize("count", [0, 1, 3, 8])
@pytest.mark.parametrize("sizes", [[0, 2], [2, 0], [0, 0, 1], [1, 0], [0, 3, 0]])
@pytest.mark.parametrize("drop", [False, True])
def test_rebatch_empty_splits_match_tf(count: int, sizes: list[int], drop: bool) -> None:
    expected, got = both(lambda D: D.range(count).batch(4).rebatch(sizes, drop_remainder=drop))
    assert got == expected


def test_rebatch_empty_batch_of_empty_input_is_one_empty_batch() -> None:
    """range(0).batch(4).rebatch([0, 2]): tf.data yields one empty int64 batch."""
    (batch,) = list(hr.Dataset.range(0).batch(4).rebatch([0, 2]))
    assert batch.dtype == np.int64 and batch.shape == (0,)


def test_rebatch_empty_batches_take_their_shape_from_the_spec() -> None:
    """Unknown sizes are 0 in an empty batch, as tf.data builds it from output shapes."""
    rows = [np.zeros((2, 3)), np.ones((1, 3))]

    def build(D: Any) -> Any:
        spec = (tf if D is tf.data.Dataset else hr).TensorSpec((None, None), np.float64)
        return D.from_generator(lambda: iter(rows), output_signature=spec).rebatch([0, 2])

    expected, got = both(build)
    assert got == expected
    assert got[0] == ("float64", (0, 0), [])

    def strings(D: Any) -> Any:
        return D.from_tensor_slices([b"a", b"b", b"c"]).batch(2).rebatch([0, 1])

    expected, got = both(strings)
    assert got == expected


@given(
    count=st.integers(0, 20), batch=st.integers(1, 6), drop=st.booleans(),
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=5).filter(any),
)
@SWEEP
def test_rebatch_sweep_with_empty_inputs(count: int, batch: int, drop: bool, sizes: list[int]) -> None:
    expected, got = both(lambda D: D.range(count).batch(batch).rebatch(sizes, drop_remainder=drop))
    assert got == expected


def test_rebatch_empty_splits_checkpoint_at_every_position() -> None:
    assert_checkpoint_roundtrip(hr.Dataset.range(0).batch(4).rebatch([0, 2]))
    assert_checkpoint_roundtrip(hr.Dataset.range(5).batch(4).rebatch([0, 2, 0], drop_remainder=True))
