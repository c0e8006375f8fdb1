"""A from_generator generator's cleanup runs on the thread that ran its body.

Seed 004's pattern: a generator that opens a sqlite3 connection, iterated through
``prefetch`` (its body runs on the prefetch thread) and left early inside ``with``.
sqlite3 refuses to close a connection from another thread than the one that made
it (``ProgrammingError``); the generator's ``finally`` must run where it was opened,
whether the run is closed by ``with``, by ``close()`` or by garbage collection.
"""

from __future__ import annotations

import gc
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace.core.run import join_abandoned

SIGNATURE = (hr.TensorSpec((), np.float32), hr.TensorSpec((), np.int32))


class SqliteRows:
    """The seed's generator: rows from a cursor, the connection closed in ``finally``.
    Records on which thread it opened and closed, and whether the close failed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[tuple[str, str]] = []

    def __call__(self) -> Iterator[tuple[np.float32, np.int32]]:
        connection = sqlite3.connect(self.path)
        self.events.append(("open", threading.current_thread().name))
        try:
            for x, y in connection.execute("SELECT x, y FROM t ORDER BY y"):
                yield np.float32(x), np.int32(y)
        finally:
            try:
                connection.close()
                self.events.append(("closed", threading.current_thread().name))
            except sqlite3.ProgrammingError as error:
                self.events.append(("failed", str(error)))
                raise


@pytest.fixture
def rows(tmp_path: Path) -> SqliteRows:
    path = tmp_path / "rows.db"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE t (x REAL, y INTEGER)")
        connection.executemany("INSERT INTO t VALUES (?, ?)", [(i / 2, i) for i in range(500)])
    connection.close()
    return SqliteRows(path)


def _opened_and_closed_on_one_thread(events: list[tuple[str, str]]) -> None:
    assert [kind for kind, _ in events] == ["open", "closed"], events
    assert events[0][1] == events[1][1]


@pytest.mark.parametrize("stop", ["with", "close", "collected"])
@pytest.mark.parametrize("after", [0, 1, 5, 120])
def test_seed_004_generator_left_early_closes_on_its_thread(
    rows: SqliteRows, stop: str, after: int
) -> None:
    ds = hr.Dataset.from_generator(rows, output_signature=SIGNATURE).prefetch(2)
    if stop == "with":
        with iter(ds) as it:
            for index, (x, y) in enumerate(it):
                assert int(y) == index and float(x) == index / 2
                if index == after:
                    break
    else:
        it = iter(ds)
        for _ in range(after + 1):
            next(it)
        if stop == "close":
            it.close()
        else:
            del it
            gc.collect()
            assert join_abandoned()  # the closer thread finished
    _opened_and_closed_on_one_thread(rows.events)


def test_generator_read_to_its_end_closes_on_its_thread(rows: SqliteRows) -> None:
    ds = hr.Dataset.from_generator(rows, output_signature=SIGNATURE).prefetch(2)
    with iter(ds) as it:
        assert sum(1 for _ in it) == 500
    _opened_and_closed_on_one_thread(rows.events)


def test_a_failing_cleanup_reaches_the_consumer(tmp_path: Path) -> None:
    """What the generator's ``finally`` raises on the prefetch thread is raised by the
    consumer's ``close()``, not lost."""

    def failing_cleanup() -> Iterator[Any]:
        try:
            yield from range(100)
        finally:
            raise OSError("cleanup failed")

    ds = hr.Dataset.from_generator(failing_cleanup, output_signature=hr.TensorSpec((), np.int64))
    it = iter(ds.prefetch(2))
    next(it)
    with pytest.raises(OSError, match="cleanup failed"):
        it.close()


@pytest.mark.parametrize("batch", [None, 7])
@pytest.mark.parametrize("cut", [0, 1, 3, 64, 499])
def test_a_generator_resumed_under_prefetch_runs_on_the_prefetch_thread(
    rows: SqliteRows, cut: int, batch: int | None
) -> None:
    """Restoring a state replays the generator where it will run: on the prefetch
    thread, so a connection it opens is used and closed there. The elements after the
    state are the uninterrupted run's (the oracle). Replayed by set_state on the
    caller's thread, the prefetch thread's next row raised ProgrammingError."""
    ds = hr.Dataset.from_generator(rows, output_signature=SIGNATURE).prefetch(2)
    if batch is not None:
        ds = ds.batch(batch)
    whole = [np.asarray(y).tolist() for _, y in ds]
    with iter(ds) as it:
        for _ in range(cut if batch is None else cut // batch):
            next(it)
        state = it.get_state()
    rows.events.clear()
    with iter(ds) as resumed:
        resumed.set_state(state)
        rest = [np.asarray(y).tolist() for _, y in resumed]
    assert rest == whole[len(whole) - len(rest):] and len(rest) == len(whole) - (
        cut if batch is None else cut // batch), (cut, batch)
    _opened_and_closed_on_one_thread(rows.events)
    assert rows.events[0][1] != threading.current_thread().name
