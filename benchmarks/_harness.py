"""Shared machinery for the headrace benchmarks: fresh child processes, memory sampling.

Every side of every scenario runs in its own fresh interpreter (``run_child``),
one after the other, so import cost, allocator state and leaked buffers of one
side never show up in another. The child measures itself:

* :class:`MemorySampler` — a daemon thread that reads ``/proc/self/status``
  (and the same file of every descendant process) every ~5 ms and keeps the
  peak of ``RssAnon + RssShmem`` (what docs/guarantees.md G1 charges) and, separately,
  of ``RssFile`` (memmap and page-cache pages: reported, not charged).
* The kernel's own high-water mark as a cross-check: writing ``5`` to
  ``/proc/self/clear_refs`` resets ``VmHWM``, so ``VmHWM`` after the run minus
  ``VmRSS`` at the reset is the exact peak growth of the *total* RSS
  (anonymous + shared + file-backed) — it cannot miss a spike between samples.

The child prints one line ``@@RESULT@@ <json>`` on stdout; anything else it
prints (TensorFlow's logging, warnings) is kept for error reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
RESULT_TAG = "@@RESULT@@ "
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


# --------------------------------------------------------------------------- child side


def read_status(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/status`` memory fields in bytes (missing fields are absent)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in STATUS_FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def charged(status: dict[str, int]) -> int:
    """What G1 charges: anonymous + shared memory."""
    return status.get("RssAnon", 0) + status.get("RssShmem", 0)


def read_proportional(pid: int | str = "self") -> int:
    """``Pss_Anon + Pss_Shmem`` of ``pid`` (``/proc/<pid>/smaps_rollup``), in bytes: pages
    a forked worker shares copy-on-write with its parent count once across the tree,
    where ``RssAnon`` counts them in every process."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                key, _, rest = line.partition(":")
                if key in ("Pss_Anon", "Pss_Shmem"):
                    total += int(rest.split()[0]) * 1024
    except OSError:
        pass
    return total


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live descendants (all threads)."""
    total = sum(os.times()[:2])
    for pid in _descendants():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass  # a worker that just exited
    return total


def _descendants() -> list[int]:
    """PIDs of all descendant processes (worker processes count against G1)."""
    pids: list[int] = []
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as children:
                    kids = [int(k) for k in children.read().split()]
            except OSError:
                continue
            pids.extend(kids)
            todo.extend(kids)
    return pids


def reset_kernel_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


@dataclass
class MemorySampler:
    """Background sampler of this process (plus descendants) every ``interval`` seconds.

    ``start()`` records the baseline; ``stop()`` returns a dict of growths in
    bytes relative to it. Use as a context manager.
    """

    interval: float = 0.005
    #: Count every process of the tree by its proportional share (G1's measure with
    #: worker processes) instead of its RssAnon + RssShmem.
    proportional: bool = False
    baseline: dict[str, int] = field(default_factory=dict)
    peak_charged: int = 0
    peak_file: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _go: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _kernel_peak_ok: bool = False

    def _total(self, pids: Sequence[int]) -> tuple[int, int]:
        own = read_status()
        anon_shm, file_backed = charged(own), own.get("RssFile", 0)
        if self.proportional:
            anon_shm = read_proportional()
        for pid in pids:
            child = read_status(pid)
            anon_shm += read_proportional(pid) if self.proportional else charged(child)
            file_backed += child.get("RssFile", 0)
        return anon_shm, file_backed

    def _run(self) -> None:
        # The thread's own first allocations (its stack pages, the allocator arena of a
        # new thread, the /proc readers' buffers) happen before the baseline is taken:
        # the sampler's memory is not the measured code's. start() waits for this.
        pids = _descendants()
        self._total(pids)
        self._ready.set()
        self._go.wait()
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_scan:
                pids = _descendants()
                next_scan = now + 0.1
            self._sample(pids)
            self._stop.wait(self.interval)

    def _sample(self, pids: Sequence[int]) -> None:
        anon_shm, file_backed = self._total(pids)
        self.peak_charged = max(self.peak_charged, anon_shm)
        self.peak_file = max(self.peak_file, file_backed)
        self.samples += 1

    def start(self) -> MemorySampler:
        self._stop.clear()
        self._ready.clear()
        self._go.clear()
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)
        self._thread.start()
        self._ready.wait()
        self._kernel_peak_ok = reset_kernel_peak()
        own = read_status()
        anon_shm, file_backed = self._total(_descendants())
        self.baseline = {"charged": anon_shm, "file": file_backed, "rss": own.get("VmRSS", 0)}
        self.peak_charged, self.peak_file = anon_shm, file_backed
        self._go.set()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample(_descendants())
        own = read_status()
        end_charged, _ = self._total([])
        out: dict[str, Any] = {
            "baseline_charged": self.baseline["charged"],
            "peak_growth": self.peak_charged - self.baseline["charged"],
            "end_growth": end_charged - self.baseline["charged"],
            "peak_file_growth": self.peak_file - self.baseline["file"],
            "samples": self.samples,
        }
        if self._kernel_peak_ok and "VmHWM" in own:
            out["kernel_peak_rss_growth"] = own["VmHWM"] - self.baseline["rss"]
        return out

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join()


def emit(result: dict[str, Any]) -> None:
    """Hand the child's result to the parent (one tagged JSON line on stdout)."""
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()


def child_main(config_json: str, children: dict[str, Any]) -> int:
    """The child side of a benchmark script: run one side, emit its result or its error."""
    import traceback

    config = json.loads(config_json)
    try:
        result = children[config["kind"]](config)
    except Exception as exc:  # the parent shows it as an ERROR cell, the run goes on
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    emit(result)
    return 0


# --------------------------------------------------------------------------- parent side


def run_child(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``argv`` in a fresh process; return its tagged JSON result or an error dict."""
    load_before = loadavg()
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        if isinstance(tail, bytes):
            tail = tail.decode(errors="replace")
        return {"error": f"timeout after {timeout:.0f} s (hang?)", "stderr_tail": tail}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result: dict[str, Any] = json.loads(line[len(RESULT_TAG) :])
            result.setdefault("process_wall_s", wall)
            result["loadavg_1min_before"] = load_before
            return result
    return {
        "error": f"child exited with code {proc.returncode} and no result",
        "stderr_tail": proc.stderr[-2000:],
        "stdout_tail": proc.stdout[-1000:],
    }


def loadavg() -> float | None:
    """1-minute load average: how busy the shared machine was (others' jobs add noise)."""
    try:
        with open("/proc/loadavg") as load:
            return float(load.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def source_fingerprint(src: Path) -> dict[str, Any]:
    """Which headrace was measured: git HEAD (read-only query) and a hash of the sources.

    The tree is edited concurrently, so HEAD alone does not say what ran.
    """
    digest = hashlib.sha256()
    files = sorted(src.rglob("*.py"))
    for path in files:
        digest.update(str(path.relative_to(src)).encode())
        digest.update(path.read_bytes())
    head = "unknown"
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        head = out.stdout.strip() or head
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"git_head": head, "src_sha256": digest.hexdigest()[:16], "src_files": len(files)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _version_in(python: str, module: str) -> str:
    code = (
        "import importlib.metadata as m, sys\n"
        f"try: print(m.version({module!r}))\n"
        "except m.PackageNotFoundError: print('not installed')"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine_info(python: str) -> dict[str, Any]:
    """CPU, cores, RAM, interpreter and library versions, thread-related env vars."""
    threads_env = {
        key: value
        for key, value in os.environ.items()
        if key.startswith(("OPENBLAS", "OMP_", "MKL_", "TF_NUM", "NUMEXPR"))
    }
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "ram_gib": round(_mem_total() / (1 << 30), 1),
        "kernel": platform.release(),
        "python": subprocess.run(
            [python, "-c", "import sys; print(sys.version.split()[0])"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip(),
        "python_exe": python,
        "numpy": _version_in(python, "numpy"),
        "tensorflow": _version_in(python, "tensorflow-cpu")
        if _version_in(python, "tensorflow-cpu") != "not installed"
        else _version_in(python, "tensorflow"),
        "torch": _version_in(python, "torch"),
        "psutil": _version_in(python, "psutil"),
        "thread_env": threads_env or "none set",
        "loadavg_1min_at_start": loadavg(),
    }


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_mib(nbytes: float | None) -> str:
    if nbytes is None:
        return "—"
    return f"{nbytes / MIB:,.1f} MiB"


def fmt_rate(per_s: float | None) -> str:
    if per_s is None:
        return "—"
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f} M/s"
    return f"{per_s / 1e3:.1f} k/s"


def fmt_ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``, or a dash when either is missing."""
    return f"{a / b:.2f}x" if a and b else "—"


def pass_fail(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# --------------------------------------------------------------------------- parent runs

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def child_env() -> dict[str, str]:
    """The children import headrace from this checkout's src, whatever is installed."""
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quieter logs; no effect on speed
    return env


def spawn(script: str, python: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one side of ``script`` (``--child <cfg>``) in a fresh ``python``, with progress
    on stderr; paths in the config (``dir``, ``npy``, ``files``) are left out of it."""
    argv = [python, str(Path(script).resolve()), "--child", json.dumps(cfg)]
    label = " ".join(f"{k}={v}" for k, v in cfg.items() if k not in ("dir", "npy", "files"))
    print(f"  running {label} ...", file=sys.stderr, flush=True)
    result = run_child(argv, timeout=timeout, env=child_env())
    if result.get("error"):
        print(f"    -> {result['error']}\n{result.get('stderr_tail', '')}", file=sys.stderr)
    elif "best_s" in result:
        print(f"    -> best {result['best_s']:.3f} s", file=sys.stderr, flush=True)
    return result


def report_head(title: str, python: str, run_line: str) -> tuple[dict[str, Any], list[str]]:
    """Machine info (with a fingerprint of the headrace source measured) and the opening
    lines of a results page: title, when and how it ran, the machine."""
    info = machine_info(python)
    info["headrace_source"] = source_fingerprint(REPO / "src" / "headrace")
    sections = [
        f"# {title}",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {run_line}",
        "",
        "## Machine",
        "",
        "\n".join(f"- **{key}**: {value}" for key, value in info.items()),
        "",
    ]
    return info, sections


def write_report(
    stem: str, sections: list[str], report: dict[str, Any], started: float
) -> str:
    """Close a results page with the run's wall time and the machine's load, print it,
    and write ``results/<stem>.md`` and ``.json`` (every raw number)."""
    total = time.perf_counter() - started
    report["total_s"] = total
    report["loadavg_1min_at_end"] = loadavg()
    sections.append(
        f"Total wall time: {total:.0f} s; 1-min load average at start "
        f"{report['machine']['loadavg_1min_at_start']}, at end {report['loadavg_1min_at_end']} "
        f"({os.cpu_count()} cores; above that, other jobs shared the CPUs)."
    )
    markdown = "\n".join(sections) + "\n"
    print(markdown)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(markdown)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {RESULTS / (stem + '.md')} and .json", file=sys.stderr)
    return markdown
