"""``group_by_window``, proven against TensorFlow itself: the same pipeline under tf.data and
headrace, compared element for element (values, dtypes, shapes); parameters are
the cases of TensorFlow's own kernel tests, carried over as data, not code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from tf_compare import SWEEP, hr_list, tf_list

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf


def _sequences(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.arange(int(n), dtype=np.int64) + 1 for n in rng.integers(1, 12, size=count)]


# -- group_by_window / bucket_by_sequence_length -------------------------------------------
def test_group_by_window_simple_matches_tf() -> None:
    """group_by_window_test.testSimple / testShortCircuit / testGroupByWindowWithSizeFunc."""
    cases = [
        (lambda ds: ds.group_by_window(lambda x: x % 2, lambda _, xs: xs.batch(4), 4), 10),
        (lambda ds: ds.group_by_window(lambda x: x % 3, lambda k, xs: xs.batch(2), 2), 20),
        (lambda ds: ds.group_by_window(lambda x: x % 4, lambda k, xs: xs.batch(5),
                                       window_size_func=lambda k: k + 1), 30),
        (lambda ds: ds.group_by_window(lambda x: np.int64(0), lambda k, xs: xs.take(1), 5), 12),
    ]
    for build, count in cases:
        tf_ds = build(tf.data.Dataset.range(count))
        hr_ds = build(hr.Dataset.range(count))
        assert hr_list(hr_ds) == tf_list(tf_ds)
        assert_checkpoint_roundtrip(hr_ds)


@given(
    count=st.integers(0, 40), modulus=st.integers(1, 6), window=st.integers(1, 5),
    batch=st.integers(1, 4),
)
@SWEEP
def test_group_by_window_sweep(count: int, modulus: int, window: int, batch: int) -> None:
    def build(ds: Any) -> Any:
        return ds.group_by_window(
            lambda x: (x * 7) % modulus, lambda k, xs: xs.batch(batch), window_size=window
        )

    assert hr_list(build(hr.Dataset.range(count))) == tf_list(build(tf.data.Dataset.range(count)))


def test_group_by_window_key_must_be_an_integer_scalar() -> None:
    with pytest.raises(hr.ElementSpecError, match="integer scalar"):
        list(hr.Dataset.range(3).group_by_window(lambda x: 0.5, lambda k, w: w, 2))
    with pytest.raises(hr.InvalidArgumentError, match="exactly one of window_size"):
        hr.Dataset.range(3).group_by_window(lambda x: x, lambda k, w: w)


@pytest.mark.parametrize("pad_to_boundary", [False, True])
@pytest.mark.parametrize("no_padding", [False, True])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_bucket_by_sequence_length_matches_tf(
    pad_to_boundary: bool, no_padding: bool, drop_remainder: bool
) -> None:
    """bucket_by_sequence_length_test: buckets, padding to the boundary, no padding."""
    if no_padding and pad_to_boundary:
        return
    rows = _sequences(60, 3)
    if no_padding:
        rows = [np.full(4 if len(r) < 5 else 7, len(r), np.int64) for r in rows]
        if pad_to_boundary:
            return
    boundaries, sizes = [3, 5, 8], [2, 3, 4, 2]
    if pad_to_boundary:
        boundaries = [3, 5, 8, 13]
        sizes = [2, 3, 4, 2, 1]

    def build(ds: Any) -> Any:
        return ds.bucket_by_sequence_length(
            lambda x: np.int64(len(x)) if isinstance(x, np.ndarray) else tf.shape(x)[0],
            boundaries, sizes, pad_to_bucket_boundary=pad_to_boundary,
            no_padding=no_padding, drop_remainder=drop_remainder,
        )

    tf_ds = build(tf.data.Dataset.from_generator(
        lambda: iter(rows), output_signature=tf.TensorSpec((None,), tf.int64)))
    hr_ds = build(hr.Dataset.from_generator(
        lambda: iter(rows), output_signature=hr.TensorSpec((None,), np.int64)))
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)


def test_bucket_arguments_are_checked() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="len\\(bucket_boundaries\\) \\+ 1"):
        hr.Dataset.range(3).bucket_by_sequence_length(lambda x: x, [1, 2], [1, 2])


def _rows_after_a_shuffle() -> hr.Dataset:
    """12 rows of 1.5 MiB through shuffle(2): the shuffle's weight gives it most of the
    budget, which its buffer of two rows does not use."""
    def rows() -> Any:
        for i in range(12):
            yield np.full(3 * (1 << 20) // 8, i, np.int32)

    source = hr.Dataset.from_generator(rows, output_signature=hr.TensorSpec((None,), np.int32))
    return source.shuffle(2, seed=1)


def test_minima_that_fit_are_not_refused_inside_a_reduced_or_flat_mapped_dataset() -> None:
    # The reduced dataset ran in half the stage's share and a flat_map's inner dataset in
    # its slot's part, neither split again: a batch of 2 rows (3 MiB) was refused at
    # "the memory budget of 2.7 MiB" of a 16 MiB pipeline whose minima fit it.
    budget = hr.Options(memory_budget="16MiB")
    bucketed = _rows_after_a_shuffle().bucket_by_sequence_length(
        lambda x: x.shape[0], [10], [2, 2])
    assert sorted(int(v) for b in bucketed.with_options(budget) for v in b[:, 0]) == list(range(12))
    windows = _rows_after_a_shuffle().window(3).flat_map(lambda w: w.batch(3))
    assert [b.shape[0] for b in windows.with_options(budget)] == [3, 3, 3, 3]


def _vectors_shuffled_then_grouped(scale: int) -> hr.Dataset:
    """30 vectors of 1-6 MiB (divided by ``scale``) filled with their id, through
    shuffle(6), grouped by parity into padded pairs."""
    sizes = np.random.default_rng(0).integers(1 << 20, 6 << 20, 30) // scale // 4

    def vectors() -> Any:
        for i, size in enumerate(sizes):
            yield np.full(int(size), i + 1, np.int32)

    source = hr.Dataset.from_generator(vectors, output_signature=hr.TensorSpec((None,), np.int32))
    return source.shuffle(6, seed=3).group_by_window(
        lambda x: np.int64(x[0] % 2), lambda key, w: w.padded_batch(2), window_size=2)


@pytest.mark.parametrize("scale", [1, 4])
def test_a_restore_under_a_tight_budget_resumes_the_run_it_was_taken_from(scale: int) -> None:
    # A restore replays the input, and dropped the groups it completed unreduced: their
    # reduced pipelines, which widen their part of a tight share while they run, never
    # ran, so the shuffle upstream filled to more than it had and drew another order
    # from the third element on (13 of 17 positions wrong; found by an outsider's
    # checkpoint-at-every-position attack on a 64 MiB budget).
    options = hr.Options(memory_budget=f"{64 // scale}MiB")
    ds = _vectors_shuffled_then_grouped(scale).with_options(options)
    states, ids = [], []
    with iter(ds) as iterator:
        for batch in iterator:
            states.append(iterator.get_state())
            ids.append(batch[:, 0].tolist())
    for position, state in enumerate(states):
        with iter(ds) as resumed:
            resumed.set_state(state)
            assert [b[:, 0].tolist() for b in resumed] == ids[position + 1:], position


def test_a_restore_passes_a_group_whose_reduce_func_raised() -> None:
    # The restore's replay runs the groups it passes through reduce_func; one that
    # raised in the run (a length past the last boundary, padded to the boundary) must
    # not make set_state raise it.
    ds = hr.Dataset.from_tensor_slices(np.arange(8)).map(lambda x: np.zeros(x % 3 + 1)) \
        .bucket_by_sequence_length(lambda x: x.shape[0], [2], [2, 2],
                                   pad_to_bucket_boundary=True)

    def rest(iterator: Any) -> list[Any]:
        out: list[Any] = []
        while True:
            try:
                out.append(next(iterator).shape)
            except StopIteration:
                return out
            except hr.InvalidArgumentError:
                out.append("error")

    states, seen = [], []
    with iter(ds) as iterator:
        while True:
            states.append(iterator.get_state())
            try:
                seen.append(next(iterator).shape)
            except StopIteration:
                break
            except hr.InvalidArgumentError:
                seen.append("error")
    assert "error" in seen and any(s != "error" for s in seen)
    for position, state in enumerate(states):
        with iter(ds) as resumed:
            resumed.set_state(state)
            assert rest(resumed) == seen[position:], position


def test_a_group_whose_reduce_func_raised_gives_its_booking_back() -> None:
    # Its elements stayed booked on the stage's share, one group more at every error
    # (5.3 MB after 133 such groups here), until the iterator closed.
    ds = hr.Dataset.from_tensor_slices(np.arange(400)).map(
        lambda x: np.zeros((x % 3 + 1) * 1000)).bucket_by_sequence_length(
        lambda x: x.shape[0], [2000], [2, 2], pad_to_bucket_boundary=True)
    outputs = errors = 0
    with iter(ds) as iterator:
        while True:
            try:
                next(iterator)
                outputs += 1
            except StopIteration:
                break
            except hr.InvalidArgumentError:
                errors += 1
                assert iterator.stats().budget_used < 100_000
        assert (outputs, errors) == (67, 133)
        assert iterator.stats().budget_used == 0
