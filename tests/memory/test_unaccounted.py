"""stats().unaccounted: memory the process grew by that no live pipeline booked (G7)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

import headrace as hr
from headrace._memory.system import LiveRuns, ProcessMemory, live_runs

MiB = 1 << 20


def _pipeline() -> hr.Dataset:
    rows = hr.Dataset.from_generator(
        lambda: (np.ones(1 << 18, np.uint8) for _ in range(400)),
        output_signature=hr.TensorSpec((1 << 18,), "uint8"),
    )
    return rows.prefetch(16).with_options(hr.Options(memory_budget="32MiB"))


def test_memory_the_loop_holds_shows_as_unaccounted_and_bookings_do_not() -> None:
    gc.collect()
    with iter(_pipeline()) as iterator:
        for _ in range(20):
            next(iterator)
        before = iterator.stats()
        hidden = np.ones(96 * MiB, np.uint8)  # the training loop's memory, touched
        after = iterator.stats()
        # what the loop allocated is the pipeline's to explain: it is not booked
        assert after.unaccounted - before.unaccounted >= 80 * MiB
        assert after.budget_used <= 32 * MiB
        del hidden


def test_every_live_run_bookings_are_subtracted_from_one_baseline() -> None:
    class Budget:  # what the registry reads of a run's budget
        used = 0

    runs = LiveRuns()
    train, evaluation = Budget(), Budget()
    runs.start(train)
    runs._baseline = 100 * MiB  # the first live run sets it...
    runs.start(evaluation)
    assert runs._baseline == 100 * MiB  # ...a second one does not move it
    train.used, evaluation.used = 10 * MiB, 30 * MiB
    now = ProcessMemory(anonymous=140 * MiB, shared=10 * MiB, file_backed=500 * MiB)
    assert runs.unaccounted(now) == 10 * MiB  # 50 grown, 40 booked; file pages not charged
    runs.stop(evaluation)
    assert runs.unaccounted(now) == 40 * MiB
    assert runs.unaccounted(ProcessMemory(90 * MiB, 0, 0)) == 0  # never negative


def test_closed_and_dropped_iterators_leave_the_registry() -> None:
    budgets = []
    for _ in range(3):
        with iter(_pipeline()) as iterator:
            next(iterator)
            budgets.append(iterator.context.budget)
            assert iterator.context.budget in live_runs._budgets
    dropped = iter(_pipeline())  # dropped without close(), as a loop that breaks
    next(dropped)
    budgets.append(dropped.context.budget)
    del dropped
    assert all(budget not in live_runs._budgets for budget in budgets)


def test_memory_freed_below_the_baseline_moves_it_down() -> None:
    """A live iterator that outlived the memory around it when it started (another
    test's, a finished epoch's) kept a baseline the process no longer reaches: growth
    from there on was hidden (96 MiB allocated showed as 41)."""

    class Budget:
        used = 0

    runs = LiveRuns()
    budget = Budget()
    runs.start(budget)
    runs._baseline = 100 * MiB
    assert runs.unaccounted(ProcessMemory(40 * MiB, 0, 0)) == 0
    assert runs.unaccounted(ProcessMemory(136 * MiB, 0, 0)) == 96 * MiB


class _Budget:
    """What the registry reads of a run's budget."""

    used = 0

    def __init__(self, total: int) -> None:
        self.total = total


def _watched_heap(monkeypatch: Any, total: int, memory: Any) -> tuple[LiveRuns, _Budget]:
    """A registry with one live run of ``total`` bytes, /proc answered by ``memory()``,
    and the allocator's watch on, from a clean state (no look yet, no floor, one look
    per CHECK_EVERY: not what an earlier pipeline in this process left)."""
    from headrace._memory import allocator, system

    runs = LiveRuns()
    budget = _Budget(total)  # (the registry holds runs weakly: the caller keeps it)
    runs.start(budget)
    runs._baseline = 0
    monkeypatch.setattr(system, "live_runs", runs)
    monkeypatch.setattr(system, "sample_process_memory", memory)
    monkeypatch.setattr(allocator, "_watching", True)
    monkeypatch.setattr(allocator, "_released", 0)
    monkeypatch.setattr(allocator, "_floor", 0)
    monkeypatch.setattr(allocator, "_scale", 1)
    return runs, budget


def test_the_heap_is_trimmed_when_unbooked_memory_grows_and_not_again_for_the_programs_own(
    monkeypatch: Any,
) -> None:
    """Budgets' releases look at the heap every CHECK_EVERY bytes: a growth of unbooked
    memory past a quarter of the largest live budget trims it once; memory that stays
    after the trim (the program's own) raises the floor, and is not trimmed for again."""
    from headrace._memory import allocator

    resident = [0]  # anonymous memory the fake /proc reports
    trims: list[int] = []

    def trim() -> None:
        trims.append(resident[0])
        resident[0] -= 20 * MiB  # the heap's free pages went back; the rest is live

    _runs, _budget = _watched_heap(monkeypatch, 64 * MiB,
                                   lambda: ProcessMemory(resident[0], 0, 0))
    monkeypatch.setattr(allocator, "release_free_heap", trim)
    monkeypatch.setattr(allocator, "_free_heap", lambda: 20 * MiB)

    def release(total: int) -> None:
        for _ in range(total // MiB):
            allocator.note_released(MiB)

    resident[0] = 15 * MiB  # within a quarter of 64 MiB: nothing to trim
    release(allocator.CHECK_EVERY)
    assert trims == []
    resident[0] = 60 * MiB  # grown past it
    release(allocator.CHECK_EVERY - MiB)  # (looked at only every CHECK_EVERY bytes)
    assert trims == []
    release(MiB)
    assert trims == [60 * MiB]
    assert allocator._floor == 40 * MiB  # the program keeps 40 MiB: the new floor
    release(3 * allocator.CHECK_EVERY)
    assert trims == [60 * MiB]  # not trimmed for the program's own memory again
    resident[0] = 40 * MiB + 17 * MiB  # the heap retains again, past the floor
    release(allocator.CHECK_EVERY)
    assert trims == [60 * MiB, 57 * MiB]


def test_looks_at_the_heap_are_spaced_by_an_eighth_of_the_largest_budget(
    monkeypatch: Any,
) -> None:
    """A look costs a /proc read and a walk of the heap (0.2-0.3 ms in a busy process):
    under a 1 GiB budget they come every 128 MiB released, not every 16 MiB, which is
    still twice per allowance (a quarter of the budget); a small budget keeps 16 MiB."""
    from headrace._memory import allocator

    looks: list[int] = []
    _runs, budget = _watched_heap(monkeypatch, 1024 * MiB,
                                  lambda: looks.append(1) or ProcessMemory(0, 0, 0))
    for _ in range(1024 // 4):  # 1 GiB released, 4 MiB at a time
        allocator.note_released(4 * MiB)
    # the first look (at 16 MiB) learns the budget; then one every 128 MiB
    assert len(looks) == 1 + (1024 - 16) // 128
    budget.total = 64 * MiB
    looks.clear()
    allocator._released = 0
    for _ in range(512 // 4):  # the next look learns the smaller budget
        allocator.note_released(4 * MiB)
    assert len(looks) == 1 + (512 - 128) // 16


def test_no_look_at_the_heap_without_the_allocators_tuning(monkeypatch: Any) -> None:
    """Options(tune_allocator=False) (or a platform without glibc) leaves the heap alone."""
    from headrace._memory import allocator

    looks: list[int] = []
    monkeypatch.setattr(allocator, "_watching", False)
    monkeypatch.setattr(allocator, "_trim_if_retaining", lambda: looks.append(1))
    for _ in range(4):
        allocator.note_released(allocator.CHECK_EVERY)
    assert looks == []


def test_memory_the_program_holds_for_a_moment_is_not_trimmed_for(monkeypatch: Any) -> None:
    """A training loop holding each batch for a step makes unbooked memory swing by a
    batch; with little free in the heap that is not retention, and trimming (then
    faulting the pages back in) once a batch cost an image pipeline 8-12% of its CPU.
    Once the heap does hold the allowance in free blocks, it is trimmed."""
    from headrace._memory import allocator

    resident, free, trims = [0], [4 * MiB], [0]

    def trim() -> None:
        trims[0] += 1

    _runs, _budget = _watched_heap(monkeypatch, 64 * MiB,
                                   lambda: ProcessMemory(resident[0], 0, 0))
    monkeypatch.setattr(allocator, "release_free_heap", trim)
    monkeypatch.setattr(allocator, "_free_heap", lambda: free[0])
    for step in range(20):
        resident[0] = 40 * MiB if step % 2 else 0  # a 40 MiB batch held, then let go
        allocator.note_released(allocator.CHECK_EVERY)
    assert trims[0] == 0
    free[0] = 20 * MiB  # the heap now keeps more than a quarter of the budget free
    resident[0] = 40 * MiB
    allocator.note_released(allocator.CHECK_EVERY)
    assert trims[0] == 1
