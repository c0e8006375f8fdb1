"""Profiles see inside interleave: the stages of the datasets it makes, their counts, time and bytes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace.profiling.probe import recipe_nodes
from headrace.profiling.profiler import profile


def _shard(rows: int, width: int) -> Any:
    def make(i: Any) -> hr.Dataset:
        return hr.Dataset.from_generator(
            lambda: (np.full(width, int(i), np.uint8) for _ in range(rows)),
            output_signature=hr.TensorSpec((width,), np.uint8),
        ).map(lambda r: np.repeat(r, 4)).shuffle(50, seed=1)

    return make


def _inner(result: Any, prefix: str) -> Any:
    found = [s for s in result.stages if s.name.startswith(prefix) and s.name.endswith("[inner]")]
    assert len(found) == 1, [s.name for s in result.stages]
    return found[0]


@pytest.mark.parametrize("parallel", [None, 2])
def test_interleave_inner_stages_are_counted_timed_and_booked(parallel: int | None) -> None:
    shards, rows, width = 6, 200, 2048
    ds = (hr.Dataset.range(shards)
          .interleave(_shard(rows, width), cycle_length=2, num_parallel_calls=parallel)
          .batch(8).prefetch(2))
    result = profile(ds, epochs=2, interval=0.005, progress=False)
    total = shards * rows * 2
    source = _inner(result, "from_generator")
    mapped = _inner(result, "map(")
    shuffled = _inner(result, "shuffle")
    # every inner dataset's stage at one place adds to one row, over both epochs
    assert source.elements_out == mapped.elements_out == shuffled.elements_out == total
    assert source.iterators == shards * 2
    assert mapped.inflation == pytest.approx(4.0)
    assert mapped.mean_bytes_out == pytest.approx(4 * width)
    # each inner shuffle buffers 50 elements of 8 KiB under its slot's budget
    assert shuffled.peak >= 50 * 4 * width
    assert shuffled.share > 0
    interleave = next(s for s in result.stages if s.name.startswith("interleave"))
    # the inner root is read by the interleave: one level below it in the table
    assert shuffled.depth == interleave.depth + 1
    assert mapped.depth == shuffled.depth + 1 and source.depth == mapped.depth + 1
    held_over_time = [
        sample.held[result.stage_names.index(shuffled.name)]
        for sample in result.samples if len(sample.held) > result.stage_names.index(shuffled.name)
    ]
    assert max(held_over_time) > 0  # the timeline (and the report's chart) shows it
    text = result.format()
    assert "shuffle [inner]" in text
    assert "shuffle [inner]" in result.to_html()
    for node in recipe_nodes(ds.node):  # nothing left on the recipe
        assert "make_iterator" not in node.__dict__ and "inner_node" not in node.__dict__
    assert sum(1 for _ in ds) == result.elements // 2  # and it still runs, uninstrumented


def test_random_inner_pipelines_count_what_they_yield() -> None:
    rng = random.Random(5)
    for _ in range(8):
        rows = rng.randint(1, 40)
        take = rng.randint(1, 50)
        batch = rng.randint(1, 5)

        def make(i: Any, rows: int = rows, take: int = take, batch: int = batch) -> hr.Dataset:
            return hr.Dataset.range(rows).map(lambda x: x + int(i)).take(take).batch(batch)

        shards = rng.randint(1, 5)
        ds = hr.Dataset.range(shards).interleave(make, cycle_length=rng.randint(1, 3))
        result = profile(ds, progress=False, lint=False)
        per_shard = -(-min(rows, take) // batch)
        inner_root = next(s for s in result.stages if s.name == "batch [inner]")
        assert inner_root.elements_out == per_shard * shards == result.elements
