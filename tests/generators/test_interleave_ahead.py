"""Slots opened ahead of their turn (interleave with threads) change nothing a user sees.

A parallel interleave opens the next input element's slot once a slot has read its
last element, so a new file's first records are read while the ending slot hands
out what it has left. Random cycles (sizes, empty inner datasets, cycle and block
lengths, parallel calls, ``deterministic=False``) with faults in the input, in
building an inner dataset and in inner elements are run against the oracle, the
sequential interleave of the same pipeline: the same elements and errors in the
same order, and a checkpoint taken anywhere (slots waiting ahead included)
resumes to the same rest.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import numpy as np
import pytest
from transform_cases import positions

import headrace as hr
from headrace._transforms._interleave_cycle import CycleIterator


class Planted(Exception):
    """A fault the case planted (its message says where)."""


def build(case: dict[str, Any], parallel: int | None, deterministic: bool | None = None,
          slow: float = 0.0) -> hr.Dataset:
    sizes, bad_inputs, bad_builds = case["sizes"], case["bad_inputs"], case["bad_builds"]
    bad_elements = case["bad_elements"]

    def input_fault(i: Any) -> Any:
        if int(i) in bad_inputs:
            raise Planted(f"input {int(i)}")
        return i

    def element_fault(x: Any) -> Any:
        if int(x) in bad_elements:
            raise Planted(f"element {int(x)}")
        if slow:
            time.sleep(slow)
        return x

    def inner(i: Any) -> hr.Dataset:
        i = int(i)
        if i in bad_builds:
            raise Planted(f"build {i}")
        return hr.Dataset.range(i * 100, i * 100 + sizes[i]).map(element_fault)

    extra: dict[str, Any] = {}
    if parallel is not None:
        extra = {"num_parallel_calls": parallel, "deterministic": deterministic}
    return (
        hr.Dataset.range(len(sizes)).map(input_fault)
        .interleave(inner, cycle_length=case["cycle"], block_length=case["block"], **extra)
    )


def outputs(iterator: Any, limit: int | None = None, pause: float = 0.0) -> list[Any]:
    """Every position up to ``limit``: the element, or the planted error's message."""
    return positions(iterator, Planted, limit, pause)


def draw_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    inputs = rng.randint(0, 9)
    sizes = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(inputs)]
    cycle = rng.randint(1, 4)

    def some(population: list[int], p: float) -> set[int]:
        return {x for x in population if rng.random() < p}

    elements = [i * 100 + j for i, size in enumerate(sizes) for j in range(size)]
    return {
        "sizes": sizes, "cycle": cycle, "block": rng.randint(1, 3),
        "parallel": rng.randint(1, cycle),
        "bad_inputs": some(list(range(inputs)), 0.12),
        "bad_builds": some(list(range(inputs)), 0.12),
        "bad_elements": some(elements, 0.05),
    }


@pytest.fixture
def opened_ahead(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the slots opened ahead of their turn (the generator must reach them)."""
    counts = [0]
    original = CycleIterator._open_ahead_slot

    def counted(self: CycleIterator, *args: Any) -> Any:
        counts[0] += 1
        return original(self, *args)

    monkeypatch.setattr(CycleIterator, "_open_ahead_slot", counted)
    return counts


@pytest.mark.usefixtures("no_thread_leak")
def test_slots_opened_ahead_keep_the_order_and_the_errors(opened_ahead: list[int]) -> None:
    for seed in range(60):
        case = draw_case(seed)
        with iter(build(case, None)) as sequential:
            expected = outputs(sequential)
        with iter(build(case, case["parallel"])) as threaded:
            got = outputs(threaded, pause=0.0005)
        assert got == expected, (seed, case)
    assert opened_ahead[0] >= 30  # the generator reaches slots opened ahead


@pytest.mark.usefixtures("no_thread_leak")
def test_a_checkpoint_with_slots_waiting_ahead_resumes_to_the_same_rest(
    opened_ahead: list[int],
) -> None:
    waiting_at_save = 0
    for seed in range(100, 140):
        case = draw_case(seed)
        with iter(build(case, None)) as sequential:
            expected = outputs(sequential)
        cut = random.Random(seed).randint(0, len(expected))
        with iter(build(case, case["parallel"])) as threaded:
            head = outputs(threaded, limit=cut, pause=0.0005)
            stage = next(s for s in threaded.stages() if isinstance(s, CycleIterator))
            waiting_at_save += bool(stage.ahead)
            state = json.loads(json.dumps(threaded.get_state()))
            rest = outputs(threaded)
        assert head + rest == expected, (seed, case)
        with iter(build(case, case["parallel"])) as resumed:
            resumed.set_state(state)
            assert outputs(resumed) == expected[cut:], (seed, case, cut)
    assert waiting_at_save >= 5  # states were taken with slots waiting ahead


@pytest.mark.usefixtures("no_thread_leak")
def test_first_ready_yields_each_element_and_error_once(opened_ahead: list[int]) -> None:
    for seed in range(200, 230):
        case = draw_case(seed)
        with iter(build(case, None)) as sequential:
            expected = outputs(sequential)
        with iter(build(case, case["parallel"], deterministic=False)) as first_ready:
            got = outputs(first_ready, pause=0.0005)
        key = repr
        assert sorted(got, key=key) == sorted(expected, key=key), (seed, case)
    assert opened_ahead[0] > 0


@pytest.mark.usefixtures("no_thread_leak")
def test_a_new_file_is_read_while_the_ending_one_hands_out_its_rest(tmp_path: Any) -> None:
    """What open-ahead is for: with same-sized shards every slot ends at once, and
    without it the cycle waited for each new file's first read in turn."""
    from headrace.io.tfrecord import TFRecordWriter

    paths = []
    for shard in range(8):
        path = str(tmp_path / f"shard-{shard}.tfrecord")
        with TFRecordWriter(path) as writer:
            for record in range(20):
                writer.write(np.full(64 * 1024, shard * 20 + record, np.uint8).tobytes())
        paths.append(path)
    ds = hr.Dataset.from_tensor_slices(paths).interleave(
        hr.TFRecordDataset, cycle_length=4, num_parallel_calls=2)
    with iter(ds) as iterator:
        stage = next(s for s in iterator.stages() if isinstance(s, CycleIterator))
        firsts = []
        seen_ahead = 0
        for _ in range(80):
            time.sleep(0.001)
            firsts.append(next(iterator)[0])
            seen_ahead = max(seen_ahead, len(stage.ahead))
        assert seen_ahead == 4  # the whole next cycle of files waited, opened and reading
        rest = [record[0] for record in iterator]
    order = [shard * 20 + r for group in (0, 4) for r in range(20) for shard in range(group, group + 4)]
    assert firsts + rest == order
