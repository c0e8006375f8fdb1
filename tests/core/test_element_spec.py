"""element_spec never reads data by surprise; when it must, it reads under the user's options."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace as hr


class Counting:
    """A generator source and a map function that count how often they run."""

    def __init__(self, n: int = 6) -> None:
        self.n = n
        self.generator_runs = 0
        self.calls = 0

    def source(self) -> hr.Dataset:
        def generate() -> Any:
            self.generator_runs += 1
            yield from (np.arange(3, dtype=np.float32) + i for i in range(self.n))

        return hr.Dataset.from_generator(
            generate, output_signature=hr.TensorSpec((3,), np.float32)
        )

    def fn(self, x: Any) -> Any:
        self.calls += 1
        return x * 2


# Every way a stage may want its input's spec while being built.
STAGES: dict[str, Callable[[hr.Dataset], hr.Dataset]] = {
    "batch": lambda ds: ds.batch(2),
    "padded_batch": lambda ds: ds.padded_batch(2),
    "padded_batch_shapes": lambda ds: ds.padded_batch(2, padded_shapes=[4]),
    "unbatch": lambda ds: ds.unbatch(),
    "rebatch": lambda ds: ds.batch(2).rebatch(3),
    "concatenate": lambda ds: ds.concatenate(ds),
    "zip": lambda ds: hr.Dataset.zip(ds, ds),
    "enumerate": lambda ds: ds.enumerate(),
    "shuffle": lambda ds: ds.shuffle(4, seed=1),
    "prefetch": lambda ds: ds.prefetch(2),
    "take": lambda ds: ds.take(3),
    "filter": lambda ds: ds.filter(lambda x: True),
    "interleave": lambda ds: ds.interleave(
        lambda x: hr.Dataset.from_tensors(x), cycle_length=2
    ),
    "cast": lambda ds: ds.cast(np.float16),
}


@given(st.lists(st.sampled_from(sorted(STAGES)), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_building_a_pipeline_and_its_repr_run_no_user_code(stages: list[str]) -> None:
    counting = Counting()
    ds = counting.source().map(counting.fn)
    for stage in stages:
        ds = STAGES[stage](ds)
    text = repr(ds)
    assert (counting.generator_runs, counting.calls) == (0, 0), stages
    assert "element_spec=<known after reading an element>" in text


def test_repr_shows_a_spec_known_without_data() -> None:
    ds = hr.Dataset.range(4).batch(2, drop_remainder=True)
    assert repr(ds) == (
        "<headrace.Dataset element_spec=TensorSpec(shape=(2,), dtype=int64)>"
    )


def test_element_spec_reads_one_element_when_it_must() -> None:
    counting = Counting()
    ds = counting.source().map(counting.fn).padded_batch(2)
    spec = ds.element_spec
    # x * 2 over (3,): tf.data's shape inference knows (3,), and so does the sample
    assert spec == hr.TensorSpec((None, 3), np.float32)
    assert counting.generator_runs == 1
    assert counting.calls == 1  # one element, one call
    assert ds.element_spec == spec and counting.calls == 1  # and only once


def test_output_signature_states_the_spec_so_nothing_is_sampled() -> None:
    counting = Counting()
    signature = hr.TensorSpec((3,), np.float32)
    ds = counting.source().map(counting.fn, output_signature=signature)
    assert ds.element_spec == signature
    assert ds.padded_batch(2, padded_shapes=[5]).element_spec == hr.TensorSpec(
        (None, 5), np.float32
    )
    assert ds.unbatch().element_spec == hr.TensorSpec((), np.float32)
    assert (counting.generator_runs, counting.calls) == (0, 0)
    assert [b.shape for b in ds.padded_batch(4, padded_shapes=[5])] == [(4, 5), (2, 5)]
    assert counting.calls == 6
    other = counting.source().map(counting.fn, output_signature=hr.TensorSpec((3,), np.float64))
    assert other.fingerprint() != ds.fingerprint()


def test_output_signature_must_be_tensor_specs() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="output_signature leaves must be TensorSpec"):
        hr.Dataset.range(3).map(lambda x: x, output_signature=(np.int64,))


@pytest.mark.parametrize(
    "build, hint",
    [
        (lambda ds: ds.map(lambda x: x), "output_signature"),
        (lambda ds: ds.map(lambda x: x).batch(2), "output_signature"),
        (lambda ds: ds.interleave(lambda x: hr.Dataset.from_tensors(x), cycle_length=1), ""),
    ],
)
def test_an_empty_input_gives_a_clear_error_not_stop_iteration(
    build: Callable[[hr.Dataset], hr.Dataset], hint: str
) -> None:
    empty = hr.Dataset.from_generator(lambda: iter([]), output_signature=hr.TensorSpec((), np.int64))
    ds = build(empty)
    with pytest.raises(hr.ElementSpecError, match=f"the input is empty.*{hint}"):
        _ = ds.element_spec
    assert "known after reading" in repr(ds)
    assert list(ds) == []  # iterating an empty pipeline needs no spec


def test_padded_batch_over_an_empty_unknown_spec_input_yields_nothing() -> None:
    empty = hr.Dataset.from_generator(lambda: iter([]), output_signature=hr.TensorSpec((), np.int64))
    ds = empty.map(lambda x: x).padded_batch(2)  # builds: nothing is read
    assert list(ds) == []  # as tf.data: an empty stream is no error
    with pytest.raises(hr.EmptyInputError, match=r"map.*the input is empty"):
        _ = ds.element_spec  # only asking for a spec no element can show fails


def test_padded_batch_lays_out_from_its_first_element_when_the_probe_saw_none() -> None:
    runs: list[int] = []

    def generate() -> Any:  # empty when the spec is sampled, rows when iterated
        runs.append(1)
        if len(runs) > 1:
            yield from (np.arange(n, dtype=np.int64) for n in (2, 3, 1))

    source = hr.Dataset.from_generator(
        generate, output_signature=hr.TensorSpec((None,), np.int64)
    )
    batches = [b.tolist() for b in source.map(lambda x: x + 1).padded_batch(2)]
    assert batches == [[[1, 2, 0], [1, 2, 3]], [[1]]]
    assert len(runs) == 2  # one probe, one run


# -- empty inputs anywhere: tf.data is the oracle ---------------------------------------
#
# Each step is built twice, in headrace and in tf.data, from the same description. The
# maps have no output_signature, so headrace learns their spec from a first element;
# the filters, ranges and interleaves make that element missing at random places.


def _hr_fill(x: Any) -> Any:
    return np.full(int(x) % 3, x, dtype=np.int64)


def _tf_step(tf: Any, step: tuple[Any, ...]) -> Callable[[Any], Any]:
    kind, a, b = step
    if kind == "double":
        return lambda ds: ds.map(lambda x: x * 2)
    if kind == "filter":  # keep x % a == b; a = 0 drops everything
        return lambda ds: ds.filter(lambda x: (x % a == b) if a else tf.constant(False))
    if kind == "interleave":  # range(x % a) doubled, so x % a == 0 is an empty inner one
        return lambda ds: ds.interleave(
            lambda x: tf.data.Dataset.range(x % a).map(lambda y: y * 2), cycle_length=b
        )
    if kind == "take":
        return lambda ds: ds.take(a)
    if kind == "fill":
        return lambda ds: ds.map(lambda x: tf.fill([x % 3], x))
    if kind == "padded_batch":
        return lambda ds: ds.padded_batch(a, drop_remainder=b)
    if kind == "batch":
        return lambda ds: ds.batch(a, drop_remainder=b)
    raise AssertionError(kind)


def _hr_step(step: tuple[Any, ...]) -> Callable[[hr.Dataset], hr.Dataset]:
    kind, a, b = step
    if kind == "double":
        return lambda ds: ds.map(lambda x: x * 2)
    if kind == "filter":
        return lambda ds: ds.filter(lambda x: bool(x % a == b) if a else False)
    if kind == "interleave":
        return lambda ds: ds.interleave(
            lambda x: hr.Dataset.range(int(x) % a).map(lambda y: y * 2), cycle_length=b
        )
    if kind == "take":
        return lambda ds: ds.take(a)
    if kind == "fill":
        return lambda ds: ds.map(_hr_fill)
    if kind == "padded_batch":
        return lambda ds: ds.padded_batch(a, drop_remainder=b)
    if kind == "batch":
        return lambda ds: ds.batch(a, drop_remainder=b)
    raise AssertionError(kind)


_scalar_steps = st.one_of(
    st.tuples(st.just("double"), st.none(), st.none()),
    st.tuples(st.just("filter"), st.integers(0, 3), st.integers(0, 1)).filter(
        lambda s: s[1] == 0 or s[2] < s[1]
    ),
    st.tuples(st.just("interleave"), st.integers(1, 4), st.integers(1, 3)),
    st.tuples(st.just("take"), st.integers(0, 3), st.none()),
)
_last_steps = st.one_of(
    st.tuples(st.just("fill"), st.none(), st.none()).map(
        lambda fill: [fill, ("padded_batch", 2, False)]
    ),
    st.tuples(st.sampled_from(["padded_batch", "batch"]), st.integers(1, 3), st.booleans()).map(
        lambda last: [("double", None, None), last]
    ),
    st.just([("double", None, None)]),
)


@pytest.mark.tf
@given(
    n=st.integers(0, 7),
    steps=st.lists(_scalar_steps, max_size=3),
    last=_last_steps,
)
@settings(max_examples=40, deadline=None)
def test_empty_inputs_anywhere_yield_what_tf_data_yields(
    n: int, steps: list[tuple[Any, ...]], last: list[tuple[Any, ...]]
) -> None:
    tf = pytest.importorskip("tensorflow")
    ours, theirs = hr.Dataset.range(n), tf.data.Dataset.range(n)
    for step in [*steps, *last]:
        ours, theirs = _hr_step(step)(ours), _tf_step(tf, step)(theirs)
    expected = [np.asarray(e) for e in theirs.as_numpy_iterator()]
    got = [np.asarray(e) for e in ours]
    assert [(e.shape, e.tolist()) for e in got] == [(e.shape, e.tolist()) for e in expected]


def test_an_interleave_looks_past_empty_inner_datasets_for_its_spec() -> None:
    ds = hr.Dataset.range(5).interleave(
        lambda x: hr.Dataset.range(int(x) % 3).map(lambda y: np.full(int(y) + 1, y)),
        cycle_length=2,
    )
    assert ds.element_spec == hr.TensorSpec((None,), np.int64)
    empty = hr.Dataset.range(3).interleave(
        lambda x: hr.Dataset.range(0).map(lambda y: y), cycle_length=2
    )
    with pytest.raises(hr.EmptyInputError, match=r"all 3 it made .* are empty"):
        _ = empty.element_spec
    assert list(empty.padded_batch(2)) == []


def test_checks_that_need_the_spec_run_when_it_is_known() -> None:
    counting = Counting()
    ds = counting.source().map(counting.fn)
    mixed = ds.concatenate(hr.Dataset.range(3))  # float32 rows vs int64 scalars
    wrong = ds.padded_batch(2, padded_shapes=[4, 4])
    scalar = counting.source().map(lambda x: x[0]).unbatch()
    assert counting.calls == 0
    with pytest.raises(hr.ElementSpecError, match=r"concatenate: component dtypes differ"):
        _ = mixed.element_spec
    with pytest.raises(
        hr.InvalidArgumentError, match=r"padded shape \(4, 4\) for element has rank 2, but"
    ):
        _ = wrong.element_spec
    with pytest.raises(hr.InvalidArgumentError, match="unbatch: component element is a scalar"):
        _ = scalar.element_spec


def test_sampling_a_spec_runs_under_the_pipelines_memory_budget() -> None:
    """The probe that reads the first element fills the shuffle buffer: with the
    user's 1 MiB budget it stops after a few 64 KiB elements; with the default
    budget (half the machine) it would read all 1,000."""
    pulled = []

    def generate() -> Any:
        for i in range(1000):
            pulled.append(i)
            yield np.full(1 << 16, i % 256, np.uint8)

    ds = (
        hr.Dataset.from_generator(generate, output_signature=hr.TensorSpec((1 << 16,), np.uint8))
        .shuffle(1000, seed=1)
        .map(lambda x: x[:2])
        .with_options(hr.Options(memory_budget="1MiB"))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe's shrink is not the user's business
        # tf.data's shape inference says (2,); one sample cannot tell x[:2] from x[: x[0]]
    assert ds.element_spec == hr.TensorSpec((None,), np.uint8)
    assert 0 < len(pulled) < 40


@pytest.mark.tf
@pytest.mark.parametrize("seed", range(4))
def test_an_empty_pipeline_through_to_tf_and_save_load_yields_nothing(seed: int, tmp_path: Any) -> None:
    # tf.data builds and runs these and yields nothing: so must to_tf() and save+load,
    # while a pipeline that only has an empty branch still refuses (nothing is dropped)
    import random

    rng = random.Random(seed)
    source = rng.choice([
        hr.Dataset.range(0),
        hr.Dataset.range(rng.randint(1, 9)).filter(lambda x: x < 0),
        hr.Dataset.range(rng.randint(1, 9)).take(0),
    ])
    empty = source.map(lambda x: np.full(3, x))
    if rng.random() < 0.5:
        empty = empty.batch(rng.randint(1, 3))
    assert list(empty.to_tf()) == []
    empty.save(str(tmp_path / "saved"))
    loaded = hr.Dataset.load(str(tmp_path / "saved"))
    assert list(loaded) == []
    with pytest.raises(hr.EmptyInputError):
        loaded.element_spec  # noqa: B018
    not_empty = empty.concatenate(hr.Dataset.range(3).map(lambda x: np.full(3, x)))
    with pytest.raises(hr.EmptyInputError):
        not_empty.to_tf()
