"""Dataset.from_sql against a real PostgreSQL server (scripts/postgres.sh starts one and sets
HEADRACE_TEST_POSTGRES; without it these tests fail, they never skip)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._sources.sql import SqlError
from headrace.testing import assert_checkpoint_roundtrip

URL = os.environ.get("HEADRACE_TEST_POSTGRES", "")


@pytest.fixture
def table() -> Any:
    assert URL, "HEADRACE_TEST_POSTGRES is not set: run the tests with scripts/test.sh"
    import adbc_driver_postgresql.dbapi as pg

    name = f"t_{uuid.uuid4().hex[:10]}"
    with pg.connect(URL) as db, db.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, i int, f real, d double precision,"
                    " ok boolean, s text, b bytea, n numeric(10,2))")
        cur.execute(f"INSERT INTO {name} SELECT g, g * 2, g * 0.5, g * 0.25, g % 2 = 0, 'r' || g,"
                    " int4send(g), g / 4.0 FROM generate_series(0, 2999) g")
        cur.execute(f"UPDATE {name} SET s = NULL WHERE id % 100 = 7")
        db.commit()
    yield name
    with pg.connect(URL) as db, db.cursor() as cur:
        cur.execute(f"DROP TABLE {name}")
        db.commit()


def all_rows(ds: hr.Dataset) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for batch in ds:
        for key, column in batch.items():
            out.setdefault(key, []).extend(column.tolist())
    return out


def test_types_come_from_the_column_types(table: str) -> None:
    ds = hr.Dataset.from_sql(f"SELECT * FROM {table} WHERE id < $1", (10,), connection=URL,
                             key="id", batch_size=4, null_defaults={"s": ""})
    batch = next(iter(ds))
    assert {k: v.dtype for k, v in batch.items()} == {
        "id": np.int64, "i": np.int32, "f": np.float32, "d": np.float64, "ok": np.bool_,
        "s": object, "b": object, "n": np.float64}
    assert batch["s"][1] == "r1" and batch["b"][1] == b"\x00\x00\x00\x01" and batch["n"][2] == 0.5
    rows = all_rows(ds)
    assert rows["id"] == list(range(10)) and rows["s"][7] == ""


def test_null_without_default_is_an_error(table: str) -> None:
    ds = hr.Dataset.from_sql(f"SELECT id, s FROM {table}", connection=URL, key="id")
    with pytest.raises(SqlError, match=r"NULL in column 's' at row 7 \(key 7\)"):
        list(ds)


@pytest.mark.parametrize("hostile", ["'; DROP TABLE x; --", "$1", "a\"b", "é'\\"])
def test_hostile_strings_are_parameters(table: str, hostile: str) -> None:
    ds = hr.Dataset.from_sql(f"SELECT id, s FROM {table} WHERE s = $1 OR s = $2",
                             (hostile, "r5"), connection=URL, key="id")
    assert all_rows(ds) == {"id": [5], "s": ["r5"]}


def test_keyset_resume_and_sharding(table: str) -> None:
    ds = hr.Dataset.from_sql(f"SELECT id, d FROM {table}", connection=URL, key="id",
                             batch_size=70, page_rows=200)
    assert_checkpoint_roundtrip(ds, max_checkpoints=8)
    shards = [all_rows(hr.auto_shard(ds, "data", num_shards=4, index=i))["id"] for i in range(4)]
    assert all(all(v % 4 == i for v in ids) for i, ids in enumerate(shards))
    assert sorted(v for ids in shards for v in ids) == list(range(3000))


class Proxy:
    """A TCP proxy to the server that the test can cut: the server 'goes away'."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.conns: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            server = socket.create_connection(self.target)
            self.accepted += 1
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self, stay_down: bool = False) -> None:
        self.up = not stay_down
        for s in self.conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.conns = []

    def close(self) -> None:
        self.cut(stay_down=True)
        self.listener.close()


def test_a_server_that_goes_away_mid_stream(table: str) -> None:
    host_port = URL.split("@", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    proxy = Proxy((host, int(port)))
    try:
        via = URL.replace(host_port, f"127.0.0.1:{proxy.port}")
        # (a parameter: the read goes by keyset pages, the route of resumes and retries)
        ds = hr.Dataset.from_sql(f"SELECT id FROM {table} WHERE id >= $1", (0,), connection=via,
                                 key="id", batch_size=100, page_rows=300, retry_delay=0.05)
        ids: list[int] = []
        with iter(ds) as it:
            for step, batch in enumerate(it):
                ids.extend(batch["id"].tolist())
                if step in (2, 11):
                    proxy.cut()  # the connection drops; the next page reconnects
        assert ids == list(range(3000))  # nothing twice, nothing skipped
        with iter(ds) as it:
            for _ in range(3):
                next(it)
            proxy.cut(stay_down=True)
            with pytest.raises(SqlError, match=r"after the row with key 299 \(3 retries\)"):
                next(it)
    finally:
        proxy.close()


def test_a_stream_that_drops_goes_on_by_pages_from_the_last_key() -> None:
    """A query without parameters streams (ADBC's COPY reader); cut twice mid-stream, it
    reconnects and goes on from the last key read: every row once, in order."""
    assert URL
    import adbc_driver_postgresql.dbapi as pg

    name = f"big_{uuid.uuid4().hex[:10]}"
    rows = 400_000
    with pg.connect(URL) as db, db.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} AS SELECT g::bigint AS id, g * 0.5 AS x "
                    f"FROM generate_series(0, {rows - 1}) g")
        db.commit()
    host_port = URL.split("@", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    proxy = Proxy((host, int(port)))
    try:
        via = URL.replace(host_port, f"127.0.0.1:{proxy.port}")
        ds = hr.Dataset.from_sql(f"SELECT * FROM {name}", connection=via, key="id",
                                 batch_size=5000, page_rows=20000, retry_delay=0.05)
        ids: list[np.ndarray] = []
        with iter(ds) as it:
            for step, batch in enumerate(it):
                ids.append(batch["id"])
                if step in (3, 40):
                    proxy.cut()
        assert np.array_equal(np.concatenate(ids), np.arange(rows))
        assert proxy.accepted >= 2  # it did reconnect
    finally:
        proxy.close()
        with pg.connect(URL) as db, db.cursor() as cur:
            cur.execute(f"DROP TABLE {name}")
            db.commit()


def test_a_refused_login_is_a_clear_error() -> None:
    assert URL
    bad = URL.replace("postgres@", "no_such_role@", 1)
    ds = hr.Dataset.from_sql("SELECT 1 AS one", connection=bad, max_retries=1, retry_delay=0)
    with pytest.raises(SqlError, match=r"cannot connect to postgresql://no_such_role@.*no_such_role"):
        list(ds)


def test_a_table_larger_than_the_budget_streams_within_it(table: str) -> None:
    ds = hr.Dataset.from_sql(
        f"SELECT a.id * 3000 + b.id AS k, a.d FROM {table} a, {table} b WHERE b.id < 100",
        connection=URL, key="k", batch_size=1000, page_rows=5000,
    ).with_options(hr.Options(memory_budget="2MiB"))
    with iter(ds) as it:
        assert sum(len(batch["k"]) for batch in it) == 300_000  # ~4.8 MB of values
        assert 0 < it.stats().budget_peak <= 2 << 20


# -- issue 22: keys that are not unique, trailing comments, final errors ----------------------
def _key_values(seed: int, rows: int, pattern: str) -> list[int | None]:
    rng = np.random.default_rng(seed)
    if pattern == "runs":
        values = np.repeat(np.arange(rows), rng.integers(1, 300, rows))[:rows]
    elif pattern == "few":
        values = rng.integers(0, max(1, rows // 50 + 1), rows)
    else:
        values = rng.permutation(rows * 3)[:rows] - rows
        if pattern == "some_dups" and rows > 1:
            values[rng.integers(rows)] = values[rng.integers(rows)]
    keys: list[int | None] = [int(v) for v in rng.permutation(values)]
    if pattern == "nulls" and rows:
        keys[int(rng.integers(rows))] = None
    return keys


@pytest.mark.parametrize("seed", range(12))
def test_keyset_pages_deliver_every_row_or_refuse_the_key(seed: int) -> None:
    """Random key columns (unique, runs, few values, one duplicate, a NULL), random pages,
    streamed (no parameters) or paged (a parameter), sharded or not. Oracle: the table
    read directly; a key that is not unique or holds a NULL is a SqlError, and no row
    came twice before it."""
    assert URL
    import adbc_driver_postgresql.dbapi as pg

    rng = np.random.default_rng(seed)
    rows = int(rng.integers(0, 900))
    pattern = ["unique", "runs", "few", "some_dups", "nulls", "unique"][seed % 6]
    keys = _key_values(seed, rows, pattern)
    name = f"k_{uuid.uuid4().hex[:10]}"
    with pg.connect(URL) as db, db.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, k bigint, v text)")
        cur.adbc_ingest(name, __import__("pyarrow").table(
            {"id": list(range(rows)), "k": keys, "v": [f"v{i}" for i in range(rows)]}),
            mode="append")
        db.commit()
    try:
        oracle = sorted((i, k, f"v{i}") for i, k in enumerate(keys))
        paged = bool(rng.integers(2))
        query = f"SELECT * FROM {name}" + (" WHERE id >= $1" if paged else "")
        ds = hr.Dataset.from_sql(query, (0,) if paged else (), connection=URL, key="k",
                                 page_rows=int(rng.integers(1, 200)),
                                 batch_size=int(rng.integers(1, 90)), max_retries=0)
        shards = int(rng.integers(1, 4))
        parts = [ds] if shards == 1 else [
            hr.auto_shard(ds, "data", num_shards=shards, index=i) for i in range(shards)]
        fine = None not in keys and len(set(keys)) == len(keys)
        got: list[tuple[Any, ...]] = []
        try:
            for part in parts:
                out = all_rows(part)
                got.extend(zip(out.get("id", []), out.get("k", []), out.get("v", []),
                               strict=True))
        except SqlError as error:
            assert not fine, f"a unique key was refused: {error}"
            assert "'k'" in str(error) and ("not unique" in str(error) or "NULL" in str(error))
            assert len(set(got)) == len(got) and set(got) <= set(oracle)
            return
        assert fine, f"{pattern}: no error over keys with duplicates or NULLs"
        assert sorted(got) == oracle
    finally:
        with pg.connect(URL) as db, db.cursor() as cur:
            cur.execute(f"DROP TABLE {name}")
            db.commit()


@pytest.mark.parametrize("seed", range(8))
def test_queries_with_trailing_comments_and_semicolons_read_their_rows(
        table: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pieces = [" ", "\n", ";", "-- done\n", "-- a ) b ; c ' d", "/* x ; ) */", "/* /* */ */",
              "--;", "/* ' $$ */"]
    tail = "".join(rng.choice(pieces, int(rng.integers(1, 6))))
    odd = ", E'--;\\'' AS odd, $q$ -- ; $q$ AS dollar" if rng.integers(2) else ""
    core = f"SELECT id{odd} FROM {table} WHERE id % 7 = 1"
    key = "id" if rng.integers(2) else None
    ds = hr.Dataset.from_sql(core + tail, connection=URL, key=key, batch_size=50,
                             page_rows=int(rng.integers(1, 120)), max_retries=0)
    rows = all_rows(ds)
    got = rows["id"] if key else sorted(rows["id"])  # (keyless: the table's own order)
    assert got == list(range(1, 3000, 7)), tail
    if odd:
        assert set(rows["odd"]) == {"--;'"} and set(rows["dollar"]) == {" -- ; "}


@pytest.mark.parametrize(("query", "message"), [
    ("SELECT id FROM no_such_table", "does not exist"),
    ("SELEC id FROM {t}", "syntax error"),
    ("SELECT nope FROM {t}", "does not exist"),
    ("SELECT id / 0 AS z FROM {t}", "division by zero"),
])
def test_a_wrong_query_fails_at_once_with_the_databases_message(
        table: str, query: str, message: str) -> None:
    query = query.format(t=table)
    ds = hr.Dataset.from_sql(query, connection=URL, max_retries=3, retry_delay=5)
    with pytest.raises(SqlError, match=message) as caught:
        list(ds)
    assert "not retried" in str(caught.value) and repr(query) in str(caught.value)
