"""`headrace convert`, run in-process: CSV, SQLite, PostgreSQL and .npy sources to TFRecord
shards that TensorFlow reads back with the same values; TFRecord back to CSV; errors that
name the file and row and leave nothing written."""

from __future__ import annotations

import contextlib
import csv
import glob
import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headrace.cli import main
from headrace.io.tfrecord_index import index_path_for, load_index

Capture = pytest.CaptureFixture[str]

# --------------------------------------------------------------------------- helpers


def shard_files(directory: Path) -> list[str]:
    return sorted(glob.glob(str(directory / "*.tfrecord")))


def read_with_tf(paths: list[str], features: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """Each shard's Examples parsed by TensorFlow: one dict of columns per shard."""
    out = []
    for path in paths:
        records = list(tf.data.TFRecordDataset(path).as_numpy_iterator())
        if not records:
            out.append({name: np.empty(0) for name in features})
            continue
        parsed = tf.io.parse_example(records, features)
        out.append({name: value.numpy() for name, value in parsed.items()})
    return out


def round_robin(shards: list[dict[str, np.ndarray]], name: str, total: int) -> list[Any]:
    """Rows in source order from round-robin shards (row i is in shard i % N)."""
    count = len(shards)
    return [shards[i % count][name][i // count] for i in range(total)]


def nothing_final(directory: Path) -> bool:
    """No file under a final name: at most hidden staging leftovers (there should be none)."""
    return not directory.exists() or not [n for n in os.listdir(directory) if not n.startswith(".")]


# --------------------------------------------------------------------------- CSV

_TEXT = st.text(alphabet=st.sampled_from(list('ab ,"\n;é')), max_size=6).map(lambda s: "t" + s)
_FLOAT = st.floats(width=32, allow_nan=False, allow_infinity=False)
_INT = st.integers(-(2**31), 2**31 - 1)
_COLUMN = st.sampled_from(["int", "float", "text"])


@st.composite
def tables(draw: Any) -> tuple[list[str], list[list[Any]]]:
    kinds = draw(st.lists(_COLUMN, min_size=1, max_size=4))
    rows = draw(st.integers(1, 40))
    by_kind = {"int": _INT, "float": _FLOAT, "text": _TEXT}
    data = [[draw(by_kind[kind]) for kind in kinds] for _ in range(rows)]
    return kinds, data


def write_csv(path: Path, kinds: list[str], rows: list[list[Any]]) -> list[str]:
    names = [f"{kind}{i}" for i, kind in enumerate(kinds)]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(names)
        for row in rows:
            # repr of a float32 value read back as float64 is exact; TF rounds it to float32
            writer.writerow([repr(float(v)) if isinstance(v, float) else v for v in row])
    return names


def tf_features(kinds: list[str], names: list[str]) -> dict[str, Any]:
    dtypes = {"int": tf.int64, "float": tf.float32, "text": tf.string}
    return {name: tf.io.FixedLenFeature([], dtypes[kind]) for name, kind in zip(names, kinds, strict=True)}


def expected(kind: str, value: Any) -> Any:
    if kind == "float":
        return np.float32(value)
    if kind == "text":
        return value.encode("utf-8")
    return value


@pytest.mark.tf
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=tables(), shards=st.integers(1, 4))
def test_csv_to_tfrecord_and_back_keeps_every_value(
    tmp_path_factory: pytest.TempPathFactory, table: tuple[list[str], list[list[Any]]], shards: int
) -> None:
    kinds, rows = table
    directory = tmp_path_factory.mktemp("csv")
    source = directory / "data.csv"
    names = write_csv(source, kinds, rows)
    out = directory / "shards"
    assert main(["convert", str(source), str(out), "--shards", str(shards), "--progress", "never"]) == 0
    paths = shard_files(out)
    assert len(paths) == shards
    for path in paths:  # every shard has a valid index
        assert len(load_index(path)) == len(list(tf.data.TFRecordDataset(path)))
    parsed = read_with_tf(paths, tf_features(kinds, names))
    for column, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        got = round_robin(parsed, name, len(rows))
        want = [expected(kind, row[column]) for row in rows]
        assert got == want, name
    # and back to CSV: the same values as text
    back = directory / "back.csv"
    assert main(["convert", *paths, str(back), "--progress", "never"]) == 0
    with open(back, newline="", encoding="utf-8") as handle:
        read = list(csv.reader(handle))
    assert read[0] == sorted(names)
    order = [names.index(name) for name in read[0]]
    recovered = [[line[order.index(c)] for c in range(len(names))] for line in read[1:]]
    shard_order = [i for s in range(shards) for i in range(s, len(rows), shards)]
    for line, i in zip(recovered, shard_order, strict=True):
        for column, kind in enumerate(kinds):
            value = rows[i][column]
            if kind == "float":
                assert np.float32(line[column]) == np.float32(value)
            else:
                assert line[column] == str(value)


def test_convert_prints_a_summary_and_shows_progress(tmp_path: Path, capsys: Capture) -> None:
    source = tmp_path / "data.csv"
    source.write_text("a,b\n" + "".join(f"{i},{i / 2}\n" for i in range(1000)))
    assert main(["convert", str(source), str(tmp_path / "out"), "--shards", "3",
                 "--progress", "always", "--batch-size", "100"]) == 0
    captured = capsys.readouterr()
    assert "writing: 1,000 records" in captured.err and "-> 3 shards" in captured.err
    out = captured.out
    assert f"converted csv {source}: 1,000 records" in out
    assert "a: int32 -> int64_list" in out and "b: float32 -> float_list" in out
    for shard in range(3):
        path = tmp_path / "out" / f"part-{shard:05d}-of-00003.tfrecord"
        records = 334 if shard == 0 else 333
        assert f"{path}: {records} records" in out
        assert os.path.exists(index_path_for(path))


def test_a_bad_csv_field_names_file_record_and_column_and_writes_nothing(
    tmp_path: Path, capsys: Capture
) -> None:
    source = tmp_path / "data.csv"
    lines = [f"{i},{i}.5" for i in range(100)]
    lines[60] = "60,oops"
    source.write_text("id,value\n" + "\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["convert", str(source), str(out), "--shards", "2", "--infer-rows", "10",
                 "--progress", "never"]) == 1
    err = capsys.readouterr().err
    assert str(source) in err and "record 60" in err and "oops" in err
    assert "column 1" in err or "'value'" in err
    assert "nothing was written" in err
    assert nothing_final(out)


def test_unknown_sources_and_missing_files_are_refused(tmp_path: Path, capsys: Capture) -> None:
    assert main(["convert", str(tmp_path / "data.parquet"), str(tmp_path / "o")]) == 1
    assert "cannot tell what" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.csv"), str(tmp_path / "o")]) == 1
    assert "missing.csv does not exist" in capsys.readouterr().err
    assert main(["convert", "sqlite:///" + str(tmp_path / "x.db"), str(tmp_path / "o")]) == 1
    assert "--query" in capsys.readouterr().err


# --------------------------------------------------------------------------- .npy


@pytest.mark.tf
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 50), width=st.integers(0, 3), shards=st.integers(1, 4),
       dtype=st.sampled_from(["float32", "int16", "int64", "bool"]))
def test_npy_shards_are_contiguous_blocks_that_tf_reads(
    tmp_path_factory: pytest.TempPathFactory, rows: int, width: int, shards: int, dtype: str
) -> None:
    directory = tmp_path_factory.mktemp("npy")
    shape = (rows,) if width == 0 else (rows, width)
    array = (np.arange(int(np.prod(shape))).reshape(shape) % 7 - 3).astype(dtype)
    np.save(directory / "a.npy", array)
    out = directory / "out"
    assert main(["convert", str(directory / "a.npy"), str(out), "--shards", str(shards),
                 "--feature", "pixels", "--batch-size", "16", "--progress", "never"]) == 0
    paths = shard_files(out)
    per_row = max(width, 1)
    kind = tf.float32 if dtype == "float32" else tf.int64
    parsed = read_with_tf(paths, {"pixels": tf.io.FixedLenFeature([per_row], kind)})
    sizes = [rows // shards + (1 if s < rows % shards else 0) for s in range(shards)]
    assert [len(p["pixels"]) for p in parsed] == sizes
    got = np.concatenate([p["pixels"].reshape(-1, per_row) for p in parsed]) if rows else []
    np.testing.assert_array_equal(np.asarray(got).reshape(-1, per_row),
                                  array.reshape(rows, per_row).astype(got.dtype if rows else float))


@pytest.mark.tf
def test_a_structured_npy_gives_one_feature_per_field(tmp_path: Path, capsys: Capture) -> None:
    array = np.zeros(10, dtype=[("label", np.int32), ("score", np.float64), ("xy", np.float32, (2,))])
    array["label"] = np.arange(10)
    array["score"] = np.arange(10) / 3
    array["xy"] = np.arange(20).reshape(10, 2)
    np.save(tmp_path / "s.npy", array)
    assert main(["convert", str(tmp_path / "s.npy"), str(tmp_path / "out"), "--progress", "never"]) == 0
    out = capsys.readouterr().out
    assert "note: column 'score' is float64: written as float32" in out
    (parsed,) = read_with_tf(shard_files(tmp_path / "out"), {
        "label": tf.io.FixedLenFeature([], tf.int64),
        "score": tf.io.FixedLenFeature([], tf.float32),
        "xy": tf.io.FixedLenFeature([2], tf.float32)})
    np.testing.assert_array_equal(parsed["label"], np.arange(10))
    np.testing.assert_array_equal(parsed["score"], (np.arange(10) / 3).astype(np.float32))
    np.testing.assert_array_equal(parsed["xy"], array["xy"])


# --------------------------------------------------------------------------- SQL


def make_sqlite(path: Path, rows: int, null_at: int | None = None) -> str:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, x REAL, name TEXT)")
        db.executemany("INSERT INTO t VALUES (?, ?, ?)",
                       [(i, i * 0.25, None if i == null_at else f"n{i}") for i in range(rows)])
    return f"sqlite:///{path}"


@contextlib.contextmanager
def postgres_table(columns: str, rows_query: str) -> Iterator[tuple[str, str]]:
    """(server URL, name) of a throwaway table filled by ``rows_query``; dropped after."""
    url = os.environ.get("HEADRACE_TEST_POSTGRES", "")
    assert url, "HEADRACE_TEST_POSTGRES is not set: run the tests with scripts/test.sh"
    import adbc_driver_postgresql.dbapi as pg

    name = f"conv_{uuid.uuid4().hex[:10]}"
    with pg.connect(url) as db, db.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} ({columns})")
        cur.execute(f"INSERT INTO {name} {rows_query}")
        db.commit()
    try:
        yield url, name
    finally:
        with pg.connect(url) as db, db.cursor() as cur:
            cur.execute(f"DROP TABLE {name}")
            db.commit()


@pytest.mark.tf
def test_sqlite_query_to_shards(tmp_path: Path, capsys: Capture) -> None:
    url = make_sqlite(tmp_path / "db.sqlite", 500)
    hostile = "x'); DROP TABLE t; --"
    assert main(["convert", url, str(tmp_path / "out"), "--shards", "2", "--key", "id",
                 "--query", "SELECT * FROM t WHERE name != ?", "--param", hostile,
                 "--batch-size", "64", "--progress", "never"]) == 0
    assert "note: column 'x' is float64" in capsys.readouterr().out
    parsed = read_with_tf(shard_files(tmp_path / "out"), {
        "id": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([], tf.float32),
        "name": tf.io.FixedLenFeature([], tf.string)})
    assert round_robin(parsed, "id", 500) == list(range(500))
    assert round_robin(parsed, "name", 500) == [f"n{i}".encode() for i in range(500)]
    assert round_robin(parsed, "x", 500) == [np.float32(i * 0.25) for i in range(500)]
    with sqlite3.connect(tmp_path / "db.sqlite") as db:  # the parameter stayed a value
        assert db.execute("SELECT count(*) FROM t").fetchone() == (500,)


def test_a_sql_null_names_column_and_row_and_writes_nothing(tmp_path: Path, capsys: Capture) -> None:
    url = make_sqlite(tmp_path / "db.sqlite", 300, null_at=250)
    out = tmp_path / "out"
    assert main(["convert", url, str(out), "--table", "t", "--key", "id", "--shards", "2",
                 "--batch-size", "32", "--progress", "never"]) == 1
    err = capsys.readouterr().err
    assert "NULL in column 'name' at row 250 (key 250)" in err
    assert nothing_final(out)


@pytest.mark.tf
def test_postgresql_query_to_shards(tmp_path: Path) -> None:
    with postgres_table("id bigint PRIMARY KEY, f real, s text",
                        "SELECT g, g * 0.5, 'r' || g FROM generate_series(0, 999) g") as (url, name):
        assert main(["convert", url, str(tmp_path / "out"), "--table", name, "--key", "id",
                     "--shards", "3", "--progress", "never"]) == 0
    parsed = read_with_tf(shard_files(tmp_path / "out"), {
        "id": tf.io.FixedLenFeature([], tf.int64), "f": tf.io.FixedLenFeature([], tf.float32),
        "s": tf.io.FixedLenFeature([], tf.string)})
    assert round_robin(parsed, "id", 1000) == list(range(1000))
    assert round_robin(parsed, "f", 1000) == [np.float32(i * 0.5) for i in range(1000)]
    assert round_robin(parsed, "s", 1000) == [f"r{i}".encode() for i in range(1000)]


# --------------------------------------------------------------------------- TFRecord -> CSV


@pytest.mark.tf
def test_tensorflow_written_examples_to_csv(tmp_path: Path, capsys: Capture) -> None:
    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(5):
            feature = {
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                "vec": tf.train.Feature(float_list=tf.train.FloatList(value=[0.1, i])),
                "tags": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a,b", b'q"'])),
            }
            if i % 2:
                feature["odd"] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"yes"]))
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                         .SerializeToString())
    dest = tmp_path / "out.csv"
    assert main(["convert", path, str(dest), "--limit", "4", "--progress", "never"]) == 0
    with open(dest, newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["label", "odd", "tags", "vec"]
    assert rows[1] == ["0", "", '["a,b", "q\\""]', "[0.1, 0.0]"]
    assert rows[2] == ["1", "yes", '["a,b", "q\\""]', "[0.1, 1.0]"]
    assert len(rows) == 5  # the header and --limit 4 rows
    assert "4 records" in capsys.readouterr().out


def test_a_corrupt_tfrecord_names_file_and_offset_and_writes_no_csv(
    tmp_path: Path, capsys: Capture
) -> None:
    import headrace as hr

    (path,) = hr.Dataset.from_tensor_slices({"x": np.arange(50)}).save_tfrecords(
        tmp_path / "shards", progress=False)
    data = bytearray(Path(path).read_bytes())
    data[200] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    dest = tmp_path / "out.csv"
    assert main(["convert", path, str(dest), "--progress", "never"]) == 1
    err = capsys.readouterr().err
    assert path in err and "offset" in err
    assert not dest.exists() and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_tfrecord_destination_must_be_csv(tmp_path: Path, capsys: Capture) -> None:
    assert main(["convert", str(tmp_path / "a.tfrecord"), str(tmp_path / "out")]) == 1
    assert "must end with .csv" in capsys.readouterr().err


def test_save_tfrecords_takes_a_row_count_only_for_batches(tmp_path: Path) -> None:
    from headrace._errors import InvalidArgumentError
    from headrace._persist.writers import save_tfrecords

    batches = [{"x": np.arange(5)}, {"x": np.arange(5, 7)}]
    paths = save_tfrecords(batches, tmp_path / "a", num_shards=2, batched=True, num_records=7,
                           progress=False)
    assert [len(load_index(p)) for p in paths] == [4, 3]  # contiguous blocks, not round-robin
    with pytest.raises(InvalidArgumentError, match="only with batched=True"):
        save_tfrecords(batches, tmp_path / "b", num_records=7, progress=False)
    with pytest.raises(InvalidArgumentError, match="more elements than"):
        save_tfrecords(batches, tmp_path / "c", batched=True, num_records=6, progress=False)
    assert nothing_final(tmp_path / "c")


# --------------------------------------------------------------------------- --null-default

_CELL = st.one_of(st.none(), st.integers(-1000, 1000))


@pytest.mark.tf
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(_CELL, st.one_of(st.none(), _FLOAT), st.sampled_from(["", "w"])),
                  min_size=1, max_size=30),
    every=st.sampled_from([None, "-7", "2.5"]),
    own=st.fixed_dictionaries({}, optional={"i": st.sampled_from(["3", "-1"]),
                                            "s": st.sampled_from(["none", "x=y"])}),
)
def test_csv_empty_fields_take_the_null_default_or_fail_naming_where(
    tmp_path_factory: pytest.TempPathFactory, capsys: Capture,
    rows: list[tuple[int | None, float | None, str]], every: str | None, own: dict[str, str],
) -> None:
    tmp = tmp_path_factory.mktemp("nulls")
    source = tmp / "t.csv"
    # row 0 fixes each column's inferred type (int, float, text), whatever follows
    table = [(1, 0.5, "w"), *rows]
    with open(source, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["i", "f", "s"])
        for i, f, s in table:
            writer.writerow(["" if i is None else i, "" if f is None else repr(f), s])
    specs = ([every] if every is not None else []) + [f"{k}={v}" for k, v in own.items()]
    argv = ["convert", str(source), str(tmp / "out"), "--progress", "never", "--batch-size", "8"]
    for spec in specs:
        argv += ["--null-default", spec]
    code = main(argv)
    err = capsys.readouterr().err

    int_default = own.get("i", every)
    if int_default is not None and "." in int_default:  # 2.5 is no int: refused up front
        assert code == 1 and "'2.5' for column 'i'" in err and "not a int32 value" in err
        assert nothing_final(tmp / "out")
        return
    missing = [(r, c) for r, row in enumerate(table) for c, v in enumerate(row[:2]) if v is None
               and (own.get("i" if c == 0 else "f", every) is None)]
    if missing:
        record, column = missing[0]
        assert code == 1, err
        assert f"Field {column} is required but missing" in err and "--null-default" in err
        assert f"record {record}" in err and str(source) in err
        assert nothing_final(tmp / "out")
        return
    assert code == 0, err
    (parsed,) = read_with_tf(shard_files(tmp / "out"), {
        "i": tf.io.FixedLenFeature([], tf.int64), "f": tf.io.FixedLenFeature([], tf.float32),
        "s": tf.io.FixedLenFeature([], tf.string)})
    f_default = own.get("f", every)
    assert parsed["i"].tolist() == [int(int_default) if i is None else i  # type: ignore[arg-type]
                                    for i, _, _ in table]
    assert parsed["f"].tolist() == [np.float32(float(f_default) if f is None else f)  # type: ignore[arg-type]
                                    for _, f, _ in table]
    # an empty text field is the empty string, a value: only the column's own default replaces it
    assert parsed["s"].tolist() == [(own.get("s", "") if s == "" else s).encode()
                                    for _, _, s in table]


def make_sqlite_nulls(path: Path) -> str:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER, x REAL, name TEXT)")
        db.executemany("INSERT INTO t VALUES (?, ?, ?, ?)",
                       [(i, None if i % 3 == 0 else i, None if i % 4 == 1 else i / 2,
                         None if i % 5 == 2 else f"n{i}") for i in range(40)])
    return f"sqlite:///{path}"


@pytest.mark.tf
def test_sql_nulls_take_the_null_default_parsed_per_column(tmp_path: Path, capsys: Capture) -> None:
    url = make_sqlite_nulls(tmp_path / "db.sqlite")
    assert main(["convert", url, str(tmp_path / "out"), "--table", "t", "--key", "id",
                 "--batch-size", "7", "--progress", "never", "--null-default", "-1",
                 "--null-default", "name=unknown"]) == 0, capsys.readouterr().err
    (parsed,) = read_with_tf(shard_files(tmp_path / "out"), {
        "n": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([], tf.float32),
        "name": tf.io.FixedLenFeature([], tf.string)})
    assert parsed["n"].tolist() == [-1 if i % 3 == 0 else i for i in range(40)]
    assert parsed["x"].tolist() == [-1.0 if i % 4 == 1 else i / 2 for i in range(40)]
    assert parsed["name"].tolist() == [b"unknown" if i % 5 == 2 else f"n{i}".encode()
                                       for i in range(40)]


def test_a_null_default_that_is_not_the_column_type_names_the_column(
    tmp_path: Path, capsys: Capture
) -> None:
    url = make_sqlite_nulls(tmp_path / "db.sqlite")
    out = tmp_path / "out"
    assert main(["convert", url, str(out), "--table", "t", "--progress", "never",
                 "--null-default", "NA"]) == 1
    err = capsys.readouterr().err
    assert "NULL default 'NA' for column 'n' is not a int value" in err and "nothing was written" in err
    assert nothing_final(out)


@pytest.mark.parametrize(("specs", "message"), [
    (["=5"], "names no column"),
    (["a=1", "a=2"], "given twice for 'a'"),
    (["1", "*=2"], "given twice for '*'"),
])
def test_bad_null_default_specs_are_refused(specs: list[str], message: str) -> None:
    from headrace._errors import InvalidArgumentError
    from headrace._tools.convert import parse_null_defaults

    with pytest.raises(InvalidArgumentError, match=message):
        parse_null_defaults(specs)
    assert parse_null_defaults(["0", "s=a=b"]) == {"*": "0", "s": "a=b"}


def test_null_default_for_a_column_the_csv_lacks_is_refused(tmp_path: Path, capsys: Capture) -> None:
    source = tmp_path / "t.csv"
    source.write_text("a,b\n1,2\n")
    assert main(["convert", str(source), str(tmp_path / "out"), "--null-default", "c=1",
                 "--progress", "never"]) == 1
    assert "--null-default for ['c']" in capsys.readouterr().err


@pytest.mark.tf
def test_postgresql_nulls_take_the_null_default_parsed_per_column(
    tmp_path: Path, capsys: Capture
) -> None:
    # PostgreSQL's columns arrive as Arrow: the default is parsed as each Arrow type
    with postgres_table(
        "id bigint PRIMARY KEY, n integer, f double precision, b boolean, s text",
        "SELECT g, CASE WHEN g % 3 = 0 THEN NULL ELSE g END, "
        "CASE WHEN g % 4 = 1 THEN NULL ELSE g * 0.5 END, "
        "CASE WHEN g % 5 = 2 THEN NULL ELSE g % 2 = 0 END, "
        "CASE WHEN g % 7 = 3 THEN NULL ELSE 'r' || g END FROM generate_series(0, 99) g",
    ) as (url, name):
        refused = main(["convert", url, str(tmp_path / "bad"), "--table", name, "--key", "id",
                        "--progress", "never", "--null-default", "NA"])
        assert refused == 1
        assert "NULL default 'NA' for column 'n' is not a int value" in capsys.readouterr().err
        assert nothing_final(tmp_path / "bad")
        assert main(["convert", url, str(tmp_path / "out"), "--table", name, "--key", "id",
                     "--progress", "never", "--null-default", "1", "--null-default", "s=none",
                     "--null-default", "f=-2.5"]) == 0, capsys.readouterr().err
    (parsed,) = read_with_tf(shard_files(tmp_path / "out"), {
        "n": tf.io.FixedLenFeature([], tf.int64), "f": tf.io.FixedLenFeature([], tf.float32),
        "b": tf.io.FixedLenFeature([], tf.int64), "s": tf.io.FixedLenFeature([], tf.string)})
    assert parsed["n"].tolist() == [1 if g % 3 == 0 else g for g in range(100)]
    assert parsed["f"].tolist() == [-2.5 if g % 4 == 1 else g * 0.5 for g in range(100)]
    assert parsed["b"].tolist() == [1 if g % 5 == 2 else int(g % 2 == 0) for g in range(100)]
    assert parsed["s"].tolist() == [b"none" if g % 7 == 3 else f"r{g}".encode() for g in range(100)]
