"""Worker processes within the budget. A process map books its workers' own memory:
more workers than the budget holds start fewer, with a warning. A process
interleave's slot holds its part once, not once in the worker and once here. In
each case the process tree stays within the measured bound."""

from __future__ import annotations

import os
import random
import threading
import warnings
from pathlib import Path

import process_fns
import pytest

import headrace as hr
from headrace._errors import HeadraceWarning
from headrace._transforms.process_map import WORKER_BASELINE_BYTES
from headrace._workers.memory import tree_charged

MIB = 1 << 20


def _pipeline(count: int, workers: int, budget: int) -> hr.Dataset:
    return (
        hr.Dataset.range(count).batch(10)
        .map(process_fns.square, num_parallel_calls=workers, workers="processes")
        .with_options(hr.Options(memory_budget=budget))
    )


def _most_workers(budget: int) -> int:
    """Workers a stage whose share is at most ``budget`` may start: the first, plus
    those whose baseline fits half the share."""
    return 1 + (budget // 2) // WORKER_BASELINE_BYTES


def test_more_workers_than_the_budget_holds_start_fewer_and_say_so() -> None:
    budget = 16 * MIB
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with iter(_pipeline(200, 8, budget)) as iterator:
            values = [batch.tolist() for batch in iterator]
            (workers,) = iterator.stats().workers
    assert values == [[(10 * b + k) ** 2 for k in range(10)] for b in range(20)]
    assert 1 <= workers.count <= _most_workers(budget) < 8
    assert f"{workers.count} of 8 workers fit" in workers.reason
    (warning,) = [w for w in caught if issubclass(w.category, HeadraceWarning)]
    text = str(warning.message)
    assert "stage 'map(" in text and f"starts {workers.count} worker" in text and "not 8" in text


def test_workers_that_fit_start_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeadraceWarning)
        with iter(_pipeline(60, 2, 256 * MIB)) as iterator:
            assert len(list(iterator)) == 6
            (workers,) = iterator.stats().workers
    assert workers.count == 2


class _Peak:
    """The largest PSS (anonymous + shared) of this process tree, sampled on a thread."""

    def __init__(self) -> None:
        self.base = self.peak = tree_charged(os.getpid())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, tree_charged(os.getpid()))

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_charged(os.getpid()))


@pytest.mark.parametrize("seed", range(2))
def test_many_workers_keep_the_process_tree_within_the_measured_bound(seed: int) -> None:
    rng = random.Random(seed)
    workers, budget = rng.randint(24, 32), rng.choice([16, 20]) * MIB
    count = rng.randrange(3000, 6000, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadraceWarning)
        with _Peak() as peak, iter(_pipeline(count, workers, budget)) as iterator:
            total = sum(int(batch.sum()) for batch in iterator)
    assert total == sum(x * x for x in range(count))  # the oracle: every element, once
    bound = budget * 1.1 + 64 * MIB
    growth = peak.peak - peak.base
    assert growth <= bound, (seed, workers, budget // MIB, growth / MIB, bound / MIB)


@pytest.mark.parametrize("seed", range(2))
def test_a_process_interleave_slot_holds_its_part_once(seed: int, tmp_path: Path) -> None:
    """The inner pipeline in a worker and the slot's chunks in flight share the slot's
    part: the tree stays within the bound, whether the pipeline runs or is refused."""
    import functools

    from headrace.io.tfrecord import write_tfrecord

    rng = random.Random(seed)
    inner_batch, budget = rng.randint(4, 6), rng.choice([24, 32]) * MIB
    files = []
    for k in range(4):
        path = tmp_path / f"s{k}.tfrecord"
        write_tfrecord(str(path), [bytes([k]) * MIB] * rng.randint(12, 24))
        files.append(str(path))
    fn = functools.partial(process_fns.record_batches, inner_batch)
    ds = (hr.Dataset.from_tensor_slices(files)
          .interleave(fn, cycle_length=4, num_parallel_calls=4, workers="processes")
          .with_options(hr.Options(memory_budget=budget)))
    got: list[bytes] = []
    refused = None
    with _Peak() as peak:
        try:
            with iter(ds) as iterator:
                for batch in iterator:
                    got.extend(bytes(record[:1]) for record in batch)
                    del batch
        except hr.MemoryBudgetError as error:
            refused = str(error)
    growth, bound = peak.peak - peak.base, budget * 1.1 + 64 * MIB
    assert growth <= bound, (seed, inner_batch, budget // MIB, growth / MIB, bound / MIB)
    if refused is None:  # the oracle: the sequential interleave's records, in order
        expected = hr.Dataset.from_tensor_slices(files).interleave(fn, cycle_length=4)
        assert got == [bytes(r[:1]) for b in expected for r in b]
    else:
        assert "batch" in refused and f"{inner_batch} records" in refused
