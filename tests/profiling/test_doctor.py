"""The doctor at the cost of a plain epoch (issue 24): untraced epochs by default, a short
traced pass only to say where a leak was allocated, ``deep=True`` for the old way, progress
on the command line, and bad counts refused before anything runs."""

from __future__ import annotations

import re
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import InvalidArgumentError
from headrace.cli import main
from headrace.profiling import diagnose
from headrace.profiling import doctor as doctor_module
from headrace.profiling.doctor import ATTRIBUTION_EPOCHS, DEEP_FRAMES, allocated_bytes

Capture = pytest.CaptureFixture[str]

#: A leak no holder analysis can see: the list sits in a tuple, which is not a container
#: the doctor costs, so only the allocation's traceback can name the stage.
_HIDDEN: tuple[list[Any]] = ([],)
_KEPT: list[Any] = []
_TRACING: list[bool] = []


def _rows(n: int) -> hr.Dataset:
    return hr.Dataset.from_generator(
        lambda: (np.full(4, i, np.int64) for i in range(n)),
        output_signature=hr.TensorSpec((4,), np.int64),
    )


def _hide(row: Any) -> Any:
    _HIDDEN[0].append(np.ones(512))  # 4 KiB an element, never freed
    return row


def _keep(row: Any) -> Any:
    _KEPT.append(np.ones(512))
    return row


def _notes_tracing(row: Any) -> Any:
    _TRACING.append(tracemalloc.is_tracing())
    return row + 1


@pytest.fixture(autouse=True)
def _forget() -> Any:
    yield
    _HIDDEN[0].clear()
    _KEPT.clear()
    _TRACING.clear()


def test_allocated_bytes_sees_an_array_and_its_release() -> None:
    before = allocated_bytes()
    assert before is not None  # glibc: the test machine's libc
    block = np.ones(1 << 20)  # 8 MiB from malloc
    grown = allocated_bytes()
    del block
    after = allocated_bytes()
    assert grown is not None and after is not None
    assert 8 << 20 <= grown - before < 9 << 20
    assert abs(after - before) < 1 << 20


def test_default_epochs_are_untraced_and_deep_ones_traced() -> None:
    clean = _rows(50).map(_notes_tracing).batch(5)
    diagnosis = diagnose(clean, epochs=5, lint=False)
    assert _TRACING and not any(_TRACING)
    assert diagnosis.healthy and not diagnosis.deep and diagnosis.traced_epochs == ()
    assert all(m.traced == 0 and m.allocated > 0 for m in diagnosis.epochs)
    assert diagnosis.allocated.points == 3 and diagnosis.traced.points == 0
    _TRACING.clear()
    deep = diagnose(clean, epochs=5, lint=False, deep=True)
    assert len(_TRACING) == 250 and all(_TRACING)
    assert deep.healthy and deep.deep and deep.traced.points == 3
    assert all(m.traced > 0 for m in deep.epochs)
    assert not tracemalloc.is_tracing()  # what the doctor started, it stopped


def test_a_leak_its_holder_explains_costs_no_traced_epoch() -> None:
    diagnosis = diagnose(_rows(200).map(_keep).batch(10), epochs=6, lint=False)
    assert diagnosis.leak and diagnosis.traced_epochs == ()
    first = diagnosis.growth[0]
    assert first.stage.endswith("_keep)") and first.where == "kept in _KEPT (global of _keep)"
    # 200 arrays of 4 KiB (plus their headers) an epoch
    assert 800 << 10 <= diagnosis.allocated.slope <= 900 << 10


def test_a_hidden_leak_is_traced_for_a_few_epochs_and_blamed_where_allocated() -> None:
    traced: list[int] = []
    diagnosis = diagnose(_rows(200).map(_hide).map(lambda r: r * 2).batch(10), epochs=6,
                         lint=False, on_traced_epoch=lambda m: traced.append(m.epoch))
    assert diagnosis.leak and not diagnosis.deep
    assert traced == list(range(6, 6 + ATTRIBUTION_EPOCHS))
    assert [m.epoch for m in diagnosis.traced_epochs] == traced
    assert all(m.traced > 0 for m in diagnosis.traced_epochs)
    assert len(diagnosis.epochs) == 6 and all(m.traced == 0 for m in diagnosis.epochs)
    first = diagnosis.growth[0]
    line = next(k for k, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "_HIDDEN[0].append" in text)
    assert first.stage.endswith("_hide)")
    assert first.where == f"{__file__}:{line}"
    assert 700 << 10 <= first.bytes_per_epoch <= 900 << 10
    text = diagnosis.format()
    assert f"then {ATTRIBUTION_EPOCHS} epochs traced ({DEEP_FRAMES} frames)" in text
    assert f"allocated at {__file__}:{line}" in text
    assert not tracemalloc.is_tracing()
    page = diagnosis.to_html()
    assert f"Then {ATTRIBUTION_EPOCHS} epochs ran under tracemalloc" in page


def test_deep_finds_the_hidden_leak_without_a_second_pass() -> None:
    diagnosis = diagnose(_rows(200).map(_hide).batch(10), epochs=6, lint=False, deep=True)
    assert diagnosis.leak and diagnosis.traced_epochs == ()
    assert diagnosis.traced.significant(diagnosis.min_leak)
    assert diagnosis.leaking_stages[0].endswith("_hide)")


def test_without_malloc_counters_every_epoch_is_traced_shallow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off glibc the doctor falls back on ``tracemalloc`` (one frame) for the verdict."""
    monkeypatch.setattr(doctor_module, "allocated_bytes", lambda: None)
    diagnosis = diagnose(_rows(200).map(_hide).map(_notes_tracing).batch(10), epochs=6,
                         lint=False)
    assert all(_TRACING)
    assert diagnosis.allocated.points == 0 and diagnosis.traced.significant(64 << 10)
    assert all(m.allocated == 0 for m in diagnosis.epochs)
    assert len(diagnosis.traced_epochs) == ATTRIBUTION_EPOCHS  # one frame cannot name it
    assert diagnosis.leaking_stages[0].endswith("_hide)")
    page = diagnosis.to_html()
    assert "traced (tracemalloc)" in page and "allocated (malloc" not in page


def test_trace_false_never_traces_and_blames_only_holders() -> None:
    diagnosis = diagnose(_rows(200).map(_hide).map(_notes_tracing).batch(10), epochs=6,
                         lint=False, trace=False)
    assert not any(_TRACING) and diagnosis.traced_epochs == ()
    assert diagnosis.leak and diagnosis.growth == ()
    assert "not traced to a stage" in diagnosis.format()


@pytest.mark.parametrize(("options", "message"), [
    ({"epochs": 4}, "needs at least warmup + 3 = 5 epochs (a leak is a trend over the epochs "
                    "after the warm-up), got 4"),
    ({"epochs": 0}, "epochs must be >= 1, got 0"),
    ({"epochs": -8}, "epochs must be >= 1, got -8"),
    ({"epochs": 7.0}, "epochs must be an integer, got 7.0 (float)"),
    ({"epochs": "8"}, "epochs must be an integer, got '8' (str)"),
    ({"epochs": True}, "epochs must be an integer, got True (bool)"),
    ({"epochs": None}, "epochs must be an integer, got None (NoneType)"),
    ({"steps": 0}, "steps must be >= 1, got 0"),
    ({"steps": 2.5}, "steps must be an integer, got 2.5 (float)"),
    ({"warmup": -1}, "warmup must be >= 0, got -1"),
    ({"warmup": 4, "epochs": 6}, "needs at least warmup + 3 = 7 epochs"),
])
def test_bad_counts_are_refused_before_anything_runs(options: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        diagnose(_rows(20).map(_notes_tracing), **options)
    assert str(raised.value).startswith(f"doctor: {message}")
    assert _TRACING == []  # not one element was made


# -- the command line ---------------------------------------------------------------------------


def _module(tmp_path: Path) -> Path:
    path = tmp_path / "doctor_cli_pipeline.py"
    path.write_text(textwrap.dedent(f"""
        import numpy as np
        import headrace as hr
        from pathlib import Path

        Path({str(tmp_path / "imported")!r}).touch()  # the command ran the file
        HIDDEN = ([],)

        def clean():
            return hr.Dataset.range(100).map(lambda i: np.full(64, i)).batch(10)

        def hide(i):  # 6.4 MiB an epoch: clear of a shared test process's noise
            HIDDEN[0].append(np.ones(8192))
            return i

        def hidden():
            return hr.Dataset.range(100).map(hide).batch(10)
    """))
    return path


_EPOCH_LINE = re.compile(
    r"headrace doctor: epoch (\d+)/(\d+): 10 elements in \d+\.\d\d s \(elapsed \d+\.\d s\), "
    r"allocated \d+(\.\d)? [KMG]?i?B, anon\+shm \d+(\.\d)? [KMG]?i?B$")


def test_cli_shows_progress_by_default_and_quiet_silences_it(tmp_path: Path,
                                                             capsys: Capture) -> None:
    module = _module(tmp_path)
    assert main(["doctor", f"{module}:clean", "--epochs", "6"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 6, captured.err
    for k, line in enumerate(lines, 1):
        match = _EPOCH_LINE.match(line)
        assert match, line
        assert match.groups()[:2] == (str(k), "6")
    assert "no leak" in captured.out
    assert main(["doctor", f"{module}:clean", "--epochs", "5", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "no leak" in captured.out
    assert main(["doctor", f"{module}:clean", "--epochs", "5", "--quiet", "--progress"]) == 0
    assert len(capsys.readouterr().err.splitlines()) == 5


def test_cli_shows_the_traced_pass_and_deep_skips_it(tmp_path: Path, capsys: Capture) -> None:
    module = _module(tmp_path)
    assert main(["doctor", f"{module}:hidden", "--epochs", "5"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 5 + ATTRIBUTION_EPOCHS, captured.err
    for k, line in enumerate(lines[5:], 1):
        assert line.startswith(f"headrace doctor: leak: traced epoch {k}/{ATTRIBUTION_EPOCHS} "
                               "(finding where it was allocated): 10 elements in "), line
    assert "LEAK" in captured.out and f"allocated at {module}:" in captured.out
    assert main(["doctor", f"{module}:hidden", "--epochs", "5", "--deep", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "traced" in captured.out and "epochs traced" not in captured.out
    assert f"allocated at {module}:" in captured.out


@pytest.mark.parametrize("argv", [
    ["--epochs", "0"], ["--epochs", "-1"], ["--epochs=-5"], ["--epochs", "4"], ["--epochs=4"],
    ["--epochs", "5.0"], ["--epochs", "1e1"], ["--epochs", "five"], ["--epochs", ""],
    ["--epochs", " "], ["--epochs", "0x10"], ["--epochs", "100001"], ["--epochs"],
    ["--epochs", "8", "--steps", "0"],
])
def test_cli_bad_epochs_are_one_line_exit_2_and_run_nothing(tmp_path: Path, capsys: Capture,
                                                            argv: list[str]) -> None:
    module = _module(tmp_path)
    assert main(["doctor", f"{module}:clean", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    option = "--steps" if "--steps" in argv else "--epochs"
    assert captured.err.startswith(f"headrace doctor: error: argument {option}: ")
    assert captured.err.endswith("(see headrace doctor --help)\n")
    assert "Traceback" not in captured.err
    assert not (tmp_path / "imported").exists()
