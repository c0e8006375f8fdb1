"""tf.data's remaining transformations, proven against TensorFlow itself.

Each transformation runs the same pipeline under ``tf.data`` and headrace and
compares values, dtypes and shapes element for element; the parameters are the
cases of TensorFlow's own kernel tests (``tensorflow/python/data/kernel_tests``:
window_test, scan_test, reduce_test, take_while_test, unique_test,
group_by_window_test, bucket_by_sequence_length_test, choose_from_datasets_test,
sample_from_datasets_test, get_single_element_test, ignore_errors_test,
ragged_batch_test, random_test, range_test, from_generator_test), carried over
as inputs, parameters, expected outputs and errors — not as code. Every
transformation also passes a checkpoint round trip, and hypothesis draws
further parameters for the ones with an order to get right.
"""

from __future__ import annotations

import warnings
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
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def py(value: Any) -> Any:
    """A nested value as Python data with dtype names, the same for both libraries."""
    if isinstance(value, dict):
        return {key: py(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(py(item) for item in value)
    if hasattr(value, "row_splits") and hasattr(value, "values"):  # ragged, either side
        values = value.values.numpy() if hasattr(value.values, "numpy") else value.values
        splits = value.row_splits.numpy() if hasattr(value.row_splits, "numpy") else value.row_splits
        return ("ragged", py(values), np.asarray(splits).tolist())
    if isinstance(value, tf.Tensor):
        value = value.numpy()
    if isinstance(value, bytes):
        return ("bytes", value)
    array = np.asarray(value)
    kind = "bytes" if array.dtype.kind in "OSU" else array.dtype.name
    return (kind, array.shape, array.tolist())


def tf_list(dataset: tf.data.Dataset) -> list[Any]:
    return [py(element) for element in dataset]


def hr_list(dataset: hr.Dataset) -> list[Any]:
    return [py(element) for element in dataset]


# -- window (window_test.py) ----------------------------------------------------------------
WINDOW_CASES = [  # (count, size, shift, stride, drop_remainder), from testWindowDataset
    (20, 14, 7, 1, False), (20, 17, 9, 1, False), (20, 14, 14, 1, False),
    (20, 10, 14, 1, False), (20, 14, 7, 2, False), (20, 7, 1, 1, False),
    (20, 14, 7, 1, True), (20, 17, 9, 1, True), (20, 10, 14, 1, True),
    (20, 14, 19, 1, True), (20, 4, 4, 3, True), (20, 4, 4, 3, False),
    (1, 10, 4, 1, False), (0, 3, 1, 1, False), (7, 3, None, 1, False),
]


def _windows(library: Any, count: int, size: int, shift: Any, stride: int, drop: bool) -> Any:
    components = (np.arange(count, dtype=np.int64), np.arange(count, dtype=np.float32) * 2)
    dataset = library.data.Dataset if library is tf else hr.Dataset
    ds = dataset.from_tensor_slices(components).window(size, shift, stride, drop)
    return ds.flat_map(lambda a, b: dataset.zip((a.batch(size), b.batch(size))))


@pytest.mark.parametrize("count, size, shift, stride, drop", WINDOW_CASES)
def test_window_matches_tf(count: int, size: int, shift: Any, stride: int, drop: bool) -> None:
    expected = tf_list(_windows(tf, count, size, shift, stride, drop))
    assert hr_list(_windows(hr, count, size, shift, stride, drop)) == expected
    tf_ds = tf.data.Dataset.range(count).window(size, shift, stride, drop)
    hr_ds = hr.Dataset.range(count).window(size, shift, stride, drop)
    assert hr_ds.cardinality() == int(tf_ds.cardinality())


@given(
    count=st.integers(0, 30), size=st.integers(1, 6), shift=st.integers(1, 8),
    stride=st.integers(1, 4), drop=st.booleans(),
)
@SWEEP
def test_window_sweep_against_tf(count: int, size: int, shift: int, stride: int, drop: bool) -> None:
    tf_ds = tf.data.Dataset.range(count).window(size, shift, stride, drop)
    hr_ds = hr.Dataset.range(count).window(size, shift, stride, drop)
    assert hr_list(hr_ds.flat_map(lambda w: w.batch(size))) == tf_list(
        tf_ds.flat_map(lambda w: w.batch(size))
    )


@pytest.mark.parametrize("argument", ["size", "shift", "stride"])
def test_window_arguments_must_be_positive(argument: str) -> None:
    kwargs = {"size": 2, "shift": 1, "stride": 1, argument: 0}
    with pytest.raises(tf.errors.InvalidArgumentError):
        list(tf.data.Dataset.range(4).window(**kwargs))
    with pytest.raises(hr.InvalidArgumentError, match=f"window: {argument} must be > 0"):
        hr.Dataset.range(4).window(**kwargs)


def test_window_checkpoints_and_dict_windows() -> None:
    ds = hr.Dataset.range(23).window(4, shift=3, stride=2).flat_map(lambda w: w.batch(4))
    assert_checkpoint_roundtrip(ds)
    rows = {"a": np.arange(6), "b": np.arange(6) * 10}
    tf_ds = tf.data.Dataset.from_tensor_slices(rows).window(2).flat_map(
        lambda w: tf.data.Dataset.zip((w["a"].batch(2), w["b"].batch(2)))
    )
    hr_ds = hr.Dataset.from_tensor_slices(rows).window(2).flat_map(
        lambda w: hr.Dataset.zip((w["a"].batch(2), w["b"].batch(2)))
    )
    assert hr_list(hr_ds) == tf_list(tf_ds)


def test_window_books_what_it_holds() -> None:
    rows = np.zeros((40, 64 << 10), np.uint8)  # 64 KiB rows
    ds = hr.Dataset.from_generator(
        lambda: iter(rows), output_signature=hr.TensorSpec((64 << 10,), np.uint8)
    ).window(8, shift=1).flat_map(lambda w: w.batch(8))
    with iter(ds.with_options(hr.Options(memory_budget="8MiB"))) as iterator:
        next(iterator)
        stage = next(s for s in iterator.stats().stages if s.name == "window")
        assert stage.held >= 7 * (64 << 10)
    with pytest.raises(hr.MemoryBudgetError, match="window"):
        list(ds.with_options(hr.Options(memory_budget="512KiB")))


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


@pytest.mark.parametrize("n", range(10))
def test_reduce_sum_matches_tf(n: int) -> None:
    """reduce_test.testSum."""
    tf_value = tf.data.Dataset.range(1, n + 1).reduce(np.int64(0), lambda s, x: s + x)
    hr_value = hr.Dataset.range(1, n + 1).reduce(np.int64(0), lambda s, x: s + x)
    assert int(hr_value) == int(tf_value) == n * (n + 1) // 2


def test_reduce_dict_state() -> None:
    """reduce_test.testNested: a dict state."""
    def step(state: Any, value: Any) -> Any:
        return {"dense": state["dense"] + value, "count": state["count"] + 1}

    init = {"dense": np.int64(0), "count": np.int64(0)}
    tf_value = tf.data.Dataset.range(5).reduce(init, step)
    hr_value = hr.Dataset.range(5).reduce(init, step)
    assert py(hr_value) == py({k: v for k, v in tf_value.items()})


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


# -- unique (unique_test.py) ---------------------------------------------------------------
UNIQUE_CASES = [[], [1], [1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4], [1, 2, 4, 3, 2, 1, 2, 3, 4],
                [[1], [1, 1], [1, 1, 1]], [[1, 1], [1, 1], [2, 2], [3, 3], [1, 1]]]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case", UNIQUE_CASES)
def test_unique_matches_tf(dtype: Any, case: list[Any]) -> None:
    flat = np.array([v for row in case for v in (row if isinstance(row, list) else [row])],
                    dtype=dtype)
    tf_ds = tf.data.Dataset.from_tensor_slices(flat).unique()
    hr_ds = hr.Dataset.from_tensor_slices(flat).unique()
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)


def test_unique_strings_and_bad_types() -> None:
    words = ["hello", "world", "hello", "", "world", "!"]
    tf_ds = tf.data.Dataset.from_tensor_slices(words).unique()
    hr_ds = hr.Dataset.from_tensor_slices(words).unique()
    assert hr_list(hr_ds) == tf_list(tf_ds)
    with pytest.raises(TypeError):
        tf.data.Dataset.range(3).map(lambda x: tf.cast(x, tf.float32)).unique()
    with pytest.raises(hr.ElementSpecError, match="integer or string scalars"):
        hr.Dataset.from_tensor_slices(np.arange(3.0)).unique()


def test_unique_books_the_values_it_has_seen() -> None:
    ds = hr.Dataset.range(20_000).unique().with_options(hr.Options(memory_budget="16MiB"))
    with iter(ds) as iterator:
        for _ in range(10_000):
            next(iterator)
        stage = next(s for s in iterator.stats().stages if s.name == "unique")
        assert stage.held >= 10_000 * 27
    tight = hr.Dataset.range(200_000).unique().with_options(hr.Options(memory_budget="1MiB"))
    with pytest.raises(hr.MemoryBudgetError, match="unique"):
        list(tight)


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


def _sequences(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.arange(int(n), dtype=np.int64) + 1 for n in rng.integers(1, 12, size=count)]


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


# -- random, range(output_type), get_single_element, ignore_errors ------------------------
def test_random_is_int64_reproducible_and_resumable() -> None:
    tf_spec = tf.data.Dataset.random(seed=4).element_spec
    ds = hr.Dataset.random(seed=4)
    assert ds.element_spec == hr.TensorSpec((), tf_spec.dtype.as_numpy_dtype)
    assert ds.cardinality() == int(tf.data.Dataset.random(seed=4).cardinality()) == hr.INFINITE
    first = [int(v) for v in ds.take(50)]
    assert first == [int(v) for v in ds.take(50)]  # every iteration the same, as tf.data
    assert all(0 <= v < 2**32 for v in first) and len(set(first)) == 50
    assert [int(v) for v in hr.Dataset.random(seed=5).take(50)] != first
    rerandomized = hr.Dataset.random(seed=4, rerandomize_each_iteration=True).take(20)
    assert [int(v) for v in rerandomized] != [int(v) for v in rerandomized]
    assert_checkpoint_roundtrip(ds.take(5000), max_checkpoints=8)


@pytest.mark.parametrize("output_type", [tf.int32, tf.int64, tf.float32, np.int16])
def test_range_output_type(output_type: Any) -> None:
    """range_test.testRangeWithOutputType (TF dtypes accepted as they are)."""
    tf_ds = tf.data.Dataset.range(2, 11, 3, output_type=output_type)
    hr_ds = hr.Dataset.range(2, 11, 3, output_type=output_type)
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert hr_list(hr_ds.batch(2)) == tf_list(tf_ds.batch(2))


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


def test_ignore_errors_matches_tf() -> None:
    """ignore_errors_test.testMapIgnoreError: elements whose map raised are dropped."""
    components = np.array([1.0, 2.0, 3.0, np.nan, 5.0], dtype=np.float32)
    tf_ds = tf.data.Dataset.from_tensor_slices(components).map(
        lambda x: tf.debugging.check_numerics(x, "message")).ignore_errors()

    def check_numerics(x: Any) -> Any:
        if not np.isfinite(x):
            raise ValueError("message")
        return x

    hr_ds = hr.Dataset.from_tensor_slices(components).map(check_numerics).ignore_errors()
    assert hr_list(hr_ds) == tf_list(tf_ds)
    assert_checkpoint_roundtrip(hr_ds)
    with pytest.warns(hr.HeadraceWarning, match="dropped an element that raised ValueError"):
        list(hr.Dataset.from_tensor_slices(components).map(check_numerics)
             .ignore_errors(log_warning=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(hr_ds)


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


@pytest.mark.parametrize("num_parallel_calls", [None, 1, 4, hr.AUTOTUNE])
@pytest.mark.parametrize("deterministic", [None, True, False])
def test_batch_parallel_arguments(num_parallel_calls: Any, deterministic: Any) -> None:
    tf_ds = tf.data.Dataset.range(11).batch(
        3, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    hr_ds = hr.Dataset.range(11).map(lambda x: x + 0).batch(
        3, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    tf_out = tf_list(tf_ds)
    hr_out = hr_list(hr_ds)
    assert sorted(map(repr, hr_out)) == sorted(map(repr, tf_out))
    assert hr_out == tf_list(tf.data.Dataset.range(11).batch(3))  # always in order
    with pytest.raises(hr.InvalidArgumentError, match="num_parallel_calls"):
        hr.Dataset.range(3).batch(2, num_parallel_calls=0)


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
