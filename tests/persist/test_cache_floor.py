"""What ``cache(filename)`` adds to a pipeline's minimum working set (G1).

A complete cache file read by ``batch`` (with ``skip`` and ``take`` between them, as
in ``cache(f).skip(k).batch(n)``) is batched column by column: the batch's rows are
booked first and large records are read straight into them. So the cached pipeline
needs what the uncached one needs (the batch's rows) plus only what the cache reader
holds beside them: its index and CRCs (at most 12 bytes a record), the frames and
skeletons of one batch's records, and — for records under 4 KiB, read in runs
through a buffer — one record; a ``skip`` adds one element (those it drops are read
and checked before the batch's rows are booked). Never a large element's worth
beside a batch: at memory_budget="8MiB"
``cache(f).skip(3).batch(6)`` of 1.2 MB elements was refused, short by 12 KB, where
the uncached pipeline ran (the element-by-element path after ``skip`` booked one
record beside the batch), and ``cache(f).batch(6)`` peaked past the budget (its
first batch's read buffer was booked before the rows).

The generator draws element sizes, batch sizes, skip/take windows and budgets around
the uncached pipeline's floor, and checks: where the uncached pipeline runs at a
budget, the cached one runs at that budget plus the reader's allowance above, with
the same batches and never past its budget; a byte below the floor, the cached one
runs within it or is refused naming the batch stage (and a total within the
allowance of the floor). The uncached floor is found by bisection over budgets.
"""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr

#: Records from this size on are read straight into the batch's rows (no buffer).
SCATTER_FROM = 4 << 10


class Values:
    """Elements of one shape and dtype, distinct per index (a module-level class: the
    cache's content fingerprint covers it)."""

    def __init__(self, count: int, dtype: str, labelled: bool) -> None:
        self.count, self.dtype, self.labelled = count, dtype, labelled

    def __call__(self, i: Any) -> Any:
        i = int(i)
        x = ((np.arange(self.count, dtype=np.int64) * 7 + i * 1_000_003) % 251).astype(
            self.dtype
        )
        return {"x": x, "y": np.int64(i)} if self.labelled else x


def _window(ds: hr.Dataset, op: str, k: int) -> hr.Dataset:
    if op == "skip":
        return ds.skip(k)
    if op == "take":
        return ds.take(k)
    if op == "skip_take":
        return ds.skip(k).take(k + 2)
    return ds


def _run(ds: hr.Dataset, budget: int) -> tuple[list[Any], int, dict[str, int]]:
    """The batches, the budget's peak and each stage's peak; MemoryBudgetError raised."""
    with iter(ds.with_options(hr.Options(memory_budget=budget))) as it:
        batches = list(it)
        stats = it.stats()
    return batches, stats.budget_peak, {stage.name: stage.peak for stage in stats.stages}


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for key in x:
                assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key])
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y)


def _allowance(
    cache_file: Path, records: int, batch: int, skips: bool
) -> tuple[int, int]:
    """What the module docstring says the reader may hold beside a batch, for this
    file (its first record's size and skeleton, from the TFRecord framing), and the
    record's size."""
    with open(cache_file, "rb") as f:
        head = f.read(16)
    (length,) = struct.unpack_from("<Q", head, 0)
    (skeleton,) = struct.unpack_from("<I", head, 12)
    record = length + 16
    frames = (batch + 1) * (skeleton + 20 + 33)  # each row's frame, and the head's read
    # a record under 4 KiB read through a buffer, or a skipped element (its record and
    # its objects' headers): read before the batch's rows, but its minimum stays
    buffered = record + 33 if record < SCATTER_FROM else 0
    if skips:
        buffered = max(buffered, record + (1 << 10))
    return 12 * records + frames + buffered, record


@pytest.mark.parametrize("seed", range(24))
def test_a_cached_read_needs_the_uncached_floor_plus_the_readers_allowance(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    dtype = rng.choice(["float32", "uint8", "int64", "float64"])
    itemsize = np.dtype(dtype).itemsize
    size = rng.choice([rng.randint(8, 900), rng.randint(1 << 10, 64 << 10),
                       rng.randint(64 << 10, 700 << 10)])
    count = max(1, size // itemsize)
    n = rng.randint(4, 14)
    batch = rng.randint(2, 7)
    drop = rng.random() < 0.3
    op = rng.choice(["none", "skip", "take", "skip_take"])
    k = rng.randint(1, n - 1)
    source = hr.Dataset.range(n).map(Values(count, dtype, rng.random() < 0.7))
    prefix = str(tmp_path / "c")
    list(source.cache(prefix))  # written once; every run below reads the file

    def uncached() -> hr.Dataset:
        return _window(source, op, k).batch(batch, drop_remainder=drop)

    def cached() -> hr.Dataset:
        return _window(source.cache(prefix), op, k).batch(batch, drop_remainder=drop)

    roomy = 256 << 20
    expected, _, _ = _run(uncached(), roomy)
    if not expected:
        return  # (a window with no full batch: nothing is batched, nothing to book)
    floor = _least_budget(uncached)
    allowance, record = _allowance(tmp_path / "c.hrcache", n, batch, op.startswith("skip"))
    _same(_run(cached(), roomy)[0], expected)

    # where the uncached pipeline runs, the cached one runs with the reader's allowance
    # added, never past its budget, with the same batches
    for extra in (0, rng.randint(1, 4 << 10), rng.randint(1, record)):
        budget = floor + extra + allowance
        case = (f"{dtype}[{count}] n={n} batch={batch} drop={drop} {op}({k}) "
                f"floor={floor} allowance={allowance} budget={budget}")
        try:
            got, peak, stages = _run(cached(), budget)
        except hr.MemoryBudgetError as error:
            raise AssertionError(f"{case}: {error}") from None
        _same(got, expected)
        assert peak <= budget, (case, stages)

    # below the uncached floor: refused, naming the batch stage's minimum (and a total
    # within the allowance of the floor), or run within the budget
    try:
        got, peak, _ = _run(cached(), floor - 1)
    except hr.MemoryBudgetError as refused:
        assert "batch" in str(refused)
        stated = re.search(r"must hold ([\d,]+) B at once", str(refused))
        if stated is not None:  # (exact bytes, where the need is close to the budget)
            assert int(stated.group(1).replace(",", "")) <= floor + allowance
    else:
        _same(got, expected)
        assert peak <= floor - 1


def _least_budget(make: Any) -> int:
    """The least memory_budget at which ``make()`` runs (a bisection: a budget either
    fits the pipeline's minimum working sets or is refused)."""
    low, high = 1, 256 << 20  # refused at low, runs at high
    while high - low > 1:
        middle = (low + high) // 2
        try:
            _run(make(), middle)
        except hr.MemoryBudgetError:
            low = middle
        else:
            high = middle
    return high


def test_the_reported_case_runs_at_8_mib(tmp_path: Path) -> None:
    """1.2 MB elements, batches of 6, memory_budget="8MiB": the uncached pipeline runs,
    and so do the cached ones, with skip or take between the cache and the batch."""
    source = hr.Dataset.range(10).map(Values(300_000, "float32", True))
    prefix = str(tmp_path / "c")
    list(source.cache(prefix))
    budget = 8 << 20
    for skip, take in ((0, -1), (3, -1), (0, 7)):
        expected, _, _ = _run(source.skip(skip).take(take).batch(6), budget)
        got, peak, stages = _run(source.cache(prefix).skip(skip).take(take).batch(6), budget)
        _same(got, expected)
        assert peak <= budget
        # no record held beside a batch: the skipped ones are read (and checked) one at
        # a time before the batch's rows are booked
        assert stages["cache"] < (1_300_000 if skip else 4 << 10)


def test_a_window_with_no_full_batch_is_refused_as_the_uncached_one(tmp_path: Path) -> None:
    """``drop_remainder`` with fewer elements than a batch: no batch was made, so the
    cached read goes element by element as the uncached pipeline does, and a full
    batch's rows that cannot fit are refused alike (a short last batch is read column
    by column and dropped only once a full batch's rows were booked)."""
    source = hr.Dataset.range(5).map(Values(300_000, "float32", True))
    prefix = str(tmp_path / "c")
    list(source.cache(prefix))
    for window in (lambda d: d, lambda d: d.take(4)):
        for ds in (window(source), window(source.cache(prefix))):
            assert _run(ds.batch(8, drop_remainder=True), 256 << 20)[0] == []
            with pytest.raises(hr.MemoryBudgetError, match="batch"):
                _run(ds.batch(8, drop_remainder=True), 8 << 20)
