"""A streamed shuffle whose input raises: checkpoints taken at every position resume to
the uninterrupted run's rest (G4, G5).

The shuffle fills its buffer from the input; an input error is raised in its place and
the input goes on after it. A state records the draws and the errors met, and a
restore replays both, so a state taken right after an error resumes after it (the error
was raised again, or set_state raised it, before). Oracle: the uninterrupted run, for
random inputs (sizes, failing elements, a streamed or interleaved input, a filter),
buffer sizes and seeds.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from transform_cases import positions

import headrace as hr


class Planted(Exception):
    """A fault the case planted."""


def build(case: dict[str, Any]) -> hr.Dataset:
    bad = case["bad"]

    def fault(x: Any) -> Any:
        if int(x) in bad:
            raise Planted(f"element {int(x)}")
        return x

    ds = hr.Dataset.range(case["n"])
    if case["input"] == "interleave":
        ds = ds.interleave(lambda i: hr.Dataset.from_tensors(i).map(fault), cycle_length=2)
    elif case["input"] == "filter":
        ds = ds.filter(lambda x: x % 5 != 4).map(fault)
    else:
        ds = ds.map(fault)
    return ds.shuffle(case["buffer"], seed=case["seed"], reshuffle_each_iteration=False)


def outputs(iterator: Any, limit: int | None = None) -> list[Any]:
    return positions(iterator, Planted, limit)


def draw_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    n = rng.randint(0, 24)
    return {
        "n": n, "buffer": rng.choice([1, 2, 3, 5, 8, 100]), "seed": rng.randint(0, 99),
        "input": rng.choice(["map", "interleave", "filter"]),
        "bad": {x for x in range(n) if rng.random() < 0.2},
    }


@pytest.mark.parametrize("seeds", [range(0, 40), range(40, 80)])
def test_a_state_taken_anywhere_resumes_to_the_same_rest(seeds: range) -> None:
    restores = with_errors_before = 0
    for seed in seeds:
        case = draw_case(seed)
        with iter(build(case)) as iterator:
            expected = outputs(iterator)
        for cut in range(len(expected) + 1):
            with iter(build(case)) as iterator:
                head = outputs(iterator, cut)
                state = json.loads(json.dumps(iterator.get_state()))
            assert head == expected[:cut], (seed, case)
            with iter(build(case)) as resumed:
                resumed.set_state(state)
                assert outputs(resumed) == expected[cut:], (seed, case, cut)
            restores += 1
            with_errors_before += any(isinstance(x, tuple) for x in head)
    assert restores > 200 and with_errors_before > 50
