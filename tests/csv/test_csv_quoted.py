"""Quoted CSV through the block reader: pyarrow's parser where it reads quoting as
``CsvDataset`` does, the same records as Python's csv module (the oracle), and a bad
record's error on its own line, embedded newlines counted."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
import headrace._csv.reader as csvfmt
from headrace._csv.reader import CsvError

FMT = csvfmt.CsvFormat.make(",", True, "")

_PLAIN = st.text(alphabet="abc xyz019.-", max_size=6)
_QUOTED = st.text(alphabet='ab ,"\n9', max_size=8)


@st.composite
def csv_text(draw: Any, width: int, crlf: bool) -> tuple[str, list[list[str]]]:
    """Valid CSV text of ``width`` fields per record, and its rows."""
    rows = draw(st.lists(st.lists(st.tuples(st.booleans(), _PLAIN, _QUOTED),
                                  min_size=width, max_size=width), min_size=1, max_size=12))
    end = "\r\n" if crlf else "\n"
    lines, values = [], []
    for row in rows:
        fields, record = [], []
        for quote, plain, quoted in row:
            if quote:
                fields.append('"' + quoted.replace('"', '""') + '"')
                record.append(quoted)
            else:
                fields.append(plain)
                record.append(plain)
        lines.append(",".join(fields))
        values.append(record)
    last = end if draw(st.booleans()) else ""
    return end.join(lines) + last, values


def read(path: Path, width: int, engine: str, block_bytes: int) -> list[list[bytes]]:
    dataset = hr.CsvDataset(str(path), [[b""]] * width, engine=engine,
                            block_bytes=block_bytes).batch(5)
    return [list(row) for batch in dataset for row in zip(*[c.tolist() for c in batch],
                                                          strict=True)]


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), width=st.integers(2, 4), crlf=st.booleans(),
       block_bytes=st.sampled_from([16, 64, 1 << 20]))
def test_quoted_records_are_pythons_csv_rows(tmp_path: Path, data: Any, width: int,
                                             crlf: bool, block_bytes: int) -> None:
    text, _ = data.draw(csv_text(width, crlf))
    path = tmp_path / "q.csv"
    path.write_bytes(text.encode())
    oracle = [[field.encode() for field in row]
              for row in csv.reader(io.StringIO(text, newline=""))]
    assert read(path, width, "arrow", block_bytes) == oracle
    assert read(path, width, "pure", block_bytes) == oracle
    if not crlf:  # pyarrow reads the whole file: its quoting is TensorFlow's
        assert csvfmt.quoted_block_end(text.encode(), 0, len(text.encode()), True,
                                       FMT) in (None, len(text.encode()))
        if '"' in text:
            assert csvfmt.quoted_block_end(text.encode(), 0, len(text.encode()), True,
                                           FMT) == len(text.encode())


_BAD = ['"ab"c', 'a"b', '"x" ', ' "x"', 'a""']


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), width=st.integers(2, 3), bad=st.sampled_from(_BAD),
       block_bytes=st.sampled_from([16, 1 << 20]), engine=st.sampled_from(["arrow", "pure"]))
def test_a_bad_record_is_raised_on_its_line_after_the_good_ones(
        tmp_path: Path, data: Any, width: int, bad: str, block_bytes: int, engine: str) -> None:
    before, rows_before = data.draw(csv_text(width, False))
    after, rows_after = data.draw(csv_text(width, False))
    record = ",".join([bad] + ["1"] * (width - 1))
    text = before.rstrip("\n") + "\n" + record + "\n" + after
    path = tmp_path / "bad.csv"
    path.write_bytes(text.encode())
    dataset = hr.CsvDataset(str(path), [[b""]] * width, engine=engine, block_bytes=block_bytes)
    got: list[list[bytes]] = []
    iterator = iter(dataset)
    with pytest.raises(CsvError) as info:
        while True:
            got.append(list(next(iterator)))
    assert got == [[f.encode() for f in row] for row in rows_before]
    line = before.rstrip("\n").count("\n") + 2  # the bad record's line, from 1
    assert info.value.line == line and info.value.record == len(rows_before)
    assert info.value.path == str(path)
    if not bad.startswith('"'):  # (text after a closing quote: TensorFlow reads on in
        # quotes to the next quote, as the pure scanner does: the record goes on there)
        rest = [list(element) for element in iterator]  # the next record, as TensorFlow
        assert rest == [[f.encode() for f in row] for row in rows_after]


def test_an_unclosed_quote_at_the_end_is_tensorflows_error_on_its_line(tmp_path: Path) -> None:
    path = tmp_path / "open.csv"
    path.write_bytes(b'a,"b\nc"\nd,e\nf,"g\nh\n')
    for engine in ("arrow", "pure"):
        iterator = iter(hr.CsvDataset(str(path), [[b""], [b""]], engine=engine))
        assert list(next(iterator)) == [b"a", b"b\nc"]
        assert list(next(iterator)) == [b"d", b"e"]
        with pytest.raises(CsvError, match="without closing quoted field") as info:
            next(iterator)
        assert info.value.line == 4 and info.value.record == 2


def test_numbers_and_strings_in_a_quoted_file_match_the_pure_parser(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    words = ["alpha", "be,ta", 'ga""mma', "del\nta", "", "x"]
    lines = ["name,v,n"]
    for i in range(3000):
        lines.append(f'"{words[i % 6]} {i}",{rng.random():.6g},{i}')
    path = tmp_path / "mixed.csv"
    path.write_text("\n".join(lines) + "\n")
    defaults = [[b"?"], [0.0], [0]]
    arrow = list(hr.read_csv(str(path), 700, column_defaults=defaults, engine="arrow",
                             block_bytes=1 << 14))
    pure = list(hr.read_csv(str(path), 700, column_defaults=defaults, engine="pure",
                            block_bytes=1 << 14))
    assert len(arrow) == len(pure) == 5
    for ours, reference in zip(arrow, pure, strict=True):
        for name in ("name", "v", "n"):
            assert ours[name].dtype == reference[name].dtype
            np.testing.assert_array_equal(ours[name], reference[name])
    assert arrow[0]["name"][2] == b'ga"mma 2' and arrow[0]["name"][3] == b"del\nta 3"


_CELL = st.one_of(
    st.sampled_from(["", "NA", "1.5", " 2", "-3", "1e3", "x", "7"]),
    st.sampled_from(['""', '"NA"', '"1.5"', '" 2"', '"4,5"', '"6\n"', '"a""b"']),
)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rows=st.lists(st.lists(_CELL, min_size=3, max_size=3), min_size=1, max_size=10),
       kinds=st.lists(st.sampled_from(["float32", "int64", "string"]), min_size=2,
                      max_size=2),
       select=st.sampled_from([(0, 1), (0, 2), (1, 2)]), na_value=st.sampled_from(["", "NA"]))
def test_quoted_numbers_defaults_and_selections_read_alike_on_both_engines(
        tmp_path: Path, rows: list[list[str]], kinds: list[str], select: tuple[int, int],
        na_value: str) -> None:
    """pyarrow's values, defaults (empty or na_value, quoted or not) and errors are the
    pure parser's, for any selection of columns."""
    path = tmp_path / "cells.csv"
    path.write_bytes(("\n".join(",".join(row) for row in rows) + "\n").encode())
    defaults = [[b"-"] if kind == "string" else [np.dtype(kind).type(9)] for kind in kinds]

    def outcome(engine: str) -> list[Any]:
        out: list[Any] = []
        iterator = iter(hr.CsvDataset(str(path), defaults, select_cols=list(select),
                                      na_value=na_value, engine=engine).batch(4))
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return out
            except CsvError as error:
                out.append((error.message, error.line, error.record))
                continue
            out.append([(c.dtype.name, c.tolist()) for c in batch])

    assert outcome("arrow") == outcome("pure")
