"""The public API: explicit, documented, and the CLI runs in-process."""

from __future__ import annotations

import inspect
import subprocess
import sys

import headrace as hr
from headrace.cli import main


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(hr) if not name.startswith("_")} - {
        "dataset", "errors", "core", "options", "structure", "memory",
        "sources", "transforms", "profiling", "testing", "io", "cli", "distribute", "writers",
        "tools",
    }
    assert public | {"__version__"} == set(hr.__all__)


def test_the_extension_api_is_listed_and_documented() -> None:
    import headrace.core as core

    for name in core.__all__:
        value = getattr(core, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"headrace.core.{name}"


def test_every_public_callable_has_a_docstring() -> None:
    for name in hr.__all__:
        value = getattr(hr, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), name
    for name, member in inspect.getmembers(hr.Dataset):
        if not name.startswith("_") and callable(member):
            assert inspect.getdoc(member), f"Dataset.{name}"


def test_import_is_light() -> None:
    code = (
        "import time, sys; t = time.perf_counter(); import headrace;"
        "print(time.perf_counter() - t, 'tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, tf_loaded = out.stdout.split()
    assert tf_loaded == "False"
    assert float(seconds) < 1.0  # well under 0.3 s on an idle machine; CI may be busy


def test_demo_streams_more_than_its_budget(tmp_path, capsys) -> None:
    assert main(["demo", "--size", "48MiB", "--budget", "16MiB", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rows/s" in out and "within the bound" in out
    assert "shuffle" in out and "prefetch" in out
