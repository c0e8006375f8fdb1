"""The last corners of tf.data's surface, each run under TensorFlow and headrace.

None components through unbatch/rebatch, what ``global_shuffle`` accepts and
refuses, ``map(deterministic=False)``, generators released when ``take`` ends,
and rebatch's empty splits — compared element for element with TensorFlow 2.21.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tf_compare import both, py

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

pytestmark = pytest.mark.tf

SWEEP = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
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


# -- 2. global_shuffle: what tf.data 2.21 accepts in its input, and what it refuses ----------
def tf_global_shuffle(ds: tf.data.Dataset, seed: int = 1) -> tf.data.Dataset:
    """tf.data 2.21's global_shuffle (not yet a Dataset method there).

    Its map-and-batch fusion turns ``map(f).batch(n)`` into a stage without random
    access — an optimizer artifact, not a semantic rule — so it is off here; headrace
    reads through ``map(f).batch(n, drop_remainder=True)`` (README: differences).
    """
    from tensorflow.python.data.experimental.ops import global_shuffle_op

    options = tf.data.Options()
    options.experimental_optimization.map_and_batch_fusion = False
    return global_shuffle_op._global_shuffle(ds.with_options(options), seed=seed)


def shuffled(D: Any, ds: Any) -> Any:
    return tf_global_shuffle(ds) if D is tf.data.Dataset else ds.global_shuffle(seed=1)


def _map_double(D: Any) -> Any:
    return D.range(10).map(lambda x: x * 2, num_parallel_calls=2)


ACCEPTED = {  # what tf.data 2.21's global_shuffle reads through (checked there too)
    "range": lambda D: D.range(2, 20, 3),
    "from_tensor_slices": lambda D: D.from_tensor_slices((np.arange(6), np.arange(6.0))),
    "from_tensors": lambda D: D.from_tensors(np.arange(3)),
    "prefetch": lambda D: D.range(10).prefetch(2),
    "prefetch AUTOTUNE": lambda D: D.range(10).prefetch(-1),
    "shard": lambda D: D.range(10).shard(3, 1),
    "take": lambda D: D.range(10).take(4),
    "take(-1)": lambda D: D.range(10).take(-1),
    "take past the end": lambda D: D.range(10).take(40),
    "skip": lambda D: D.range(10).skip(4),
    "repeat(3)": lambda D: D.range(5).repeat(3),
    "map": lambda D: D.range(10).map(lambda x: x + 1),
    "parallel map": _map_double,
    "batch(drop_remainder=True)": lambda D: D.range(10).batch(3, drop_remainder=True),
    "zip": lambda D: D.zip((D.range(10), D.range(10, 25))),
    "concatenate": lambda D: D.range(3).concatenate(D.range(10, 13)),
    "cache": lambda D: D.range(10).cache(),
    "prefetch shard take repeat": lambda D: D.range(20).prefetch(2).shard(2, 0).take(6).repeat(2),
    "zip of take and shard": lambda D: D.zip((D.range(8).take(5), D.range(20).shard(4, 3))),
    "global_shuffle inside": lambda D: shuffled(D, D.range(10)).map(lambda x: x + 1),
}

REFUSED = {  # (pipeline, the stage headrace names); tf.data refuses each as well
    "infinite repeat": (lambda D: D.range(5).repeat(), "repeat"),
    "batch keeping a partial batch": (lambda D: D.range(10).batch(3), "batch"),
    "filter": (lambda D: D.range(10).filter(lambda x: x % 2 == 0), "filter"),
    "shuffle": (lambda D: D.range(10).shuffle(3).map(lambda x: x), "shuffle"),
    "interleave": (lambda D: D.range(3).interleave(lambda x: D.range(x), cycle_length=2), "interleave"),
    "unbatch": (lambda D: D.range(10).batch(2).unbatch().take(3), "unbatch"),
    "padded_batch": (lambda D: D.range(10).padded_batch(3), "padded_batch"),
    "rebatch": (lambda D: D.range(10).batch(4).rebatch(2), "rebatch"),
    "take_while": (lambda D: D.range(10).take_while(lambda x: x < 5), "take_while"),
    "ignore_errors": (lambda D: D.range(10).ignore_errors(), "ignore_errors"),
}


def _sorted(elements: list[Any]) -> list[Any]:
    return sorted(elements, key=repr)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_global_shuffle_accepts_what_tf_accepts(case: str) -> None:
    """The same elements as tf.data's global_shuffle, each once, and the same cardinality
    (the permutations themselves are each library's own)."""
    expected, got = both(lambda D: shuffled(D, ACCEPTED[case](D)))
    assert _sorted(got) == _sorted(expected)
    tf_card = int(tf_global_shuffle(ACCEPTED[case](tf.data.Dataset)).cardinality())
    assert ACCEPTED[case](hr.Dataset).global_shuffle(seed=1).cardinality() == tf_card


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_global_shuffle_refuses_what_tf_refuses(case: str) -> None:
    build, stage = REFUSED[case]
    with pytest.raises(tf.errors.OpError, match=r"random access|non-empty finite cardinality"):
        list(tf_global_shuffle(build(tf.data.Dataset)))
    with pytest.raises(hr.InvalidArgumentError, match=rf"; {stage} does not support random access"):
        build(hr.Dataset).global_shuffle(seed=1)


def test_global_shuffle_refuses_an_empty_input_like_tf() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-empty"):
        list(tf_global_shuffle(tf.data.Dataset.range(0)))
    with pytest.raises(hr.InvalidArgumentError, match="non-empty input"):
        hr.Dataset.range(10).take(0).global_shuffle(seed=1)


def test_global_shuffle_through_stages_is_a_full_permutation_each_epoch() -> None:
    ds = hr.Dataset.range(200).prefetch(4).shard(2, 1).take(80).repeat(2)
    shuffled_ds = ds.global_shuffle(seed=3).repeat(2)
    first, second = (
        [int(x) for x in epoch]
        for epoch in (list(shuffled_ds.take(160)), list(shuffled_ds.skip(160)))
    )
    expected = sorted([int(x) for x in ds] * 1)
    assert sorted(first) == expected and sorted(second) == expected
    assert first != [int(x) for x in ds] and first != second  # shuffled, and again


@pytest.mark.parametrize("case", ["prefetch shard take repeat", "batch(drop_remainder=True)",
                                  "parallel map", "zip of take and shard"])
def test_global_shuffle_through_stages_checkpoints(case: str) -> None:
    assert_checkpoint_roundtrip(ACCEPTED[case](hr.Dataset).global_shuffle(seed=5))


STAGES = st.sampled_from(["take", "skip", "shard", "repeat", "prefetch", "map", "batch"])


@given(size=st.integers(1, 40), ops=st.lists(st.tuples(STAGES, st.integers(1, 5)), max_size=4))
@SWEEP
def test_global_shuffle_random_chains_match_tf(size: int, ops: list[tuple[str, int]]) -> None:
    """Random chains of the addressable stages: the same multiset as tf.data, or both refuse."""

    def build(D: Any) -> Any:
        ds = D.range(size)
        for op, n in ops:
            if op == "shard":
                ds = ds.shard(n, n - 1)
            elif op == "prefetch":
                ds = ds.prefetch(n)
            elif op == "map":
                ds = ds.map(lambda x: x * 3)
            elif op == "batch":
                ds = ds.batch(n, drop_remainder=True).map(lambda x: x[0])
            else:
                ds = getattr(ds, op)(n)
        return ds

    expected_error = None
    try:
        expected = [py(x) for x in tf_global_shuffle(build(tf.data.Dataset))]
    except tf.errors.InvalidArgumentError as error:
        expected_error = error
    if expected_error is not None:  # only an empty input is refused here
        assert "non-empty" in str(expected_error)
        with pytest.raises(hr.InvalidArgumentError, match="non-empty"):
            build(hr.Dataset).global_shuffle(seed=1)
        return
    got = [py(x) for x in build(hr.Dataset).global_shuffle(seed=1)]
    assert _sorted(got) == _sorted(expected)


# -- 3. map(deterministic=False) reorders around a slow element ------------------------------
def _slow_at(slow: int, seconds: float = 0.4) -> Any:
    def fn(x: Any) -> Any:
        if int(x) == slow:
            time.sleep(seconds)
        return x

    return fn


def _order(D: Any, n: int, slow: int) -> list[int]:
    """The order an unordered map of ``n`` elements hands out, where element ``slow``
    takes 0.4 s and also waits until more than half of them came out (at most 30 s: a
    map that waits for it then shows it in its place). On a loaded machine the quick
    elements' pace must not decide the test, nor may the slow call end before a map
    that runs quick elements in chunks has had time to hand its neighbours on."""
    passed = threading.Event()

    def fn(x: Any) -> Any:
        if int(x) == slow:
            started = time.monotonic()
            passed.wait(30)
            time.sleep(max(0.0, 0.4 - (time.monotonic() - started)))
        return x

    if D is tf.data.Dataset:
        ds = D.range(n).map(
            lambda x: tf.py_function(fn, [x], tf.int64), num_parallel_calls=4,
            deterministic=False,
        )
    else:
        ds = D.range(n).map(fn, num_parallel_calls=4, deterministic=False)
    order: list[int] = []
    for x in ds:
        order.append(int(x))
        if len(order) > n // 2 + 1:
            passed.set()
    passed.set()
    return order


@pytest.mark.parametrize("n, slow", [(60, 5), (2000, 500)])
def test_map_out_of_order_lets_later_elements_pass_a_slow_one_like_tf(n: int, slow: int) -> None:
    """tf.data: the slow element comes out last, the next one long before it. The quick
    elements here are so quick that headrace gives calls chunks of them: the chunk
    holding the slow element gives up the rest, so its neighbours pass too."""
    for D in (tf.data.Dataset, hr.Dataset):
        order = _order(D, n, slow)
        assert sorted(order) == list(range(n))
        assert order.index(slow) > n // 2, D  # it came out long after its place
        assert order.index(slow + 1) < order.index(slow), D


@pytest.mark.parametrize("n, slow", [(60, 5), (600, 300)])
def test_map_keeps_order_by_default_and_when_asked(n: int, slow: int) -> None:
    for deterministic in (True, None):
        ds = hr.Dataset.range(n).map(_slow_at(slow, 0.1), num_parallel_calls=4,
                                     deterministic=deterministic)
        assert [int(x) for x in ds] == list(range(n))
    options = hr.Options()
    options.deterministic = False  # the pipeline option, as tf.data's
    ds = hr.Dataset.range(n).map(_slow_at(slow, 0.3), num_parallel_calls=4)
    order = [int(x) for x in ds.with_options(options)]
    assert order.index(slow) > order.index(slow + 1)


def test_map_out_of_order_books_what_it_holds_while_splitting() -> None:
    """The split chunk's elements are booked again for their new call (never less):
    the stage stays within its share plus one element, and every byte comes back."""
    payload = np.ones(20_000)

    def fn(x: Any) -> Any:
        if int(x) == 50:
            time.sleep(0.2)
        return payload * float(x)

    ds = hr.Dataset.range(400).map(fn, num_parallel_calls=4, deterministic=False)
    iterator = iter(ds.with_options(hr.Options(memory_budget="8MiB")))
    seen = sorted(int(x[1]) for x in iterator)
    assert seen == list(range(400))
    budget = iterator.context.budget
    assert budget.used == 0
    for stage in iterator.stats().stages:  # a map may overdraw by the output it just made
        assert stage.peak <= stage.limit + stage.max_element


@given(slow=st.sets(st.integers(0, 199), max_size=4), errors=st.sets(st.integers(0, 199), max_size=3))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_map_out_of_order_loses_nothing(slow: set[int], errors: set[int]) -> None:
    """Random slow elements and failing ones: every output once, every error once."""

    def fn(x: Any) -> Any:
        if int(x) in slow:
            time.sleep(0.02)
        if int(x) in errors:
            raise ValueError(f"bad {int(x)}")
        return x

    it = iter(hr.Dataset.range(200).map(fn, num_parallel_calls=3, deterministic=False))
    got, failed = [], []
    while True:
        try:
            got.append(int(next(it)))
        except StopIteration:
            break
        except ValueError as error:
            failed.append(int(str(error).split()[1]))
    assert sorted(got) == sorted(set(range(200)) - errors)
    assert sorted(failed) == sorted(errors)


# -- 4. a generator is released when take ends -----------------------------------------------
def _logged_generator(log: list[str]) -> Any:
    def gen() -> Any:
        try:
            yield from range(10)
        finally:
            log.append("closed")

    return gen


@pytest.mark.parametrize("tail", ["none", "map", "prefetch", "parallel map", "prefetch before"])
def test_take_releases_its_generator_when_it_ends_like_tf(tail: str) -> None:
    for library in (tf, hr):
        log: list[str] = []
        D = library.data.Dataset if library is tf else hr.Dataset
        spec = library.TensorSpec((), np.int64)
        ds = D.from_generator(_logged_generator(log), output_signature=spec)
        ds = ds.prefetch(2).take(3) if tail == "prefetch before" else ds.take(3)
        if tail == "map":
            ds = ds.map(lambda x: x)
        elif tail == "prefetch":
            ds = ds.prefetch(1)
        elif tail == "parallel map":
            ds = ds.map(lambda x: x, num_parallel_calls=2)
        iterator = iter(ds)
        assert [int(x) for x in iterator] == [0, 1, 2]
        assert log == ["closed"], library.__name__  # the iterator itself is still alive
        del iterator


def test_take_release_keeps_state_and_each_epoch_releases_its_own() -> None:
    log: list[str] = []
    spec = hr.TensorSpec((), np.int64)
    ds = hr.Dataset.from_generator(_logged_generator(log), output_signature=spec).take(3)
    iterator = iter(ds)
    start = iterator.get_state()
    assert [int(x) for x in iterator] == [0, 1, 2] and log == ["closed"]
    assert iterator.get_state()["state"] == {"inner": {"produced": 3}, "consumed": 3}
    iterator.set_state(start)  # the closed input reopens
    assert [int(x) for x in iterator] == [0, 1, 2] and log == ["closed", "closed"]
    log.clear()
    epochs = [int(x) for x in ds.repeat(3)]
    assert epochs == [0, 1, 2] * 3 and log == ["closed"] * 3
    assert_checkpoint_roundtrip(ds.repeat(2))
