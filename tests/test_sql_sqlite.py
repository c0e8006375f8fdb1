"""Dataset.from_sql on SQLite (the standard library): values, NULLs, hostile strings,
keyset resume, keyless resume, sharding by key, retries, budget."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.sources.sql import SqlError
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
