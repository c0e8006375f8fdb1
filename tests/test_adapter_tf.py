"""``Dataset.to_tf()``: a real tf.data.Dataset with the right signature, values and cardinality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace as hr

tf = pytest.importorskip("tensorflow")
pytestmark = pytest.mark.tf


def _as_numpy(value: object) -> object:
    if isinstance(value, dict):
        return {key: _as_numpy(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_as_numpy(item) for item in value)
    return value.numpy()  # type: ignore[attr-defined]


def test_signature_values_and_strings_exact() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    names = np.array([b"a", b"b\x00", b"", b"d", b"e\x00\x00", b"f", b"g", b"h", b"i", b"j"], object)
    ds = hr.Dataset.from_tensor_slices({"x": x, "name": names, "id": np.arange(10)}).batch(4)
    out = ds.to_tf()
    spec = out.element_spec
    assert spec["x"] == tf.TensorSpec((None, 2), tf.float32)
    assert spec["name"] == tf.TensorSpec((None,), tf.string)
    assert spec["id"] == tf.TensorSpec((None,), tf.int64)
    assert int(out.cardinality()) == 3
    batches = [_as_numpy(b) for b in out]
    assert [b["id"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[1]["name"].tolist() == [b"e\x00\x00", b"f", b"g", b"h"]  # NULs kept
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)


def test_every_pass_is_a_new_epoch_and_cardinality_is_asserted() -> None:
    ds = hr.Dataset.range(6).shuffle(6, seed=1)
    out = ds.to_tf()
    first, second = [int(v) for v in out], [int(v) for v in out]
    assert sorted(first) == sorted(second) == list(range(6)) and first != second
    assert int(hr.Dataset.range(3).repeat().to_tf().cardinality()) == tf.data.INFINITE_CARDINALITY
    unknown = hr.Dataset.range(10).filter(lambda v: v % 3 == 0).to_tf()
    assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert [int(v) for v in unknown] == [0, 3, 6, 9]
    # It composes with tf.data like any dataset (a legacy input_fn, tf.distribute).
    assert [int(v) for v in hr.Dataset.range(4).to_tf().map(lambda v: v * 2)] == [0, 2, 4, 6]




def test_unsupported_dtype_says_which_component() -> None:
    ds = hr.Dataset.from_tensor_slices({"z": np.zeros((2, 2), np.complex256)})
    with pytest.raises(hr.InvalidArgumentError, match="complex256"):
        ds.to_tf()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 4),
    batch=st.integers(1, 7),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]),
    drop=st.booleans(),
)
def test_random_pipelines_match_headrace(
    rows: int, width: int, batch: int, dtype: type, drop: bool
) -> None:
    data = (np.arange(rows * width) % 7).astype(dtype).reshape(rows, width)
    ds = hr.Dataset.from_tensor_slices((data, np.arange(rows))).shuffle(rows, seed=rows, reshuffle_each_iteration=False).batch(
        batch, drop_remainder=drop
    )
    ds = ds.shuffle(4, seed=0, reshuffle_each_iteration=False)
    expected = list(ds)
    got = [_as_numpy(b) for b in ds.to_tf()]
    assert len(got) == len(expected) == max(ds.cardinality(), 0)
    for (gx, gi), (ex, ei) in zip(got, expected, strict=True):
        assert gx.dtype == ex.dtype
        np.testing.assert_array_equal(gx, ex)
        np.testing.assert_array_equal(gi, ei)
