"""``Dataset.to_tf()``: a real tf.data.Dataset with the right signature, values and cardinality."""

from __future__ import annotations

import sys
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
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


def test_str_components_arrive_as_utf8() -> None:
    words = np.array(["é", "", "naïve", "x\x00"], object)
    got = [v.numpy() for v in hr.Dataset.from_tensor_slices(words).to_tf()]
    assert got == [w.encode() for w in words]


def test_two_passes_at_once_are_independent() -> None:
    out = hr.Dataset.range(5).to_tf()
    first, second = iter(out), iter(out)
    pairs = [(int(next(first)), int(next(second))) for _ in range(5)]
    assert pairs == [(v, v) for v in range(5)]


def test_an_error_in_the_pipeline_reaches_tensorflow_with_its_message() -> None:
    def bad(v: np.ndarray) -> np.ndarray:
        if int(v) == 2:
            raise ValueError("row two is bad")
        return v

    out = hr.Dataset.range(4).map(bad).to_tf()
    with pytest.raises(tf.errors.OpError, match="row two is bad"):
        list(out)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # checked once, at the end
@given(stops=st.lists(st.integers(0, 12), min_size=1, max_size=4), batch=st.integers(1, 5))
def test_abandoned_and_finished_passes_give_back_their_budget(
    stops: list[int], batch: int, no_thread_leak: None
) -> None:
    # TensorFlow drops an iterator mid-pass (a `break`, steps_per_epoch) or runs it out:
    # either way the headrace iterator closes, so its threads stop and its bytes return.
    import gc

    from headrace.core.run import default_budget, join_abandoned

    gc.collect()  # earlier tests' abandoned iterators close (on threads of their own)
    assert join_abandoned()  # before the baseline is read, not after
    before = default_budget().used
    ds = hr.Dataset.range(40).map(lambda v: np.full(64, v)).prefetch(4).batch(batch).prefetch(2)
    out = ds.to_tf()
    for stop in stops:
        iterator = iter(out)
        seen = [next(iterator).numpy() for _ in range(min(stop, ds.cardinality()))]
        assert [int(b[0, 0]) for b in seen] == [i * batch for i in range(len(seen))]
        del iterator
    gc.collect()
    assert join_abandoned()
    assert default_budget().used == before


def test_arrays_someone_else_holds_reach_tensorflow_as_copies(tmp_path: pytest.TempPathFactory) -> None:
    # TensorFlow owns the buffer of an array it is handed and may write an op's result
    # into it: a view of a read-only memmap then crashed fit with SIGSEGV (seen under a
    # MirroredStrategy), and a view of the user's array or a cached batch would be
    # overwritten. Writing into what TensorFlow got stands in for such an op.
    from headrace.adapters.tf import _Feed

    source = np.arange(512 * 8, dtype=np.float32).reshape(512, 8)
    np.save(tmp_path / "x.npy", source)  # type: ignore[operator]
    cases = {
        "view of the user's array": hr.Dataset.from_tensor_slices(source).batch(64),
        "view of a memmap": hr.Dataset.from_npy(tmp_path / "x.npy").batch(64),  # type: ignore[operator]
        "cached batch": hr.Dataset.from_tensor_slices(source).map(lambda r: r + 0).batch(64).cache(),
    }
    for name, dataset in cases.items():
        feed = _Feed(dataset)
        for _ in range(2):  # the cache's second pass reads what the first one stored
            key = int(feed.start())
            for step in range(8):
                batch = feed.pull(key)[0]
                np.testing.assert_array_equal(batch, source[step * 64 : (step + 1) * 64], name)
                assert batch.flags.writeable, name
                batch[...] = -1  # what a forwarded TensorFlow op may do
            feed.finish(key)
        np.testing.assert_array_equal(source, np.arange(512 * 8).reshape(512, 8), name)
    # A fresh batch (shuffled: gathered into a new array) crosses without a copy: what
    # the feed hands on is the very array the map returned. Weak references, not
    # addresses: a freed batch's address is reused by the next one, and the map's
    # call on the first element for the element spec must not count as a batch.
    made: list[weakref.ref[np.ndarray]] = []
    fresh = hr.Dataset.from_tensor_slices(source).shuffle(512, seed=0).batch(64).map(
        lambda b: made.append(weakref.ref(b)) or b)
    feed = _Feed(fresh)
    made.clear()  # the element spec's call
    key = int(feed.start())
    # Under a tracer (a debugger, coverage, a test runner's) frames keep snapshots of
    # their locals, so every array looks held and is copied: safe, only slower.
    previous = sys.gettrace()
    sys.settrace(None)
    try:
        handed = [feed.pull(key)[0] for _ in range(8)]
    finally:
        sys.settrace(previous)
    feed.finish(key)
    # (the pipeline may have made the next batch already)
    assert [array is ref() for array, ref in zip(handed, made[:8], strict=True)] == [True] * 8
