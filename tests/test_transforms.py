"""Transformations: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np
import pytest

import headrace as hr


def ints(ds: hr.Dataset) -> list[int]:
    return [int(v) for v in ds]


def streaming(values: list[int]) -> hr.Dataset:
    """A non-random-access source, so the streaming code paths run."""
    return hr.Dataset.from_generator(
        lambda: iter(values), output_signature=hr.TensorSpec((), np.int64)
    )


@pytest.fixture(params=["indexed", "streaming"])
def source(request):
    def make(n: int) -> hr.Dataset:
        return hr.Dataset.range(n) if request.param == "indexed" else streaming(list(range(n)))

    return make


def test_map_unpacks_tuples_like_tf_data(source) -> None:
    ds = hr.Dataset.zip(source(3), source(3)).map(lambda a, b: a * 10 + b)
    assert ints(ds) == [0, 11, 22]


@pytest.mark.parametrize("parallel", [2, hr.AUTOTUNE])
def test_parallel_map_keeps_order_by_default(source, parallel) -> None:
    assert ints(source(200).map(lambda x: x * 2, num_parallel_calls=parallel)) == [
        x * 2 for x in range(200)
    ]


def test_nondeterministic_parallel_map_yields_every_element_once(source) -> None:
    ds = source(300).map(lambda x: x + 1, num_parallel_calls=4, deterministic=False)
    assert sorted(ints(ds)) == list(range(1, 301))


def test_map_errors_reach_the_consumer(source) -> None:
    def explode(x):
        if x == 5:
            raise KeyError("boom at 5")
        return x

    for ds in (source(10).map(explode), source(10).map(explode, num_parallel_calls=2)):
        with pytest.raises(KeyError, match="boom at 5"):
            list(ds)


def test_filter(source) -> None:
    assert ints(source(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    with pytest.raises(hr.ElementSpecError, match="scalar bool"):
        list(source(3).filter(lambda x: np.array([True, False])))


def test_batch_and_drop_remainder(source) -> None:
    batches = [b.tolist() for b in source(7).batch(3)]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in source(7).batch(3, drop_remainder=True)] == [[0, 1, 2], [3, 4, 5]]
    assert source(7).batch(3, drop_remainder=True).element_spec.shape == (3,)
    assert source(7).batch(3).element_spec.shape == (None,)


def test_batch_shape_mismatch_names_element_and_shapes() -> None:
    ds = hr.Dataset.from_generator(
        lambda: iter([np.zeros(2), np.zeros(2), np.zeros(3)]),
        output_signature=hr.TensorSpec((None,), np.float64),
    ).batch(4)
    with pytest.raises(hr.ElementSpecError, match=r"element 2 has shape \(3,\).*element 0.*\(2,\)"):
        list(ds)


def test_padded_batch_pads_to_batch_max_and_fixed_shapes() -> None:
    ragged = hr.Dataset.from_generator(
        lambda: iter([[1], [2, 2], [3, 3, 3]]), output_signature=hr.TensorSpec((None,), np.int64)
    )
    assert [b.tolist() for b in ragged.padded_batch(2)] == [[[1, 0], [2, 2]], [[3, 3, 3]]]
    fixed = [b.tolist() for b in ragged.padded_batch(2, padded_shapes=[4], padding_values=-1)]
    assert fixed == [[[1, -1, -1, -1], [2, 2, -1, -1]], [[3, 3, 3, -1]]]
    with pytest.raises(hr.DataLossError, match="smaller size than the input element: element 2"):
        list(ragged.padded_batch(3, padded_shapes=[2]))


def test_padded_batch_of_bytes_uses_empty_bytes() -> None:
    ds = hr.Dataset.from_generator(
        lambda: iter([[b"a"], [b"b", b"c"]]), output_signature=hr.TensorSpec((None,), bytes)
    )
    (batch,) = list(ds.padded_batch(2))
    assert batch.tolist() == [[b"a", b""], [b"b", b"c"]]


def test_unbatch_and_rebatch(source) -> None:
    assert ints(source(7).batch(3).unbatch()) == list(range(7))
    sizes = [len(b) for b in source(8).batch(4).rebatch([3, 1])]
    assert sizes == [3, 1, 3, 1]
    assert [b.tolist() for b in source(8).batch(4).rebatch([3, 1])][:2] == [[0, 1, 2], [3]]
    with pytest.raises(hr.InvalidArgumentError, match="must be batched"):
        source(3).rebatch(2)


def test_rebatch_of_batches_padded_to_other_widths_names_the_batch_and_component() -> None:
    """tf.data cannot join them either (FailedPreconditionError); NumPy's concatenate
    message named neither the stage nor the component."""
    ds = hr.Dataset.range(6).map(lambda x: {"v": np.arange(int(x) % 4)}).padded_batch(2)
    with pytest.raises(hr.ElementSpecError, match=(
            r"rebatch: batch 0 would take rows of shape \(1,\) and \(3,\) for component "
            r"\['v'\].*padded_shapes")) as raised:
        list(ds.rebatch(3))
    assert "concatenation axis" not in str(raised.value)
    # padded to one fixed width, the same batches rebatch
    fixed = hr.Dataset.range(6).map(lambda x: {"v": np.arange(int(x) % 4)})
    rows = [b["v"].shape for b in fixed.padded_batch(2, padded_shapes={"v": [4]}).rebatch(3)]
    assert rows == [(3, 4), (3, 4)]


def test_shuffle_is_a_seeded_permutation_that_reshuffles_each_epoch(source) -> None:
    ds = source(50).shuffle(10, seed=3)
    first, second = ints(ds), ints(ds)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert first != second  # reshuffle_each_iteration=True
    fixed = source(50).shuffle(10, seed=3, reshuffle_each_iteration=False)
    assert ints(fixed) == ints(fixed)
    assert ints(source(50).shuffle(10, seed=3)) == first  # a new recipe: same first epoch


def test_shuffle_never_draws_beyond_its_window(source) -> None:
    order = ints(source(100).shuffle(5, seed=0))
    for position, value in enumerate(order):
        assert value <= position + 4


def test_shuffle_repeat_does_not_mix_epochs(source) -> None:
    order = ints(source(10).shuffle(10, seed=1).repeat(3))
    for epoch in range(3):
        assert sorted(order[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    assert order[:10] != order[10:20]


def test_repeat_take_skip_shard(source) -> None:
    assert ints(source(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert ints(source(3).repeat(0)) == []
    assert ints(source(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert ints(source(0).repeat()) == []
    assert ints(source(5).take(-1)) == list(range(5))
    assert ints(source(5).skip(-1)) == []
    assert ints(source(5).skip(2)) == [2, 3, 4]
    assert ints(source(10).shard(3, 1)) == [1, 4, 7]
    with pytest.raises(hr.InvalidArgumentError, match="between 0 and 2"):
        source(10).shard(3, 3)
    with pytest.raises(hr.InvalidArgumentError, match="greater than zero"):
        source(10).shard(0, 0)


def test_zip_concatenate_enumerate(source) -> None:
    zipped = list(hr.Dataset.zip({"a": source(3), "b": source(5)}))
    assert [(int(e["a"]), int(e["b"])) for e in zipped] == [(0, 0), (1, 1), (2, 2)]
    assert ints(source(2).concatenate(source(3))) == [0, 1, 0, 1, 2]
    assert [(int(i), int(v)) for i, v in source(3).enumerate(start=5)] == [(5, 0), (6, 1), (7, 2)]
    with pytest.raises(hr.ElementSpecError, match="dtypes differ"):
        source(2).concatenate(hr.Dataset.from_tensor_slices(np.zeros(2, np.float32)))


def test_cast_lowers_precision_of_chosen_components() -> None:
    data = {"x": np.ones((4, 3), np.float32), "y": np.arange(4)}
    (element,) = list(hr.Dataset.from_tensor_slices(data).cast({"x": np.float16}).batch(4))
    assert element["x"].dtype == np.float16 and element["y"].dtype == np.int64
    (pair,) = list(hr.Dataset.from_tensor_slices((data["x"], data["y"])).cast(np.float16).batch(4))
    assert pair[0].dtype == np.float16 and pair[1].dtype == np.int64


def test_prefetch_autotune(source) -> None:
    assert ints(source(100).prefetch(hr.AUTOTUNE)) == list(range(100))
    assert ints(source(100).prefetch(3)) == list(range(100))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: hr.Dataset.range(3).batch(0), "batch_size must be > 0"),
        (lambda: hr.Dataset.range(3).shuffle(0), "buffer_size must be > 0"),
        (lambda: hr.Dataset.range(3).prefetch(-3), "buffer_size must be >= 0"),
        (lambda: hr.Dataset.range(3).take(1.5), "count must be an int"),
        (lambda: hr.Dataset.range(3).repeat("2"), "repeat: count"),
        (lambda: hr.Dataset.range(3).map(lambda x: x, num_parallel_calls=0), "num_parallel_calls"),
        (lambda: hr.Options(memory_budget="lots"), "cannot parse byte size 'lots'"),
        (lambda: hr.Options(memory_budget=-5), "must be positive"),
    ],
)
def test_bad_arguments_fail_at_build_time(build, message) -> None:
    with pytest.raises(hr.InvalidArgumentError, match=message):
        build()


def test_cardinality() -> None:
    assert hr.Dataset.range(10).batch(3).cardinality() == 4
    assert hr.Dataset.range(10).repeat().cardinality() == hr.INFINITE
    assert hr.Dataset.range(10).filter(lambda x: True).cardinality() == hr.UNKNOWN
    assert hr.Dataset.range(10).shard(3, 0).cardinality() == 4
    assert len(hr.Dataset.range(10).skip(4)) == 6


def test_index_shuffle_kernel_c_and_python_agree() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from headrace._transforms.shuffle import _draw_python
    from headrace.io._native import native_module

    native = native_module()
    assert native is not None, "the C extension must be built (pip install -e .)"

    @settings(max_examples=200, deadline=None)
    @given(
        capacity=st.integers(1, 9),
        filled=st.integers(0, 9),
        incoming=st.lists(st.integers(0, 10**6), max_size=12),
        draws=st.lists(st.integers(0, 2**32 - 1), min_size=12, max_size=12),
        count=st.integers(0, 12),
    )
    def check(capacity, filled, incoming, draws, count) -> None:
        filled = min(filled, capacity)
        results = []
        for kernel in (native.shuffle_draw, _draw_python):
            ring = np.arange(100, 100 + capacity, dtype=np.int64)
            out = np.zeros(count, np.int64)
            meta = kernel(ring, capacity, 0, filled, np.array(incoming, np.int64),
                          np.array(draws, np.uint64), out)
            results.append((meta, out.tolist(), ring.tolist()))
        assert results[0] == results[1]

    check()


def test_full_shuffle_of_an_array_source_is_fast_and_exact() -> None:
    import time

    data = np.arange(200_000)
    ds = hr.Dataset.from_tensor_slices(data).shuffle(200_000, seed=1).batch(1000)
    started = time.perf_counter()
    seen = np.concatenate(list(ds))
    elapsed = time.perf_counter() - started
    assert sorted(seen.tolist()) == data.tolist()
    assert elapsed < 5  # ~0.05 s here; the per-row Python ring took ~0.5 s


def test_asking_for_a_spec_does_not_change_the_next_shuffle_order() -> None:
    shuffled = hr.Dataset.range(20).shuffle(20, seed=4)
    expected = ints(hr.Dataset.range(20).shuffle(20, seed=4))
    _ = shuffled.map(lambda x: x + 1).element_spec  # reads one element of `shuffled`
    assert ints(shuffled) == expected


def test_padded_batch_keeps_bytes_exact_with_trailing_nuls() -> None:
    """G5: bytes scalars were stored as 0-d fixed-width arrays, which drop trailing NULs."""
    values = [b"a\x00", b"bb", b"\x00"]
    ds = hr.Dataset.from_generator(
        lambda: iter(values), output_signature=hr.TensorSpec((), bytes)
    ).padded_batch(3)
    (batch,) = list(ds)
    assert batch.dtype == object and batch.tolist() == values
    assert all(type(item) is bytes for item in batch)
    rows = hr.Dataset.from_generator(
        lambda: iter([[b"a\x00"], [b"bb", b"\x00"]]),
        output_signature=hr.TensorSpec((None,), bytes),
    ).padded_batch(2)
    assert next(iter(rows)).tolist() == [[b"a\x00", b""], [b"bb", b"\x00"]]
