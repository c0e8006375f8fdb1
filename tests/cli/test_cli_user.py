"""The command line as a user first meets it: --version, --help, a missing file, a
pipeline file that imports its neighbours."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import headrace as hr
from headrace.cli import main

Capture = pytest.CaptureFixture[str]


def test_version(capsys: Capture) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"headrace {hr.__version__}"


def test_help_describes_the_tool_for_its_user(capsys: Capture) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "input pipelines under a hard memory budget" in out
    assert "main(argv)" not in out and "tested in-process" not in out
    for command in ("demo", "convert", "inspect", "index", "profile", "doctor"):
        assert command in out


def write_tfrecord(path: Path) -> str:
    from headrace._persist.writers import save_tfrecords

    (shard,) = save_tfrecords(hr.Dataset.from_tensor_slices({"x": np.arange(3)}),
                              str(path / "{shard}.tfrecord"), progress=False)
    return shard


def test_inspect_of_a_missing_file_says_no_such_file(tmp_path: Path, capsys: Capture) -> None:
    missing = tmp_path / "nope.tfrecord"
    assert main(["inspect", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"headrace inspect: {missing}: no such file\n"
    assert "CORRUPT" not in captured.out + captured.err
    good = write_tfrecord(tmp_path)
    assert main(["inspect", good, str(missing)]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("2 files, 3 records, 0 corrupt, 1 unreadable")


def test_profile_of_a_file_imports_the_modules_beside_it(tmp_path: Path, capsys: Capture) -> None:
    helper = f"helper_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"{helper}.py").write_text(
        "import headrace as hr\n\ndef numbers():\n    return hr.Dataset.range(10).batch(5)\n")
    (folder / "pipeline.py").write_text(f"from {helper} import numbers\n\n"
                                        "def make():\n    return numbers()\n")
    try:
        assert main(["profile", f"{folder / 'pipeline.py'}:make", "--html", ""]) == 0
        assert "2 elements" in capsys.readouterr().out.replace(",", "")
        assert main(["doctor", f"{folder / 'pipeline.py'}:make", "--epochs", "5"]) == 0
    finally:
        sys.modules.pop(helper, None)
        if str(folder) in sys.path:
            sys.path.remove(str(folder))


@pytest.mark.parametrize("command", ["profile", "doctor"])
@pytest.mark.parametrize("value", ["0", "-3", "two", "1.5", "", "99999999999"])
def test_a_bad_epochs_value_is_one_line(command: str, value: str, capsys: Capture) -> None:
    assert main([command, "x:f", "--epochs", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"headrace {command}: error: argument --epochs")


def test_doctor_refuses_too_few_epochs_to_see_a_trend_before_running(capsys: Capture) -> None:
    # (it ran the pipeline, then failed with a ValueError's traceback hint)
    assert main(["doctor", "no_such_module:make", "--epochs", "4"]) == 2
    err = capsys.readouterr().err
    assert err == ("headrace doctor: error: argument --epochs: must be >= 5 (2 warm-up epochs, "
                   "then 3 to measure a trend), got '4' (see headrace doctor --help)\n")
