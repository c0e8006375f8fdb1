"""CSV readers drawn at random under budgets down to 1 MiB (G1, G3, G4): the reader
(`CsvDataset` one by one or batched, `read_csv`, `make_csv_dataset` shuffled or not),
the rows (short numbers, or long quoted text fields with delimiters and newlines
inside), the block size and the batch. Oracle: the same pipeline under a 1 GiB budget.
A run either gives the oracle's elements exactly, in order, with every stage's peak
within its share and the process's growth within the budget fuzzer's bound, or is
refused with MemoryBudgetError because one record or one batch cannot fit: never
because of a block of text, which is cut smaller instead. A state taken halfway resumes to exactly the oracle's rest under the small budget."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzz_pipelines import PeakGrowth

import headrace as hr

MiB = 1 << 20


def _write(path: Path, rng: random.Random, rows: int, columns: int, text: bool) -> None:
    lines = [",".join(f"c{i}" for i in range(columns))]
    for _ in range(rows):
        fields = [str(rng.randint(-999, 999)) for _ in range(columns - 1)]
        if text:  # quoted: a delimiter, a newline and doubled quotes inside
            body = "".join(rng.choice("ab,\n\"") for _ in range(rng.randint(0, 3000)))
            fields.append('"' + body.replace('"', '""') + '"')
        else:
            fields.append(str(rng.randint(0, 9)))
        lines.append(",".join(fields))
    path.write_text("\n".join(lines) + "\n")


def _dataset(case: dict[str, Any], path: Path, budget: int) -> hr.Dataset:
    defaults: list[Any] = [[0]] * (case["columns"] - 1) + [[""] if case["text"] else [0]]
    reader, batch = case["reader"], case["batch"]
    if reader == "CsvDataset":
        ds = hr.CsvDataset(str(path), defaults, header=True, block_bytes=case["block"])
        if batch:
            ds = ds.batch(batch)
    elif reader == "read_csv":
        ds = hr.read_csv(str(path), batch, column_defaults=[d[0] for d in defaults],
                         block_bytes=case["block"])
    else:
        ds = hr.make_csv_dataset(str(path), batch, column_defaults=[d[0] for d in defaults],
                                 num_epochs=1, shuffle=case["shuffle"], shuffle_seed=7)
    return ds.with_options(hr.Options(memory_budget=budget))


def _plain(element: Any) -> Any:
    if isinstance(element, dict):
        return tuple((name, _plain(value)) for name, value in sorted(element.items()))
    if isinstance(element, tuple | list):
        return tuple(_plain(value) for value in element)
    value = np.asarray(element)
    return (value.dtype.str, value.shape, value.tolist())


def _case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    reader = rng.choice(["CsvDataset", "read_csv", "make_csv_dataset"])
    return {
        "seed": seed,
        "reader": reader,
        "rows": rng.randint(1, 4000),
        "columns": rng.randint(1, 12),
        "text": rng.random() < 0.4,
        "block": rng.choice([1 << 10, 1 << 14, 1 << 20, 4 << 20]),
        "batch": rng.choice([0, 1, 7, 64, 512]) if reader == "CsvDataset"
        else rng.choice([1, 7, 64, 512]),
        "shuffle": rng.random() < 0.5,
        "budget": rng.choice([1, 2, 4, 8]) * MiB,
    }


@pytest.mark.parametrize("seed", range(24))
def test_csv_readers_under_small_budgets_give_the_oracles_elements(
    tmp_path: Path, seed: int
) -> None:
    case = _case(seed)
    rng = random.Random(seed)
    path = tmp_path / "a.csv"
    _write(path, rng, case["rows"], case["columns"], case["text"])
    oracle = [_plain(e) for e in _dataset(case, path, 1 << 30)]
    got = 0  # (compared as they come: the consumer keeps nothing the budget should see)
    with PeakGrowth() as memory:
        try:
            with iter(_dataset(case, path, case["budget"])) as iterator:
                for element in iterator:
                    assert got < len(oracle) and _plain(element) == oracle[got], (case, got)
                    got += 1
                stages = iterator.stats().stages
        except hr.MemoryBudgetError as error:
            # refused only for a minimum working set: one record, or one batch of rows;
            # never a CSV block, which is cut smaller instead (it is divisible)
            assert "at once" in str(error) and "CSV block" not in str(error), (case, error)
            return
    assert got == len(oracle), case
    for stage in stages:
        assert stage.peak <= stage.limit or stage.overdrawn_peak == 0, (case, stage)
    # what the run grew by: the budget fuzzer's bound (its budget, plus the measured slack
    # of the interpreter and of allocators: pyarrow's parse of a 4 MiB block grows the
    # process by ~40 MiB that its memory pool and threads keep, booked or not)
    assert memory.growth <= case["budget"] * 1.1 + 64 * MiB, (case, memory.growth / MiB)
    # a state taken halfway resumes to exactly the rest, under the small budget
    if len(oracle) > 1:
        half = len(oracle) // 2
        with iter(_dataset(case, path, case["budget"])) as iterator:
            for _ in range(half):
                next(iterator)
            state = iterator.get_state()
        with iter(_dataset(case, path, case["budget"])) as resumed:
            resumed.set_state(state)
            assert [_plain(e) for e in resumed] == oracle[half:], case
