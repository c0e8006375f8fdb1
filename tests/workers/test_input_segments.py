"""A process pool's pooled input segments: sized to what a chunk carries, and replaced
when the chunks have become much smaller.

Why it matters: each pooled input segment is booked on the stage's share for as long as
it is pooled. Sized to the next power of two and never shrunk, an image map's two
workers held 4.5-7 MB of them on a 33 MB share, up to twice what their chunks carried,
and the map's calls had that much less room.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import process_fns
import pytest
from segments import own_segments

from headrace._memory.budget import MemoryBudget
from headrace._workers import processes
from headrace._workers.shm import SegmentPool

MIB = 1 << 20
KIB = 1 << 10


@pytest.fixture
def pool_and_account() -> object:
    budget = MemoryBudget(256 * MIB)
    account = budget.account("test", weight=1)
    budget.allot()
    pool = processes.ProcessPool(len, 1, "test", book_idle=account.admit)
    yield pool, account
    pool.shutdown()
    assert account.held == 0  # every pooled segment's booking went with it
    assert own_segments() == []


def _records(count: int, kib: int) -> list[bytes]:
    return [bytes([n]) * (kib * KIB) for n in range(count)]


def _pooled(pool: processes.ProcessPool) -> list[int]:
    """The capacities of the worker's pooled input segments."""
    return sorted(size for _, size, _ in pool.workers[0].inputs.segments.values())


def test_an_input_segment_is_the_chunk_and_a_quarter_not_the_next_power_of_two(
        pool_and_account: tuple[processes.ProcessPool, object]) -> None:
    pool, account = pool_and_account
    outputs, failed, _, _ = pool.submit(_records(3, 200)).result(timeout=30)
    assert outputs == [200 * KIB] * 3 and failed is None
    expected = SegmentPool.capacity_for(600 * KIB + 150 * KIB)
    assert _pooled(pool) == [expected]
    assert expected < 1 * MIB  # (the former size)
    assert account.held == expected  # booked while pooled


def test_a_chunk_a_little_larger_or_smaller_reuses_the_segment(
        pool_and_account: tuple[processes.ProcessPool, object]) -> None:
    pool, account = pool_and_account
    pool.submit(_records(3, 200)).result(timeout=30)
    first = _pooled(pool)
    for records in (_records(7, 100), _records(2, 200), _records(3, 200)):
        outputs = pool.submit(records).result(timeout=30)[0]
        assert outputs == [len(r) for r in records]
    assert _pooled(pool) == first
    assert pool.traffic.segments == 1  # one segment made in all
    assert account.held == first[0]


def test_chunks_that_became_much_smaller_get_a_segment_their_size(
        pool_and_account: tuple[processes.ProcessPool, object]) -> None:
    """Once the worker's last chunks are all much smaller than its idle segment, that
    segment is dropped (the worker told to unmap it) and one sized to them takes its
    place, booked by part of the large one's booking; the results are unchanged. A
    single small chunk does not do it: chunks vary from call to call."""
    pool, account = pool_and_account
    pool.submit(_records(8, 200)).result(timeout=30)
    large = SegmentPool.capacity_for(2000 * KIB)
    assert _pooled(pool) == [large]
    history = processes._INPUT_HISTORY
    for n in range(history - 1):  # the large chunk is still among the last few
        assert pool.submit(_records(1, 100 + n)).result(timeout=30)[0] == [(100 + n) * KIB]
        assert _pooled(pool) == [large] and account.held == large
    outputs = pool.submit(_records(1, 100)).result(timeout=30)[0]
    assert outputs == [100 * KIB]
    small = SegmentPool.capacity_for((100 + history - 2) * KIB * 5 // 4)
    assert _pooled(pool) == [small]
    assert account.held == small
    assert pool.traffic.segments == 2
    # the worker unmapped the dropped one with that task, and goes on with the new one
    outputs = pool.submit(_records(1, 110)).result(timeout=30)[0]
    assert outputs == [110 * KIB] and _pooled(pool) == [small]


@contextlib.contextmanager
def _two_pooled(room: int) -> Iterator[tuple[processes.ProcessPool, object, int]]:
    """A pool whose worker has two pooled input segments of 100 KiB chunks (two calls
    in flight at once), on a share of ``room`` bytes; their capacity. Shut down after,
    with every segment's booking returned and no segment left."""
    budget = MemoryBudget(room)
    account = budget.account("test", weight=1)
    budget.allot()

    def book_idle(nbytes: int) -> object:  # as the process map books: only within room
        return account.admit(nbytes) if nbytes <= account.room() else None

    pool = processes.ProcessPool(functools.partial(process_fns.len_after, 0.3), 1, "test",
                                 book_idle=book_idle)
    first = pool.submit(_records(1, 100))
    second = pool.submit(_records(1, 100))  # the first one's segment is busy
    assert first.result(timeout=30)[0] == second.result(timeout=30)[0] == [100 * KIB]
    small = SegmentPool.capacity_for(125 * KIB)
    assert _pooled(pool) == [small, small] and account.held == 2 * small
    try:
        yield pool, account, small
    finally:
        pool.shutdown()
    assert account.held == 0
    assert own_segments() == []


def test_chunks_that_outgrew_the_segments_get_a_larger_one_booked_before_the_small_goes() -> None:
    with _two_pooled(256 * MIB) as (pool, account, small):
        outputs = pool.submit(_records(3, 200)).result(timeout=30)[0]
        assert outputs == [200 * KIB] * 3
        large = SegmentPool.capacity_for(750 * KIB)
        assert _pooled(pool) == [small, large]
        assert account.held == small + large
        assert pool.traffic.segments == 3


def test_without_room_for_a_larger_segment_the_chunk_goes_one_shot_and_the_pool_stays() -> None:
    """The difference does not fit the share: the small segments stay pooled and booked,
    the large chunk travels in a one-shot segment (unlinked with its call)."""
    with _two_pooled(1 * MIB) as (pool, account, small):
        outputs = pool.submit(_records(5, 200)).result(timeout=30)[0]
        assert outputs == [200 * KIB] * 5
        assert _pooled(pool) == [small, small] and account.held == 2 * small
        assert pool.traffic.segments == 3
        # the small chunks still reuse the pooled segments
        assert pool.submit(_records(1, 90)).result(timeout=30)[0] == [90 * KIB]
        assert pool.traffic.segments == 3


def test_a_larger_segment_booked_past_the_share_is_booked_whole() -> None:
    """A caller whose bookings may pass its share (an overdraft, which cannot be joined
    to a plain booking): the larger segment is booked whole, the small one's booking
    released, and no byte is booked twice or not at all."""
    with _two_pooled(1 * MIB) as (pool, account, small):
        pool.book_idle = account.overdraw
        outputs = pool.submit(_records(5, 200)).result(timeout=30)[0]
        assert outputs == [200 * KIB] * 5
        large = SegmentPool.capacity_for(1250 * KIB)
        assert _pooled(pool) == [small, large]
        assert account.held == small + large
