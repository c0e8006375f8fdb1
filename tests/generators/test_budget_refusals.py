"""What a caller who catches refusals and goes on gets: random pipelines under budgets
too small for some of their batches, stages or elements.

Each pipeline of the budget fuzzer (``fuzz_pipelines.random_spec``) runs under a
budget cut to a fraction of the drawn one, driven by a loop that catches every
error and calls ``next()`` again, as a training loop that logs and goes on does.
The oracle is the same pipeline under a budget that refuses nothing:

- the loop ends: a refusal stands for what it refused (an element, a batch's rows)
  and the stream goes on past it, and one the pipeline can never get past ends the
  stream after its third time, rather than spinning;
- every element that comes out is the oracle's, in the oracle's order (a refusal
  stands for the elements it refused, and none is invented, repeated or moved).

Pipelines that regroup or reorder after an error are left out of the order check
(:data:`_REGROUPS`).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from fuzz_pipelines import _fingerprint, build, random_spec

import headrace as hr

MiB = 1 << 20


def _outcomes(spec: dict[str, Any], limit: int) -> tuple[list[Any], int, bool]:
    """The elements' fingerprints in order, the errors met, and whether it ended."""
    elements: list[Any] = []
    errors = 0
    try:
        iterator = iter(build(spec))
    except hr.MemoryBudgetError:  # refused as it starts (a first element it must probe)
        return elements, 1, True
    with iterator:
        for _ in range(limit):
            try:
                elements.append(_fingerprint(next(iterator)))
            except StopIteration:
                return elements, errors, True
            except Exception:  # (the loop under test goes on after anything)
                errors += 1
    return elements, errors, False


def _is_subsequence(part: list[Any], whole: list[Any]) -> bool:
    rest = iter(whole)
    return all(any(item == other for other in rest) for item in part)


def _case(seed: int, processes: bool = False) -> dict[str, Any]:
    spec = random_spec(seed, processes=processes)
    rng = random.Random(seed ^ 0xB0D6E7)
    # a budget from a quarter of the drawn one down to a fraction of one element's share
    spec["budget_mib"] = max(spec["budget_mib"] / rng.choice((4, 16, 64, 256)), 0.25)
    return spec


#: Ops whose output an error below them regroups or reorders: a shuffle's buffer
#: shrinks with the budget, and an element's error inside a batch (or window) starts the
#: next one after it, as in tf.data, so later groups differ from the oracle's. (An
#: interleave source reorders too: an error does not take its slot's turn, as in tf.data.)
_REGROUPS = {"shuffle", "sample", "batch", "padded_batch", "ragged_batch", "rebatch",
             "window", "group_by_window"}


@pytest.mark.parametrize("block", range(4))
def test_a_loop_that_goes_on_after_refusals_ends_and_gets_only_the_oracles_elements(
    block: int,
) -> None:
    _check_block(range(block * 30, block * 30 + 30))


@pytest.mark.parametrize("block", range(2))
def test_the_same_with_maps_on_worker_processes(block: int) -> None:
    _check_block(range(100_000 + block * 40, 100_000 + block * 40 + 40), processes=True)


def _check_block(seeds: range, processes: bool = False) -> None:
    refused = 0
    for seed in seeds:
        spec = _case(seed, processes)
        roomy = dict(spec, budget_mib=4096)
        expected, oracle_errors, ended = _outcomes(roomy, 100_000)
        assert ended and oracle_errors == 0, f"seed {seed}: the oracle itself failed"
        # (errors pass a filter or a take_while that would have dropped their elements:
        # the bound is the source's elements, each drawn a few times by repeats)
        limit = 16 * spec["count"] + 50
        got, errors, ended = _outcomes(spec, limit)
        assert ended, f"seed {seed} ({spec['ops']}): no end after {limit} calls"
        kinds = {op[0] for op in spec["ops"]}
        if not errors and not kinds & {"shuffle", "sample"}:
            assert got == expected, f"seed {seed} ({spec['ops']}): refused nothing, but differs"
        elif spec["source"] != "interleave" and not kinds & _REGROUPS:
            # (as in tf.data, take counts elements, not errors: with errors in place it
            # reaches further into its input than the oracle's take)
            reach = expected
            if "take" in kinds and "zip" not in kinds:  # (a zip pairs by position)
                reach = _outcomes(dict(roomy, ops=[op for op in spec["ops"] if op[0] != "take"]),
                                  100_000)[0]
            if "take" not in kinds or "zip" not in kinds:
                assert _is_subsequence(got, reach), f"seed {seed} ({spec['ops']})"
        refused += errors > 0
    assert refused >= 2, f"only {refused} of {len(seeds)} pipelines were refused anything"
