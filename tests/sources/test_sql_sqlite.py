"""Dataset.from_sql on SQLite (the standard library): values, NULLs, hostile strings,
keyset resume, keyless resume, sharding by key, retries, budget."""

from __future__ import annotations

import json
import re
import sqlite3
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._sources.sql import SqlError
from headrace.testing import assert_checkpoint_roundtrip

HOSTILE = ["'; DROP TABLE t; --", 'a"b', "x') OR ('1'='1", "\x00nul", "é\n\"'", "%s $1 ?"]


def make_db(path: Any, rows: int = 500) -> str:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, x REAL, n INTEGER, s TEXT, b BLOB)")
    db.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?)",
                   [(i, i * 0.5, None if i % 7 == 3 else i * 2, f"r{i}", bytes([i % 256]))
                    for i in range(rows)])
    db.commit()
    db.close()
    return f"sqlite:///{path}"


def all_rows(ds: hr.Dataset) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for batch in ds:
        for name, column in batch.items():
            out.setdefault(name, []).extend(column.tolist())
    return out


def test_values_dtypes_and_null_defaults(tmp_path: Any) -> None:
    url = make_db(tmp_path / "t.db")
    ds = hr.Dataset.from_sql("SELECT id, x, n, s, b FROM t WHERE id < ?", (20,), connection=url,
                             key="id", batch_size=8, null_defaults={"n": -1})
    batches = list(ds)
    assert [len(b["id"]) for b in batches] == [8, 8, 4]
    first = batches[0]
    assert first["id"].dtype == np.int64 and first["x"].dtype == np.float64
    assert first["s"].dtype == object and first["s"][0] == "r0" and first["b"][1] == b"\x01"
    rows = all_rows(ds)
    assert rows["id"] == list(range(20))
    assert rows["n"][3] == -1 and rows["n"][4] == 8


def test_null_without_default_names_column_row_and_key(tmp_path: Any) -> None:
    url = make_db(tmp_path / "t.db")
    ds = hr.Dataset.from_sql("SELECT id, n FROM t", connection=url, key="id", batch_size=4)
    with pytest.raises(SqlError, match=r"NULL in column 'n' at row 3 \(key 3\)"):
        list(ds)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_values_only_travel_as_parameters(tmp_path: Any, hostile: str) -> None:
    url = make_db(tmp_path / "t.db", rows=5)
    db = sqlite3.connect(tmp_path / "t.db")
    db.execute("INSERT INTO t VALUES (?, 0, 0, ?, x'00')", (100, hostile))
    db.commit()
    ds = hr.Dataset.from_sql("SELECT id, s FROM t WHERE s = ?", (hostile,), connection=url,
                             key="id")
    assert all_rows(ds) == {"id": [100], "s": [hostile]}
    # a hostile key name is an identifier, quoted, never run
    with pytest.raises(SqlError, match="no column named"):
        list(hr.Dataset.from_sql("SELECT id FROM t", connection=url, key=hostile.strip("\x00")
                                 or "x", max_retries=0))
    assert sqlite3.connect(tmp_path / "t.db").execute("SELECT count(*) FROM t").fetchone()[0] == 6


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 50), st.integers(1, 80), st.booleans())
def test_resume_is_exact(tmp_path_factory: Any, batch_size: int, page_rows: int,
                         keyed: bool) -> None:
    url = make_db(tmp_path_factory.mktemp("db") / "t.db", rows=120)
    ds = hr.Dataset.from_sql("SELECT id, x FROM t ORDER BY id", connection=url,
                             key="id" if keyed else None, batch_size=batch_size,
                             page_rows=page_rows)
    assert_checkpoint_roundtrip(ds, max_checkpoints=12)


def test_state_holds_the_last_key(tmp_path: Any) -> None:
    url = make_db(tmp_path / "t.db")
    ds = hr.Dataset.from_sql("SELECT id FROM t", connection=url, key="id", batch_size=10)
    with iter(ds) as it:
        next(it)
        next(it)
        state = json.loads(json.dumps(it.get_state()))
    assert '"last_key": 19' in json.dumps(state)


def test_auto_shard_rewrites_into_a_where_on_the_key(tmp_path: Any) -> None:
    url = make_db(tmp_path / "t.db", rows=101)
    ds = hr.Dataset.from_sql("SELECT id FROM t", connection=url, key="id", batch_size=7)
    seen = []
    for index in range(3):
        mine = hr.auto_shard(ds, "data", num_shards=3, index=index)
        ids = all_rows(mine)["id"]
        assert all(i % 3 == index for i in ids)
        seen.extend(ids)
    assert sorted(seen) == list(range(101))


class FlakyCursor(sqlite3.Cursor):
    """Queries fail (as if the database went away) while FAILS > 0."""

    FAILS = [0]

    def execute(self, sql: str, params: Any = ()) -> Any:  # type: ignore[override]
        if FlakyCursor.FAILS[0] > 0:
            FlakyCursor.FAILS[0] -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return super().execute(sql, params)


class Flaky(sqlite3.Connection):
    def cursor(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().cursor(FlakyCursor)


class FlakyConnect:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, factory=Flaky)


def test_a_dropped_connection_is_retried_from_the_last_key(tmp_path: Any) -> None:
    make_db(tmp_path / "t.db", rows=300)
    ds = hr.Dataset.from_sql("SELECT id FROM t", connection=FlakyConnect(str(tmp_path / "t.db")),
                             key="id", batch_size=16, page_rows=50, retry_delay=0)
    ids: list[int] = []
    with iter(ds) as it:
        for step, batch in enumerate(it):
            ids.extend(batch["id"].tolist())
            if step in (2, 9):
                FlakyCursor.FAILS[0] = 2  # the next page fails twice, then works
    assert ids == list(range(300))  # nothing twice, nothing skipped
    try:
        with iter(ds) as it:
            for _ in range(3):
                next(it)
            FlakyCursor.FAILS[0] = 100  # the database stays away
            with pytest.raises(SqlError, match=r"failed after the row with key 47 \(3 retries\)"):
                next(it)
    finally:
        FlakyCursor.FAILS[0] = 0


def test_pages_are_booked_within_the_budget(tmp_path: Any) -> None:
    url = make_db(tmp_path / "t.db", rows=5000)
    ds = hr.Dataset.from_sql("SELECT id, x, s FROM t", connection=url, key="id", batch_size=100,
                             page_rows=1000).with_options(hr.Options(memory_budget="4MiB"))
    with iter(ds) as it:
        assert sum(len(b["id"]) for b in it) == 5000
        stats = it.stats()
    assert 0 < stats.budget_peak <= 4 << 20


# -- issue 22: keys that are not unique, queries with trailing comments, final errors ---------
@st.composite
def key_columns(draw: Any) -> list[Any]:
    """A key column's values, in random order: unique, runs of equal values of random
    lengths, a few distinct values, one value, or unique with a few duplicates or NULLs."""
    rows = draw(st.integers(0, 260))
    pattern = draw(st.sampled_from(["unique", "runs", "few", "one", "some_dups", "nulls"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if pattern == "runs":
        values = np.repeat(np.arange(rows), rng.integers(1, 300, rows))[:rows]
    elif pattern == "few":
        values = rng.integers(0, max(1, rows // 50 + 1), rows)
    elif pattern == "one":
        values = np.full(rows, 7)
    else:
        values = rng.permutation(rows * 3)[:rows] - rows
        if pattern == "some_dups" and rows > 1:
            for _ in range(int(rng.integers(1, 4))):
                values[rng.integers(rows)] = values[rng.integers(rows)]
    keys: list[Any] = [int(v) for v in rng.permutation(values)]
    if pattern == "nulls" and rows:
        for _ in range(int(rng.integers(1, 4))):
            keys[int(rng.integers(rows))] = None
    return keys


def _keyed_table(path: Any, keys: list[Any]) -> str:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, k INTEGER, v TEXT)")
    db.executemany("INSERT INTO t VALUES (?, ?, ?)",
                   [(i, k, f"v{i}") for i, k in enumerate(keys)])
    db.commit()
    db.close()
    return f"sqlite:///{path}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key_columns(), st.integers(1, 70), st.integers(1, 40), st.sampled_from([None, 1, 2, 3]),
       st.booleans())
def test_keyset_pages_deliver_every_row_or_refuse_the_key(
        tmp_path_factory: Any, keys: list[Any], page_rows: int, batch_size: int,
        shards: int | None, params: bool) -> None:
    """Oracle: the table read directly with sqlite3. Over a unique, non-NULL key every
    row comes once (sharded: once over all shards); otherwise SqlError says the key is
    not unique or holds a NULL, and no row came twice before it."""
    url = _keyed_table(tmp_path_factory.mktemp("db") / "t.db", keys)
    oracle = sorted((i, k, f"v{i}") for i, k in enumerate(keys))
    query, args = ("SELECT * FROM t WHERE id >= ?", (0,)) if params else ("SELECT * FROM t", ())
    ds = hr.Dataset.from_sql(query, args, connection=url, key="k", page_rows=page_rows,
                             batch_size=batch_size, max_retries=0)
    parts = [ds] if shards is None else [
        hr.auto_shard(ds, "data", num_shards=shards, index=i) for i in range(shards)]
    fine = None not in keys and len(set(keys)) == len(keys)
    got: list[tuple[Any, ...]] = []
    try:
        for part in parts:
            rows = all_rows(part)
            got.extend(zip(rows.get("id", []), rows.get("k", []), rows.get("v", []),
                           strict=True))
    except SqlError as error:
        assert not fine, f"a unique key was refused: {error}"
        assert ("is not unique" in str(error)) == (None not in keys) or "NULL" in str(error)
        assert "'k'" in str(error)
        assert len(set(got)) == len(got) and set(got) <= set(oracle)  # nothing twice
        return
    assert fine, f"keys {keys} have duplicates or NULLs, and no error was raised"
    assert sorted(got) == oracle


@st.composite
def trailing_text(draw: Any) -> str:
    """What may follow a valid query: whitespace, ';', -- and /* */ comments holding the
    characters that would break a naive strip (';', ')', quotes, '--', '*/' halves)."""
    pieces = st.sampled_from([
        " ", "\n", "\t", ";", " ;", "-- done\n", "-- a ) b ; c ' d", "/* x ; ) */",
        "/* -- */", "/**/", "--;", "\r\n", "-- 'unclosed\n", "/* ' */"])
    return "".join(draw(st.lists(pieces, max_size=6)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trailing_text(), st.sampled_from([None, "id"]), st.booleans(), st.integers(1, 30))
def test_queries_with_trailing_comments_and_semicolons_read_their_rows(
        tmp_path_factory: Any, tail: str, key: str | None, literal: bool, page_rows: int) -> None:
    """Oracle: the query (without its tail) run directly with sqlite3."""
    path = tmp_path_factory.mktemp("db") / "t.db"
    url = make_db(path, rows=45)
    select = "SELECT id, s, '--;' AS odd" if literal else "SELECT id, s"
    core = f"{select} FROM t WHERE id % ? = 1"
    oracle = sqlite3.connect(path).execute(core, (2,)).fetchall()
    ds = hr.Dataset.from_sql(core + tail, (2,), connection=url, key=key, page_rows=page_rows,
                             batch_size=7, max_retries=0)
    rows = all_rows(ds)
    assert list(zip(*rows.values(), strict=True)) == oracle


class CountingConnect:
    """Connects to a SQLite file, counting the queries run (to see retries)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls = 0

    def __call__(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path)
        connection.set_trace_callback(self._traced)
        return connection

    def _traced(self, sql: str) -> None:
        self.calls += 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([
    ("SELECT id FROM no_such_table", "no such table"),
    ("SELECT id, nope FROM t", "no such column"),
    ("SELEC id FROM t", "syntax error"),
    ("SELECT id FROM t WHERE", "incomplete input|syntax error"),
    ("SELECT id FROM t; DELETE FROM t", "more than one statement"),
]), st.sampled_from([None, "id"]), st.integers(1, 4))
def test_a_wrong_query_fails_at_once_with_the_databases_message(
        tmp_path_factory: Any, case: tuple[str, str], key: str | None, retries: int) -> None:
    path = tmp_path_factory.mktemp("db") / "t.db"
    make_db(path, rows=5)
    query, message = case
    connect = CountingConnect(str(path))
    ds = hr.Dataset.from_sql(query, connection=connect, key=key, max_retries=retries,
                             retry_delay=0.5)
    with pytest.raises(SqlError) as caught:
        list(ds)
    text = str(caught.value)
    assert re.search(message, text) and "retries" not in text
    if "statement" not in message:
        assert repr(query) in text  # the query, as given
        assert connect.calls <= 1  # (SQLite traces only statements that ran)
    assert sqlite3.connect(path).execute("SELECT count(*) FROM t").fetchone()[0] == 5


def test_a_missing_database_file_is_named_and_not_created(tmp_path: Any) -> None:
    missing = tmp_path / "typo.db"
    ds = hr.Dataset.from_sql("SELECT 1 AS one", connection=f"sqlite:///{missing}")
    with pytest.raises(SqlError, match=r"no SQLite database at '.*typo\.db': no such file"):
        list(ds)
    assert not missing.exists()


@st.composite
def mixed_keys(draw: Any) -> list[Any]:
    """Unique keys (as SQLite compares them: 2 equals 2.0, never '2') mixing SQLite's
    storage classes in an untyped column: integers, reals (some fractional), text."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kinds = draw(st.sets(st.sampled_from(["int", "real", "whole_real", "text"]), min_size=1))
    keys: dict[Any, Any] = {}
    for _ in range(draw(st.integers(0, 16))):
        kind = str(rng.choice(sorted(kinds)))
        number = int(rng.integers(-20, 20))
        value: Any = {"int": number, "real": number + 0.5, "whole_real": float(number),
                      "text": str(number)}[kind]
        keys.setdefault(("t", value) if kind == "text" else ("n", float(value)), value)
    values = list(keys.values())
    return [values[i] for i in rng.permutation(len(values)).tolist()]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_keys(), st.integers(1, 12), st.integers(1, 8),
       st.sampled_from([None, "float64", "object"]))
def test_a_key_mixing_storage_classes_delivers_each_row_once_or_says_so(
        tmp_path_factory: Any, keys: list[Any], page_rows: int, batch_size: int,
        key_dtype: str | None) -> None:
    """Oracle: the table read with sqlite3. A key whose values change type (1 then 1.5,
    1 then '1') is never converted in silence nor paged from a converted value (which
    repeated one row forever): every row comes once, with its key unchanged, or
    SqlError names the key column, within a bounded number of next() calls."""
    path = tmp_path_factory.mktemp("db") / "t.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (id INTEGER, k)")  # no affinity: each value keeps its class
    db.executemany("INSERT INTO t VALUES (?, ?)", [(i, k) for i, k in enumerate(keys)])
    db.commit()
    oracle = db.execute("SELECT id, k FROM t").fetchall()
    db.close()
    ds = hr.Dataset.from_sql("SELECT * FROM t", connection=f"sqlite:///{path}", key="k",
                             page_rows=page_rows, batch_size=batch_size, max_retries=0,
                             dtypes={"k": key_dtype} if key_dtype else {})
    got: list[tuple[int, Any]] = []
    it = iter(ds)
    refused = None
    try:
        for _ in range(len(keys) // batch_size + 2):  # a loop would run past this
            batch = next(it)
            got.extend(zip(batch["id"].tolist(), batch["k"].tolist(), strict=True))
        raise AssertionError(f"more batches than {len(keys)} rows make: {got[:20]}")
    except StopIteration:
        pass
    except SqlError as error:
        refused = error
    by_id = dict(oracle)
    assert len({i for i, _ in got}) == len(got)  # nothing twice
    for i, k in got:  # each key as the database holds it, in value and kind
        assert k == by_id[i] and isinstance(k, str) == isinstance(by_id[i], str), (i, k)
    if refused is None:
        assert sorted(got) == sorted(oracle)
        return
    assert key_dtype != "object", refused  # an object column holds any value as it is
    if key_dtype == "float64":
        assert any(isinstance(k, str) for k in keys), f"numbers, refused: {refused}"
    else:
        assert len({type(k) for k in keys}) > 1, f"one type, refused: {refused}"
    assert "key column 'k'" in str(refused)


def test_a_first_page_mixing_kinds_is_object_and_a_later_one_raises(tmp_path: Any) -> None:
    """The documented rule, at both page sizes: types come from the first page (at least
    batch_size rows); a first page of ints then text and a real keeps every value as it
    is in an object column, and the same rows with the text past a first page of ints
    raise, naming the column, row and value (never a silent conversion)."""
    import sqlite3

    path = tmp_path / "mixed.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v)")
    con.executemany("INSERT INTO t VALUES (?, ?)",
                    [(i, i) for i in range(10)] + [(10, "1"), (11, 1.5)])
    con.commit()
    con.close()
    url = f"sqlite:///{path}"
    (whole,) = list(hr.Dataset.from_sql("SELECT k, v FROM t", connection=url, key="k",
                                        batch_size=1024, page_rows=3))
    assert whole["v"].dtype == object and whole["v"].tolist() == [*range(10), "1", 1.5]
    paged = hr.Dataset.from_sql("SELECT k, v FROM t", connection=url, key="k",
                                batch_size=4, page_rows=3)
    with pytest.raises(hr.SqlError, match=r"column 'v' row 10 \(key 10\): '1' \(a str\)"):
        list(paged)
