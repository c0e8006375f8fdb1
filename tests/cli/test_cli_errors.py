"""Every CLI subcommand against bad inputs: a non-zero exit within a time limit, one line
on stderr naming the problem and the path (or the option and its value), no
traceback, and nothing written next to the input or left in the temp directory.

Each case runs ``main(argv)`` in a forked child (the same process image, in-process
code) so that a command that hangs (``inspect --no-crc /dev/zero`` used to read
endless empty records) is killed at the limit instead of hanging the test run.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headrace.cli import main
from headrace.io.tfrecord import write_tfrecord

LIMIT_S = 30.0


@dataclass
class Ran:
    code: int | None  # None: killed at the time limit
    out: str
    err: str
    seconds: float


def run_cli(argv: list[str], *, cwd: Path, temp: Path, capture: Path) -> Ran:
    """``main(argv)`` in a forked child with ``cwd``, its temp directory ``temp`` and
    its stdout/stderr written under ``capture``; killed after ``LIMIT_S``."""
    capture.mkdir(parents=True, exist_ok=True)
    out_path, err_path = capture / "stdout", capture / "stderr"
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            for fd, path in ((1, out_path), (2, err_path)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            os.chdir(cwd)
            os.environ["TMPDIR"] = str(temp)
            tempfile.tempdir = str(temp)
            code = main(argv)
        except SystemExit as done:  # what the console script would print and return
            if isinstance(done.code, str):
                print(done.code, file=sys.stderr)
            code = done.code if isinstance(done.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status = None
    while time.monotonic() - started < LIMIT_S:
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = None
    seconds = time.monotonic() - started
    code = None if status is None else os.waitstatus_to_exitcode(status)
    return Ran(code, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"),
               seconds)


def one_error_line(ran: Ran, argv: list[str]) -> str:
    """The run failed in time, with exactly one line on stderr and no traceback."""
    assert ran.code is not None, f"{argv}: still running after {LIMIT_S} s"
    assert ran.code != 0, f"{argv}: exit 0 for a bad input\n{ran.out}\n{ran.err}"
    lines = ran.err.splitlines()
    assert "Traceback" not in ran.err, f"{argv}:\n{ran.err}"
    assert len(lines) == 1 and lines[0].strip(), f"{argv}: stderr is not one line:\n{ran.err}"
    return lines[0]


# --------------------------------------------------------------------------- bad files

def tfrecord_bytes(rng: np.random.Generator) -> tuple[bytes, int]:
    """A valid TFRecord file's bytes and the size of its last record's framing."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "f.tfrecord")
        records = [rng.bytes(int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 6)))]
        write_tfrecord(path, records)
        return Path(path).read_bytes(), len(records[-1]) + 16


def npy_bytes(rng: np.random.Generator) -> tuple[bytes, int]:
    """A valid ``.npy`` file's bytes and the size of its data."""
    array = rng.standard_normal((int(rng.integers(1, 20)), int(rng.integers(1, 5))))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "f.npy")
        np.save(path, array)
        return Path(path).read_bytes(), array.nbytes


def make_bad_input(kind: str, suffix: str, directory: Path, seed: int, device_ok: bool) -> str:
    """A bad input of ``kind`` for a command that wants a ``suffix`` file."""
    rng = np.random.default_rng(seed)
    path = directory / f"input{suffix}"
    if kind == "missing":
        return str(path)
    if kind == "directory":
        path.mkdir()
        return str(path)
    if kind in ("/dev/zero", "/dev/null"):
        if device_ok:  # the device itself: nothing may be written next to it
            return kind
        path.symlink_to(kind)
        return str(path)
    if kind == "fifo":
        os.mkfifo(path)
        return str(path)
    if suffix == ".py":
        text = "def make(:\n" if kind == "truncated" else "raise RuntimeError('boom at import')\n"
        path.write_text(text)
        return str(path)
    whole, tail = tfrecord_bytes(rng) if suffix == ".tfrecord" else npy_bytes(rng)
    if kind == "truncated":  # cut inside the last record / the array's data
        data = whole[: len(whole) - int(rng.integers(1, tail))]
    else:  # "corrupt": garbage where the file starts
        data = b"\x00" + rng.bytes(int(rng.integers(15, 64))) + whole
    path.write_bytes(data)
    return str(path)


@dataclass(frozen=True)
class Command:
    name: str
    suffix: str
    argv: Callable[[str, Path], list[str]]  # (input path, output dir) -> argv
    any_name: bool = False  # takes a path of any name (the devices themselves)
    kinds: tuple[str, ...] = (
        "missing", "directory", "/dev/zero", "/dev/null", "fifo", "truncated", "corrupt",
    )


COMMANDS = [
    Command("inspect", ".tfrecord", lambda p, o: ["inspect", p], any_name=True),
    Command("inspect --no-crc", ".tfrecord", lambda p, o: ["inspect", "--no-crc", p],
            any_name=True),
    Command("index", ".tfrecord", lambda p, o: ["index", p], any_name=True),
    Command("index --check", ".tfrecord", lambda p, o: ["index", "--check", p],
            any_name=True),
    Command("convert npy", ".npy",
            lambda p, o: ["convert", p, str(o / "shards"), "--progress", "never"]),
    Command("convert csv", ".csv",
            lambda p, o: ["convert", p, str(o / "shards"), "--progress", "never"],
            kinds=("missing", "directory", "/dev/zero", "/dev/null", "fifo")),
    Command("convert tfrecord", ".tfrecord",
            lambda p, o: ["convert", p, str(o / "out.csv"), "--progress", "never"]),
    Command("profile", ".py", lambda p, o: ["profile", f"{p}:make", "--html", ""]),
    Command("doctor", ".py", lambda p, o: ["doctor", f"{p}:make", "--epochs", "5"]),
]

CASES = [(command, kind) for command in COMMANDS for kind in command.kinds]


def dev_entries() -> set[str]:
    return {name for name in os.listdir("/dev") if name.endswith((".hrx", ".tmp", ".csv"))}


@pytest.mark.parametrize(
    ("command", "kind"), CASES, ids=[f"{c.name}-{k}" for c, k in CASES]
)
def test_every_command_refuses_a_bad_input_in_one_line(
    tmp_path: Path, command: Command, kind: str
) -> None:
    # files with content are drawn from a seeded generator: two per case
    seeds = [zlib.crc32(f"{command.name}/{kind}/{i}".encode()) for i in range(2)]
    for seed in seeds if kind in ("truncated", "corrupt") else seeds[:1]:
        check_bad_input(tmp_path / str(seed), command, kind, seed)


def check_bad_input(root: Path, command: Command, kind: str, seed: int) -> None:
    inputs, outputs, temp, cwd = (root / name for name in ("in", "out", "tmp", "cwd"))
    for directory in (inputs, outputs, temp, cwd):
        directory.mkdir(parents=True)
    path = make_bad_input(kind, command.suffix, inputs, seed, command.any_name)
    argv = command.argv(path, outputs)
    inputs_before, dev_before = set(os.listdir(inputs)), dev_entries()
    try:
        ran = run_cli(argv, cwd=cwd, temp=temp, capture=root / "capture")
    finally:
        for leaked in dev_entries() - dev_before:  # never leave a file in /dev
            os.unlink(os.path.join("/dev", leaked))
    line = one_error_line(ran, argv)
    assert path in line or os.path.basename(path) in line, f"{argv}: {line}"
    assert set(os.listdir(inputs)) == inputs_before, f"{argv}: wrote next to the input"
    assert dev_entries() == dev_before, f"{argv}: wrote into /dev"
    assert not os.listdir(temp), f"{argv}: left {os.listdir(temp)} in the temp directory"
    assert not os.listdir(cwd), f"{argv}: wrote {os.listdir(cwd)} in the working directory"
    leftovers = [name for name in os.listdir(outputs) if any(os.scandir(outputs / name))
                 or not (outputs / name).is_dir()]
    assert not leftovers, f"{argv}: wrote {leftovers}"


# --------------------------------------------------------------------------- bad numbers

COUNTS = ["abc", "-3", "1.5", "", "0x10", "1e3"]
SIZES = ["abc", "0", "-1MiB", "12 parsecs", "nan", "inf", "9" * 400, ""]
HUGE = ["99999999999999999999", "100001", "2" * 40]  # past every bound: refused at parse time

# (argv before the option, option, bad values, argv after), with a valid file as {npy}
OPTIONS = [
    (["demo"], "--size", [*SIZES, *HUGE[::2], "17TiB"], []),
    (["demo"], "--budget", SIZES, []),
    (["demo"], "--batch-size", [*COUNTS, "0"], []),
    (["demo"], "--shuffle", [*COUNTS, "0"], []),
    (["inspect", "{tfrecord}"], "--records", COUNTS, []),
    (["convert", "{npy}", "{out}"], "--shards", [*COUNTS, "0", *HUGE], []),
    (["convert", "{npy}", "{out}"], "--batch-size", [*COUNTS, "0"], []),
    (["convert", "{npy}", "{out}"], "--memory-budget", SIZES, []),
    (["convert", "{tfrecord}", "{out}.csv"], "--limit", COUNTS, []),
    (["profile", "{py}:make"], "--steps", [*COUNTS, "0"], ["--html", ""]),
    (["profile", "{py}:make"], "--budget", SIZES, ["--html", ""]),
    (["doctor", "{py}:make"], "--epochs", [*COUNTS, "0", *HUGE], []),
    (["profile", "{py}:make"], "--epochs", [*COUNTS, "0", *HUGE], ["--html", ""]),
]

_option_cases = st.sampled_from(OPTIONS).flatmap(
    lambda option: st.tuples(st.just(option), st.sampled_from(option[2]))
)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_option_cases)
def test_a_bad_number_is_one_line_naming_the_option_and_value(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[tuple[list[str], str, list[str],
                                                                  list[str]], str]
) -> None:
    (before, option, _, after), value = case
    root = tmp_path_factory.mktemp("number")
    temp, cwd = root / "tmp", root / "cwd"
    temp.mkdir()
    cwd.mkdir()
    np.save(root / "ok.npy", np.arange(12.0).reshape(6, 2))
    write_tfrecord(str(root / "ok.tfrecord"), [b"a", b"bc"])
    (root / "ok.py").write_text("import headrace as hr\n\ndef make():\n"
                                "    return hr.Dataset.range(4)\n")
    names = {"npy": str(root / "ok.npy"), "tfrecord": str(root / "ok.tfrecord"),
             "py": str(root / "ok.py"), "out": str(root / "out")}
    argv = [part.format(**names) for part in before] + [f"{option}={value}", *after]
    ran = run_cli(argv, cwd=cwd, temp=temp, capture=root / "capture")
    line = one_error_line(ran, argv)
    assert ran.code == 2, f"{argv}: exit {ran.code}"
    assert option in line and repr(value)[:30].rstrip("'") in line, f"{argv}: {line}"
    assert not os.listdir(temp) and not os.listdir(cwd)
    assert not os.path.exists(root / "out") and not os.path.exists(root / "out.csv")


# --------------------------------------------------------------------------- demo

def test_a_demo_that_fails_removes_its_data_file(tmp_path: Path) -> None:
    temp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    temp.mkdir()
    cwd.mkdir()
    argv = ["demo", "--size", "2MiB", "--budget", "1KiB"]  # no element fits the budget
    ran = run_cli(argv, cwd=cwd, temp=temp, capture=tmp_path / "capture")
    line = one_error_line(ran, argv)
    assert ran.code == 1 and "memory budget" in line
    assert not os.listdir(temp), "the demo's data file was left in the temp directory"


def test_demo_keeps_a_complete_file_in_dir_and_refuses_a_dir_that_is_a_file(
    tmp_path: Path,
) -> None:
    temp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    temp.mkdir()
    cwd.mkdir()
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    argv = ["demo", "--size", "1MiB", "--dir", str(not_dir)]
    ran = run_cli(argv, cwd=cwd, temp=temp, capture=tmp_path / "capture")
    assert str(not_dir) in one_error_line(ran, argv)
    keep = tmp_path / "keep"
    keep.mkdir()
    argv = ["demo", "--size", "2MiB", "--budget", "1KiB", "--dir", str(keep)]
    run_cli(argv, cwd=cwd, temp=temp, capture=tmp_path / "capture")
    assert os.listdir(keep) == ["demo.npy"]  # complete (renamed when written), reused
    assert np.load(keep / "demo.npy", mmap_mode="r").shape == (512, 1024)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    argv = ["--debug", "profile", f"{tmp_path / 'nope.py'}:make"]
    ran = run_cli(argv, cwd=tmp_path, temp=tmp_path, capture=tmp_path / "capture")
    assert ran.code == 1 and "Traceback" in ran.err and "nope.py" in ran.err
    assert main(["inspect", "--help"]) == 0


# --------------------------------------------------------------------------- bad outputs

def make_output(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()


@pytest.mark.parametrize(
    "kind", ["fifo", "directory", "/dev/null", "name too long", "/proc/version"])
@pytest.mark.parametrize("command", ["profile", "doctor"])
def test_an_html_report_that_cannot_be_written_is_refused_before_running(
    tmp_path: Path, command: str, kind: str
) -> None:
    # a FIFO blocked the report's write forever; a name too long or a /proc file ran
    # every epoch, then failed at the write with status 1 (attacks8): refused on the
    # command line instead, and nothing made on the way
    temp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    temp.mkdir()
    cwd.mkdir()
    (tmp_path / "ok.py").write_text("import headrace as hr\n\ndef make():\n"
                                    "    raise AssertionError('ran the pipeline')\n")
    if kind.startswith("/"):
        html = kind
    else:
        html = str(tmp_path / ("x" * 300 + ".html" if kind == "name too long" else "report"))
    make_output(kind, Path(html))
    argv = [command, f"{tmp_path / 'ok.py'}:make", "--html", html, "--epochs", "5"]
    ran = run_cli(argv, cwd=cwd, temp=temp, capture=tmp_path / "capture")
    line = one_error_line(ran, argv)
    assert ran.code == 2 and html[:60] in line and "--html" in line, line
    assert not os.listdir(temp) and not os.listdir(cwd)
    assert set(os.listdir(tmp_path)) - {"report"} == {"capture", "cwd", "ok.py", "tmp"}


def test_an_existing_report_file_is_left_as_it_was_until_the_report(tmp_path: Path) -> None:
    from headrace.cli import _output_file

    report = tmp_path / "report.html"
    report.write_text("old")
    os.utime(report, (1_000_000, 1_000_000))
    assert _output_file(str(report)) == str(report)
    assert report.read_text() == "old" and report.stat().st_mtime == 1_000_000
    assert _output_file(str(tmp_path / "new.html")) and not (tmp_path / "new.html").exists()


def failing_convert(case: str, root: Path, rng: np.random.Generator) -> list[str]:
    """A ``convert`` that fails after its arguments parse (argv without the destination)."""
    import sqlite3

    rows = int(rng.integers(1, 50))
    connection = sqlite3.connect(root / "db.sqlite")
    connection.execute("create table t(k integer primary key, v)")
    connection.executemany("insert into t values (?, ?)", [(i, i * 2) for i in range(rows)])
    connection.commit()
    connection.close()
    np.save(root / "a.npy", np.arange(rows))
    (root / "a.csv").write_text("a,b\n" + "".join(f"{i},{i}\n" for i in range(rows)))
    return {
        "sql bad query": ["convert", f"sqlite:///{root / 'db.sqlite'}", "--query",
                          "select * from nosuch"],
        "sql no database": ["convert", f"sqlite:///{root / 'nosuch.db'}", "--table", "t"],
        "csv tiny budget": ["convert", str(root / "a.csv"), "--memory-budget",
                            str(rng.choice(["1.5", "1", "100"]))],
    }[case]


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(["sql bad query", "sql no database", "csv tiny budget"]),
       dest=st.sampled_from(["out", "out/a/b", "out/a/part-{shard}.tfrecord"]),
       seed=st.integers(0, 2**32 - 1))
def test_a_failed_convert_leaves_no_directory_it_created(
    tmp_path_factory: pytest.TempPathFactory, case: str, dest: str, seed: int
) -> None:
    root = tmp_path_factory.mktemp("convert")
    temp, cwd, inputs = root / "tmp", root / "cwd", root / "in"
    for directory in (temp, cwd, inputs):
        directory.mkdir()
    argv = failing_convert(case, inputs, np.random.default_rng(seed))
    argv[2:2] = [str(root / dest)]  # after the source: SOURCE DEST --options
    argv += ["--progress", "never"]
    before = sorted(os.listdir(root))
    ran = run_cli(argv, cwd=cwd, temp=temp, capture=root / "capture")
    one_error_line(ran, argv)
    assert ran.code == 1
    left = sorted(os.listdir(root))
    assert left == sorted([*before, "capture"]), f"{argv}: left {left}"
    assert not os.listdir(temp) and not os.listdir(cwd)
