"""SQL as users write it: typed parameters in both drivers and on the command line,
PostgreSQL's column types as NumPy (docs/guide/csv-sql.md's table), psycopg's
placeholders refused with the right form, and the guide's PostgreSQL ``convert`` example
run as written (scripts/postgres.sh starts the server; these tests never skip)."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import os
import re
import shlex
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import InvalidArgumentError
from headrace._sources.sql import SqlError, parse_param
from headrace.cli import main
from headrace.io.tfrecord_index import load_index

URL = os.environ.get("HEADRACE_TEST_POSTGRES", "")
ROOT = Path(__file__).resolve().parents[2]
UTC = datetime.timezone.utc

# One row per parameter type: (value, the SQLite column it matches, the PostgreSQL one).
TYPED = [
    (7, "i", "i"),
    (np.int64(7), "i", "i"),
    (2.5, "f", "f"),
    (np.float32(2.5), "f", "f"),
    ("seven", "s", "s"),
    (b"\x00\x07", "b", "b"),
    (bytearray(b"\x00\x07"), "b", "b"),
    (True, "ok", "ok"),
    (datetime.date(2024, 1, 31), "day", "day"),
    (datetime.datetime(2024, 1, 31, 12, 30, 5), "ts", "ts"),
    (datetime.datetime(2024, 1, 31, 14, 30, 5, tzinfo=datetime.timezone(
        datetime.timedelta(hours=2))), "ts", "tz"),
    (decimal.Decimal("1.25"), "n", "n"),
]


def rows_of(ds: hr.Dataset, column: str) -> list[Any]:
    return [value for batch in ds for value in batch[column].tolist()]


@pytest.fixture
def pg() -> Iterator[Any]:
    assert URL, "HEADRACE_TEST_POSTGRES is not set: run the tests with scripts/test.sh"
    import adbc_driver_postgresql.dbapi as adbc

    names: list[str] = []

    def make(columns: str, rows: str) -> str:
        name = f"t_{uuid.uuid4().hex[:10]}"
        with adbc.connect(URL) as db, db.cursor() as cur:
            cur.execute(f"CREATE TABLE {name} ({columns})")
            cur.execute(f"INSERT INTO {name} {rows}")
            db.commit()
        names.append(name)
        return name

    yield make
    with adbc.connect(URL) as db, db.cursor() as cur:
        for name in names:
            cur.execute(f"DROP TABLE {name}")
        db.commit()


def typed_pg_table(pg: Any) -> str:
    return pg("id int, i bigint, f double precision, s text, b bytea, ok boolean, day date, "
              "ts timestamp, tz timestamptz, n numeric(10, 2), x int",
              "VALUES (1, 7, 2.5, 'seven', '\\x0007', true, '2024-01-31', '2024-01-31 12:30:05', "
              "'2024-01-31 12:30:05+00', 1.25, NULL), "
              "(2, 8, 3.5, 'eight', '\\x0008', false, '2024-02-01', '2024-02-01 00:00:00', "
              "'2024-02-01 00:00:00+00', 2.5, 3)")


def typed_sqlite(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, i INTEGER, f REAL, s TEXT, b BLOB, "
                   "ok BOOLEAN, day DATE, ts TIMESTAMP, n NUMERIC, x INTEGER)")
        db.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
            (1, 7, 2.5, "seven", b"\x00\x07", 1, "2024-01-31", "2024-01-31 12:30:05", 1.25, None),
            (2, 8, 3.5, "eight", b"\x00\x08", 0, "2024-02-01", "2024-02-01 00:00:00", 2.5, 3)])
        db.commit()
    return f"sqlite:///{path}"


@pytest.mark.parametrize(("value", "column"), [(v, c) for v, c, _ in TYPED] + [(None, "x")],
                         ids=lambda v: type(v).__name__)
def test_sqlite_binds_each_parameter_type(tmp_path: Path, value: Any, column: str) -> None:
    url = typed_sqlite(tmp_path / "t.db")
    where = f"{column} IS ?" if value is None else f"{column} = ?"
    ds = hr.Dataset.from_sql(f"SELECT id FROM t WHERE {where}", (value,), connection=url)
    assert rows_of(ds, "id") == [1]


@pytest.mark.parametrize(("value", "column"), [(v, c) for v, _, c in TYPED]
                         + [(None, "x")], ids=lambda v: type(v).__name__)
def test_postgres_binds_each_parameter_type(pg: Any, value: Any, column: str) -> None:
    table = typed_pg_table(pg)
    where = f"{column} IS NOT DISTINCT FROM $1" if value is None else f"{column} = $1"
    for key in ("id", None):  # keyset pages add parameters after the user's
        ds = hr.Dataset.from_sql(f"SELECT id FROM {table} WHERE {where}", (value,),
                                 connection=URL, key=key)
        assert rows_of(ds, "id") == [1]


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, object(), 1j, np.zeros(2)],
                         ids=lambda v: type(v).__name__)
def test_a_parameter_of_another_type_is_refused_by_position(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"parameter 2 is a {type(value).__name__} "
                       r".*int, float, bool, str, bytes, datetime.date"):
        hr.Dataset.from_sql("SELECT 1 WHERE ? < ?", (1, value), connection="sqlite:///x.db")


def test_postgres_column_types_become_numpy_by_the_documented_rules(pg: Any) -> None:
    table = pg(
        "id int, d date, ts timestamp, tz timestamptz, tm time, iv interval, n numeric(10, 2), "
        "u uuid, j json, jb jsonb, ia int[], sa text[], da date[]",
        "SELECT g, DATE '2024-01-30' + g, TIMESTAMP '2024-01-01 01:02:03.456789' + g * "
        "INTERVAL '1 second', TIMESTAMPTZ '2024-01-01 01:02:03+02', TIME '01:02:03.5', "
        "INTERVAL '1 day 2 hours' * g, g / 4.0, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', "
        "'{\"a\": 1}', '{\"a\": 1}', ARRAY[g, 2], CASE WHEN g = 1 THEN ARRAY['x'] ELSE "
        "ARRAY['y', 'z'] END, ARRAY[DATE '2024-01-01'] FROM generate_series(1, 5) g")
    for key in ("id", None):  # the COPY stream and plain queries convert alike
        batch = next(iter(hr.Dataset.from_sql(f"SELECT * FROM {table} ORDER BY id",
                                              connection=URL, key=key, batch_size=5)))
        assert batch["d"].dtype == np.dtype("datetime64[D]")
        assert batch["d"][0] == np.datetime64("2024-01-31")
        assert batch["ts"].dtype == np.dtype("datetime64[us]")
        assert batch["ts"][1] == np.datetime64("2024-01-01T01:02:05.456789")
        assert batch["tz"].dtype == np.dtype("datetime64[us]")
        assert batch["tz"][0] == np.datetime64("2023-12-31T23:02:03")  # the instant in UTC
        assert batch["tm"].dtype == np.dtype("timedelta64[us]")
        assert batch["tm"][0] == np.timedelta64(3723500000, "us")
        assert batch["iv"].dtype == np.dtype("timedelta64[us]")
        assert batch["iv"][1] == np.timedelta64(2 * 26, "h")
        assert batch["n"].dtype == np.float64 and batch["n"][1] == 0.5
        assert batch["u"][0] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
        assert batch["j"][0] == '{"a": 1}' and batch["jb"][0] == '{"a": 1}'
        assert batch["ia"].dtype == object and batch["ia"][2].tolist() == [3, 2]
        assert batch["ia"][2].dtype == np.int32
        assert [a.tolist() for a in batch["sa"][:2]] == [["x"], ["y", "z"]]
        assert batch["da"][0].dtype == np.dtype("datetime64[D]")
    exact = next(iter(hr.Dataset.from_sql(f"SELECT n FROM {table} ORDER BY id", connection=URL,
                                          dtypes={"n": object})))
    assert exact["n"].tolist()[:2] == [decimal.Decimal("0.25"), decimal.Decimal("0.50")]


def test_postgres_timestamp_key_pages_and_resumes(pg: Any) -> None:
    table = pg("ts timestamp, v int", "SELECT TIMESTAMP '2024-01-01' + g * INTERVAL '1 minute', "
               "g FROM generate_series(0, 99) g")
    ds = hr.Dataset.from_sql(f"SELECT * FROM {table} WHERE ts >= $1",
                             (datetime.datetime(2024, 1, 1, 0, 10),), connection=URL, key="ts",
                             batch_size=7, page_rows=20)
    assert rows_of(ds, "v") == list(range(10, 100))


def test_postgres_timestamptz_key_pages_in_any_session_time_zone(pg: Any) -> None:
    table = pg("ts timestamptz, v int", "SELECT TIMESTAMPTZ '2024-01-01 00:00:00+00' + g * "
               "INTERVAL '1 minute', g FROM generate_series(0, 49) g")
    tokyo = URL + ("&" if "?" in URL else "?") + "options=-c%20TimeZone%3DAsia%2FTokyo"
    ds = hr.Dataset.from_sql(f"SELECT * FROM {table} WHERE v >= $1", (0,), connection=tokyo,
                             key="ts", batch_size=4, page_rows=10)
    assert rows_of(ds, "v") == list(range(50))


@pytest.mark.parametrize(("select", "message"), [
    ("INTERVAL '1 month'", r"column 'v' row 0: the interval .* has months"),
    ("ARRAY[1, NULL]", r"column 'v' row 0: an array holds a NULL element"),
])
def test_postgres_values_numpy_cannot_hold_are_refused_naming_them(select: str,
                                                                   message: str) -> None:
    assert URL, "HEADRACE_TEST_POSTGRES is not set: run the tests with scripts/test.sh"
    with pytest.raises(SqlError, match=message):
        list(hr.Dataset.from_sql(f"SELECT {select} AS v", connection=URL))


def test_sqlite_dates_parse_with_dtypes(tmp_path: Path) -> None:
    url = typed_sqlite(tmp_path / "t.db")
    ds = hr.Dataset.from_sql("SELECT day, ts FROM t ORDER BY id", connection=url,
                             dtypes={"day": "datetime64[D]", "ts": "datetime64[s]"})
    batch = next(iter(ds))
    assert batch["day"].tolist() == [datetime.date(2024, 1, 31), datetime.date(2024, 2, 1)]
    assert batch["ts"][0] == np.datetime64("2024-01-31T12:30:05")


@pytest.mark.parametrize(("query", "postgres", "shown"), [
    ("SELECT * FROM t WHERE a = %s AND b = %s", True, "SELECT * FROM t WHERE a = $1 AND b = $2"),
    ("SELECT * FROM t WHERE a = %(x)s OR b = %(y)s OR c = %(x)s", True,
     "SELECT * FROM t WHERE a = $1 OR b = $2 OR c = $1'; params=(...) in this order: x, y"),
    ("SELECT a %% 2 FROM t WHERE b = %s", True, "SELECT a % 2 FROM t WHERE b = $1"),
    ("SELECT * FROM t WHERE s LIKE 'a%s' AND a = %s", False,
     "SELECT * FROM t WHERE s LIKE 'a%s' AND a = ?"),
])
def test_psycopg_placeholders_are_refused_showing_the_drivers_form(
        tmp_path: Path, query: str, postgres: bool, shown: str) -> None:
    url = "postgresql://nobody@127.0.0.1:1/x" if postgres else typed_sqlite(tmp_path / "t.db")
    with pytest.raises(InvalidArgumentError, match="psycopg's placeholder") as caught:
        hr.Dataset.from_sql(query, (1, 2), connection=url)
    assert shown in str(caught.value)
    # a connection function's database is known when it connects: refused then
    path = str(tmp_path / "f.db")
    sqlite3.connect(path).close()
    with pytest.raises(InvalidArgumentError, match="psycopg's placeholder"):
        list(hr.Dataset.from_sql("SELECT 1 WHERE 1 = %s", (1,),
                                 connection=lambda: sqlite3.connect(path)))


def test_percent_in_strings_comments_and_modulo_is_left_alone(tmp_path: Path) -> None:
    url = typed_sqlite(tmp_path / "t.db")
    ds = hr.Dataset.from_sql("SELECT id % 2 AS m, '%s' AS p FROM t -- %s\n WHERE s LIKE '%e%'",
                             connection=url)
    assert rows_of(ds, "m") == [1, 0] and rows_of(ds, "p") == ["%s", "%s"]


@pytest.mark.parametrize(("text", "value"), [
    ("5", "5"), ("int:5", 5), ("float:0.5", 0.5), ("bool:TRUE", True), ("bool:0", False),
    ("date:2024-01-31", datetime.date(2024, 1, 31)),
    ("datetime:2024-01-31T12:00:00+02:00",
     datetime.datetime(2024, 1, 31, 10, tzinfo=UTC)),
    ("decimal:1.25", decimal.Decimal("1.25")), ("bytes:00ff", b"\x00\xff"), ("null:", None),
    ("str:int:5", "int:5"), ("http://x", "http://x"), ("a:b", "a:b"),
])
def test_cli_parameter_types(text: str, value: Any) -> None:
    parsed = parse_param(text)
    assert parsed == value and type(parsed) is type(value)


def test_cli_typed_parameter_reaches_sqlite_and_a_bad_one_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = typed_sqlite(tmp_path / "t.db")
    out = tmp_path / "out"
    assert main(["convert", url, str(out), "--query", "SELECT id, day FROM t WHERE day >= ? "
                 "AND n = ?", "--param", "date:2024-02-01", "--param", "decimal:2.50",
                 "--progress", "never"]) == 0
    shards = sorted(str(p) for p in out.glob("*.tfrecord"))
    assert sum(len(load_index(p)) for p in shards) == 1
    capsys.readouterr()
    assert main(["convert", url, str(out), "--query", "SELECT 1", "--param", "date:31/01/2024"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'31/01/2024' is not a date value" in err


def test_the_guides_postgres_convert_example_runs_as_written(
        pg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `headrace convert 'postgresql://...'` lines of docs/guide/csv-sql.md, with this
    server's URL in place of the example's, against an `events` table."""
    guide = (ROOT / "docs" / "guide" / "csv-sql.md").read_text()
    command = re.search(r"^(headrace convert 'postgresql://[^\n]*\\\n[^\n]*)$", guide,
                        flags=re.M)
    assert command is not None, "the guide's PostgreSQL convert example moved"
    argv = shlex.split(command.group(1).replace("\\\n", " "))
    argv[2] = URL
    import adbc_driver_postgresql.dbapi as adbc

    with adbc.connect(URL) as db, db.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS events")
        cur.execute("CREATE TABLE events (id bigint PRIMARY KEY, day date, v double precision)")
        cur.execute("INSERT INTO events SELECT g, DATE '2023-12-31' + g % 3, g * 0.5 "
                    "FROM generate_series(0, 299) g")
        db.commit()
    try:
        monkeypatch.chdir(tmp_path)
        assert main([*argv[1:], "--progress", "never"]) == 0
        shards = sorted(tmp_path.glob("train-*.tfrecord"))
        assert len(shards) == 64
        assert sum(len(load_index(str(p))) for p in shards) == 100  # day = 2024-01-01
    finally:
        with adbc.connect(URL) as db, db.cursor() as cur:
            cur.execute("DROP TABLE events")
            db.commit()


def test_convert_writes_dates_and_times_as_counts_of_their_unit(
        pg: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from headrace.io.example import decode_example
    from headrace.io.tfrecord import open_tfrecord

    table = pg("id int, d date, ts timestamp, iv interval",
               "VALUES (1, '1970-01-11', '1970-01-01 00:00:01.5', '1 day')")
    assert main(["convert", URL, str(tmp_path / "out"), "--table", table,
                 "--progress", "never"]) == 0
    out = capsys.readouterr().out
    assert "d: datetime64[D] -> int64_list (count of D since 1970-01-01)" in out
    assert "iv: timedelta64[us] -> int64_list (count of us)" in out
    (shard,) = sorted((tmp_path / "out").glob("*.tfrecord"))
    with open_tfrecord(str(shard)) as reader:
        (record,) = reader.read_batch(2)
    decoded = decode_example(record)
    assert [decoded[name][1].tolist() for name in ("d", "ts", "iv")] == [
        [10], [1_500_000], [86_400_000_000]]
