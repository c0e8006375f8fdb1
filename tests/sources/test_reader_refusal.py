"""Readers refuse at the share (G1): a record that cannot fit its stage's share of the
budget raises MemoryBudgetError naming the file and its offset *before* it is read
whole, and every record before it is delivered as a reader without budget pressure
delivers it.

The cases come from a seeded generator: files of normal records with one oversized
record at a random place, plain or compressed, read record by record or in batches.
The oracle is the same file read under a budget that holds everything. Bytes pulled
from the file and the Python heap's peak (tracemalloc) show that the big record was
not read whole.
"""

from __future__ import annotations

import gzip
import random
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import headrace as hr
from headrace._errors import MemoryBudgetError
from headrace.io.tfrecord import write_tfrecord

MiB = 1 << 20
#: The budget the cases run under, and the one of the oracle (it holds any record here).
BUDGET = 2 * MiB
ORACLE_BUDGET = 256 * MiB
#: Text a CSV source parses at once (the default, 4 MiB, would not fit BUDGET).
CSV_BLOCK_BYTES = 256 << 10


@dataclass
class Case:
    path: Path
    kind: str  # "text" | "tfrecord" | "csv"
    compressed: bool
    batch: int  # 0: record by record
    bad_index: int  # which record is oversized
    bad_offset: int  # its offset in the (decompressed) stream
    bad_size: int
    bad_column: int = 0  # CSV: the field that is oversized
    header: bool = False  # CSV
    engine: str = "auto"  # CSV

    def dataset(self, budget: int) -> hr.Dataset:
        compression = "GZIP" if self.compressed else None
        if self.kind == "csv":
            ds = hr.CsvDataset(str(self.path), ["", "", ""], compression, header=self.header,
                               engine=self.engine, block_bytes=CSV_BLOCK_BYTES)
        elif self.kind == "text":
            ds = hr.TextLineDataset(str(self.path), compression_type=compression)
        else:
            ds = hr.TFRecordDataset(str(self.path), compression_type=compression)
        if self.batch:
            ds = ds.batch(self.batch)
        return ds.with_options(hr.Options(memory_budget=budget))


def make_case(seed: int, directory: Path) -> Case:
    """One file: up to 300 normal records, then a record 3 to 6 budgets long somewhere,
    then a few more."""
    rng = random.Random(seed)
    kind = rng.choice(["text", "tfrecord", "csv"])
    compressed = rng.random() < 0.3
    batch = rng.choice([0, 0, 1, 7, 64])
    count = rng.randrange(0, 300)
    if kind == "csv":  # a CSV window doubles, and a compressed one is read then joined
        return _csv_case(rng, directory / f"case{seed}.csv", compressed, batch, count)
    bad_size = rng.randrange(3 * BUDGET, 6 * BUDGET)
    sizes = [rng.choice([0, rng.randrange(1, 100), rng.randrange(100, 5000)])
             for _ in range(count)]
    records = [bytes(rng.choice(b"abcdefghij") for _ in range(min(n, 64))) * (n // 64 + 1)
               for n in sizes]
    records = [r[:n] for r, n in zip(records, sizes, strict=True)]
    tail = [b"after %d" % i for i in range(rng.randrange(0, 5))]
    big = b"x" * bad_size
    path = directory / f"case{seed}.{'txt' if kind == 'text' else 'tfrecord'}"
    if kind == "text":
        records = [r or b"-" for r in records]  # (empty lines are tested elsewhere)
        raw = b"".join(r + b"\n" for r in [*records, big, *tail])
        bad_offset = sum(len(r) + 1 for r in records)
        path.write_bytes(gzip.compress(raw, 1) if compressed else raw)
    else:
        write_tfrecord(path, [*records, big, *tail], compression_type="GZIP" if compressed else None)
        bad_offset = sum(len(r) + 16 for r in records)
    return Case(path, kind, compressed, batch, len(records), bad_offset, bad_size)


def _csv_case(rng: random.Random, path: Path, compressed: bool, batch: int, count: int
              ) -> Case:
    """Records of three text fields, some quoted; one field 8 to 12 budgets long."""
    bad_size = rng.randrange(8 * BUDGET, 12 * BUDGET)
    bad_column = rng.randrange(3)
    header = rng.random() < 0.5

    def field(text: bytes) -> bytes:
        return b'"' + text.replace(b'"', b'""') + b'"' if rng.random() < 0.3 else text

    rows = [b",".join(field(b"r%d.%d" % (i, c) * rng.randrange(1, 30)) for c in range(3))
            for i in range(count)]
    bad = [b"b%d" % c for c in range(3)]
    bad[bad_column] = field(b"y" * bad_size)
    tail = [b"t%d,u,v" % i for i in range(rng.randrange(0, 5))]
    head = b"first,second,third\n" if header else b""
    raw = head + b"".join(row + b"\n" for row in [*rows, b",".join(bad), *tail])
    path.write_bytes(gzip.compress(raw, 1) if compressed else raw)
    bad_offset = len(head) + sum(len(row) + 1 for row in rows)
    return Case(path, "csv", compressed, batch, count, bad_offset, bad_size, bad_column,
                header, rng.choice(["auto", "pure"]))



def _flatten(items: list[Any], batched: bool) -> list[Any]:
    """Records one by one (a CSV record as a tuple of its fields' bytes)."""
    if items and isinstance(items[0], tuple):  # CSV: tuples of columns, or of scalars
        if batched:
            return [tuple(bytes(v) for v in row) for item in items
                    for row in zip(*item, strict=True)]
        return [tuple(bytes(v) for v in item) for item in items]
    return [bytes(r) for item in items for r in (item if batched else [item])]


def run_until_error(ds: hr.Dataset) -> tuple[list[Any], BaseException | None]:
    delivered: list[Any] = []
    try:
        for item in ds:
            delivered.append(item)
    except MemoryBudgetError as error:
        return delivered, error
    return delivered, None


def measure(action: Callable[[], Any]) -> tuple[Any, int]:
    """``action()`` and the peak of the Python heap's growth while it ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = action()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return result, peak


@pytest.mark.parametrize("seed", range(24))
def test_an_oversized_record_is_refused_before_it_is_read_whole(
    tmp_path: Path, seed: int, bytes_read: list[int]
) -> None:
    case = make_case(seed, tmp_path)
    oracle = _flatten(list(case.dataset(ORACLE_BUDGET)), bool(case.batch))
    if case.kind == "csv":
        assert len(oracle[case.bad_index][case.bad_column]) == case.bad_size
    else:
        assert len(oracle[case.bad_index]) == case.bad_size  # the oracle reads it
    bytes_read[0] = 0

    (delivered, error), peak = measure(lambda: run_until_error(case.dataset(BUDGET)))

    assert isinstance(error, MemoryBudgetError), f"not refused: {case}"
    message = str(error)
    if case.kind == "csv":
        line = case.bad_index + 1 + case.header
        assert (f"CSV record {case.bad_index} (line {line}, column {case.bad_column}) "
                f"at offset {case.bad_offset}") in message, message
    else:
        kind = "line" if case.kind == "text" else "record"
        assert f"{kind} at offset {case.bad_offset}" in message, message
    assert f"in file {case.path}" in message
    # Everything before it, exactly as the oracle (whole batches only: a batch cut short
    # by the error is not handed out, as in tf.data).
    got = _flatten(delivered, bool(case.batch))
    expected = oracle[: case.bad_index]
    if case.batch:
        expected = expected[: len(expected) // case.batch * case.batch]
    assert got == expected
    # Not read whole: at most the share's worth of it, and a read buffer or two (a CSV
    # window is booked before it is read, and a compressed one is joined once read).
    if case.kind == "csv":
        assert peak < 3 * BUDGET + 2 * MiB <= case.bad_size / 2, (peak, case)
    else:
        assert bytes_read[0] - case.bad_offset < case.bad_size / 2
        assert peak < BUDGET + 2 * MiB < case.bad_size / 2 + 2 * MiB, (peak, case)


def test_the_refusal_is_kept_and_nothing_after_it_is_handed_out(tmp_path: Path) -> None:
    """Asked again, the reader raises again: the stream is inside the line, and its
    tail must never come out as a line of its own."""
    path = tmp_path / "t.txt"
    path.write_bytes(b"a\nb\n" + b"y" * (8 * MiB) + b"\nc\n")
    iterator = iter(hr.TextLineDataset(str(path)).with_options(
        hr.Options(memory_budget=BUDGET)))
    assert [next(iterator), next(iterator)] == [b"a", b"b"]
    for _ in range(2):
        with pytest.raises(MemoryBudgetError, match=f"line at offset 4 in file {path}"):
            next(iterator)
    iterator.close()


def test_a_long_line_that_fits_is_still_read(tmp_path: Path) -> None:
    """The check re-splits the budget as a booking would: a line larger than the read
    share but within the budget comes through whole."""
    path = tmp_path / "t.txt"
    line = b"z" * (3 * MiB)
    path.write_bytes(b"a\n" + line + b"\nb\n")
    ds = hr.TextLineDataset(str(path)).with_options(hr.Options(memory_budget=16 * MiB))
    assert list(ds) == [b"a", line, b"b"]


# ------------------------------------------------------------------------------ SQL rows


def _sqlite_table(path: Path, sizes: list[int]) -> None:
    import sqlite3

    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, payload BLOB)")
    connection.executemany("INSERT INTO t VALUES (?, ?)",
                           [(i, bytes([i % 251]) * n) for i, n in enumerate(sizes)])
    connection.commit()
    connection.close()


@pytest.mark.parametrize("seed", range(8))
def test_a_page_of_rows_is_refused_about_one_row_past_the_share(tmp_path: Path,
                                                                   seed: int) -> None:
    """One huge BLOB among small rows (named by its row and column), or many large rows
    in one page (refused once the page passes the share, not after all its rows)."""
    rng = random.Random(3000 + seed)
    path = tmp_path / "t.db"
    many = seed % 2 == 1
    if many:
        sizes = [rng.randrange(200 << 10, 400 << 10) for _ in range(rng.randrange(40, 70))]
        page_rows, bad = 65536, None
    else:
        sizes = [rng.randrange(0, 2000) for _ in range(rng.randrange(1, 400))]
        bad = rng.randrange(len(sizes))
        sizes[bad] = rng.randrange(3 * BUDGET, 6 * BUDGET)
        page_rows = rng.choice([8, 50, 65536])
    batch_size = rng.choice([1, 4, 8])
    key = rng.choice([None, "id"])
    _sqlite_table(path, sizes)

    def dataset(budget: int) -> hr.Dataset:
        return hr.Dataset.from_sql(
            "SELECT id, payload FROM t", connection=f"sqlite:///{path}", key=key,
            batch_size=batch_size, page_rows=page_rows,
        ).with_options(hr.Options(memory_budget=budget))

    def rows(batches: list[Any]) -> list[tuple[int, bytes]]:
        return [(int(i), bytes(p)) for b in batches
                for i, p in zip(b["id"], b["payload"], strict=True)]

    oracle = rows(list(dataset(ORACLE_BUDGET)))
    assert [len(p) for _, p in oracle] == sizes
    (delivered, error), peak = measure(lambda: run_until_error(dataset(BUDGET)))

    assert isinstance(error, MemoryBudgetError), (seed, sizes[:5])
    assert "of the query 'SELECT id, payload FROM t'" in str(error)
    largest = max(sizes)
    if bad is not None:
        assert f"row {bad}, column 1 " in str(error), str(error)
        page = max(page_rows, batch_size)
        before = bad // page * page  # the rows of the pages read whole before it
        assert rows(delivered) == oracle[: before // batch_size * batch_size]
    else:
        assert rows(delivered) == []  # one page: refused before any batch
        assert peak < BUDGET + 2 * largest + MiB < sum(sizes) / 2, (peak, sum(sizes))
    # The driver hands over a row whole: at most that one past the share.
    assert peak < BUDGET + 2 * largest + MiB, (peak, largest)
