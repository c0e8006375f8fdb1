"""Errors that carry data are booked while a stage holds them for their turn (G1).

A user's exception may hold large arrays: in its ``args``, its attributes, its
cause or context. A parallel map, a prefetch or an interleave's read-ahead
holds such errors until every earlier element is handed out. These tests
generate maps that raise such exceptions (random sizes, random slow elements)
and check the process's growth against the issue's bound, and the sequence of
values and errors against the sequential run under a huge budget.
"""

from __future__ import annotations

import builtins
import random
import time
from typing import Any

import numpy as np
import pytest
from fuzz_pipelines import PeakGrowth

import headrace as hr
from headrace._memory.sizeof import sizeof

MiB = 1 << 20


class CarriedError(ValueError):
    """An exception whose ``__init__`` keeps what it refused (a common pattern)."""

    def __init__(self, index: int, payload: Any) -> None:
        super().__init__(f"bad row {index}")
        self.index = index
        self.payload = payload


def _carriers(rng: random.Random, payload: np.ndarray[Any, Any]) -> list[BaseException]:
    """Each place an exception may keep ``payload`` alive."""
    in_args = ValueError("bad row", payload)
    in_dict = CarriedError(rng.randrange(100), payload)
    try:
        try:
            raise KeyError(payload)
        except KeyError:
            raise RuntimeError("while handling") from None
    except RuntimeError as error:  # the KeyError stays as its context
        in_context = error
    in_cause = RuntimeError("wrapped")
    in_cause.__cause__ = ValueError(payload)
    carriers: list[BaseException] = [in_args, in_dict, in_context, in_cause]
    group_type = getattr(builtins, "ExceptionGroup", None)  # Python >= 3.11
    if group_type is not None:
        carriers.append(group_type("several", [ValueError(payload)]))
    return carriers


@pytest.mark.parametrize("seed", range(4))
def test_sizeof_counts_what_an_exception_keeps(seed: int) -> None:
    rng = random.Random(seed)
    payload = np.zeros(rng.randrange(1, 4 * MiB), np.uint8)
    for error in _carriers(rng, payload):
        # the payload once (a cycle or a repeat counts once), plus small headers
        assert payload.nbytes <= sizeof(error) <= payload.nbytes + 8192, type(error)


def _spec(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "n": rng.randrange(120, 160),
        "slow_every": rng.randrange(12, 20),  # elements before each slow one
        "slow_s": rng.uniform(0.1, 0.15),
        "payload_mib": tuple(round(rng.uniform(4, 9), 1) for _ in range(16)),
        "npc": rng.randrange(2, 5),
        "prefetch": rng.random() < 0.5,
        "ignore": rng.random() < 0.5,
    }


def _fn(spec: dict[str, Any]) -> Any:
    slow_every, slow_s, sizes = spec["slow_every"], spec["slow_s"], spec["payload_mib"]

    def fn(i: Any) -> Any:
        i = int(i)
        if i % slow_every == 0:
            time.sleep(slow_s)  # the errors after it wait for their turn
            return np.float64(i)
        payload = np.full(int(sizes[i % len(sizes)] * MiB) // 8, i, np.float64)
        if i % 3 == 0:
            raise ValueError(f"bad row {i}", payload)  # in args
        raise CarriedError(i, payload)  # in an attribute

    return fn


def _pipeline(spec: dict[str, Any], *, parallel: bool, budget: str) -> hr.Dataset:
    ds = hr.Dataset.range(spec["n"]).map(
        _fn(spec), num_parallel_calls=spec["npc"] if parallel else None)
    if spec["ignore"]:
        ds = ds.ignore_errors()
    if spec["prefetch"]:
        ds = ds.prefetch(hr.AUTOTUNE)
    return ds.with_options(hr.Options(memory_budget=budget))


def _drain(ds: hr.Dataset) -> list[tuple[str, Any]]:
    """Values and errors in order; each error by its type and message, dropped at once."""
    out: list[tuple[str, Any]] = []
    it = iter(ds)
    try:
        while True:
            try:
                value = next(it)
            except StopIteration:
                return out
            except ValueError as error:
                out.append(("error", f"{type(error).__name__}: {error.args[0]}"))
                del error
                continue
            out.append(("value", float(value)))
    finally:
        it.close()


@pytest.mark.slow  # ~3 s: the sequential oracle waits out every slow element
@pytest.mark.parametrize("seed", range(3, 6))
def test_held_errors_stay_within_the_budget(seed: int) -> None:
    spec = _spec(seed)
    budget_mib = 16
    expected = _drain(_pipeline(spec, parallel=False, budget="4GiB"))
    with PeakGrowth() as memory:
        got = _drain(_pipeline(spec, parallel=True, budget=f"{budget_mib}MiB"))
    assert got == expected, f"seed {seed}"
    growth = memory.growth / MiB
    bound = budget_mib * 1.1 + 64  # the bound
    assert growth <= bound, f"seed {seed}: grew {growth:.1f} MiB > {bound:.1f} MiB"
