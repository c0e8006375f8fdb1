"""A from_sql page of big rows that cannot fit is refused at its share, and the
error's advice works: the page_rows (or batch_size) it names runs the same query."""

from __future__ import annotations

import random
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import headrace as hr
from headrace._errors import MemoryBudgetError

KiB, MiB = 1 << 10, 1 << 20


def rows_of(path: Path, budget: str, **kwargs: object) -> list[tuple[int, bytes]]:
    ds = hr.Dataset.from_sql("SELECT id, payload FROM t", connection=f"sqlite:///{path}",
                             **kwargs)  # type: ignore[arg-type]
    out = []
    for batch in ds.with_options(hr.Options(memory_budget=budget)):
        out += [(int(i), bytes(p)) for i, p in zip(batch["id"], batch["payload"], strict=True)]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_page_rows_a_refusal_advises_runs_the_query(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    budget_mib, size = rng.randint(8, 12), rng.randint(128, 512) * KiB
    count = 3 * budget_mib * MiB // size + rng.randint(0, 20)  # the table outgrows the budget
    db = tmp_path / "t.db"
    payloads = [np.random.default_rng(seed * 1000 + i).bytes(size) for i in range(count)]
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, payload BLOB)")
        connection.executemany("INSERT INTO t VALUES (?, ?)", enumerate(payloads))
    key = rng.choice(["id", None])
    batch_size = rng.randint(1, 4)
    budget = f"{budget_mib}MiB"
    oracle = rows_of(db, key=key, batch_size=batch_size, budget="1GiB")
    assert oracle == list(enumerate(payloads))
    with pytest.raises(MemoryBudgetError) as caught:
        rows_of(db, key=key, batch_size=batch_size, budget=budget)
    message = str(caught.value)
    assert "from_sql" in message and "Raise Options(memory_budget" not in message
    advised = re.search(r"Pass page_rows=(\d+) or fewer \(now 65536\)", message)
    assert advised, message
    got = rows_of(db, key=key, batch_size=batch_size, budget=budget,
                  page_rows=int(advised.group(1)))
    assert got == oracle
