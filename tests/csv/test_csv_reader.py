"""The columnar CSV reader: edge cases, both engines agree, resume, budget, file cap."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.testing import assert_checkpoint_roundtrip

ENGINES = ["pure", "arrow"]


def rows_of(dataset: hr.Dataset) -> list[dict[str, Any]]:
    out = []
    for batch in dataset:
        n = len(next(iter(batch.values())))
        out.extend({k: v[i] for k, v in batch.items()} for i in range(n))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_edge_cases_have_values(tmp_path: Any, engine: str) -> None:
    path = tmp_path / "edge.csv"
    path.write_bytes(
        b"\xef\xbb\xbfid,text,score\r\n"  # UTF-8 BOM and CRLF
        b'1,"a, quoted ""field""",0.5\r\n'  # embedded delimiter and quotes
        b'2,"two\nlines",\r\n'  # embedded newline; an empty float takes its default
        b"3,plain,-1e3"  # no final newline
    )
    ds = hr.read_csv(str(path), 2, column_defaults=[[0], [""], [9.0]], engine=engine)
    rows = rows_of(ds)
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert [r["text"] for r in rows] == [b'a, quoted "field"', b"two\nlines", b"plain"]
    assert [float(r["score"]) for r in rows] == [0.5, 9.0, -1000.0]
    assert rows[0]["score"].dtype == np.float32


@pytest.mark.parametrize("engine", ENGINES)
def test_ragged_rows_and_bad_numbers_name_file_row_and_column(tmp_path: Any, engine: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("a,b\n1,2\n3\n4,x\n5,6\n")
    ds = hr.read_csv(str(path), 10, column_defaults=[[0], [0]], engine=engine)
    it = iter(ds)
    # the batch's good record before the bad one is dropped, as tf.data's batch drops it
    with pytest.raises(hr.CsvError) as ragged:
        next(it)
    assert ragged.value.message == "Expect 2 fields but have 1 in record"
    assert (ragged.value.path, ragged.value.record, ragged.value.line) == (str(path), 1, 3)
    with pytest.raises(hr.CsvError) as bad:
        next(it)
    assert bad.value.message == "Field 1 in record is not a valid int32: x"
    assert (bad.value.record, bad.value.line, bad.value.column, bad.value.column_name) == (
        2, 4, 1, "b")
    assert next(it)["a"].tolist() == [5]
    with pytest.raises(StopIteration):
        next(it)


def outcomes(dataset: hr.Dataset) -> list[Any]:
    """Each batch as lists, or a bad record's error text, in order (reading goes on after
    an error, as CsvDataset's does)."""
    got: list[Any] = []
    it = iter(dataset)
    while True:
        try:
            got.append({k: v.tolist() for k, v in next(it).items()})
        except StopIteration:
            return got
        except hr.CsvError as error:
            got.append(str(error))


CELL = st.one_of(st.integers(-10**9, 10**9).map(str), st.floats(allow_nan=False, width=32).map(repr),
                 st.sampled_from(["", " 7 ", "nan", "inf", "1e5", "0x1p2", "NA"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(CELL, min_size=3, max_size=3), min_size=1, max_size=60),
       st.sampled_from([64, 256, 4096]), st.sampled_from([1, 7, 64]))
def test_engines_agree_on_generated_files(tmp_path_factory: Any, rows: list[list[str]],
                                          block_bytes: int, batch: int) -> None:
    path = tmp_path_factory.mktemp("agree") / "data.csv"
    path.write_text("a,b,c\n" + "\n".join(",".join(r) for r in rows) + "\n")
    results = {}
    for engine in ENGINES:
        ds = hr.read_csv(str(path), batch, column_defaults=[[0.0], [np.float64(1)], [""]],
                                 na_value="NA", engine=engine, block_bytes=block_bytes)
        results[engine] = json.dumps(outcomes(ds), default=repr)
    assert results["pure"] == results["arrow"]


LINE_CELL = st.sampled_from(["", "1", "-2.5", " 3 ", "x", "NA", "1e3", "0x10", "0x1p3", "7",
                             "inf", "99999999999"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.lists(st.lists(LINE_CELL, min_size=1, max_size=4), max_size=50),
       st.booleans(), st.sampled_from([None, "GZIP"]), st.sampled_from([16, 64, 512]),
       st.sampled_from([1, 5, 32]), st.sampled_from([0.0, 0, np.int64(0)]))
def test_engines_agree_line_by_line_across_block_edges(
    tmp_path_factory: Any, width: int, rows: list[list[str]], final_newline: bool,
    compression: Any, block_bytes: int, batch: int, default: Any,
) -> None:
    """The arrow path trusts pyarrow's row count to be the line count of a quote- and
    CR-free block (empty lines, ragged lines and bad values included), and reads each block
    from its offset (leftover records read again, gzip streams joined instead): values,
    errors with their record and line, and checkpoints agree with the pure path."""
    lines = [",".join(row[:width]) if len(row) > 1 else row[0] for row in rows]
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    path = tmp_path_factory.mktemp("lines") / "data.csv"
    path.write_bytes(gzip.compress(text.encode()) if compression else text.encode())
    results = {}
    failed = False
    for engine in ENGINES:
        ds = hr.read_csv(str(path), batch, column_names=[f"c{i}" for i in range(width)],
                         column_defaults=[[default]] * width, header=False, na_value="NA",
                         engine=engine, block_bytes=block_bytes,
                         compression_type=compression)
        got = outcomes(ds)
        failed = failed or any(isinstance(outcome, str) for outcome in got)
        results[engine] = json.dumps(got, default=repr)
    assert results["pure"] == results["arrow"]
    if not failed:
        records = hr.CsvDataset(str(path), [[default]] * width, na_value="NA", engine="arrow",
                                block_bytes=block_bytes, compression_type=compression)
        assert_checkpoint_roundtrip(records.batch(batch), max_checkpoints=8)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_resume_mid_file_from_a_checkpoint(tmp_path: Any, engine: str, compression: Any) -> None:
    text = "x,y\n" + "".join(f"{i},{i * 0.5}\n" for i in range(300))
    paths = []
    for f in range(2):
        path = tmp_path / f"part{f}.csv"
        data = text.encode()
        if compression:
            data = gzip.compress(data)
        path.write_bytes(data)
        paths.append(str(path))
    records = hr.CsvDataset(paths, [[0], [0.0]], header=True, compression_type=compression,
                            engine=engine, block_bytes=256)
    assert_checkpoint_roundtrip(records, max_checkpoints=25)
    assert_checkpoint_roundtrip(records.batch(37), max_checkpoints=25)
    assert_checkpoint_roundtrip(records.take(5).repeat(2).batch(3), max_checkpoints=25)


def test_resume_after_an_error_goes_on_with_the_next_record(tmp_path: Any) -> None:
    path = tmp_path / "e.csv"
    path.write_text("1\n2\nbad\n4\n")
    ds = hr.CsvDataset(str(path), [[0]], block_bytes=64)
    it = iter(ds)
    assert [next(it), next(it)] == [(1,), (2,)]
    before = it.get_state()
    with pytest.raises(hr.CsvError):
        next(it)
    after = it.get_state()
    restored = iter(ds)
    restored.set_state(before)
    with pytest.raises(hr.CsvError):
        next(restored)  # the error is where it was: nothing skipped
    restored.set_state(after)
    assert next(restored) == (4,)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("text", [",\n\n", "1,2\n\n3,4\n", "\n1,2\n", "1,\n,2\n\n"])
def test_an_empty_line_in_a_wider_file_is_a_record_of_one_field(
    tmp_path: Any, engine: str, text: str,
) -> None:
    """pyarrow reads an empty line as a row of nulls (defaults, here); CsvDataset reads a
    record of one field, an error: the arrow path hands such blocks to the pure parser."""
    path = tmp_path / "e.csv"
    path.write_text(text)
    ds = hr.read_csv(str(path), 1, column_names=["a", "b"], column_defaults=[[0.0], [0.0]],
                     header=False, engine=engine)
    outcomes = []
    it = iter(ds)
    while True:
        try:
            outcomes.append(next(it)["a"].tolist())
        except StopIteration:
            break
        except hr.CsvError as error:
            outcomes.append(error.message)
    assert "Expect 2 fields but have 1 in record" in outcomes


@pytest.mark.parametrize("engine", ENGINES)
def test_a_header_longer_than_the_first_look_is_read_whole(tmp_path: Any, engine: str) -> None:
    """The header is looked for in a 64 KiB window first, grown until it holds the header
    (here a quoted name of 90 KB, with a line break in it)."""
    long_name = "n\n" + "x" * 90_000
    path = tmp_path / "h.csv"
    path.write_text(f'"{long_name}",b\n1,2\n3,4\n')
    ds = hr.read_csv(str(path), 5, column_defaults=[[0], [0]], engine=engine,
                     block_bytes=1 << 20)
    (batch,) = list(ds)
    assert list(batch) == [long_name, "b"]
    assert batch["b"].tolist() == [2, 4]
    records = hr.CsvDataset(str(path), [[0], [0]], header=True, engine=engine)
    assert list(records) == [(1, 2), (3, 4)]


def test_ignore_errors_skips_and_counts(tmp_path: Any) -> None:
    path = tmp_path / "e.csv"
    path.write_text("a,b\n1,2\n3\n4,x\n5,6\n")
    ds = hr.make_csv_dataset(str(path), 10, shuffle=False, num_epochs=1, ignore_errors=True,
                             column_defaults=[[0], [0]])
    with iter(ds) as it:
        batches = list(it)
        assert it.stats().skipped_records == 2
    assert batches[0]["a"].tolist() == [1, 5]


def test_files_go_through_the_pool_under_its_cap(tmp_path: Any, stream_descriptors: Any) -> None:
    paths = []
    for f in range(20):
        path = tmp_path / f"f{f}.csv"
        path.write_text("".join(f"{f},{i}\n" for i in range(50)))
        paths.append(str(path))
    files = hr.Dataset.from_tensor_slices(np.array(paths, dtype=object))
    ds = files.interleave(lambda p: hr.CsvDataset(p, [[0], [0]]), cycle_length=10).with_options(
        hr.Options(max_open_files=3))
    assert len(list(ds)) == 1000
    assert 0 < stream_descriptors.peak <= 3


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_block_text_and_parsed_block_are_booked_and_kept_batches_pin_no_block(
    tmp_path: Any, engine: str, compression: Any,
) -> None:
    """The CSV stage books the text it parses (an uncompressed file's reused read buffer)
    and the parsed block's columns at their real size (pyarrow-backed columns included),
    gives both back when the iterator closes, and hands out batches that own their rows:
    a consumer that keeps every batch pins no block, and the budget holds meanwhile."""
    from headrace._memory.sizeof import owner_of, sizeof

    path = tmp_path / "data.csv"
    rng = np.random.default_rng(3)
    text = "\n".join(",".join(f"{v:.5f}" for v in row) for row in rng.random((6000, 8))) + "\n"
    data = ("".join(f"c{i}," for i in range(7)) + "c7\n" + text).encode()
    path.write_bytes(gzip.compress(data) if compression else data)
    block_bytes = 64 << 10
    ds = hr.read_csv(str(path), 100, column_defaults=[[0.0]] * 8, engine=engine,
                     block_bytes=block_bytes, compression_type=compression).with_options(
        hr.Options(memory_budget="8MiB"))
    kept = []
    with iter(ds) as it:
        first = next(it)
        kept.append(first)
        csv_stage = [s for s in it.stats().stages if "parsed block" in s.name]
        assert len(csv_stage) == 1
        rows_in_block = block_bytes // len(text.splitlines()[0]) // 2  # at least this many
        parsed = rows_in_block * 8 * 4
        text_held = block_bytes if compression is None and engine == "arrow" else 0
        assert csv_stage[0].held >= parsed + text_held
        for batch in it:
            kept.append(batch)
        stats = it.stats()
        assert stats.budget_peak <= 8 << 20
    after = [s for s in it.stats().stages if "parsed block" in s.name]
    assert after[0].held == 0  # text buffer and block given back at close
    assert sum(len(b["c0"]) for b in kept) == 6000
    for batch in kept:
        for column in batch.values():
            owner = owner_of(column)
            assert owner is column or (isinstance(owner, np.ndarray) and owner.nbytes
                                       == column.nbytes)  # no view of a parsed block
        assert sizeof(batch) < 8 * (100 * 4 + 200) + 2000


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_memory_stays_within_budget_on_a_file_ten_times_larger(tmp_path: Any, engine: str) -> None:
    """RSS growth while streaming a 320 MB CSV through a 32 MiB budget (fresh process)."""
    path = tmp_path / "big.csv"
    rng = np.random.default_rng(0)
    block = "\n".join(",".join(f"{v:.6f}" for v in row) for row in rng.random((20000, 16))) + "\n"
    with open(path, "w") as handle:
        handle.write(",".join(f"c{i}" for i in range(16)) + "\n")
        while handle.tell() < 320 << 20:
            handle.write(block)
    code = textwrap.dedent(f"""
        import headrace as hr, numpy as np
        def charged():
            total = 0
            for line in open("/proc/self/status"):
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
            return total
        ds = hr.read_csv({str(path)!r}, 1024, column_defaults=[[0.0]] * 16,
                                 engine={engine!r}).prefetch(4).with_options(
            hr.Options(memory_budget="32MiB"))
        start = charged(); peak = 0; rows = 0
        with iter(ds) as it:
            for batch in it:
                rows += len(batch["c0"]); peak = max(peak, charged() - start)
            booked = it.stats().budget_peak
        print(rows, peak, booked)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    rows, peak, booked = (int(v) for v in out.stdout.split())
    assert rows > 20000 * 100
    assert booked <= 32 << 20
    assert peak <= (32 << 20) * 1.1 + (64 << 20), f"RSS grew by {peak / 2**20:.0f} MiB"


# -- issue 22: every CSV error names the file and the line ------------------------------------
CORRUPTIONS = ["huge", "huge_over_budget", "latin1", "latin1_header", "ragged", "unclosed",
               "directory", "missing"]


@st.composite
def corrupted_csv(draw: Any, corruption: str, api: str) -> dict[str, Any]:
    """1-3 clean CSV files (int and text columns, a header) and one corruption of one of
    them at a random line: a huge text field, one over the budget, a Latin-1 byte in a
    field or in the header, a ragged row, an unclosed quote; or a directory or a missing
    file in the list."""
    kinds = draw(st.lists(st.sampled_from(["int", "text"]), min_size=1, max_size=4))
    if "text" not in kinds:
        kinds[draw(st.integers(0, len(kinds) - 1))] = "text"
    files = []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.lists(st.tuples(*[
            st.integers(-999, 999).map(str) if kind == "int"
            else st.text("abcxyz ", min_size=1, max_size=6) for kind in kinds]),
            min_size=1, max_size=40))
        files.append([list(row) for row in rows])
    return {"kinds": kinds, "files": files, "which": draw(st.integers(0, len(files) - 1)),
            "corruption": corruption, "row": draw(st.integers(0, 10_000)), "api": api,
            "size": draw(st.integers(150_000, 400_000))}


def _write_case(folder: Any, case: dict[str, Any]) -> tuple[list[str], str, int | None]:
    """The files (paths), the bad one, and the line (from 1) the corruption is on."""
    kinds, names = case["kinds"], [f"c{i}" for i in range(len(case["kinds"]))]
    text_column = kinds.index("text")
    paths: list[str] = []
    bad_line = None
    for index, rows in enumerate(case["files"]):
        path = os.path.join(folder, f"part{index}.csv")
        paths.append(path)
        header = ",".join(names).encode()
        lines = [",".join(row).encode() for row in rows]
        if index == case["which"]:
            row = case["row"] % len(rows)
            bad_line = row + 2
            fields = [f.encode() for f in rows[row]]
            corruption = case["corruption"]
            if corruption in ("huge", "huge_over_budget"):
                size = case["size"] * (8 if corruption == "huge_over_budget" else 1)
                fields[text_column] = b"h" * size
                rows[row][text_column] = "h" * size
            elif corruption == "latin1":
                fields[text_column] += b"caf\xe9"
                rows[row][text_column] += "caf\xe9"
            elif corruption == "latin1_header":
                header = header.replace(b"c0", b"\xe9t\xe9", 1)
                bad_line = 1
            elif corruption == "ragged":
                fields.append(b"7")
            elif corruption == "unclosed":
                fields[text_column] = b'"' + fields[text_column]
            lines[row] = b",".join(fields)
        if index == case["which"] and case["corruption"] == "directory":
            os.mkdir(path)
            continue
        if index == case["which"] and case["corruption"] == "missing":
            continue
        with open(path, "wb") as f:
            f.write(header + b"\n" + b"\n".join(lines) + b"\n")
    return paths, paths[case["which"]], bad_line


def _read(case: dict[str, Any], paths: list[str]) -> list[list[Any]]:
    """Every row read through the case's API, as lists of Python values."""
    kinds = case["kinds"]
    budget = hr.Options(memory_budget="1MiB")
    if case["api"] == "read_csv":
        ds = hr.read_csv(paths, 16, block_bytes=1 << 16)
    elif case["api"] == "make_csv_dataset":
        ds = hr.make_csv_dataset(paths, 16, num_epochs=1, shuffle=False)
    else:
        defaults = [[0] if kind == "int" else [""] for kind in kinds]
        ds = hr.CsvDataset(paths, defaults, header=True, block_bytes=1 << 16).batch(16)
    if case["corruption"] == "huge_over_budget" and case["api"] != "make_csv_dataset":
        ds = ds.with_options(budget)
    out: list[list[Any]] = []
    for batch in ds:
        columns = list(batch.values()) if isinstance(batch, dict) else list(batch)
        out.extend([column[i] for column in columns] for i in range(len(columns[0])))
    return out


@pytest.mark.parametrize("api", ["read_csv", "make_csv_dataset", "CsvDataset"])
@pytest.mark.parametrize("corruption", CORRUPTIONS)
@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupt_csv_reads_or_fails_naming_the_file_and_line(
        tmp_path_factory: Any, corruption: str, api: str, data: Any) -> None:
    """Oracle: the rows as written. A huge field (under max_record_bytes) or a Latin-1
    byte in a field reads as written (text columns are bytes); anything else is an error
    that names the file, and the line where it has one — never a bare csv.Error,
    UnicodeDecodeError or "[Errno 21]"."""
    case = data.draw(corrupted_csv(corruption, api))
    folder = tmp_path_factory.mktemp("csv")
    paths, bad, line = _write_case(folder, case)
    readable = corruption in ("huge", "latin1") or (
        corruption == "huge_over_budget" and api == "make_csv_dataset") or (
        corruption == "latin1_header" and api == "CsvDataset")  # (its header is skipped)
    try:
        got = _read(case, paths)
    except (hr.HeadraceError, OSError) as error:
        assert not readable, f"{corruption}: {error!r}"
        text = str(error)
        assert bad in text, f"{corruption}: the error does not name {bad}: {text}"
        if corruption not in ("directory", "missing"):
            assert f"line {line}" in text, f"{corruption}: not line {line}: {text}"
        return
    assert readable, f"{corruption} in {bad} read without an error"
    expected = [[int(v) if kind == "int" else v.encode("latin-1")
                 for v, kind in zip(row, case["kinds"], strict=True)]
                for rows in case["files"] for row in rows]
    assert [[v.item() if isinstance(v, np.generic) else v for v in row] for row in got] == expected


QUOTED_CELL = st.sampled_from(["a", "b,c", 'q"q', "line\nbreak", "cr\r\nlf", "é☃", " sp ",
                               "x" * 40, "", '"', ",,", "7"])


def _quoted_csv(rows: list[list[str]], crlf: bool) -> bytes:
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n" if crlf else "\n")
    writer.writerow(["id", "text"])
    writer.writerows([[str(i), "".join(cells)] for i, cells in enumerate(rows)])
    return out.getvalue().encode()


@pytest.mark.parametrize("seed", range(12))
def test_every_resume_point_gives_what_the_uninterrupted_run_gives(
    tmp_path: Any, seed: int
) -> None:
    """Generated quoted CSVs (fields holding newlines, delimiters and quotes) across small
    blocks, plain and GZIP, both engines: a state taken after any number of batches,
    restored in a new iterator, gives exactly the rows the uninterrupted iterator gives next
    (blocks are cut the same way whatever a compressed stream had read ahead)."""
    import random

    rng = random.Random(seed)
    pieces = ["a", "b,c", 'q"q', "line\nbreak", "cr\r\nlf", "é☃", " sp ", "x" * 50, "",
              '"', ",,", "7"]
    rows = [[rng.choice(pieces) for _ in range(rng.randint(0, 4))]
            for _ in range(rng.randint(20, 200))]
    compression = ("GZIP", None)[seed % 2]
    engine = ENGINES[(seed // 2) % 2]
    block_bytes = rng.choice([16, 64, 100, 256])
    batch = rng.choice([1, 3, 7])
    data = _quoted_csv(rows, rng.random() < 0.3)
    path = tmp_path / "q.csv"
    path.write_bytes(gzip.compress(data) if compression else data)

    def make() -> hr.Dataset:
        return hr.read_csv(str(path), batch, column_defaults=[[0], [""]], engine=engine,
                           block_bytes=block_bytes, compression_type=compression)

    def ids(batches: Any) -> list[tuple[int, bytes]]:
        return [(int(i), bytes(t)) for b in batches for i, t in zip(b["id"], b["text"],
                                                                      strict=True)]

    whole = ids(make())
    assert [i for i, _ in whole] == list(range(len(rows)))
    wrong = []
    for taken in range(1, -(-len(rows) // batch) + 1):
        with iter(make()) as it:
            first = ids(next(it) for _ in range(taken))
            state = json.loads(json.dumps(it.get_state()))
        with iter(make()) as again:
            again.set_state(state)
            rest = ids(again)
        if first + rest != whole:
            wrong.append(taken)
    assert not wrong, (f"{compression} {engine} block_bytes={block_bytes} batch={batch}: "
                       f"resumed after {wrong} batches differ from the uninterrupted run")


def test_read_csv_takes_paths_as_an_interleave_hands_them_out(tmp_path: Path) -> None:
    """``from_tensor_slices([path])`` gives bytes: read_csv reads them like a str path;
    something that is no path is refused naming the argument."""
    path = tmp_path / "a.csv"
    path.write_text("x,y\n1,2\n3,4\n")
    files = hr.Dataset.from_tensor_slices([str(path), str(path)])
    ds = files.interleave(lambda f: hr.read_csv(f, batch_size=2), cycle_length=2)
    assert [list(batch["x"]) for batch in ds] == [[1, 3], [1, 3]]
    with pytest.raises(hr.InvalidArgumentError, match="read_csv: filenames"):
        hr.read_csv([1, 2], batch_size=2)
