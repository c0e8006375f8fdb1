"""``batch(n).parse_examples(spec)`` books its parsed features before making them (G1).

A parse can make 8 bytes of an int64 from one wire byte, so a batch that fits the
budget as records may not fit it parsed. Each case is compared with the same
pipeline under a huge budget: the same batches, or a refusal naming the stage, and
the Python heap (tracemalloc: NumPy and bytearray allocations) within the budget.
"""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import MemoryBudgetError
from headrace._memory.sizeof import sizeof
from headrace.io.example import FixedLenFeature, VarLenFeature, serialize_example
from headrace.io.tfrecord import write_tfrecord

MiB = 1 << 20


def case(rng: random.Random, path: Path) -> tuple[dict[str, Any], int, int]:
    """Records of one random spec (written to ``path``), the batch size, and the
    largest batch of records (bytes)."""
    kind = rng.choice(["fixed_int", "varlen_int", "varlen_float", "varlen_bytes", "mixed"])
    values = np.random.default_rng(rng.randrange(1 << 30))
    width = rng.randint(10_000, 100_000)
    small = rng.random() < 0.85  # one-byte varints: 8x when parsed
    records = []
    for _ in range(rng.randint(4, 12)):
        count = width if kind == "fixed_int" else rng.randint(0, width)
        ints = values.integers(0, 100 if small else 1 << 60, count, dtype=np.int64)
        features: dict[str, dict[str, Any]] = {
            "fixed_int": {"v": ints},
            "varlen_int": {"v": ints},
            "varlen_float": {"v": ints.astype(np.float32)},
            "varlen_bytes": {"v": [b"x" * (i % 7) for i in range(count // 8)]},
            "mixed": {"v": ints, "w": ints[: count // 2].astype(np.float32)},
        }
        records.append(serialize_example(features[kind]))
    write_tfrecord(path, records)
    batch_size = rng.randint(2, 8)
    wire = max(sum(map(len, records[i:i + batch_size]))
               for i in range(0, len(records), batch_size))
    specs: dict[str, dict[str, Any]] = {
        "fixed_int": {"v": FixedLenFeature((width,), np.int64)},
        "varlen_int": {"v": VarLenFeature(np.int64)},
        "varlen_float": {"v": VarLenFeature(np.float32)},
        "varlen_bytes": {"v": VarLenFeature(bytes)},
        "mixed": {"v": VarLenFeature(np.int64), "w": VarLenFeature(np.float32)},
    }
    return specs[kind], batch_size, wire


def digest(batch: dict[str, Any]) -> str:
    """A batch's values and types, small (the test's own memory stays out of the peak)."""
    hasher = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        parts = [value] if isinstance(value, np.ndarray) else [value.values, value.row_splits]
        for part in parts:
            hasher.update(f"{name}{part.dtype}{part.shape}".encode())
            hasher.update(repr(part.tolist()).encode() if part.dtype.hasobject else
                          part.tobytes())
    return hasher.hexdigest()


def parsed(path: Path, spec: dict[str, Any], batch_size: int, budget: str) -> list[str]:
    """Digests of the batches; none is kept while the next is parsed."""
    ds = hr.TFRecordDataset(str(path)).batch(batch_size).parse_examples(spec)
    digests: list[str] = []
    with iter(ds.with_options(hr.Options(memory_budget=budget))) as iterator:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return digests
            digests.append(digest(batch))
            del batch


@pytest.mark.parametrize("seed", range(10))
def test_parsed_batches_are_booked_or_refused_at_the_share(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "r.tfrecord"
    spec, batch_size, wire = case(rng, path)
    # The records fit (their stages are tested elsewhere); parsed, they may not.
    budget = max(MiB, int(rng.uniform(2.5, 4) * wire))
    ds = hr.TFRecordDataset(str(path)).batch(batch_size).parse_examples(spec)
    largest = max(sizeof(batch) for batch in ds.with_options(hr.Options(memory_budget="1GiB")))
    oracle = parsed(path, spec, batch_size, "1GiB")
    tracemalloc.start()
    try:
        got = parsed(path, spec, batch_size, str(budget))
    except MemoryBudgetError as error:  # by the batch of records, or their parse
        got = None
        if "stage 'parse_examples'" in str(error):
            assert largest > budget // 8, (largest, budget)  # only when it may not fit
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    if got is not None:
        assert got == oracle
    assert peak <= budget * 1.1 + MiB, (peak, budget, largest)
