"""Inner pipelines (interleave, flat_map) live and die with their slot (G1).

What an interleave function makes during iteration is charged to its slot, never
marked as the user's pre-existing memory; nothing of an inner dataset (its
sources, stages, accounts, arrays) outlives its slot, so neither the number of
inner datasets nor the number of epochs makes anything grow.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._errors import MemoryBudgetError
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import Buffer
from headrace.core.iterator import Iterator
from headrace.core.run import join_abandoned
from headrace.io.tfrecord import write_tfrecord

MiB = 1 << 20
ROWS, WIDTH = 1000, 1000  # 8 MB per inner dataset


def big_inner(i: np.int64) -> hr.Dataset:
    return hr.Dataset.from_tensor_slices(np.ones((ROWS, WIDTH)) * i).take(3)


def live(kind: type) -> int:
    # An earlier test's abandoned iterator is closed on the closer thread after the
    # collection finds it: wait for that, or it counts here and is gone by the next sample.
    gc.collect()
    join_abandoned()
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kind))


def expected_interleave(inputs: list[Any], make, cycle_length: int, block_length: int = 1) -> list:
    """tf.data's interleave order (interleave_dataset_op.cc), in plain Python."""
    slots: list[list[Any] | None] = [None] * cycle_length
    pending = list(inputs)
    out: list[Any] = []
    cycle = block = 0
    while pending or any(slot is not None for slot in slots):
        slot = slots[cycle]
        if slot is None and pending:
            slots[cycle] = list(make(pending.pop(0)))
            continue
        if slot:
            out.append(slot.pop(0))
            block += 1
            if block < block_length:
                continue
        elif slot is not None:
            slots[cycle] = None  # an exhausted input is noticed on a visit, which moves on
        block, cycle = 0, (cycle + 1) % cycle_length
    return out


@pytest.mark.parametrize("flat", [False, True])
def test_arrays_made_by_the_function_are_charged_to_the_slot_not_marked_preexisting(
    flat: bool,
) -> None:
    source = hr.Dataset.range(6)
    ds = source.flat_map(big_inner) if flat else source.interleave(big_inner, cycle_length=2)
    ds = ds.map(lambda row: float(row[0])).with_options(hr.Options(memory_budget="256MiB"))
    with iter(ds) as iterator:
        values = list(iterator)
        budget = iterator.context.budget
        # the outer run registered nothing: the inner arrays are not the user's memory
        assert iterator.context.preexisting == set()
        assert budget.peak >= ROWS * WIDTH * 8  # an open slot's array was booked
        assert budget.peak <= budget.total
        assert budget.used == 0  # and given back when its slot ended
    expected = expected_interleave(list(range(6)), lambda i: [float(i)] * 3, 1 if flat else 2)
    assert values == expected


def test_an_inner_dataset_larger_than_its_slot_share_is_a_clear_error() -> None:
    ds = hr.Dataset.range(4).interleave(big_inner, cycle_length=2)
    with pytest.raises(MemoryBudgetError, match=r"interleave.*big_inner.*cycle_length 2"):
        list(ds.with_options(hr.Options(memory_budget="8MiB")))


def test_the_users_own_arrays_stay_free_inside_slots() -> None:
    data = np.arange(4 * ROWS * 10, dtype=np.float64).reshape(4 * ROWS, 10)
    outer = hr.Dataset.from_tensor_slices(data)  # registers `data` as the user's memory
    ds = hr.Dataset.zip((outer.take(4), hr.Dataset.range(4))).flat_map(
        lambda row, i: hr.Dataset.from_tensor_slices(data[i * ROWS : (i + 1) * ROWS]).take(2)
    )
    with iter(ds.with_options(hr.Options(memory_budget="1MiB"))) as iterator:
        rows = [row[0] for row in iterator]  # a 320 KB slice per inner dataset: not charged
    assert rows == [float(v) for i in range(4) for v in (i * ROWS * 10, i * ROWS * 10 + 10)]


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("threads", [None, 2])
def test_nothing_grows_with_inner_datasets_or_epochs(flat: bool, threads: int | None) -> None:
    source = hr.Dataset.range(8)
    if flat:
        ds = source.flat_map(big_inner)
    else:
        ds = source.interleave(big_inner, cycle_length=2, num_parallel_calls=threads)
    ds = ds.map(lambda row: float(row[0])).repeat(50)
    iterator = iter(ds.with_options(hr.Options(memory_budget="512MiB")))
    context = iterator.context
    samples = []
    for count, _ in enumerate(iterator, 1):
        if count % (8 * 3 * 10) == 0:  # every 10 epochs
            samples.append(
                (live(Buffer), live(MemoryBudget), live(Iterator), len(context._keepalive),
                 len(context.preexisting), len(context.budget.accounts))
            )
    assert count == 50 * 8 * 3
    assert len(samples) == 5
    assert samples[-1] == samples[0], samples  # flat: no growth from epoch 10 to 50
    iterator.close()


RSS_CHILD = """
import sys, warnings
import numpy as np
import headrace as hr
from headrace.cli import _PeakSampler
warnings.simplefilter("ignore")
flat = sys.argv[1] == "flat"
def inner(i):
    return hr.Dataset.from_tensor_slices(np.ones((1000, 1000)) * i).take(2)
source = hr.Dataset.range(6)
ds = source.flat_map(inner) if flat else source.interleave(inner, cycle_length=2)
ds = ds.map(lambda row: float(row[0])).repeat(50)
iterator = iter(ds.with_options(hr.Options(memory_budget=256 << 20)))
for _ in range(6 * 2 * 2):  # two epochs: the steady state
    next(iterator)
with _PeakSampler(0.002) as sampler:
    count = sum(1 for _ in iterator)
print(count, sampler.growth)
"""


@pytest.mark.parametrize("mode", ["interleave", "flat"])
def test_memory_is_flat_across_epochs_measured(mode: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RSS_CHILD), mode],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    count, growth = map(int, out.stdout.split())
    assert count == 48 * 6 * 2
    # 48 more epochs made 288 arrays of 8 MB (2.3 GB): none of them may stay alive
    assert growth <= 48 * MiB, f"grew {growth / MiB:.0f} MiB"


# ------------------------------------------------------------- random pipelines, random sizes


@st.composite
def record_files(draw: st.DrawFn) -> list[list[int]]:
    """Record sizes per file: small ones, and in some files a sudden 100x jump."""
    files = []
    for _ in range(draw(st.integers(1, 4))):
        sizes = draw(st.lists(st.integers(12, 3000), max_size=8))
        if sizes and draw(st.booleans()):
            jump = draw(st.integers(0, len(sizes) - 1))
            sizes[jump:] = [size * 100 for size in sizes[jump:]]
        files.append(sizes)
    return files


def write_files(directory: Path, kind: str, sizes: list[list[int]]) -> tuple[list[str], list]:
    names, contents = [], []
    for index, file_sizes in enumerate(sizes):
        records = [(b"%d.%d:" % (index, j)).ljust(size, b"z") for j, size in enumerate(file_sizes)]
        name = str(directory / f"{index}.{kind}")
        if kind == "tfrecord":
            write_tfrecord(name, records)
        else:
            Path(name).write_bytes(b"".join(record + b"\n" for record in records))
        names.append(name)
        contents.append(records)
    return names, contents


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=record_files(),
    kind=st.sampled_from(["tfrecord", "text"]),
    shape=st.sampled_from(["direct", "interleave", "flat_map"]),
    cycle_length=st.integers(1, 3),
    block_length=st.integers(1, 3),
    threads=st.sampled_from([None, 2]),
    after=st.sampled_from(["none", "batch", "map_prefetch"]),
    batch_size=st.integers(1, 4),
    budget_mib=st.integers(8, 64),
)
def test_random_reader_pipelines_deliver_everything_in_order_within_the_budget(
    sizes, kind, shape, cycle_length, block_length, threads, after, batch_size, budget_mib
) -> None:
    reader = hr.TFRecordDataset if kind == "tfrecord" else hr.TextLineDataset
    with tempfile.TemporaryDirectory() as directory:
        names, contents = write_files(Path(directory), kind, sizes)
        by_name = dict(zip(names, contents, strict=True))
        if shape == "direct":
            ds = reader(names)
            expected = [record for records in contents for record in records]
        else:
            files = hr.Dataset.from_tensor_slices(np.array(names, dtype=object))
            if shape == "flat_map":
                ds, cycle_length, block_length = files.flat_map(reader), 1, 1
            else:
                ds = files.interleave(
                    reader, cycle_length=cycle_length, block_length=block_length,
                    num_parallel_calls=min(threads, cycle_length) if threads else None,
                )
            expected = expected_interleave(names, by_name.__getitem__, cycle_length, block_length)
        if after == "batch":
            ds = ds.batch(batch_size).unbatch()
        elif after == "map_prefetch":
            ds = ds.map(bytes).prefetch(3)
        ds = ds.with_options(hr.Options(memory_budget=budget_mib * MiB, warn_on_shrink=False))
        with iter(ds) as iterator:
            got = [bytes(record) for record in iterator]
            budget = iterator.context.budget
            assert budget.peak <= budget.total, (budget.peak, budget.total)
            if kind == "tfrecord" and expected:  # what was read ahead was booked
                assert budget.peak >= max(map(len, expected)) + sys.getsizeof(b"")
            assert budget.used == 0  # every booking was given back
        assert got == expected  # every record once, in tf.data's order
