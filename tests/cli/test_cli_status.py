"""``profile`` and ``doctor`` exit statuses a script can branch on: 2 for a bad
argument (a target that names no dataset builder, an ``--html`` that cannot be written),
refused before the pipeline runs; 3 where the pipeline's own code raises; doctor's 1
means a leak and nothing else. Each case drawn from a seeded generator of bad targets,
checked for its status, its one line on stderr and that no epoch ran."""

from __future__ import annotations

import os
import random
import textwrap
from pathlib import Path

import pytest

from headrace.cli import main

Capture = pytest.CaptureFixture[str]

PIPELINE = textwrap.dedent("""
    import os
    import numpy as np
    import headrace as hr

    CONSTANT = 3
    MARK = os.environ["HR_STATUS_MARK"]

    def _ran():  # the builder was called: what a refused command must never reach
        open(MARK, "a").close()

    def clean():
        _ran()
        return hr.Dataset.range(40).map(lambda i: i * 2).batch(8).prefetch(1)

    def not_a_dataset():
        _ran()
        return 42

    def raises():
        _ran()
        raise RuntimeError("cannot build the pipeline")

    def opens_missing():
        _ran()
        return open("/nonexistent/headrace-status-input")

    def _boom(i):
        raise ValueError(f"element {int(i)} is bad")

    def fails_running():
        _ran()
        return hr.Dataset.range(40).map(_boom).batch(8)
""")

#: (target or argv tail, expected status, a word the error line holds, whether the
#: builder may run). {mod} is the pipeline module, {file} its path.
CASES = {
    "no colon": (["{mod}"], 2, "MODULE:FUNCTION", False),
    "empty module": ([":clean"], 2, "MODULE:FUNCTION", False),
    "empty function": (["{mod}:"], 2, "MODULE:FUNCTION", False),
    "missing module": (["no_such_module_hr_status:make"], 2, "no_such_module_hr_status", False),
    "missing function": (["{mod}:nope"], 2, "'nope'", False),
    "not callable": (["{mod}:CONSTANT"], 2, "'CONSTANT'", False),
    "missing file": (["missing_hr_status.py:make"], 2, "missing_hr_status.py", False),
    "file is a folder": (["{dir}/sub.py:make"], 2, "sub.py", False),
    "returns 42": (["{mod}:not_a_dataset"], 2, "int", True),
    "html in a missing folder": (["{mod}:clean", "--html", "/nonexistent/hr/x.html"], 2,
                                 "/nonexistent/hr", False),
    "html under a file": (["{mod}:clean", "--html", "{file}/x.html"], 2, "x.html", False),
    "builder raises": (["{mod}:raises"], 3, "cannot build the pipeline", True),
    "builder's OSError": (["{mod}:opens_missing"], 3, "headrace-status-input", True),
    "fails while running": (["{mod}:fails_running"], 3, "is bad", True),
}


def draw(seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    return rng.choice(["doctor", "profile"]), rng.choice(sorted(CASES))


@pytest.mark.parametrize("seed", range(40))
def test_a_bad_target_or_a_failing_pipeline_has_its_own_status(
    seed: int, tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    command, case = draw(seed)
    module = f"hr_status_{seed}"
    path = tmp_path / f"{module}.py"
    path.write_text(PIPELINE)
    (tmp_path / "sub.py").mkdir()
    mark = tmp_path / "built"
    monkeypatch.setenv("HR_STATUS_MARK", str(mark))
    monkeypatch.chdir(tmp_path)
    tail, status, word, builds = CASES[case]
    argv = [part.format(mod=module, file=path, dir=tmp_path) for part in tail]
    extra = ["--epochs", "5", "--quiet"] if command == "doctor" else ["--epochs", "1"]
    if command == "profile" and "--html" not in argv:
        extra += ["--html", ""]
    assert main([command, *argv, *extra]) == status, (command, case)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"headrace {command}: error: "), captured.err
    assert word in lines[0], (case, lines[0])
    assert "Traceback" not in captured.err and captured.out == ""
    assert mark.exists() == builds, (command, case)  # refused before the builder ran


@pytest.mark.parametrize("command", ["doctor", "profile"])
def test_a_clean_pipeline_still_exits_0_and_writes_its_html(
    command: str, tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / f"hr_status_ok_{command}.py").write_text(PIPELINE)
    monkeypatch.setenv("HR_STATUS_MARK", str(tmp_path / "built"))
    monkeypatch.chdir(tmp_path)
    html = tmp_path / "report.html"
    epochs = ["--epochs", "5", "--quiet"] if command == "doctor" else ["--epochs", "1"]
    assert main([command, f"hr_status_ok_{command}:clean", "--html", str(html), *epochs]) == 0
    assert html.stat().st_size > 1000 and os.path.exists(tmp_path / "built")
    capsys.readouterr()


@pytest.mark.parametrize("command", ["doctor", "profile"])
def test_help_lists_the_exit_statuses(command: str, capsys: Capture) -> None:
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0" in out and "2 a bad argument" in out
    assert "3 the pipeline's own code raised" in out
