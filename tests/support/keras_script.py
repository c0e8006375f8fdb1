"""Run a Keras test script (tests/scripts/) in a fresh interpreter on one backend and
return the JSON of its last ``RESULT`` line: each backend must be chosen before Keras
is imported, so every backend gets its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"


def run_keras_script(name: str, backend: str) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(SRC),
           "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / name)],
                          env=env, capture_output=True, text=True, timeout=280)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result
