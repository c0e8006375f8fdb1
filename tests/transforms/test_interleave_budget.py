"""G1 for interleave slots under adversarial element sizes (issue 23).

Each case is drawn from a seed: a run mode (sequential, threads in order,
first ready, AUTOTUNE, worker processes), cycle_length, block_length, and the
inner pipelines' size sequence (tiny then 1000x larger, giants and dwarfs in
turn, one element larger than a slot's part, one larger than the whole budget).
The oracle is the same interleave under a budget large enough for everything.
A run under the test budget must give the oracle's elements (in its order,
or the same multiset where the first ready wins) or stop with
MemoryBudgetError naming the interleave at an element too large for it. The
process tree's growth stays within budget + 10% + 64 MiB, plus one element
where the user's code made one larger than that.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from fuzz_pipelines import PeakGrowth

import headrace as hr

MiB = 1 << 20

#: The least Pss_Anon each worker process was seen to hold: its interpreter and
#: imports, which are its start, not the pipeline's growth.
_worker_floor: dict[int, int] = {}


def _charged() -> int:
    """Pss_Anon + Pss_Shmem of this process and its workers (shared pages counted once,
    a segment still only in its worker counted too), less each worker's start."""
    import os

    from headrace._workers.memory import _descendants, worker_memory

    own = worker_memory(os.getpid())
    total = 0 if own is None else own.charged
    for pid in _descendants(os.getpid()):
        memory = worker_memory(pid)
        if memory is None:
            continue
        floor = min(_worker_floor.get(pid, memory.pss_anon), memory.pss_anon)
        _worker_floor[pid] = floor
        total += memory.charged - floor
    return total

#: mode -> (num_parallel_calls, deterministic, workers)
MODES: dict[str, tuple[Any, bool | None, str]] = {
    "sequential": (None, None, "threads"),
    "threads": (2, True, "threads"),
    "first_ready": (2, False, "threads"),
    "autotune": (hr.AUTOTUNE, True, "threads"),
    "processes": (2, True, "processes"),
}
SEQUENCES = ("regime", "giant_dwarf", "slot_giant")


@dataclass(frozen=True)
class Case:
    seed: int
    mode: str
    cycle: int
    block: int
    shards: int
    per: int
    budget: int
    #: (shard, index) -> size; every other element is ``small``
    small: int
    sizes: tuple[tuple[int, int, int], ...]

    def size(self, shard: int, index: int) -> int:
        for where, at, nbytes in self.sizes:
            if where in (shard, -1) and (at == index or (at < 0 and index >= -at)):
                return nbytes
        return self.small


class Inner:
    """The inner pipeline of one shard: its sizes from the case (picklable, so that
    worker processes can run it). Each element is made as it is yielded: the
    generator keeps no reference to the last one."""

    def __init__(self, case: Case) -> None:
        self.case = case

    def __call__(self, shard: Any) -> Any:
        case, shard = self.case, int(shard)

        def generate() -> Any:
            for index in range(case.per):
                yield np.full(case.size(shard, index), (shard * 31 + index) % 251, np.uint8)

        return hr.Dataset.from_generator(
            generate, output_signature=hr.TensorSpec((None,), np.uint8)
        )


def draw(seed: int, mode: str, sequence: str) -> Case:
    """One case of ``sequence`` in ``mode``, its sizes drawn from ``seed``."""
    rng = random.Random(seed)
    budget = rng.choice((16, 24, 32)) * MiB
    cycle = rng.choice((2, 3, 4))
    block = rng.choice((1, 2, 3))
    shards, per = rng.randint(cycle, 5), rng.randint(16, 40)
    small = rng.choice((64, 128, 256))
    part = budget // cycle
    sizes: list[tuple[int, int, int]]
    if sequence == "regime":  # many tiny, then ~1000x larger in every shard
        at = rng.randint(per // 2, per - 5)
        sizes = [(-1, -at, small * 1000)]
    elif sequence == "giant_dwarf":  # giants (up to a quarter of a part) and dwarfs in turn
        large = part // rng.choice((4, 8, 16))
        sizes = [(-1, index, large) for index in range(1, per, 2)]
    else:  # one element larger than a slot's part, within the budget
        sizes = [(rng.randrange(shards), rng.randrange(per), rng.randint(part + 1, budget - MiB))]
    return Case(seed, mode, cycle, block, shards, per, budget, small, tuple(sizes))


def interleave(case: Case, budget: int) -> hr.Dataset:
    parallel, deterministic, workers = MODES[case.mode]
    ds = hr.Dataset.range(case.shards).interleave(
        Inner(case), cycle_length=case.cycle, block_length=case.block,
        num_parallel_calls=parallel, deterministic=deterministic, workers=workers,
    )
    options = hr.Options()
    options.memory_budget = budget
    return ds.with_options(options)


def consume(ds: hr.Dataset) -> tuple[list[tuple[int, int]], BaseException | None, int]:
    """Each element's (size, first byte), the error that ended the run, and the
    process tree's growth (sampled every 2 ms and at each large element)."""
    seen: list[tuple[int, int]] = []
    error: BaseException | None = None
    with PeakGrowth(measure=_charged) as memory:
        try:
            with iter(ds) as iterator:
                for element in iterator:
                    seen.append((len(element), int(element[0]) if len(element) else -1))
                    if len(element) > MiB:  # (a large one: sampled while it is held)
                        memory.sample()
                    del element  # (the consumer holds one element at most)
        except hr.MemoryBudgetError as raised:
            error = raised
    return seen, error, memory.growth


def check(case: Case, *, largest: int = 0) -> None:
    """The case under its budget against the oracle; ``largest``: an element the user's
    code made that the bound allows on top."""
    oracle, failed, _ = consume(interleave(case, 4 << 30))
    assert failed is None, f"{case}: the oracle failed: {failed}"
    seen, error, growth = consume(interleave(case, case.budget))
    where = f"{case}: {len(seen)} of {len(oracle)} elements, error {error}"
    if case.mode == "first_ready":  # the same elements, in any order
        remaining = list(oracle)
        for element in seen:
            assert element in remaining, where
            remaining.remove(element)
    else:
        assert seen == oracle[: len(seen)], where
    if error is None:
        assert len(seen) == len(oracle), where
    else:  # refused at an element too large for a slot, naming the stage
        assert "interleave" in str(error), where
        part = case.budget // case.cycle
        if case.mode != "first_ready":
            assert oracle[len(seen)][0] > part // 4, where  # (the element refused)
        assert any(size > part // 4 for size, _ in oracle), where
    bound = int(case.budget * 1.1) + 64 * MiB + largest
    assert growth <= bound, f"{where}: grew {growth / MiB:.0f} MiB > {bound / MiB:.0f} MiB"


#: Worker processes take seconds to start on a loaded machine: those cases run as slow.
_MODES = [pytest.param(mode, marks=pytest.mark.slow) if mode == "processes" else mode
          for mode in MODES]


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("sequence", SEQUENCES)
def test_interleave_slots_hold_the_budget_under_adversarial_sizes(
    mode: str, sequence: str
) -> None:
    seed = SEQUENCES.index(sequence) * 1000 + list(MODES).index(mode)
    case = draw(seed, mode, sequence)
    largest = max((nbytes for _, _, nbytes in case.sizes), default=0)
    check(case, largest=largest if sequence == "slot_giant" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_many_interleave_cases_hold_the_budget(seed: int) -> None:
    rng = random.Random(seed ^ 0x1E4F)
    mode, sequence = rng.choice(list(MODES)), rng.choice(SEQUENCES)
    case = draw(seed, mode, sequence)
    largest = max((nbytes for _, _, nbytes in case.sizes), default=0)
    check(case, largest=largest if sequence == "slot_giant" else 0)


@pytest.mark.parametrize(
    "mode", ["threads", "first_ready", pytest.param("processes", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("seed", range(2))
def test_an_inner_element_larger_than_the_budget_is_refused_within_the_bound(
    mode: str, seed: int
) -> None:
    """128 MiB made by an inner pipeline under a 16 MiB budget: MemoryBudgetError names
    the interleave, after every element before it, and the tree grows by that element at
    most beyond the bound. In a worker process the element is dropped before it is
    copied into shared memory (it grew by two copies of it, and lost the elements before
    it in its chunk)."""
    giant = 128 * MiB
    rng = random.Random(seed)
    case = Case(
        seed, mode, rng.choice((2, 3)), rng.choice((1, 2)), 4, 12, 16 * MiB, 100,
        ((rng.randrange(4), rng.randrange(2, 10), giant),),
    )
    check(case, largest=giant)


@pytest.mark.parametrize(
    ("seeds", "processes"),
    [((200, 201), False), pytest.param((202, 203, 204, 205), False, marks=pytest.mark.slow),
     pytest.param((313, 328), True, marks=pytest.mark.slow)],
)
def test_pipelines_over_adversarial_interleave_slots_hold_the_budget(
    seeds: tuple[int, ...], processes: bool
) -> None:
    """The budget fuzzer's pipelines, their source an interleave whose slots make
    adversarial size sequences (``fuzz_pipelines.slot_spec``): every booking within its
    share, the accounted peak within the budget (but overdrafts), the growth within
    budget + 10% + 64 MiB, whether the run finishes or is refused."""
    from fuzz_pipelines import slot_spec
    from tests.generators.test_budget_fuzz import assert_within_budget, run_specs

    for result in run_specs([slot_spec(seed, processes=processes) for seed in seeds]):
        assert_within_budget(result)
