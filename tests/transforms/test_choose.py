"""``choose``, proven against TensorFlow itself: the same pipeline under tf.data and
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


# -- choose_from_datasets / sample_from_datasets -------------------------------------------
def test_choose_from_datasets_matches_tf() -> None:
    """choose_from_datasets_test.testChooseFromDatasets."""
    words = [b"foo", b"bar", b"baz"]
    choices = np.random.default_rng(0).integers(0, 3, size=15).astype(np.int64)
    tf_ds = tf.data.Dataset.choose_from_datasets(
        [tf.data.Dataset.from_tensors(w).repeat() for w in words],
        tf.data.Dataset.from_tensor_slices(choices))
    hr_ds = hr.Dataset.choose_from_datasets(
        [hr.Dataset.from_tensors(w).repeat() for w in words],
        hr.Dataset.from_tensor_slices(choices))
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)


@pytest.mark.parametrize("stop", [True, False])
def test_choose_with_exhausted_inputs_matches_tf(stop: bool) -> None:
    """choose_from_datasets_test.testStopOnEmptyDataset / testSkipEmptyDataset."""
    choices = np.array([0, 1, 0, 1, 1, 0, 0, 1, 0], np.int64)

    def build(lib: Any) -> Any:
        return lib.choose_from_datasets(
            [lib.range(2), lib.range(10, 14)], lib.from_tensor_slices(choices),
            stop_on_empty_dataset=stop)

    assert hr_list(build(hr.Dataset)) == tf_list(build(tf.data.Dataset))


def test_choose_errors() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError):
        list(tf.data.Dataset.choose_from_datasets(
            [tf.data.Dataset.range(2)], tf.data.Dataset.from_tensor_slices(np.array([0, 3]))))
    with pytest.raises(hr.InvalidArgumentError, match="choice 1 = 3 is out of range"):
        list(hr.Dataset.choose_from_datasets(
            [hr.Dataset.range(2)], hr.Dataset.from_tensor_slices(np.array([0, 3]))))
    with pytest.raises(TypeError):
        tf.data.Dataset.choose_from_datasets(
            [tf.data.Dataset.range(2)], tf.data.Dataset.from_tensor_slices([0.5]))
    with pytest.raises(hr.ElementSpecError, match="int64 scalars"):
        hr.Dataset.choose_from_datasets(
            [hr.Dataset.range(2)], hr.Dataset.from_tensor_slices(np.array([0.5])))


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.9, 0.1], [0.2, 0.3, 0.5], None])
def test_sample_from_datasets_distribution(weights: Any) -> None:
    """sample_from_datasets_test.testSampleFromDatasets: frequencies follow the weights
    (chi-square against the weights, as the TF test does); tf.data's sequence differs."""
    n = len(weights) if weights else 3
    ds = hr.Dataset.sample_from_datasets(
        [hr.Dataset.from_tensors(np.int64(i)).repeat() for i in range(n)], weights, seed=7
    ).take(20_000)
    counts = np.bincount([int(v) for v in ds], minlength=n)
    expected = np.asarray(weights if weights else [1 / n] * n) * 20_000
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 20.0, (counts, expected)


def test_sample_from_datasets_semantics_against_tf() -> None:
    """Every element exactly once when inputs run out (stop_on_empty_dataset=False), and
    the stream ends at the first exhausted input with True — as tf.data."""
    for stop in (False, True):
        tf_out = tf_list(tf.data.Dataset.sample_from_datasets(
            [tf.data.Dataset.range(5), tf.data.Dataset.range(100, 103)], seed=1,
            stop_on_empty_dataset=stop))
        hr_out = hr_list(hr.Dataset.sample_from_datasets(
            [hr.Dataset.range(5), hr.Dataset.range(100, 103)], seed=1,
            stop_on_empty_dataset=stop))
        for out in (hr_out, tf_out):  # each input's elements in their order
            values = [v[2] for v in out]
            assert [v for v in values if v < 100] == list(range(5))[: sum(v < 100 for v in values)]
            assert [v for v in values if v >= 100] == list(range(100, 103))[
                : sum(v >= 100 for v in values)
            ]
        if not stop:
            assert sorted(hr_out) == sorted(tf_out)  # everything, once
        else:  # ends at the first pick of an exhausted input: an input ran out
            assert len(hr_out) <= 8
            values = [v[2] for v in hr_out]
            assert {0, 1, 2, 3, 4} <= set(values) or {100, 101, 102} <= set(values)
    ds = hr.Dataset.sample_from_datasets(
        [hr.Dataset.range(30), hr.Dataset.range(100, 120)], [0.3, 0.7], seed=3)
    assert hr_list(ds) == hr_list(ds)  # same seed, same order
    assert_checkpoint_roundtrip(ds)
    with pytest.raises(hr.InvalidArgumentError, match="weights"):
        hr.Dataset.sample_from_datasets([hr.Dataset.range(2)], [1.0, 2.0])


@pytest.mark.parametrize("stop", [False, True])
def test_an_input_of_weight_zero_is_never_drawn_and_ends_with_the_others(stop: bool) -> None:
    # It used to be waited for: drawing went on forever once the others ran out.
    def both(api: Any) -> Any:
        return api.Dataset.sample_from_datasets(
            [api.Dataset.range(3), api.Dataset.range(100, 103)], weights=[1.0, 0.0], seed=1,
            stop_on_empty_dataset=stop)

    assert hr_list(both(hr)) == tf_list(both(tf.data))
    assert [int(x) for x in both(hr)] == [0, 1, 2]
    assert_checkpoint_roundtrip(both(hr))
