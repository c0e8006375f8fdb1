"""Batches reuse the memory of batches the consumer let go of, and never of one it kept.

A large batch (a column of at least ``POOLED_BYTES``) comes from the batch stage's
``ArrayPool``: its memory goes back to the pool only when no array, view, memoryview
or tensor over it is left. These tests keep batches in every way a user does and
check, after the run, that each still holds its own rows.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._memory.allocator import _PAGE_MARGIN, POOLED_BYTES, ArrayPool

ROWS = 8
SIDE = 256  # 8 x 256 x 256 float32 = 2 MiB a batch: pooled


def _element(i: Any) -> Any:
    return np.full((SIDE, SIDE), i, np.float32), np.int64(i)


def _dataset(count: int = 96) -> Any:
    return hr.Dataset.range(count).map(_element).batch(ROWS)


def _address(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


def _expect_rows(images: np.ndarray[Any, Any], first: int) -> None:
    want = np.arange(first, first + len(images), dtype=np.float32)
    assert images.shape[1:] == (SIDE, SIDE)
    # every pixel of every row: a reuse would have overwritten them with later rows
    np.testing.assert_array_equal(images, np.broadcast_to(want[:, None, None], images.shape))


def _pools() -> list[ArrayPool]:
    return [o for o in gc.get_objects() if type(o) is ArrayPool]


def _run(dataset: Any) -> tuple[int, int, Any]:
    """Iterate, dropping each batch before the next: (arrays the batch stage's pool
    handed out, how many of them reused released memory, the batch stage's stats)."""
    before = set(map(id, _pools()))
    with iter(dataset) as iterator:
        (pool,) = [p for p in _pools() if id(p) not in before]
        for index, (images, labels) in enumerate(iterator):
            _expect_rows(images, index * ROWS)
            np.testing.assert_array_equal(labels, np.arange(index * ROWS, (index + 1) * ROWS))
            del images, labels
        (stage,) = [s for s in iterator.stats().stages if s.name == "batch"]
    return pool.handed, pool.reused, stage


def test_released_batches_are_reused() -> None:
    handed, reused, _ = _run(_dataset())
    assert handed == 12 and reused >= 10


def test_kept_batches_are_never_overwritten() -> None:
    import torch

    kept: dict[int, Any] = {}
    with iter(_dataset(192)) as iterator:
        for index, (images, _labels) in enumerate(iterator):
            how = index % 6
            if how == 0:
                kept[index] = images  # the batch itself
            elif how == 1:
                kept[index] = images[2:5]  # a view of some rows (the batch is dropped)
            elif how == 2:
                kept[index] = memoryview(images)  # a buffer export
            elif how == 3:
                kept[index] = torch.from_numpy(images)  # a tensor sharing the memory
            elif how == 4:
                kept[index] = [images.reshape(-1)]  # a reshaped view inside a container
            # how == 5: dropped, so its memory goes round again
            del images
            gc.collect() if index % 7 == 0 else None
    assert len(kept) == 20
    for index, value in kept.items():
        first = index * ROWS
        how = index % 6
        if how == 1:
            _expect_rows(value, first + 2)
        elif how == 2:
            _expect_rows(np.asarray(value), first)
        elif how == 3:
            _expect_rows(value.numpy(), first)
        elif how == 4:
            _expect_rows(value[0].reshape(ROWS, SIDE, SIDE), first)
        else:
            _expect_rows(value, first)


def test_kept_batches_through_prefetch_and_threads() -> None:
    """A parallel map and prefetch between the batch and the consumer: the consumer keeps
    every third batch and the memory of the others goes round under it."""
    ds = (hr.Dataset.range(240).map(_element, num_parallel_calls=2).batch(ROWS)
          .prefetch(3))
    kept = []
    with iter(ds) as iterator:
        for index, (images, _labels) in enumerate(iterator):
            if index % 3 == 0:
                kept.append((index, images))
    for index, images in kept:
        _expect_rows(images, index * ROWS)


def test_pool_reuses_only_released_memory_of_the_same_size() -> None:
    pool = ArrayPool(keep_bytes=2 << 20)
    first = pool.empty((4, 512, 256), np.float32)  # 2 MiB
    address = _address(first)
    held = pool.empty((4, 512, 256), np.float32)
    assert _address(held) != address  # `first` is still alive
    del first
    again = pool.empty((4, 512, 256), np.float32)
    assert _address(again) == address and pool.reused == 1
    view = again[1:]
    del again
    other = pool.empty((4, 512, 256), np.float32)
    assert _address(other) != address  # a view keeps the memory out of the pool
    del view, other, held
    assert pool.idle_bytes() == 2 << 20  # one released array kept, not three
    different = pool.empty((2, 512, 256), np.float32)  # another size: fresh memory
    assert pool.reused == 1 and pool.idle_bytes() == 0
    del different
    pool.close()
    assert pool.idle_bytes() == 0
    assert pool.empty((4, 512, 256), np.float32).base is None  # closed: plain np.empty


def test_small_and_object_arrays_are_plain() -> None:
    pool = ArrayPool(keep_bytes=8 << 20)
    small = pool.empty((16,), np.float32)
    assert small.base is None and small.nbytes < POOLED_BYTES
    objects = pool.empty((POOLED_BYTES,), object)
    assert objects.base is None and all(v is None for v in objects[:4])


def test_released_memory_is_reused_with_its_dtype_and_alignment() -> None:
    pool = ArrayPool(keep_bytes=4 << 20)
    first = pool.empty((3, 1 << 18), np.float32)
    del first
    again = pool.empty((1 << 17, 3), np.complex128)  # the same bytes, another shape/dtype
    assert again.dtype == np.complex128 and again.shape == (1 << 17, 3)
    assert _address(again) % 16 == 0 and again.flags.c_contiguous and again.flags.writeable
    again[:] = 1 + 2j
    assert again.sum() == (1 + 2j) * again.size


def test_release_from_another_thread() -> None:
    pool = ArrayPool(keep_bytes=2 << 20)
    box = [pool.empty((1 << 19,), np.float32)]
    address = _address(box[0])
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert _address(pool.empty((1 << 19,), np.float32)) == address


@pytest.mark.parametrize("keep", [0, 2])
def test_pool_keeps_at_most_keep_bytes_of_released_arrays(keep: int) -> None:
    pool = ArrayPool(keep_bytes=keep * (1 << 20) + 100)
    arrays = [pool.empty((1 << 18,), np.float32) for _ in range(4)]
    del arrays
    assert pool.idle_bytes() == keep * (1 << 20)
    pool.clear()
    assert pool.idle_bytes() == 0


def test_tensorflow_feed_takes_a_pooled_batch_only_when_nothing_else_holds_it() -> None:
    # TensorFlow wraps an array's buffer without a copy and may write into it: a pooled
    # batch nobody else holds crosses as it is (its memory returns to the pool when
    # TensorFlow lets go); one the cache keeps is copied, and the copy is what is written.
    import sys

    from headrace._memory.allocator import _Lease
    from headrace.adapters.tf import _Feed

    for cached in (False, True):
        dataset = _dataset(64)
        if cached:
            dataset = dataset.cache()
        feed = _Feed(dataset)
        for _ in range(2 if cached else 1):
            key = int(feed.start())
            previous = sys.gettrace()  # (a tracer's frame snapshots make every array held)
            sys.settrace(None)
            try:
                handed = [feed.pull(key)[0] for _ in range(8)]
            finally:
                sys.settrace(previous)
            feed.finish(key)
            for index, images in enumerate(handed):
                _expect_rows(images, index * ROWS)
                assert (type(images.base) is _Lease) is not cached, (cached, index)
                images[...] = -1  # what a forwarded TensorFlow op may do


def test_owns_pooled() -> None:
    from headrace._memory.allocator import owns_pooled

    pool = ArrayPool(keep_bytes=2 << 20)
    array = pool.empty((1 << 19,), np.float32)
    assert owns_pooled(array)
    assert not owns_pooled(np.empty(1 << 19, np.float32))  # owns its data: not pooled
    view = array[1:]
    assert not owns_pooled(view)  # a view's base is the batch, not the lease
    second = np.asarray(array.base)  # another array over the same lease
    assert not owns_pooled(array)
    del second, view
    assert owns_pooled(array)


def test_the_spare_is_booked_or_the_batch_is_handed_over() -> None:
    # A share with room for a released batch beside the one being made books it as the
    # spare (the stage's peak is two batches). One without still reuses memory: a batch
    # released while the stage waits for its next first element is booked in the room
    # the batch before left, and the next batch is booked over that booking, so the
    # stage's peak stays one batch and nothing is left booked at the end.
    batch_bytes = ROWS * SIDE * SIDE * 4
    handed, reused, stage = _run(_dataset().with_options(hr.Options(memory_budget="64MiB")))
    assert handed == 12 and reused >= 10
    assert stage.peak >= 2 * batch_bytes
    handed, reused, stage = _run(_dataset().with_options(hr.Options(memory_budget="3MiB")))
    assert handed == 12 and reused >= 10
    assert batch_bytes <= stage.peak < 2 * batch_bytes and stage.held == 0


def _budget_account(total: int) -> Any:
    from headrace._memory.budget import MemoryBudget

    budget = MemoryBudget(total)
    account = budget.account("batch", weight=1)
    budget.allot()
    return account


def _booker(account: Any) -> Any:
    def book(nbytes: int) -> Any:
        return account.admit(nbytes, elements=0) if account.room() >= nbytes else None

    return book


def test_a_release_between_batches_is_kept_only_while_booked() -> None:
    from headrace._memory.buffer import Assembly

    account = _budget_account(8 << 20)
    pool = ArrayPool(booker=_booker(account))
    batch = pool.empty((4, 512, 256), np.float32)  # 2 MiB, booked by its maker (here: not)
    address = _address(batch)
    pool.settle()  # the batch is made; the stage waits for the next one's first element
    del batch
    assert pool.idle_bytes() == 2 << 20 and account.stats().held == 2 << 20  # booked
    kept = pool.begin()  # the next batch: booked over the kept booking, not beside it
    assembly = Assembly(account, "a batch")
    assembly.reserve(2 << 20, elements=1, replacing=kept[0])
    assert account.stats().held == 2 << 20 and account.stats().peak == 2 << 20
    again = pool.empty((4, 512, 256), np.float32)
    assert _address(again) == address and pool.reused == 1
    assembly.finish().release()
    assert account.stats().held == 0
    # A release after begin() (the stage is filling a batch) is not booked by the pool.
    pool.settle()
    other = pool.empty((4, 512, 256), np.float32)
    pool.begin()
    del again
    assert pool.idle_bytes() == 0 and account.stats().held == 0
    # With no room on the share, a release between batches is freed at once.
    pool.settle()
    hog = account.admit(account.share(), elements=0)
    del other
    assert pool.idle_bytes() == 0 and account.stats().held == account.share()
    hog.release()
    # clear() gives back what is kept and its booking.
    third = pool.empty((4, 512, 256), np.float32)
    pool.settle()
    del third
    assert account.stats().held == 2 << 20
    pool.clear()
    assert pool.idle_bytes() == 0 and account.stats().held == 0


def test_a_fresh_array_moves_into_memory_released_while_it_is_filled() -> None:
    # A release while a fresh array is filled is kept only with a booking of the fresh
    # array's pages the filler may have touched (the rows it said it writes, a huge page
    # of margin): until the hand-over the process holds both.
    account = _budget_account(64 << 20)
    pool = ArrayPool(booker=_booker(account))
    old = pool.empty((8, 1024, 256), np.float32)
    old_address = _address(old)
    row = 1024 * 256 * 4
    fresh = pool.empty((8, 1024, 256), np.float32, exchange=True)
    assert pool.exchange(fresh, 0) is None  # nothing released yet
    fresh[0] = 0
    assert pool.exchange(fresh, 1) is None
    fresh[1] = 1
    del old  # the consumer lets go of a batch while `fresh` is filled
    touched = account.stats().held
    assert 2 * row <= touched == 2 * row + _PAGE_MARGIN
    found = pool.exchange(fresh, 2)
    assert found is not None
    moved, booking = found
    assert _address(moved) == old_address and booking.nbytes == touched
    assert pool.exchanged == 1 and pool.reused == 1
    _expect_rows_of(moved[:2], 0)
    del fresh  # its memory is not kept: nothing waits for it now
    booking.release()
    assert pool.idle_bytes() == 0 and account.stats().held == 0
    late = pool.empty((8, 1024, 256), np.float32)
    pool.settle()
    pool.begin()
    del late  # released while a batch is filled in reused memory: freed
    assert pool.idle_bytes() == 0 and account.stats().held == 0
    # a release of another size is not taken
    waiting = pool.empty((8, 1024, 256), np.float32, exchange=True)
    smaller = pool.empty((4, 1024, 256), np.float32)
    del smaller
    assert pool.exchange(waiting, 0) is None
    # with no room for the touched pages, the release is freed, not kept unbooked
    other = pool.empty((8, 1024, 256), np.float32)
    hog = account.admit(account.room() - row, elements=0)
    del other
    assert pool.idle_bytes() == 0 and pool.exchange(waiting, 1) is None
    hog.release()
    # a fresh array replaced (a widened column) takes its kept release with it
    other = pool.empty((8, 1024, 256), np.float32)
    del other
    assert pool.idle_bytes() > 0 and account.stats().held > 0
    pool.withdraw(waiting)
    assert pool.idle_bytes() == 0 and account.stats().held == 0
    pool.settle()
    assert pool.idle_bytes() == 0


def test_a_hand_over_never_meets_rows_written_past_their_booking() -> None:
    # The filler says which row it writes before it looks for a release, and a release
    # says it is coming before it reads that: whatever the interleaving, the rows
    # written before the hand-over are within what the release booked.
    account = _budget_account(256 << 20)
    booked: list[int] = []

    def book(nbytes: int) -> Any:
        booked.append(nbytes)
        threading.Event().wait(0.002)  # the releasing thread is descheduled meanwhile
        return account.admit(nbytes, elements=0)

    pool = ArrayPool(booker=book)
    rows, shape = 64, (64, 128, 128)
    row = 128 * 128 * 4
    random = np.random.default_rng(7)
    for attempt in range(60):
        booked.clear()
        old = [pool.empty(shape, np.float32)]
        fresh = pool.empty(shape, np.float32, exchange=True)
        go = threading.Event()
        delay = float(random.uniform(0, 0.004))

        def release(go: threading.Event, old: list[Any], delay: float) -> None:
            go.wait()
            threading.Event().wait(delay)
            old.clear()

        releaser = threading.Thread(target=release, args=(go, old, delay))
        releaser.start()
        go.set()
        moved_at = None
        for index in range(rows):
            found = pool.exchange(fresh, index)
            if found is not None:
                moved_at = index
                assert index * row <= booked[0] - _PAGE_MARGIN + row, (attempt, index, booked)
                fresh, booking = found
                booking.release()
                break
            fresh[index] = index
            threading.Event().wait(0.00005)
        releaser.join()
        pool.settle()
        if moved_at is not None:
            _expect_rows_of(fresh[:moved_at], 0)
        del fresh
        pool.clear()
        assert account.stats().held == 0, attempt


def _expect_rows_of(images: np.ndarray[Any, Any], first: int) -> None:
    want = np.arange(first, first + len(images), dtype=np.float32)
    np.testing.assert_array_equal(images, np.broadcast_to(want[:, None, None], images.shape))


def test_a_pooled_batch_costs_its_own_memory_only() -> None:
    # The budget costs a batch by its memory; the pool's other arrays (kept for reuse,
    # booked by the stage) are not the batch's.
    from headrace._memory.sizeof import sizeof

    pool = ArrayPool(keep_bytes=4 << 20)
    kept = [pool.empty((4, 512, 256), np.float32) for _ in range(2)]
    del kept
    assert pool.idle_bytes() == 4 << 20
    batch = pool.empty((2, 512, 512), np.float32)
    assert (2 << 20) <= sizeof(batch) < (2 << 20) + 4096
    assert (1 << 20) <= sizeof(batch[:1]) < (2 << 20) + 4096  # a view: its owner's memory


def test_kept_batches_under_a_budget_without_room_for_a_spare() -> None:
    """Threads and prefetch under a budget whose batch share holds one batch: memory is
    reused (handed over, or booked between batches), a kept batch is never written."""
    ds = (hr.Dataset.range(400).map(_element, num_parallel_calls=2).batch(ROWS)
          .prefetch(2).with_options(hr.Options(memory_budget="12MiB")))
    before = set(map(id, _pools()))
    kept = []
    with iter(ds) as iterator:
        (pool,) = [p for p in _pools() if id(p) not in before]
        for index, (images, labels) in enumerate(iterator):
            np.testing.assert_array_equal(labels, np.arange(index * ROWS, (index + 1) * ROWS))
            if index % 4 == 0:
                kept.append((index, images))
        (stage,) = [s for s in iterator.stats().stages if s.name == "batch"]
    assert pool.handed == 50 and pool.reused >= 10, (pool.handed, pool.reused)
    assert stage.peak <= stage.limit and stage.held == 0
    for index, images in kept:
        _expect_rows(images, index * ROWS)


@pytest.mark.parametrize("structured", [False, True])
def test_a_placed_element_is_not_kept_while_the_next_is_pulled(structured: bool) -> None:
    # Once its row is copied, an element's booking is released: the batch stage must not
    # keep it (nor the batch's first element, for its structure) while it pulls the next;
    # a process map's output is a view that keeps its shared-memory segment.
    import weakref

    refs: list[Any] = []
    alive_at_call: list[list[int]] = []

    def make(i: Any) -> Any:
        alive_at_call.append([k for k, ref in enumerate(refs) if ref() is not None])
        out = np.full(1000, int(i), np.float32)
        refs.append(weakref.ref(out))
        return {"x": out, "y": np.int64(i)} if structured else out

    batches = list(hr.Dataset.range(7).map(make).batch(3))
    assert len(batches) == 3
    assert alive_at_call == [[]] * 7, alive_at_call
