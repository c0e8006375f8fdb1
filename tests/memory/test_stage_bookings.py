"""What stages hold between calls is booked, and minima that fit are not refused.

Each test draws its cases from a seeded generator and compares with an oracle:
the same pipeline under a budget far above its needs (values and order), or the
bytes the data makes (what a stage may hold before it refuses).
"""

from __future__ import annotations

import random
import threading
import warnings
from typing import Any

import numpy as np
import pytest

import headrace as hr

MiB = 1 << 20
HUGE = hr.Options(memory_budget="1GiB")


def _rows(seed: int, count: int, row_bytes: list[int], threads: int = 3) -> hr.Dataset:
    sizes = [row_bytes[(seed + i) % len(row_bytes)] for i in range(count)]

    def row(i: Any) -> np.ndarray[Any, Any]:
        return np.full(sizes[int(i)] // 8, int(i), np.float64)

    return hr.Dataset.range(count).map(row, num_parallel_calls=threads)


@pytest.mark.parametrize("seed", range(4))
def test_a_shuffle_shrinks_to_let_minima_that_fit_run(seed: int) -> None:
    """A parallel map, a shuffle, a batch and a prefetch under 16 MiB: the minima fit
    (a batch, one batch in the prefetch) but not beside the shuffle's share. The
    shuffle gives up what it need not hold, so the pipeline runs, with the values
    of a huge budget, and in one order whatever the number of threads."""
    rng = random.Random(seed)
    row, batch = rng.choice([(512 << 10, 8), (1 * MiB, 4), (2 * MiB, 2)])
    shuffle, count = rng.choice([1, 4, 16, 64]), rng.choice([24, 40])

    def pipeline(threads: int, options: hr.Options) -> list[list[int]]:
        ds = _rows(seed, count, [row], threads).shuffle(shuffle, seed=seed).batch(batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hr.HeadraceWarning)
            out = ds.prefetch(hr.AUTOTUNE).with_options(options)
            return [[int(r[0]) for r in b] for b in out]

    tight = hr.Options(memory_budget="16MiB")
    first = pipeline(2, tight)
    assert sorted(v for b in first for v in b) == list(range(count))
    assert sorted(v for b in pipeline(2, HUGE) for v in b) == list(range(count))
    assert pipeline(4, tight) == first  # the order does not depend on the threads


@pytest.mark.parametrize("seed", range(3))
def test_a_shuffle_after_a_parallel_map_of_mixed_sizes_runs(seed: int) -> None:
    """shuffle(1) after a parallel map of outputs up to 6 MiB, budget 16 MiB: it was
    refused with advice (a smaller buffer_size) that could not be followed."""
    rng = random.Random(seed)
    ds = _rows(seed, 30, [rng.choice([64 << 10, 1 * MiB, 6 * MiB]) for _ in range(5)], 4)
    got = [int(x[0]) for x in ds.shuffle(1, seed=seed).with_options(
        hr.Options(memory_budget="16MiB"))]
    assert got == list(range(30))  # shuffle(1) keeps the order


@pytest.mark.parametrize("seed", range(3))
def test_a_scan_books_its_carried_state(seed: int) -> None:
    """A scan whose state grows by a random number of bytes per element: the state
    is booked as it grows, so the stage refuses, naming its state, before the state
    passes the budget. A state that stays small runs to the oracle's values."""
    rng = random.Random(seed)
    growth = [rng.choice([64 << 10, 256 << 10, 1 * MiB]) for _ in range(40)]
    budget = 8 * MiB

    def step(state: np.ndarray[Any, Any], i: Any) -> tuple[Any, Any]:
        state = np.concatenate([state, np.zeros(growth[int(i)], np.uint8)])
        return state, np.int64(state.nbytes)

    ds = hr.Dataset.range(len(growth)).scan(np.zeros(0, np.uint8), step)
    seen: list[int] = []
    with pytest.raises(hr.MemoryBudgetError, match=r"scan\(.*carried state"):
        for size in ds.with_options(hr.Options(memory_budget=budget)):
            seen.append(int(size))
    assert seen and max(seen) <= budget  # refused before the state passed the budget
    assert int(np.cumsum(growth)[len(seen)]) > budget // 2  # not refused far too early

    small = hr.Dataset.range(len(growth)).scan(np.int64(0), lambda s, i: (s + i, s * 2))
    expected = list(small.with_options(HUGE))
    assert list(small.with_options(hr.Options(memory_budget=budget))) == expected


@pytest.mark.parametrize("seed", range(3))
def test_rebatch_refuses_before_it_gathers_past_the_budget(seed: int) -> None:
    """batch(k).rebatch(n) whose output cannot fit: the refusal comes before the
    input batches were pulled past the budget (they were all gathered first), and a
    rebatch that fits gives the oracle's batches."""
    rng = random.Random(seed)
    row, inner, budget = rng.choice([256 << 10, 1 * MiB]), rng.choice([3, 5, 10]), 16 * MiB
    made = [0]
    lock = threading.Lock()

    def make(i: Any) -> np.ndarray[Any, Any]:
        with lock:
            made[0] += 1
        return np.full(row // 8, int(i), np.float64)

    wanted = 3 * budget // row  # three budgets' worth of rows in one output
    ds = hr.Dataset.range(2 * wanted).map(make).batch(inner).rebatch(wanted)
    with pytest.raises(hr.MemoryBudgetError, match="rebatch"):
        list(ds.with_options(hr.Options(memory_budget=budget)))
    assert made[0] * row <= budget + (inner + 1) * row, (made[0], row)

    fits = hr.Dataset.range(50).map(make).batch(inner).rebatch(rng.choice([2, 3]))
    got = [b.tolist() for b in fits.with_options(hr.Options(memory_budget=budget))]
    assert got == [b.tolist() for b in fits.with_options(HUGE)]


@pytest.mark.parametrize("seed", range(3))
def test_a_refused_batch_of_records_states_its_whole_need(seed: int, tmp_path: Any) -> None:
    """TFRecordDataset(...).batch(n) whose batch cannot fit: the refusal comes while the
    batch is gathered, and it states what the whole batch needs (n records at their
    size), not the part gathered when it stopped, which the budget could hold."""
    import re

    from headrace.io.tfrecord import write_tfrecord

    rng = random.Random(seed)
    record, budget = rng.choice([256 << 10, 512 << 10, 1 * MiB]), 8 * MiB
    count = budget // record + rng.randint(2, 8)  # more than the budget can hold
    path = str(tmp_path / "s.tfrecord")
    write_tfrecord(path, [bytes([k % 256]) * record for k in range(2 * count)])
    ds = hr.TFRecordDataset(path).batch(count)
    with pytest.raises(hr.MemoryBudgetError) as refused:
        list(ds.with_options(hr.Options(memory_budget=budget)))
    stated = re.search(r"needs ([\d.]+) (KiB|MiB)", str(refused.value))
    assert stated, str(refused.value)
    need = float(stated.group(1)) * (1 << (10 if stated.group(2) == "KiB" else 20))
    assert need >= 0.99 * count * record > budget, (str(refused.value)[:300], count, record)
