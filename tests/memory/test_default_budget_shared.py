"""One budget means one budget: pipelines on the process-wide default draw from it together.

A seeded generator builds 2-10 pipelines with random element sizes and stages, runs them on
a small default budget, consumed in a random interleaving by threads (some left idle), and
checks at every step that what they booked never passed the default's total; that a refusal
names every live pipeline; that none hangs; and that the process grew within the bound.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._memory.budget import MemoryBudget
from headrace._memory.system import process_memory
from headrace.core import run as run_module
from headrace.core.run import join_abandoned

MiB = 1 << 20

#: The stages the generator draws from. The parallel map ("pmap") books its calls in
#: flight against its share alone until it moves to the in-flight ledger, which asks the
#: buffer's room(): add it here then.
_OPS = ["prefetch", "shuffle", "batch", "map"]


def _pipeline(rng: random.Random) -> hr.Dataset:
    """A random pipeline of 1-D float32 arrays (16 KiB to 1 MiB each)."""
    size = rng.choice([1 << 12, 1 << 14, 1 << 16, 1 << 18])
    count = rng.randint(20, 120)
    ds = hr.Dataset.from_generator(
        lambda: (np.full(size, k, np.float32) for k in range(count)),
        output_signature=hr.TensorSpec((size,), np.float32),
    )
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(_OPS)
        if op == "prefetch":
            ds = ds.prefetch(rng.choice([1, 8, 64, hr.AUTOTUNE]))
        elif op == "shuffle":
            ds = ds.shuffle(rng.choice([4, 32, 256]), seed=rng.randrange(1 << 16))
        elif op == "batch":
            ds = ds.batch(rng.choice([2, 4, 8]), drop_remainder=True)
        elif op == "map":
            ds = ds.map(lambda x: x + 1)
        else:
            ds = ds.map(lambda x: x * 2, num_parallel_calls=2)
    return ds


def _run_case(seed: int, shared: MemoryBudget) -> dict[str, Any]:
    rng = random.Random(seed)
    count = rng.randint(2, 10)
    datasets = [_pipeline(rng) for _ in range(count)]
    idle = set(rng.sample(range(count), rng.randint(0, count // 2)))
    iterators: list[Any] = []
    refusals: list[str] = []
    errors: list[BaseException] = []
    worst = [0]
    lock = threading.Lock()

    def check() -> None:
        with shared.lock:
            worst[0] = max(worst[0], shared.used)

    for ds in datasets:
        try:
            iterators.append(iter(ds))
        except hr.MemoryBudgetError as error:
            refusals.append(str(error))
    turns = {k: rng.randint(1, 5) if k in idle else 10**6 for k in range(len(iterators))}

    def consume(k: int) -> None:
        iterator = iterators[k]
        pace = random.Random(seed * 100 + k)
        try:
            for _ in range(turns[k]):
                try:
                    next(iterator)
                except StopIteration:
                    return
                check()
                if pace.random() < 0.2:
                    time.sleep(pace.random() / 500)
        except hr.MemoryBudgetError as error:
            with lock:
                refusals.append(str(error))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in turns]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [k for k, thread in zip(turns, threads, strict=True) if thread.is_alive()]
    check()
    live_labels = [getattr(it.context.budget, "label", "?") for it in iterators]
    for iterator in iterators:
        iterator.close()
    return {
        "hung": hung,
        "errors": errors,
        "refusals": refusals,
        "worst": worst[0],
        "labels": live_labels,
        "count": count,
    }


@pytest.mark.filterwarnings("ignore:shuffle")
@pytest.mark.parametrize("seed", range(6))
def test_pipelines_on_the_default_budget_never_book_past_its_total(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = 24 * MiB
    shared = MemoryBudget(total)
    monkeypatch.setattr(run_module, "_default_budget", shared)
    before = process_memory().charged
    result = _run_case(seed, shared)
    grown = process_memory().charged - before
    assert not result["hung"], f"seed {seed}: pipelines {result['hung']} hung"
    assert not result["errors"], result["errors"]
    # The oracle: the default's total, at every step and at peak.
    assert result["worst"] <= total, (seed, result["worst"])
    assert shared.peak <= total, (seed, shared.peak)
    for message in result["refusals"]:
        # A refusal names the pipelines sharing the budget and what each holds.
        assert "holds" in message and "Options(memory_budget=...)" in message, message
        assert any(label in message for label in result["labels"]), message
    assert grown <= total * 1.1 + 64 * MiB, (seed, grown)
    assert join_abandoned()
    assert shared.used == 0
    assert (getattr(shared, "_slack", 0), getattr(shared, "_runs", 0)) == (0, 0)


def test_eight_prefetching_pipelines_share_a_64_mib_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's case: eight from_generator(1 MiB).prefetch(64) on a 64 MiB default."""
    shared = MemoryBudget(64 * MiB)
    monkeypatch.setattr(run_module, "_default_budget", shared)

    def make() -> hr.Dataset:
        return hr.Dataset.from_generator(
            lambda: (np.ones(1 << 18, np.float32) for _ in range(100)),
            output_signature=hr.TensorSpec((1 << 18,), np.float32),
        ).prefetch(64)

    pipelines = [iter(make()) for _ in range(8)]
    try:
        totals = [0.0] * 8
        for _ in range(100):
            for k, pipeline in enumerate(pipelines):
                totals[k] += float(next(pipeline)[0])
        assert totals == [100.0] * 8  # nothing refused, nothing lost
        assert shared.peak <= 64 * MiB, shared.peak
    finally:
        for pipeline in pipelines:
            pipeline.close()
    assert shared.used == 0


def test_a_minimum_that_cannot_fit_beside_an_idle_pipeline_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = MemoryBudget(16 * MiB)
    monkeypatch.setattr(run_module, "_default_budget", shared)
    rows = hr.Dataset.from_generator(
        lambda: (np.ones(1 << 18, np.float32) for _ in range(64)),
        output_signature=hr.TensorSpec((1 << 18,), np.float32),
    )
    idle = iter(rows.batch(12))  # holds a 12 MiB batch's rows, then its consumer stops
    next(idle)
    try:
        with pytest.raises(hr.MemoryBudgetError) as caught:
            next(iter(rows.batch(8)))  # needs 8 MiB together: not beside the 12
        message = str(caught.value)
        assert getattr(idle.context.budget, "label", "?") in message and "'batch'" in message
        assert "holds" in message
    finally:
        idle.close()
    assert join_abandoned()
    assert shared.used == 0
