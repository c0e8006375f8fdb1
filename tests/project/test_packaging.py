"""The package as a user installs it: the wheel scripts/wheel.sh builds, installed alone
in a fresh virtual environment; the warning where the C extension is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_c_extension_is_one_warning_at_the_users_import(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(
        "import sys, warnings\n"
        "class Block:  # as where no C compiler built it\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'headrace.io._hrio':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "warnings.simplefilter('always')\n"
        "import headrace\n"
        "print(headrace.io._native.native_module())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("HEADRACE_PURE_PYTHON", None)
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert ran.returncode == 0 and ran.stdout == "None\n", ran.stderr
    warned = [line for line in ran.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1
    assert warned[0].startswith(f"{script}:8: RuntimeWarning: headrace's C extension")
    assert "10 to 50 times slower" in warned[0] and "build-essential" in warned[0]
    assert "Example parsing 5 to 10 times slower in batches of 200" in warned[0]
    chosen = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env={**env, "HEADRACE_PURE_PYTHON": "1"}, timeout=120)
    assert chosen.returncode == 0 and "RuntimeWarning" not in chosen.stderr


def site_packages(prefix: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return prefix / "lib" / version / "site-packages"


@pytest.mark.slow
def test_the_wheel_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    started = time.monotonic()
    built = subprocess.run(["bash", str(ROOT / "scripts" / "wheel.sh"), str(tmp_path / "dist")],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHON": sys.executable})
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("headrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("headrace/py.typed", "headrace/cli.py", "headrace/io/_hrio.pyi"):
        assert needed in names
    assert any(n.startswith("headrace/io/_hrio.") and n.endswith(".so") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    # A fresh venv; the wheel installed offline (--no-index, --no-deps), and of the
    # dependencies only numpy and xxhash made visible (from this environment).
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(fresh / "bin" / "python"), "install",
         "--quiet", "--no-index", "--no-deps", str(wheel)],
        capture_output=True, text=True, timeout=120, env=env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    deps = tmp_path / "deps"
    deps.mkdir()
    import numpy
    import xxhash

    for module in (numpy, xxhash):
        source = Path(module.__file__).parent
        for entry in source.parent.iterdir():
            if entry.name.split("-")[0].split(".")[0] == source.name:
                (deps / entry.name).symlink_to(entry)
    (site_packages(fresh) / "deps.pth").write_text(f"{deps}\n")
    check = ("import headrace as hr, numpy as np; from headrace.io._native import native_module;"
             "print(hr.__file__); assert native_module() is not None;"
             "print(sum(int(b.sum()) for b in hr.Dataset.range(10).map(lambda i: i * 2)"
             ".batch(4)))")
    ran = subprocess.run([str(fresh / "bin" / "python"), "-W", "error::RuntimeWarning", "-c",
                          check], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    path, total = ran.stdout.split()
    assert path.startswith(str(site_packages(fresh))) and total == "90"
    version = subprocess.run([str(fresh / "bin" / "headrace"), "--version"], capture_output=True,
                             text=True, timeout=60, env=env)
    assert version.stdout.strip() == "headrace 0.1.0"
    assert time.monotonic() - started < 60 * 3  # (60 s on an idle machine)
