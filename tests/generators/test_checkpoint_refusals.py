"""States that must be refused are refused: clearly, naming stage and field, and at once (G4).

Each test here reproduces one way a forged, edited or foreign state used to get
through: a negative counter accepted, a huge draw count replayed for hours, a
counter past the end surfacing as a bare ``StopIteration``, an unseeded
shuffle that forgot its seed after the restored epoch.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace.core.state import seal
from headrace.testing import take_elements


def generator(n: int) -> hr.Dataset:
    return hr.Dataset.from_generator(
        lambda: iter(range(n)), output_signature=hr.TensorSpec((), np.int64)
    )


def state_after(ds: hr.Dataset, steps: int) -> dict[str, Any]:
    with iter(ds) as iterator:
        take_elements(iterator, steps)
        state: dict[str, Any] = json.loads(json.dumps(iterator.get_state()))
        return state


def refused(ds: hr.Dataset, state: dict[str, Any], match: str) -> None:
    """Restoring ``state`` raises CheckpointError matching ``match`` at once (milliseconds
    of work: the bound leaves room for a loaded machine, not for a replay).

    The state was edited after get_state sealed it: as it is, its checksum refuses it;
    sealed again (as a buggy producer would have made it), the field's own check must."""
    if "checksum" in state:
        with iter(ds) as iterator, pytest.raises(hr.CheckpointError, match="checksum"):
            iterator.set_state(state)
        state = seal(dict(state))
    started = time.perf_counter()
    with iter(ds) as iterator, pytest.raises(hr.CheckpointError, match=match):
        iterator.set_state(state)
    assert time.perf_counter() - started < 5.0


@pytest.mark.parametrize("drawn", [10**15, 101, -1])
def test_shuffle_draw_count_beyond_the_input_is_refused_at_once(drawn: int) -> None:
    ds = hr.Dataset.range(100).shuffle(10, seed=1)
    state = state_after(ds, 3)
    state["state"]["indices"]["drawn"] = drawn
    refused(ds, state, r"shuffle: state field 'drawn' = -?\d+ is out of range.*100 elements")


def test_streaming_shuffle_draws_past_the_end_of_an_unknown_size_input_are_refused() -> None:
    ds = generator(30).shuffle(8, seed=3)
    state = state_after(ds, 5)
    state["state"]["drawn"] = 31  # the generator's length is unknown until it ends
    refused(ds, state, r"shuffle: state field 'drawn' = 31 points past the end .* after 30")


@pytest.mark.parametrize(
    "ds, path, value, match",
    [
        (hr.Dataset.range(100).take(10), ("indices", "consumed"), -5, r"take: .*'consumed' = -5"),
        (hr.Dataset.range(100).take(10), ("indices", "consumed"), 11, r"\[0, 10\] \(take\(10\)\)"),
        (hr.Dataset.range(100).skip(10), ("indices", "consumed"), "2", r"skip: .*must be an int"),
        (hr.Dataset.range(100).shard(3, 1), ("indices", "consumed"), -1, r"shard: .*'consumed'"),
        (hr.Dataset.range(100), ("indices", "position"), 101, r"source: .*100 elements"),
        (hr.Dataset.range(9).repeat(3), ("indices", "epoch"), 4, r"\[0, 3\] \(repeat\(3\)\)"),
        (generator(9).take(4), ("consumed",), 5, r"take: .*'consumed' = 5.*\(take\(4\)\)"),
        (generator(9).skip(4), ("consumed",), "2", r"skip: .*must be an int, got str"),
        (generator(9).repeat(2), ("epoch",), 2, r"repeat: .*'epoch' = 2"),
        (generator(9).enumerate(5), ("next",), 4, r"enumerate: .*'next' = 4"),
        (generator(9).batch(2), ("position",), -1, r"batch: .*'position' = -1"),
        (generator(9).shard(2, 1), ("consumed",), True, r"shard: .*must be an int, got bool"),
        (generator(9).prefetch(2), ("skip",), 10**6, r"prefetch: .*'skip' = 1000000"),
        (generator(9).shuffle(4, seed=1), ("seed",), 2, r"this shuffle has seed=1"),
        (generator(9).shuffle(4, seed=1), ("epoch",), [1], r"shuffle: .*'epoch' = \[1\]"),
        (generator(9).shuffle(4, seed=1), ("shrunk_to",), 0, r"'shrunk_to' = 0"),
        (hr.Dataset.range(9).shuffle(4, seed=1), ("indices", "capacity"), 5, r"'capacity' = 5"),
        (generator(9), ("produced",), -2, r"from_generator: .*'produced' = -2"),
        (generator(9).concatenate(generator(2)), ("current",), 3, r"concatenate: .*'current'"),
        (hr.Dataset.zip(generator(3), generator(4)), ("inputs",), [{}], r"has 1 entries.*2"),
        (generator(9).map(lambda x: x), ("inner",), None, r"'inner' must be a state dict"),
        (generator(9).batch(3).unbatch(), ("rows_taken",), 4, r"batch it counts in has 3 rows"),
        (hr.Dataset.range(9).global_shuffle(1), ("indices", "position"), 10, r"global_shuffle"),
    ],
)
def test_every_counter_is_checked_for_type_and_range(
    ds: hr.Dataset, path: tuple[str, ...], value: Any, match: str
) -> None:
    state = state_after(ds, 2)
    holder = state["state"]
    for key in path[:-1]:
        holder = holder[key]
    assert path[-1] in holder, f"the test edits a field the state has: {holder}"
    holder[path[-1]] = value
    refused(ds, state, match)


def test_a_missing_field_is_named() -> None:
    ds = generator(9).take(4)
    state = state_after(ds, 1)
    del state["state"]["consumed"]
    refused(ds, state, r"take: state has no field 'consumed'")


@pytest.mark.parametrize(
    "ds, path, value",
    [
        (generator(5), ("produced",), 6),  # replay-and-skip runs off the generator's end
        (generator(5).prefetch(2), ("skip",), 6),
        (generator(5).map(lambda x: x, num_parallel_calls=2), ("skip",), 6),
    ],
)
def test_a_state_past_the_end_is_a_checkpoint_error_not_stop_iteration(
    ds: hr.Dataset, path: tuple[str, ...], value: int
) -> None:
    state = state_after(ds, 1)
    state["state"][path[0]] = value
    refused(ds, state, r"'(skip|produced)' = 6 points past the end of the input, which ended after")


def test_an_interleave_slot_past_the_end_of_its_input_is_refused() -> None:
    ds = hr.Dataset.range(3).interleave(
        lambda x: hr.Dataset.range(4).map(lambda y: y + 10 * x), cycle_length=2
    )
    state = state_after(ds, 3)
    state["state"]["slots"][0]["input_before"] = {"indices": {"position": 3}}
    refused(ds, state, r"interleave: .*'slots' \[0\] .*past the end")
    state = state_after(ds, 3)
    state["state"]["cycle_index"] = 2
    refused(ds, state, r"interleave: state field 'cycle_index' = 2 .*cycle_length")


def test_iteration_and_tree_are_checked_at_the_root() -> None:
    ds = hr.Dataset.range(5)
    state = state_after(ds, 1)
    state["iteration"] = -1
    refused(ds, state, r"iterator: state field 'iteration' = -1")
    state = state_after(ds, 1)
    state["state"] = [1, 2]
    refused(ds, state, r"iterator: state field 'state' must be a state dict, got list")


@pytest.mark.parametrize(
    "build",
    [
        lambda: hr.Dataset.range(20).shuffle(20).repeat(4),  # indices
        lambda: generator(20).shuffle(20).repeat(4),  # elements
        lambda: hr.Dataset.range(20).global_shuffle().repeat(4),
    ],
    ids=["shuffle_indices", "shuffle_stream", "global_shuffle"],
)
def test_unseeded_shuffle_restores_every_later_epoch(build: Any) -> None:
    """Two recipes built by the same code are two processes' views of one pipeline:
    their unseeded shuffles pick different random seeds, but the same fingerprint."""

    saving, restoring = build(), build()
    assert saving.fingerprint() == restoring.fingerprint()
    with iter(saving) as original:
        take_elements(original, 25)  # inside the second epoch
        state = json.loads(json.dumps(original.get_state()))
        expected = [int(x) for x in take_elements(original, 100)]
    assert len(expected) == 55  # the rest of epoch 2, and all of epochs 3 and 4
    with iter(restoring) as restored:
        restored.set_state(state)
        assert [int(x) for x in take_elements(restored, 100)] == expected


def test_an_error_of_the_data_met_while_replaying_is_not_blamed_on_the_state() -> None:
    failing: list[bool] = []

    def check(x: np.int64) -> np.int64:
        if failing and x == 2:
            raise ValueError("bad element 2")
        return x

    ds = generator(9).map(check).shuffle(4, seed=1)  # restoring replays elements 0..6
    state = state_after(ds, 3)
    failing.append(True)
    with iter(ds) as iterator, pytest.raises(ValueError, match="bad element 2") as info:
        iterator.set_state(state)
    assert type(info.value) is ValueError  # not wrapped as a CheckpointError
