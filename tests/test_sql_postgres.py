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
from headrace.sources.sql import SqlError
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
