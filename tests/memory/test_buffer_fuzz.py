"""The buffer primitive driven directly, and the prefetch that holds through it.

Seeded generators of adversarial sizes (regime jumps of x1000, giants and dwarfs
in turn, heavy tails, sizes at the share give or take an array header) and random
thread interleavings. The oracle is the share itself: what a stage holds never
passes it, nothing booked is lost, and an element no share can hold is refused
with a :class:`MemoryBudgetError` that names the stage and the sizes.
"""

from __future__ import annotations

import queue
import random
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import headrace as hr
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import NO_RESERVATION, Assembly, BudgetClosed, Buffer, Reservation
from headrace._memory.sizeof import ARRAY_HEADER_BYTES, sizeof

MiB = 1 << 20
SEEDS = range(12)


def sizes(rng: random.Random, share: int) -> Iterator[int]:
    """Element sizes in one of several adversarial regimes, each at most ``share``."""
    regime = rng.choice(["jump", "giants_and_dwarfs", "heavy_tail", "at_the_share"])
    count = 0
    while True:
        count += 1
        if regime == "jump":  # thousands of small ones, then x1000
            size = rng.randint(64, 256) * (1000 if count > 2000 else 1)
        elif regime == "giants_and_dwarfs":
            size = share - rng.randint(0, 64) if count % 2 else rng.randint(1, 64)
        elif regime == "heavy_tail":
            size = int(64 * rng.paretovariate(0.8))
        else:  # the share split in two, give or take a header
            size = share // 2 + rng.randint(-2, 2) * ARRAY_HEADER_BYTES
        yield max(1, min(size, share))


@pytest.fixture
def switch_often() -> Iterator[None]:
    """Threads switch every microsecond: interleavings a 5 ms slice almost never shows."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def check_within(buffer: Buffer) -> None:
    stats = buffer.stats()
    assert stats.peak <= stats.limit, f"{stats.name} held {stats.peak} past {stats.limit}"
    assert stats.overdrawn_peak == 0
    assert buffer.breaches == 0


@pytest.mark.usefixtures("switch_often")
@pytest.mark.parametrize("seed", SEEDS)
def test_producers_and_consumers_never_hold_past_the_share(seed: int) -> None:
    """Several producers wait for room and book (:meth:`Buffer.enter`) while consumers
    release: of two that wait for the last room, one books, the other waits again."""
    rng = random.Random(seed)
    total = rng.randint(64 << 10, 8 * MiB)
    budget = MemoryBudget(total)
    buffer = budget.account("prefetch", weight=1)
    budget.allot()
    share = buffer.share()
    handed: queue.Queue[Reservation | None] = queue.Queue()
    admitted = [0]
    count_lock = threading.Lock()
    producers = rng.randint(1, 4)
    per_producer = rng.randint(200, 3000)

    def produce(seed: int) -> None:
        local = random.Random(seed)
        made = sizes(local, share)
        for _ in range(per_producer):
            handed.put(buffer.enter(next(made)))
            with count_lock:
                admitted[0] += 1
            if local.random() < 0.05:
                time.sleep(0)  # give the others a turn here and there

    def consume(seed: int) -> None:
        local = random.Random(seed)
        while (reservation := handed.get()) is not None:
            if local.random() < 0.01:
                time.sleep(0.0001)  # a slow consumer for a moment
            reservation.release()

    threads = [threading.Thread(target=produce, args=(rng.random(),)) for _ in range(producers)]
    consumers = [
        threading.Thread(target=consume, args=(rng.random(),))
        for _ in range(rng.randint(1, 3))
    ]
    for thread in threads + consumers:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a producer never got room: deadlock"
    for _ in consumers:
        handed.put(None)
    for thread in consumers:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert admitted[0] == producers * per_producer
    check_within(buffer)
    assert buffer.is_empty()


@pytest.mark.usefixtures("switch_often")
@pytest.mark.parametrize("seed", SEEDS)
def test_assemblies_hold_rows_and_output_together_within_the_share(seed: int) -> None:
    """A producer thread books rows on a source stage; the batch stage takes them into
    assemblies (booked rows move, unbooked ones are grouped), reserves the output,
    widens a column, and finishes or abandons. A batch no share can hold is refused."""
    rng = random.Random(seed)
    total = rng.randint(1 * MiB, 16 * MiB)
    budget = MemoryBudget(total)
    source = budget.account("source", weight=1)
    batch = budget.account("batch", weight=2)
    budget.allot()
    rows: queue.Queue[tuple[int, Reservation] | None] = queue.Queue(maxsize=64)
    plans = []
    for _ in range(rng.randint(20, 60)):
        too_big = rng.random() < 0.2
        target = rng.randint(total + 1, 2 * total) if too_big else rng.randint(1, total // 2)
        plans.append((target, rng.random() < 0.3, rng.random() < 0.2, rng.random() < 0.5))
    row_most = total // 16
    stop = threading.Event()

    def produce() -> None:
        made = random.Random(seed + 1)
        while not stop.is_set():
            nbytes = made.randint(1, row_most)
            try:  # half of them made by a stage that books nothing
                upstream = source.enter(nbytes, cancelled=stop.is_set) if made.random() < 0.5 \
                    else NO_RESERVATION
            except BudgetClosed:
                return
            while True:
                if stop.is_set():
                    upstream.release()
                    return
                try:
                    rows.put((nbytes, upstream), timeout=0.01)
                    break
                except queue.Full:
                    continue

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        for target, widen, abandon, keep_rows in plans:
            # A batch past the budget asks for its output at once: refused before rows.
            output = target if target > total else target // 2
            assembly = Assembly(batch, f"a batch of about {target} bytes")
            taken = 0
            try:
                assembly.reserve(output, elements=1)
                while taken < target - output:
                    item = rows.get(timeout=30)
                    assert item is not None
                    nbytes, upstream = item
                    assembly.take(nbytes, upstream)
                    taken += nbytes
                    check_within(batch)
                if widen:
                    assembly.reserve(output // 4, what="a widened column")
                    assembly.shrink(output // 8)
                if not keep_rows:
                    assembly.drop_rows()
                check_within(batch)
            except hr.MemoryBudgetError as error:
                assembly.abandon()
                assert "'batch'" in str(error), error
                assert target > total, f"refused a batch of {target} in {total}: {error}"
                assert batch.is_empty()
                continue
            assert target <= total, "a batch larger than the budget was taken"
            if abandon:
                assembly.abandon()
            else:
                assembly.finish().release()
            assert batch.is_empty()
    finally:
        stop.set()
        source.wake()  # a producer waiting for room sees the stop (as prefetch's stop does)
        producer.join(timeout=30)
        while not rows.empty():
            item = rows.get()
            if item is not None:
                item[1].release()
    assert not producer.is_alive()
    check_within(source)
    check_within(batch)
    assert batch.is_empty() and source.is_empty()


@pytest.mark.parametrize("seed", SEEDS)
def test_an_element_no_share_can_hold_is_refused_naming_the_stage(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.randint(4096, 4 * MiB)
    budget = MemoryBudget(total)
    buffer = budget.account("prefetch", weight=1)
    budget.allot()
    giant = total + rng.randint(1, 1000 * total)
    upstream_budget = MemoryBudget(giant)
    upstream = upstream_budget.account("map", weight=1)
    upstream_budget.allot()
    small = buffer.enter(rng.randint(1, total // 4))
    booked = upstream.admit(giant)
    with pytest.raises(hr.MemoryBudgetError, match=r"'prefetch' needs .*one element"):
        buffer.enter(giant, booked)
    assert upstream.is_empty(), "the refused element's upstream booking was kept"
    small.release()
    assert buffer.is_empty()
    check_within(buffer)


@pytest.mark.parametrize("seed", SEEDS)
def test_prefetch_never_holds_past_its_share_at_the_edge(seed: int) -> None:
    """Sizes at the share, give or take array headers: a big element and a small one
    that together pass the share by a few headers never sit in the prefetch together
    (main let the second in as an overdraft: the starving rule missed the element it
    had just taken from aside)."""
    rng = random.Random(seed)
    share = rng.choice([2, 4, 8]) * MiB
    header = ARRAY_HEADER_BYTES
    lengths = []
    for _ in range(rng.randint(6, 16)):
        small = rng.randint(1, 64 << 10)
        big = share - small - rng.randint(-3, 1) * header  # the pair passes by a few headers
        lengths += [max(1, big - header), small]
    depth = rng.choice([1, 2, 3, hr.AUTOTUNE])
    ds = (
        hr.Dataset.from_generator(
            lambda: (np.zeros(n, np.uint8) for n in lengths),
            output_signature=hr.TensorSpec((None,), np.uint8),
        )
        .prefetch(depth)
        .with_options(hr.Options(memory_budget=share, warn_on_shrink=False))
    )
    iterator = iter(ds)
    seen = [len(element) for element in iterator]
    assert seen == lengths
    (stage,) = [s for s in iterator.stats().stages if s.name == "prefetch"]
    assert stage.limit == share
    assert stage.peak <= stage.limit, f"held {stage.peak - stage.limit} B past the share"
    assert stage.overdrawn_peak == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_a_ragged_batch_books_its_output_beside_its_rows(seed: int) -> None:
    """The output of a ragged batch is made while its rows are held: both are booked
    (main booked the rows only and handed the output out unbooked)."""
    rng = random.Random(seed)
    rows = [np.full(rng.randint(0, 20_000), i, np.int32) for i in range(rng.randint(1, 40))]
    batch_size = rng.randint(1, 8)
    ds = hr.Dataset.from_generator(
        lambda: iter(rows), output_signature=hr.TensorSpec((None,), np.int32)
    ).ragged_batch(batch_size)
    iterator = iter(ds)
    batches = list(iterator)
    needed = 0
    for number, batch in enumerate(batches):
        part = rows[number * batch_size : (number + 1) * batch_size]
        assert np.array_equal(batch.values, np.concatenate(part))
        held = sum(sizeof(row) for row in part)
        needed = max(needed, held + batch.values.nbytes + batch.row_splits.nbytes)
    (stage,) = [s for s in iterator.stats().stages if s.name == "ragged_batch"]
    assert stage.peak >= needed, f"booked at most {stage.peak} B, made {needed} B at once"
    assert stage.peak <= stage.limit
    assert iterator.context.budget.used == 0
