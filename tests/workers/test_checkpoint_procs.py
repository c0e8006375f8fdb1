"""G4 for the process stages: a checkpoint at *every* step restores exactly.

``assert_checkpoint_roundtrip`` (save the state at each step, restore it into a
fresh iterator, compare the rest of the stream) over generated pipelines:
``interleave(..., workers="processes")`` with inner pipelines of random lengths,
element sizes that grow mid-stream, views of larger arrays, stages inside the
worker's pipeline and random stages around the interleave; and a served
consumer (``headrace.connect``) of random pipelines, parts and indices, whose
fresh iterators are new connections to the producer.

A few examples run by default; the ``slow`` ones (CI) try many more.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import process_fns
import pytest
import served_fns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._transforms import process_interleave
from headrace.testing import assert_checkpoint_roundtrip

KEY = b"checkpoint-procs"


@st.composite
def interleave_pipelines(draw: st.DrawFn) -> tuple[hr.Dataset, int]:
    """A random pipeline around a process interleave, and the chunk size its slots read."""
    lengths = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    inner = functools.partial(
        process_fns.sized_shard,
        lengths=lengths,
        nbytes=draw(st.sampled_from([16, 4 << 10, 96 << 10])),  # pickled, or shared memory
        grow_at=draw(st.integers(0, 6)),
        inner=draw(st.sampled_from(["plain", "shuffle", "prefetch"])),
    )
    inputs = hr.Dataset.range(draw(st.integers(1, 5)))
    if draw(st.booleans()):
        inputs = inputs.shuffle(4, seed=draw(st.integers(0, 9)))
    cycle = draw(st.integers(1, 3))
    ds = inputs.interleave(
        inner,
        cycle_length=cycle,
        block_length=draw(st.integers(1, 2)),
        num_parallel_calls=draw(st.integers(1, min(2, cycle))),
        workers="processes",
    )
    for op in draw(st.lists(st.sampled_from(["map", "shuffle", "batch", "prefetch", "take"]),
                            max_size=2, unique=True)):
        if op == "map":
            ds = ds.map(np.copy, num_parallel_calls=draw(st.sampled_from([None, 2])),
                        output_signature=hr.TensorSpec((None,), np.uint8))
        elif op == "shuffle":
            ds = ds.shuffle(draw(st.integers(2, 8)), seed=draw(st.integers(0, 9)))
        elif op == "batch":
            ds = ds.padded_batch(draw(st.integers(2, 3)))
        elif op == "prefetch":
            ds = ds.prefetch(draw(st.integers(1, 3)))
        else:
            ds = ds.take(draw(st.integers(0, 12)))
    return ds.with_options(hr.Options(memory_budget="32MiB")), draw(st.integers(1, 4))


def check_process_interleave(case: tuple[hr.Dataset, int], checkpoints: int = 40) -> None:
    dataset, chunk = case
    with pytest.MonkeyPatch.context() as patch:  # slots cross chunks, and workers
        patch.setattr(process_interleave, "CHUNK_ELEMENTS", chunk)
        assert_checkpoint_roundtrip(dataset, max_checkpoints=checkpoints)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=interleave_pipelines())
def test_a_process_interleave_resumes_exactly_from_every_step(
    case: tuple[hr.Dataset, int],
) -> None:
    check_process_interleave(case)


# Many pipelines, fewer steps each: every checkpoint starts two iterators, each with its
# own worker processes, and the examples' time adds up in one test (its timeout).
@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=interleave_pipelines())
def test_many_process_interleaves_resume_exactly_from_every_step(
    case: tuple[hr.Dataset, int],
) -> None:
    check_process_interleave(case, checkpoints=12)


# -- served consumers ------------------------------------------------------------------


@st.composite
def served_pipelines(draw: st.DrawFn) -> tuple[hr.Dataset, int, int]:
    """A random pipeline to serve, the number of consumers and the index to check."""
    n = draw(st.integers(0, 30))
    ds = hr.Dataset.range(n)
    if draw(st.booleans()):
        ds = ds.shuffle(draw(st.integers(1, 12)), seed=draw(st.integers(0, 9)))
    ds = ds.map(served_fns.as_array, num_parallel_calls=draw(st.sampled_from([None, 2])))
    if draw(st.booleans()):  # arrays of the producer's process interleave
        ds = hr.Dataset.range(draw(st.integers(1, 3))).interleave(
            functools.partial(served_fns.shard_of, n), cycle_length=2,
            num_parallel_calls=draw(st.integers(1, 2)), workers="processes",
        )
    if draw(st.booleans()):
        ds = ds.prefetch(draw(st.integers(1, 3)))
    if draw(st.booleans()):
        ds = ds.repeat(2)
    k = draw(st.integers(1, 3))
    return ds, k, draw(st.integers(0, k - 1))


def check_served(case: tuple[hr.Dataset, int, int], tmp: Path, checkpoints: int = 40) -> None:
    dataset, k, index = case
    address = str(tmp / "s.sock")
    with hr.serve(dataset, k, address, authkey=KEY) as server:
        assert_checkpoint_roundtrip(
            open_iterator=lambda: hr.connect(address, index, authkey=KEY),
            max_checkpoints=checkpoints,
        )
        assert server.connected in ([], [index])  # the last connection may still be ending


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=served_pipelines())
def test_a_served_consumer_resumes_exactly_from_every_step(
    case: tuple[hr.Dataset, int, int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check_served(case, tmp_path_factory.mktemp("served"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=served_pipelines())
def test_many_served_consumers_resume_exactly_from_every_step(
    case: tuple[hr.Dataset, int, int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check_served(case, tmp_path_factory.mktemp("served"), checkpoints=12)
