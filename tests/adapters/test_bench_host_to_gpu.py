"""The host-to-GPU benchmark's smoke mode runs here (no GPU): every configuration
delivers batches, and the report lands where it is asked to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_quick_mode_runs_every_configuration(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_host_to_gpu.py"), "--device", "cpu",
         "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "host-to-gpu.json").read_text())
    sides = [(row["side"], row["workers"]) for row in report["rows"]]
    assert sides == [("headrace-pinned", 0), ("headrace-plain", 0), ("dataloader", 0),
                     ("dataloader", 8)]
    for row in report["rows"]:
        assert "error" not in row, row
        assert row["batches"] > 0 and row["gb_per_s"] > 0
        assert row["bytes"] == row["batches"] * 64 * 32 * 32 * 3
    pinned, plain = report["rows"][:2]  # the ring delivers the plain path's batches
    assert pinned["warmup_checksum"] == plain["warmup_checksum"]
    markdown = (tmp_path / "host-to-gpu.md").read_text()
    assert "| configuration | GB/s |" in markdown and "smoke test" in markdown
