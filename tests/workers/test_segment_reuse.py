"""Result segments are reused, not made afresh for each call, and a kept output is never
overwritten by a later one; a worker's large temporaries do not fault in fresh pages.

Why it matters: a fresh segment costs a page fault per 4 KiB page where the worker
writes it and again where the consumer reads it, more than the copy of the output
itself (an image pipeline's 600 KB outputs: ~0.4 ms each, against ~0.1 ms of copy).
"""

from __future__ import annotations

import functools
import gc
import sys

import numpy as np
import process_fns
import pytest
from segments import own_segments

import headrace as hr
from headrace._memory.budget import MemoryBudget
from headrace._workers import processes

MIB = 1 << 20


def _minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (field 10 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.parametrize("kib", [200, 1024])
def test_a_call_spanning_several_segments_keeps_them_all_for_reuse(kib: int) -> None:
    """A chunk of thirty 200 KiB outputs takes several segments (a segment holds at most
    4 MiB); ten outputs of 1 MiB take ten (each large output has its own). Once its
    outputs are gone all are kept idle (booked), and the next calls reuse them: no
    segment is made after the first call. Kept to two, the rest were made afresh by
    every call."""
    budget = MemoryBudget(256 * MIB)
    account = budget.account("test", weight=1)
    budget.allot()
    pool = processes.ProcessPool(
        functools.partial(process_fns.filled_kib, kib), 1, "test", book_idle=account.admit)
    count = 30 if kib < 1024 else 10
    try:
        opened_after_first = 0
        for call in range(6):
            values = list(range(call * count, call * count + count))
            outputs = pool.submit(values).result(timeout=30)[0]
            assert [float(o[0]) for o in outputs] == [float(v) for v in values]
            del outputs
            gc.collect()
            pool.recycle()
            if call == 0:
                opened_after_first = pool.maps[0].opened
                if kib < 1024:  # (the first call's segments grow: it has no call before it)
                    assert opened_after_first >= 2, opened_after_first
                else:
                    assert opened_after_first == 10, opened_after_first
        assert pool.maps[0].opened == opened_after_first, pool.maps[0].opened
        # every idle segment is booked (G1), and nothing else is held
        held = account.held
        assert held == sum(pool.maps[0].maps[key][1] for key in pool.workers[0].idle)
        assert held >= 5 * MIB
    finally:
        pool.shutdown()
    assert account.held == 0
    assert own_segments() == []


def test_kept_outputs_are_never_overwritten_while_segments_are_reused() -> None:
    """A map whose consumer keeps every fifth output while dropping the rest: the dropped
    outputs' segments are reused for later calls, and each kept output still holds its
    own values at the end (a segment is reused only once no array views it)."""
    ds = (hr.Dataset.range(240)
          .map(functools.partial(process_fns.filled_kib, 384), num_parallel_calls=2,
               workers="processes")
          .with_options(hr.Options(memory_budget="128MiB")))
    kept: list[tuple[int, np.ndarray]] = []  # type: ignore[type-arg]
    iterator = iter(ds)
    for index, output in enumerate(iterator):
        if index % 5 == 0:
            kept.append((index, output))
        del output
    workers = [s for s in iterator.stats().workers if s.kind == "processes"]
    assert workers and workers[0].elements == 240
    assert len(kept) == 48
    for index, output in kept:
        assert output.shape == (384 * 256,)
        assert np.all(output == float(index)), (index, np.unique(output)[:5])
    del iterator, kept
    assert own_segments() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_a_workers_large_temporaries_come_from_its_heap_not_fresh_pages() -> None:
    """A function that fills a 600 KB temporary per element (a decoded image) faults in
    its pages once, not per element: glibc's mmap threshold, fixed at 128 KiB once a
    worker sets its heap's top pad, mapped every such block afresh (~150 faults each)."""
    pool = processes.ProcessPool(functools.partial(process_fns.scratch_sum, 600), 1, "test")
    try:
        assert pool.submit([0, 1]).result(timeout=30)[0] == [600 * 256, 1 + 600 * 256]
        (pid,) = pool.pids
        before = _minor_faults(pid)
        for start in range(0, 40, 10):
            outputs = pool.submit(list(range(start, start + 10))).result(timeout=30)[0]
            assert outputs == [v + 600 * 256 for v in range(start, start + 10)]
        faults = _minor_faults(pid) - before
    finally:
        pool.shutdown()
    # 40 elements: per element a fresh mapping would be ~150 faults (6,000 in all)
    assert faults < 40 * 20, faults
    assert own_segments() == []

