"""A file that cannot be opened (missing, a directory) stands in its place: its error is
raised once, naming it, and the reader goes on with the next file; ``ignore_errors``
drops it and never spins on an input that raises again without moving.

Oracle: the records of the readable files, in order (the sequential read of those files
alone), with one error in each unreadable file's place.
"""

from __future__ import annotations

import os
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import headrace as hr
from headrace.io.tfrecord import write_tfrecord


def _files(tmp_path: Path, rng: random.Random, kind: str) -> tuple[list[str], list[Any]]:
    """Random files, some unreadable; the names, and per file its records or 'bad'."""
    names, expected = [], []
    for index in range(rng.randint(1, 7)):
        fate = rng.choice(["good", "good", "missing", "directory"])
        name = str(tmp_path / f"f{index}.{kind}")
        names.append(name)
        if fate == "missing":
            expected.append("bad")
            continue
        if fate == "directory":
            os.mkdir(name)
            expected.append("bad")
            continue
        records = [f"{index}-{j}" for j in range(rng.randint(0, 5))]
        if kind == "tfrecord":
            write_tfrecord(name, [r.encode() for r in records])
        else:
            Path(name).write_text("".join(f"{r}\n" for r in records))
        expected.append(records)
    return names, expected


def _dataset(kind: str, names: list[str]) -> hr.Dataset:
    if kind == "tfrecord":
        return hr.TFRecordDataset(names)
    if kind == "txt":
        return hr.TextLineDataset(names)
    return hr.CsvDataset(names, [""])


def _value(element: Any) -> str:
    if isinstance(element, tuple):
        element = element[0]
    return element.decode() if isinstance(element, bytes) else str(element)


@pytest.mark.parametrize("kind", ["tfrecord", "txt", "csv"])
@pytest.mark.parametrize("seed", range(6))
def test_an_unopenable_file_raises_once_in_its_place(tmp_path: Path, kind: str, seed: int) -> None:
    rng = random.Random(seed)
    names, expected = _files(tmp_path, rng, kind)
    oracle: list[Any] = []
    for name, records in zip(names, expected, strict=True):
        oracle += [("error", name)] if records == "bad" else records
    got: list[Any] = []
    with iter(_dataset(kind, names)) as iterator:
        while len(got) <= len(oracle):
            try:
                got.append(_value(next(iterator)))
            except StopIteration:
                break
            except OSError as error:
                assert isinstance(error, (FileNotFoundError, IsADirectoryError)), error
                text = str(error) + " ".join(getattr(error, "__notes__", []))
                got.append(("error", next(n for n in names if n in text)))
    assert got == oracle
    good = [r for r in oracle if not isinstance(r, tuple)]
    assert [_value(e) for e in _dataset(kind, names).ignore_errors()] == good


def test_a_state_taken_after_the_error_resumes_at_the_next_file(tmp_path: Path) -> None:
    good = str(tmp_path / "good.tfrecord")
    write_tfrecord(good, [b"a", b"b"])
    ds = hr.TFRecordDataset([str(tmp_path / "missing.tfrecord"), good])
    with iter(ds) as iterator:
        with pytest.raises(FileNotFoundError):
            next(iterator)
        state = iterator.get_state()
    with iter(ds) as resumed:
        resumed.set_state(state)
        assert list(resumed) == [b"a", b"b"]


def test_ignore_errors_raises_an_error_its_input_repeats_without_moving(tmp_path: Path) -> None:
    """A query that cannot run fails at every ``next()``: ``ignore_errors`` raises it
    (with a note) instead of dropping it forever."""
    path = tmp_path / "d.db"
    with sqlite3.connect(path) as connection:
        connection.execute("create table t (x integer)")
        connection.executemany("insert into t values (?)", [(i,) for i in range(10)])
    ds = hr.Dataset.from_sql("select nope from t", connection=f"sqlite:///{path}", batch_size=4)
    ds = ds.ignore_errors()
    with pytest.raises(hr.SqlError) as raised:
        next(iter(ds))
    assert any("without moving" in note for note in raised.value.__notes__)
