"""cache() and save/load proven against TensorFlow where their semantics overlap: the
elements and their order for random compositions with take/skip/repeat/batch (partial
caches included), what a partial file cache leaves on disk, save/load round trips."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("cache")),
        st.tuples(st.just("take"), st.integers(-1, 12)),
        st.tuples(st.just("skip"), st.integers(0, 5)),
        st.tuples(st.just("repeat"), st.integers(1, 3)),
        st.tuples(st.just("batch"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=5,
).filter(
    # one batch at most: a batch of ragged batches is an error in both libraries
    lambda ops: any(op[0] == "cache" for op in ops) and sum(op[0] == "batch" for op in ops) <= 1
)


def build(ds: Any, ops: list[tuple[Any, ...]]) -> Any:
    for op in ops:
        if op[0] == "cache":
            ds = ds.cache()
        elif op[0] == "batch":
            ds = ds.batch(op[1])
        else:
            ds = getattr(ds, op[0])(op[1])
    return ds


def values(elements: Any) -> list[Any]:
    return [np.asarray(e).tolist() for e in elements]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10), OPS)
def test_memory_cache_gives_tf_datas_elements_in_tf_datas_order(
    n: int, ops: list[tuple[Any, ...]]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = values(build(hr.Dataset.range(n), ops))
    theirs = values(build(tf.data.Dataset.range(n), ops).as_numpy_iterator())
    assert ours == theirs, ops


def test_partial_file_cache_leaves_no_files_in_either_library(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = values(hr.Dataset.range(10).cache(str(ours / "c")).take(2))
    want = values(tf.data.Dataset.range(10).cache(str(theirs / "c")).take(2).as_numpy_iterator())
    assert got == want == [0, 1]
    assert os.listdir(ours) == [] and os.listdir(theirs) == []


def test_complete_file_cache_is_reread_in_the_same_order_in_both(tmp_path: Path) -> None:
    def pipeline(lib: Any, prefix: str) -> Any:
        return lib.Dataset.range(12).map(lambda x: x * 7).cache(prefix).repeat(2)

    got = values(pipeline(hr, str(tmp_path / "ours")))
    want = values(pipeline(tf.data, str(tmp_path / "theirs")).as_numpy_iterator())
    assert got == want
    assert values(pipeline(hr, str(tmp_path / "ours"))) == got  # read from the files


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 30), st.integers(1, 3))
def test_save_load_round_trips_like_tf_datas(
    tmp_path_factory: pytest.TempPathFactory, n: int, width: int
) -> None:
    data = {"x": np.arange(n * width, dtype=np.float32).reshape(n, width), "y": np.arange(n)}
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    hr.Dataset.from_tensor_slices(data).save(str(ours))
    tf.data.Dataset.from_tensor_slices(data).save(str(theirs), shard_func=lambda e: np.int64(0))
    got = [(e["x"].tolist(), int(e["y"])) for e in hr.Dataset.load(str(ours))]
    want = [
        (e["x"].tolist(), int(e["y"]))
        for e in tf.data.Dataset.load(str(theirs)).as_numpy_iterator()
    ]
    assert got == want == [(row.tolist(), k) for k, row in enumerate(data["x"])]


# --------------------------------------------------------------------------- kept caches

ITERATORS = st.lists(
    st.one_of(st.just("full"), st.just("both"), st.integers(0, 8)), min_size=1, max_size=5
)


def _run_iterators(
    ds: Any, operations: list[Any], to_int: Any, reads: list[int]
) -> tuple[list[list[int]], list[bool]]:
    """Each operation with new iterators of ``ds``: a full pass, two iterators in
    lockstep, or the first k elements of one that is then dropped. Returns the elements
    and, per operation, whether it read the source (``reads[0]`` counts its elements)."""
    out: list[list[int]] = []
    touched: list[bool] = []
    for operation in operations:
        before = reads[0]
        if operation == "full":
            out.append([to_int(x) for x in iter(ds)])
        elif operation == "both":
            pairs = list(zip(iter(ds), iter(ds), strict=True))
            out.append([to_int(a) for a, _ in pairs] + [to_int(b) for _, b in pairs])
        else:
            iterator = iter(ds)
            out.append([to_int(next(iterator)) for _ in range(min(operation, 6))])
            del iterator
        touched.append(reads[0] > before)
    return out, touched


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=ITERATORS)
def test_the_memory_cache_outlives_its_iterator_as_in_tf_data(operations: list[Any]) -> None:
    """Separate iter() calls over one cached dataset (full, partial, two at once): the
    same elements as tf.data, and the source read by exactly the same operations."""

    def counting(reads: list[int]) -> Any:
        def gen() -> Any:
            for i in range(6):
                reads[0] += 1
                yield i

        return gen

    ours_reads, theirs_reads = [0], [0]
    ours = hr.Dataset.from_generator(
        counting(ours_reads), output_signature=hr.TensorSpec((), np.int64)
    ).cache()
    theirs = tf.data.Dataset.from_generator(
        counting(theirs_reads), output_signature=tf.TensorSpec((), tf.int64)
    ).cache()
    # tf.data's hidden prefetch (inject_prefetch) may read past a partial iterator's
    # last element to the end, completing the cache by timing: compared without it
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    theirs = theirs.with_options(options)
    operations = [*operations, "full", "full"]  # the last one reads the cache in both
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run_iterators(ours, operations, int, ours_reads)
    expected = _run_iterators(theirs, operations, lambda x: int(x.numpy()), theirs_reads)
    assert got == expected
    assert got[1][-1] is False
