"""Readers hold the budget and the file cap (G1, G2): bounded, booked read-ahead;
bounded, linear text lines; index files that hold no descriptor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parents[1] / "src"
MiB = 1 << 20


def run_child(script: str, *args: str, timeout: int = 300) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter (its own limits, its own RSS) and return its JSON."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)},
        timeout=timeout,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result: dict[str, object] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


INDEXED_SHARDS_CHILD = """
    import json, os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    import headrace as hr
    from headrace.io.tfrecord import write_tfrecord
    from headrace.io.tfrecord_index import build_index

    directory = sys.argv[1]
    names = []
    for shard in range(600):
        name = os.path.join(directory, f"{shard:03d}.tfrecord")
        write_tfrecord(name, [b"%d:%d" % (shard, i) for i in range(shard % 4 + 1)])
        build_index(name)
        names.append(name)
    baseline = len(os.listdir("/proc/self/fd"))
    ds = hr.TFRecordDataset(names, indexed=True)
    plain = [bytes(r) for r in ds]
    shuffled = [bytes(r) for r in ds.global_shuffle(seed=3)]
    batched = [bytes(r) for b in ds.global_shuffle(seed=4).batch(50) for r in b]
    print(json.dumps({
        "plain": [r.decode() for r in plain], "shuffled": [r.decode() for r in shuffled],
        "batched": [r.decode() for r in batched],
        "open_after": len(os.listdir("/proc/self/fd")) - baseline,
    }))
"""


def test_six_hundred_indexed_shards_under_rlimit_64(tmp_path: Path) -> None:
    result = run_child(INDEXED_SHARDS_CHILD, str(tmp_path))
    expected = [f"{shard}:{i}" for shard in range(600) for i in range(shard % 4 + 1)]
    assert result["plain"] == expected  # every record, in file order
    for key in ("shuffled", "batched"):
        order = result[key]
        assert isinstance(order, list)
        assert sorted(order) == sorted(expected)  # every record exactly once
        assert order != expected  # and really shuffled
    assert result["open_after"] == 0  # no index (nor shard) left holding a descriptor
