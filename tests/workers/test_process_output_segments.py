"""Large outputs of a process map: each in a segment of its own, booked at its own size,
and idle segments lent to the calls that write into them.

Why it matters: an image map's 600 KB outputs shared segments sized for a chunk, and
chunks vary in length, so a reused segment's unused end rode on the outputs' bookings
(each booked at 1.2-2.4x its size) and half the calls made fresh segments. The map
learns its estimate of the next outputs from those bookings, and with idle segments
booked beside the calls that would fill them, its calls took 2-4 images each.
"""

from __future__ import annotations

import functools
import gc
import time
from pathlib import Path

import numpy as np
import process_fns
from segments import own_segments

import headrace as hr
from headrace._memory.budget import MemoryBudget
from headrace._memory.inflight import InFlight, Ticket
from headrace._workers import processes

MIB = 1 << 20
KIB = 1 << 10
PAGE = 4096


def _pool(kib: int) -> tuple[processes.ProcessPool, object]:
    budget = MemoryBudget(256 * MIB)
    account = budget.account("test", weight=1)
    budget.allot()
    pool = processes.ProcessPool(
        functools.partial(process_fns.filled_kib, kib), 1, "test", book_idle=account.admit,
        book_slack=account.overdraw, lend_idle=True)
    return pool, account


def test_each_large_output_has_its_own_segment_and_its_slack_is_booked_with_it() -> None:
    """Ten outputs of 601 KiB come back in ten segments of 151 pages each. The 3 KiB
    of each that no array covers is booked while the segment's output lives (not on the
    output, where the map would learn it as part of the output's size), and released
    when the segment is released: then the segment is booked whole, idle."""
    pool, account = _pool(601)
    try:
        outputs, failed, _, slack = pool.submit(list(range(10))).result(timeout=30)
        assert failed is None and slack == 0
        assert [float(o[0]) for o in outputs] == [float(v) for v in range(10)]
        capacity = -(-601 * KIB // PAGE) * PAGE
        assert pool.maps[0].opened == 10
        assert account.held == 10 * (capacity - 601 * KIB)  # the slack, nothing else
        del outputs
        gc.collect()
        pool.recycle()
        assert account.held == 10 * capacity  # idle, booked whole
        assert len(pool.workers[0].idle) == 10
    finally:
        pool.shutdown()
    assert account.held == 0
    assert own_segments() == []


def test_a_call_in_flight_covers_the_idle_segments_it_is_lent() -> None:
    """Four idle segments of 600 KiB, booked. A call whose allowance (booked by the
    caller, as the map books a call's outputs) holds four outputs is lent all four: their
    own bookings go while it runs, so each byte is booked once, and it writes its outputs
    into them (no segment is made). A call lent more than it uses gives the rest back:
    booked again once it ends. A kept output is never overwritten."""
    pool, account = _pool(600)
    size = 600 * KIB
    try:
        first = pool.submit([0, 1, 2, 3]).result(timeout=30)[0]
        del first
        gc.collect()
        pool.recycle()
        assert account.held == 4 * size and pool.maps[0].opened == 4
        ticket = account.book_existing_total([4 * size + 4 * PAGE], count=False)
        future = pool.submit([4, 5, 6, 7], allowance=ticket.nbytes)
        assert account.held == ticket.nbytes  # the idle segments' bookings were lent
        kept = future.result(timeout=30)[0]
        del future  # (it holds the result)
        ticket.release()
        assert [float(o[0]) for o in kept] == [4.0, 5.0, 6.0, 7.0]
        assert pool.maps[0].opened == 4  # written into the lent segments
        assert account.held == 0  # (a raw pool books no outputs: the map does)
        # a call lent four segments that runs two: the two left are booked again
        more = pool.submit([8, 9, 10, 11]).result(timeout=30)[0]  # four fresh segments
        del more
        gc.collect()
        pool.recycle()
        assert account.held == 4 * size
        ticket = account.book_existing_total([4 * size + 4 * PAGE], count=False)
        two = pool.submit([12, 13], allowance=ticket.nbytes).result(timeout=30)[0]
        ticket.release()
        assert account.held == 2 * size
        assert [float(o[0]) for o in two] == [12.0, 13.0]
        assert all(np.all(o == float(v)) for o, v in zip(kept, [4, 5, 6, 7], strict=True))
        del kept, two
        gc.collect()
        pool.recycle()
        assert account.held == 8 * size
    finally:
        pool.shutdown()
    assert account.held == 0
    assert own_segments() == []


def test_outputs_of_one_size_from_inputs_of_many_are_booked_at_their_size() -> None:
    """A 600 KB output from inputs of 20-100 KB (JPEGs decoded to one size): the map books
    each call's inputs at the largest output seen, not at the largest output/input ratio
    (that of the smallest input: 30x), which booked a 100 KB input at 3 MB."""
    budget = MemoryBudget(64 * MIB)
    account = budget.account("map", weight=1)
    budget.allot()
    ledger = InFlight(account)
    inputs = [20_000 + 8_000 * k for k in range(11)]  # 20 KB .. 100 KB
    output = 600 * KIB
    for booked in ledger.settle(Ticket(), [output] * len(inputs), inputs, whole=True):
        assert not isinstance(booked, Exception)
        booked.release()
    assert ledger.expect(b"", 20_000) == output
    assert ledger.expect(b"", 100_000) == output
    # outputs that grow with their inputs: a larger input than any seen, at the ratio
    assert ledger.expect(b"", 1_000_000) == 10 * output


def test_a_process_map_of_fixed_size_outputs_runs_long_calls() -> None:
    """End to end: 600 KiB outputs from inputs of 20-100 KB under a 48 MiB budget, where
    the room the map's share has left sizes its calls. They were cut by bookings of
    1.2-3 MB per output (the ratio, each segment's unused end, idle segments beside the
    calls that fill them); now the map books what its outputs cost."""
    ds = (hr.Dataset.range(300)
          .map(lambda i: bytes(20_000 + (int(i) * 7919) % 80_000))
          .map(functools.partial(process_fns.fixed_from_bytes, 600), num_parallel_calls=2,
               workers="processes")
          .with_options(hr.Options(memory_budget="48MiB")))
    iterator = iter(ds)
    lengths = [float(output[0]) for output in iterator]
    assert lengths == [float(20_000 + (i * 7919) % 80_000) for i in range(300)]
    (workers,) = [s for s in iterator.stats().workers if s.kind == "processes"]
    assert workers.elements == 300
    # (2.7-2.8 elements per call before, 6.8-8.3 now)
    assert workers.elements / workers.chunks >= 5, (workers.elements, workers.chunks)
    del iterator
    assert own_segments() == []


def test_segments_released_while_a_call_runs_reach_the_calls_queued_behind_it(
    tmp_path: Path,
) -> None:
    """Four outputs released while the worker runs a slow call, with another call queued
    behind it: the worker hears of the free segments at once, not with its next task, so
    the queued call reuses them instead of making four more."""
    budget = MemoryBudget(256 * MIB)
    account = budget.account("test", weight=1)
    budget.allot()
    gate = tmp_path / "gate"  # the slow call's first element waits for it (not a sleep:
    # a loaded machine can take longer than any sleep to release the outputs)
    pool = processes.ProcessPool(
        functools.partial(process_fns.gated_filled, 600, str(gate)), 1, "test",
        book_idle=account.admit, book_slack=account.overdraw, lend_idle=True)
    try:
        first = pool.submit([1, 2, 3, 4]).result(timeout=30)[0]
        slow = pool.submit([-5, 6, 7, 8])  # its first element waits: released meanwhile
        queued = pool.submit([9, 10, 11, 12])
        del first
        gc.collect()
        pool.recycle()  # the four segments are free: told to the worker now
        time.sleep(1.0)  # (the worker reads it while its call waits)
        gate.touch()
        results = [slow.result(timeout=30)[0], queued.result(timeout=30)[0]]
        assert [[float(o[0]) for o in r] for r in results] == [[5, 6, 7, 8], [9, 10, 11, 12]]
        assert pool.maps[0].opened == 8, pool.maps[0].opened  # (12 when told with a task)
        del slow, queued, results
    finally:
        pool.shutdown()
    assert own_segments() == []
