"""Evaluate a *measured backstop* for the memory cap (G1, docs/guarantees.md), from measurements.

The proposal: pause the producers when the process's measured RssAnon + RssShmem
growth since the iterator started passes budget + 10% + 64 MiB, and report the
bytes nobody booked ("unaccounted") in ``stats()``. This script measures what
that would cost and how often it would be wrong, without touching ``src/``: the
backstop is a prototype in this file (:class:`Backstop`, a sampling thread).

Usage: python benchmarks/bench_backstop.py [--quick]

Parts (each allocator-sensitive case runs in a fresh child process):

1. cost of one reading of process memory (/proc/self/status, statm, smaps_rollup,
   getrusage) and what a sampling producer adds per element at ~1 us/element;
2. lag and accuracy of RSS against the bytes a program really holds (glibc
   arenas, the dynamic mmap threshold, memory freed but not returned, untouched
   pages), under glibc defaults, headrace's ``M_ARENA_MAX=2``, a fixed
   ``M_MMAP_THRESHOLD`` and a fixed ``M_TRIM_THRESHOLD``;
3. false pauses while a training loop allocates (a pipeline within its budget),
   and true positives (a map that leaks, elements pinning C memory the sizer
   cannot see), observed and enforced;
4. attribution: a train and an eval iterator in one process, each with its own
   "since the iterator started" baseline.

Writes the tables to stdout and ``benchmarks/results/backstop.json`` (raw numbers);
``benchmarks/results/backstop.md`` is the written evaluation.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
KiB = 1 << 10

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


# -- reading process memory --------------------------------------------------------------


def read_status() -> int:
    """RssAnon + RssShmem from /proc/self/status, as headrace's process_memory() reads it."""
    fields = {"RssAnon:": 0, "RssShmem:": 0}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(maxsplit=1)[0]
            if key in fields:
                fields[key] = int(line.split()[1]) * 1024
    return fields["RssAnon:"] + fields["RssShmem:"]


class StatusReader:
    """RssAnon + RssShmem from a kept-open /proc/self/status (pread regenerates it)."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/status", os.O_RDONLY)

    def __call__(self) -> int:
        text = os.pread(self.fd, 4096, 0)
        anon = text.index(b"RssAnon:")
        shmem = text.index(b"RssShmem:", anon)
        return (int(text[anon + 8:text.index(b"kB", anon)])
                + int(text[shmem + 9:text.index(b"kB", shmem)])) * 1024


class StatmReader:
    """resident - shared pages from a kept-open /proc/self/statm: RssAnon only (statm's
    "shared" is RssFile + RssShmem, so shared memory cannot be told from file pages)."""

    page = os.sysconf("SC_PAGESIZE")

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)

    def __call__(self) -> int:
        fields = os.pread(self.fd, 128, 0).split()
        return (int(fields[1]) - int(fields[2])) * self.page


def read_statm() -> int:
    with open("/proc/self/statm", "rb") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * StatmReader.page


def read_smaps_rollup() -> int:
    """Pss_Anon + Pss_Shmem (what G1 charges with worker processes)."""
    with open("/proc/self/smaps_rollup", "rb") as rollup:
        text = rollup.read()
    total = 0
    for key in (b"Pss_Anon:", b"Pss_Shmem:"):
        at = text.index(key)
        total += int(text[at + len(key):text.index(b"kB", at)])
    return total * 1024


def read_getrusage() -> int:
    """Peak RSS only (ru_maxrss, KiB on Linux): cannot see memory going down."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def per_call_us(fn: Any, calls: int, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def part1(quick: bool) -> dict:
    calls = 500 if quick else 2000
    readers = {
        "/proc/self/status (open+parse, as stats.py)": read_status,
        "/proc/self/status (kept fd, pread)": StatusReader(),
        "/proc/self/statm (open+parse)": read_statm,
        "/proc/self/statm (kept fd, pread)": StatmReader(),
        "/proc/self/smaps_rollup (open+parse)": read_smaps_rollup,
        "resource.getrusage (peak only)": read_getrusage,
    }
    small = {name: per_call_us(fn, calls) for name, fn in readers.items()}
    # smaps_rollup walks every page table; status/statm read counters: cost vs resident size.
    held = np.ones(1024 * MiB, np.uint8)
    big = {name: per_call_us(fn, calls // 4) for name, fn in readers.items()}
    del held
    return {"us_per_read_small_rss": small, "us_per_read_1GiB_rss": big,
            "per_element": per_element_cost(quick)}


def _work(n: int) -> int:
    """About 1 us of Python per element: the cheapest realistic pipeline step."""
    acc = 0
    for i in range(n):
        acc = (acc + i * 7) ^ (i >> 3)
        acc = (acc * 3 + i) & 0xFFFF
        acc = (acc + i * 7) ^ (i >> 3)
        acc = (acc * 3 + i) & 0xFFFF
        acc = (acc + i * 7) ^ (i >> 3)
        acc = (acc * 3 + i) & 0xFFFF
    return acc


def per_element_cost(quick: bool) -> dict:
    """ns per element a producer loop pays for the check, at ~1 us of work per element."""
    read = StatusReader()
    bound = 1 << 62
    n = 100_000 if quick else 300_000
    inner = 4  # _work(4) is about 1 us on this machine; measured below

    def plain() -> None:
        for _ in range(n):
            _work(inner)

    def every(k: int) -> Any:
        def loop() -> None:
            for i in range(n):
                _work(inner)
                if i % k == 0 and read() > bound:
                    raise AssertionError
        return loop

    def every_ms(ms: float) -> Any:
        step = int(ms * 1e6)

        def loop() -> None:
            due = time.monotonic_ns()
            for _ in range(n):
                _work(inner)
                now = time.monotonic_ns()
                if now >= due:
                    due = now + step
                    if read() > bound:
                        raise AssertionError
        return loop

    def monitored(ms: float) -> Any:
        def loop() -> None:
            stop = threading.Event()

            def watch() -> None:
                while not stop.wait(ms / 1000):
                    if read() > bound:
                        raise AssertionError
            thread = threading.Thread(target=watch, daemon=True)
            thread.start()
            plain()
            stop.set()
            thread.join()
        return loop

    variants = {
        "no check": plain,
        "check every element": every(1),
        "check every 64 elements": every(64),
        "check every 1024 elements": every(1024),
        "check when 1 ms passed (clock per element)": every_ms(1),
        "check when 10 ms passed (clock per element)": every_ms(10),
        "monitor thread, every 1 ms": monitored(1),
        "monitor thread, every 10 ms": monitored(10),
    }
    rounds = 3 if quick else 7
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved rounds: machine noise hits every variant alike
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / n * 1e9)
    base = statistics.median(times["no check"])
    return {name: {"ns_per_element": statistics.median(t),
                   "overhead_ns": statistics.median(t) - base,
                   "overhead_pct": 100 * (statistics.median(t) - base) / base}
            for name, t in times.items()}


# -- part 2: RSS against what is really held ---------------------------------------------


def _mallopt(param: int, value: int) -> bool:
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(param, value))


def _malloc_trim() -> None:
    ctypes.CDLL(None).malloc_trim(0)


ALLOCATOR_CONFIGS = {
    "glibc default": [],
    "M_ARENA_MAX=2 (headrace)": [(M_ARENA_MAX, 2)],
    "M_MMAP_THRESHOLD=128KiB": [(M_MMAP_THRESHOLD, 128 * KiB)],
    "M_TRIM_THRESHOLD=128KiB": [(M_TRIM_THRESHOLD, 128 * KiB)],
    "ARENA_MAX=2 + MMAP_THRESHOLD=128KiB": [(M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 128 * KiB)],
}


class Sampler:
    """A thread sampling RssAnon + RssShmem every ``interval`` s, calling ``on_sample``."""

    def __init__(self, interval: float, on_sample: Any) -> None:
        self.read = StatusReader()
        self.interval = interval
        self.on_sample = on_sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.on_sample(self.read())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def child_allocator(config: str, quick: bool) -> dict:
    for param, value in ALLOCATOR_CONFIGS[config]:
        _mallopt(param, value)
    read = StatusReader()
    out: dict[str, Any] = {}
    # Untouched pages: an allocation shows in RSS only when written.
    base = read()
    a = np.empty(64 * MiB, np.uint8)
    out["np.empty 64MiB untouched"] = (read() - base) / MiB
    b = np.zeros(64 * MiB, np.uint8)
    out["np.zeros 64MiB untouched"] = (read() - base) / MiB
    b[:] = 1
    out["np.zeros 64MiB after writing"] = (read() - base) / MiB
    del a, b
    sizes = (1, 4, 64)
    for size in sizes:
        out[f"{size}MiB"] = _producer_consumer(size * MiB, read, quick)
    return out


def _producer_consumer(size: int, read: Any, quick: bool) -> dict:
    """Two producer threads allocate (and write) arrays of ``size``, the main thread frees
    them: a prefetch/parallel map's pattern. ``live`` is exactly what the program holds."""
    gc.collect()
    _malloc_trim()
    base = read()
    total = (192 if quick else 384) * MiB
    count = max(8, total // size)
    depth = max(2, (32 * MiB) // size)  # ~32 MiB in the queue (2 elements for 64 MiB)
    q: queue.Queue = queue.Queue(depth)
    lock = threading.Lock()
    live = [0]
    over: list[float] = []
    under: list[float] = []

    def sample(rss: int) -> None:
        with lock:
            held = live[0]
        over.append((rss - base - held) / MiB)
        under.append((held - (rss - base)) / MiB)

    def produce(n: int) -> None:
        for _ in range(n):
            with lock:  # counted before it exists: RSS may only lag ``live`` here
                live[0] += size
            arr = np.empty(size, np.uint8)
            arr.fill(1)
            q.put(arr)

    with Sampler(0.001, sample):
        threads = [threading.Thread(target=produce, args=(count // 2,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for _ in range(2 * (count // 2)):
            arr = q.get()
            time.sleep(0.0002)  # the consumer's step
            del arr
            with lock:  # uncounted after it is freed: RSS above ``live`` is retention
                live[0] -= size
        for thread in threads:
            thread.join()
    time.sleep(0.01)
    residual = (read() - base) / MiB
    _malloc_trim()
    trimmed = (read() - base) / MiB
    return {"max_rss_over_live_MiB": max(over), "max_live_over_rss_MiB": max(under),
            "residual_after_free_MiB": residual, "residual_after_malloc_trim_MiB": trimmed}


# -- part 3: the backstop prototype against a training loop ------------------------------


class Backstop:
    """The proposal, as a sampling thread: 'pause' while the process's RssAnon + RssShmem
    growth since ``start()`` exceeds budget + 10% + 64 MiB.

    Each sample also records what the pipeline had booked (the sum of ``held`` over
    the iterator's budget accounts) and, where the benchmark knows it, the memory the
    pipeline really held beyond its bookings (``hidden``: ground truth). ``paused`` is
    what a gate on the producers would read.
    """

    def __init__(self, iterators: list[Any], budget: int, interval: float = 0.002,
                 hidden: Any = None) -> None:
        self.iterators = iterators
        self.budget = budget
        self.bound = budget + budget // 10 + 64 * MiB
        self.interval = interval
        self.hidden = hidden or (lambda: 0)
        self.read = StatusReader()
        self.start_rss = 0
        self.started = 0.0
        self.paused = False
        self.samples: list[tuple[float, int, int, int]] = []  # t, growth, booked, hidden
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def booked(self) -> int:
        return sum(account.held for it in self.iterators
                   for account in it.context.budget.accounts)

    def start(self) -> Backstop:
        self.start_rss = self.read()
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        growth = self.read() - self.start_rss
        self.paused = growth > self.bound
        self.samples.append((time.perf_counter() - self.started, growth, self.booked(),
                             self.hidden()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        bound = self.bound
        n = len(self.samples)
        fired = [s for s in self.samples if s[1] > bound]
        # A pause is false when what the pipeline really holds (booked + hidden) is
        # within its budget: the excess is someone else's memory (or allocator slack).
        false = [s for s in fired if s[2] + s[3] <= self.budget]
        true_over = [s for s in self.samples if s[2] + s[3] > bound]
        first_true = true_over[0][0] if true_over else None
        first_fire = fired[0][0] if fired else None
        episodes = sum(1 for a, b in zip(self.samples, self.samples[1:], strict=False)
                       if a[1] <= bound < b[1]) + (1 if self.samples and
                                                   self.samples[0][1] > bound else 0)
        unaccounted = [(s[1] - s[2]) / MiB for s in self.samples]
        return {
            "samples": n,
            "bound_MiB": bound / MiB,
            "pct_samples_paused": 100 * len(fired) / n if n else 0.0,
            "pct_samples_false_pause": 100 * len(false) / n if n else 0.0,
            "pause_episodes": episodes,
            "max_booked_MiB": max((s[2] for s in self.samples), default=0) / MiB,
            "max_growth_MiB": max((s[1] for s in self.samples), default=0) / MiB,
            "max_true_MiB": max((s[2] + s[3] for s in self.samples), default=0) / MiB,
            "unaccounted_median_MiB": statistics.median(unaccounted) if unaccounted else 0,
            "unaccounted_max_MiB": max(unaccounted, default=0),
            "truly_over_s": first_true,
            "first_pause_s": first_fire,
            "detect_delay_ms": (1000 * (first_fire - first_true)
                                if first_true is not None and first_fire is not None else None),
        }


class Hidden:
    """An element part whose 1 MiB lives in a C buffer the sizer cannot see (ctypes)."""

    live = 0
    lock = threading.Lock()

    def __init__(self, size: int) -> None:
        self.buf = ctypes.create_string_buffer(size)  # zero-filled: resident
        self.size = size
        with Hidden.lock:
            Hidden.live += size

    def __del__(self) -> None:
        with Hidden.lock:
            Hidden.live -= self.size


LEAK: list[Any] = []

LOOPS = ("none", "hold 1GiB before iter()", "hold 200MiB", "hold 1GiB",
         "grow 10MiB/step", "temp 500MiB every 10 steps")
TRUE_CASES = ("map leaks into a global list", "elements pin hidden C memory (ctypes)")


def make_pipeline(case: str, budget: int, gate_fn: Any = None) -> Any:
    import warnings

    import headrace

    warnings.simplefilter("ignore")  # the sizer warns once about ctypes objects
    element = MiB

    def gen() -> Any:
        for i in range(1_000_000):
            yield np.full(element, i & 0xFF, np.uint8)

    def fn(x: Any) -> Any:
        return x + 1

    def leak(x: Any) -> Any:
        y = x + 1
        LEAK.append(y.copy())
        return y

    def pin(x: Any) -> Any:
        return x[:1024] + 1, Hidden(element)

    shuffle = 64
    mapper = fn
    if case == TRUE_CASES[0]:
        mapper = leak
    elif case == TRUE_CASES[1]:
        mapper, shuffle = pin, 1000
    spec = headrace.TensorSpec((element,), np.uint8)
    ds = headrace.Dataset.from_generator(gen, output_signature=spec)
    if gate_fn is not None:  # the enforcing variant: a gate right after the source
        ds = ds.map(gate_fn)
    ds = (ds.map(mapper, num_parallel_calls=2)
          .shuffle(shuffle, seed=1)
          .batch(8)
          .prefetch(2)
          .with_options(headrace.Options(memory_budget=budget)))
    return ds


def gate(backstop_ref: list, stalled: list, until: list) -> Any:
    """A map (before the parallel map) that blocks while the backstop says pause: the
    enforcing variant, limited to one producer since src/ is not to be changed. A real
    pause has no time limit; this one gives up at the scenario's deadline (``until``)
    so that a pause that never lifts ends the run instead of hanging it."""
    def wait(x: Any) -> Any:
        bs = backstop_ref[0]
        if bs is not None and bs.paused:
            start = time.perf_counter()
            while bs.paused and time.perf_counter() < until[0]:
                time.sleep(0.001)
            stalled[0] += time.perf_counter() - start
        return x
    return wait


def child_pipeline(case: str, enforce: bool, quick: bool) -> dict:
    budget = 256 * MiB
    steps = 60 if quick else 120
    deadline = 4.0 if quick else 6.0
    ref: list = [None]
    stalled = [0.0]
    until = [float("inf")]
    ds = make_pipeline(case, budget, gate(ref, stalled, until) if enforce else None)
    held: list[np.ndarray] = []
    if case == "hold 1GiB before iter()":
        held.append(np.ones(1024 * MiB, np.uint8))
    it = iter(ds)
    backstop = Backstop([it], budget, hidden=lambda: Hidden.live + len(LEAK) * MiB)
    backstop.start()
    ref[0] = backstop
    # A model built lazily on the first batch (Keras, JAX): after the iterator started.
    if case == "hold 200MiB":
        held.append(np.ones(200 * MiB, np.uint8))
    elif case == "hold 1GiB":
        held.append(np.ones(1024 * MiB, np.uint8))
    started = time.perf_counter()
    until[0] = started + deadline
    done = 0
    for step in range(steps):
        if time.perf_counter() - started > deadline:
            break
        batch = next(it)
        float(batch[0].sum() if isinstance(batch, tuple) else batch.sum())
        del batch
        if case == "grow 10MiB/step":
            held.append(np.ones(10 * MiB, np.uint8))
        elif case == "temp 500MiB every 10 steps" and step % 10 == 0:
            temp = np.ones(500 * MiB, np.uint8)
            time.sleep(0.02)  # a forward/backward pass over it
            del temp
        if len(LEAK) > 700:  # keep the leak case within the benchmark's RAM limit
            del LEAK[:]
            break
        done += 1
    elapsed = time.perf_counter() - started
    backstop.stop()
    it.close()
    result = backstop.summary()
    result.update({"steps": done, "seconds": elapsed, "stalled_s": stalled[0],
                   "steps_per_s": done / elapsed if elapsed else 0.0})
    return result


# -- part 4: two iterators, two baselines ------------------------------------------------


def child_attribution(quick: bool) -> dict:
    """A train iterator, and an eval iterator opened every 20 train steps for 15 batches.

    Each has its own backstop with its own baseline. ``own unaccounted`` = growth since
    that iterator started minus *its own* bookings: what a per-iterator stats() would
    report as unaccounted. ``process unaccounted`` = growth since the first iterator
    started minus the bookings of *every* live iterator.
    """
    budget = 256 * MiB
    train_it = iter(make_pipeline("none", budget))
    train = Backstop([train_it], budget).start()
    evals: list[Any] = []
    eval_summaries = []
    process_unaccounted: list[float] = []
    own_unaccounted: list[float] = []
    rounds = 3 if quick else 5
    for _ in range(rounds):
        for _ in range(20):
            next(train_it)
        eval_it = iter(make_pipeline("none", budget))
        evaluator = Backstop([eval_it], budget).start()
        for _ in range(15):
            next(eval_it)
            next(train_it)
            growth = train.read() - train.start_rss
            own_unaccounted.append((growth - train.booked()) / MiB)
            process_unaccounted.append((growth - train.booked() - evaluator.booked()) / MiB)
        evaluator.stop()
        eval_summaries.append(evaluator.summary())
        eval_it.close()
        evals.append(eval_it)
    train.stop()
    summary = train.summary()
    train_it.close()
    return {
        "train": summary,
        "eval_min_growth_MiB": min(s["max_growth_MiB"] for s in eval_summaries),
        "train_own_unaccounted_max_MiB": max(own_unaccounted),
        "train_own_unaccounted_median_MiB": statistics.median(own_unaccounted),
        "process_unaccounted_max_MiB": max(process_unaccounted),
        "process_unaccounted_median_MiB": statistics.median(process_unaccounted),
        "eval_growth_minus_booked_max_MiB": max(s["unaccounted_max_MiB"]
                                                for s in eval_summaries),
        "eval_growth_minus_booked_min_median_MiB": min(s["unaccounted_median_MiB"]
                                                       for s in eval_summaries),
    }


# -- driver ------------------------------------------------------------------------------


def run_child(args: list[str], timeout: float = 120) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    env.pop("MALLOC_ARENA_MAX", None)
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)
    if done.returncode:
        return {"error": done.stderr[-1500:]}
    return json.loads(done.stdout.splitlines()[-1])


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "alloc":
            result = child_allocator(rest[0], args.quick)
        elif kind == "pipe":
            result = child_pipeline(rest[0], rest[1] == "enforce", args.quick)
        else:
            result = child_attribution(args.quick)
        print(json.dumps(result))
        return 0

    started = time.perf_counter()
    extra = ["--quick"] if args.quick else []
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                   f"{platform.python_version()}, kernel {platform.release()}",
    }
    out: list[str] = []

    print("part 1: cost of one reading", file=sys.stderr)
    p1 = part1(args.quick)
    results["cost"] = p1
    out += ["## 1. Cost of one reading (median us per read)", "",
            "| reader | RSS ~small | RSS +1 GiB |", "|---|---:|---:|"]
    for name, us in p1["us_per_read_small_rss"].items():
        out.append(f"| {name} | {us:.1f} | {p1['us_per_read_1GiB_rss'][name]:.1f} |")
    out += ["", "Per element, a producer doing ~1 us of Python per element:", "",
            "| check | ns/element | overhead ns | overhead % |", "|---|---:|---:|---:|"]
    for name, row in p1["per_element"].items():
        out.append(f"| {name} | {row['ns_per_element']:.0f} | {row['overhead_ns']:.0f} | "
                   f"{row['overhead_pct']:.1f} |")

    print("part 2: RSS vs live bytes", file=sys.stderr)
    results["allocator"] = {cfg: run_child(["alloc", cfg, *extra]) for cfg in ALLOCATOR_CONFIGS}
    out += ["", "## 2. RSS against bytes really held (MiB; 2 producer threads, consumer "
            "frees)", "",
            "| allocator | element | max RSS over live | max live over RSS | "
            "residual after all freed | after malloc_trim |", "|---|---:|---:|---:|---:|---:|"]
    for cfg, res in results["allocator"].items():
        if "error" in res:
            out.append(f"| {cfg} | ERROR {res['error'][-200:]!r} |")
            continue
        for size in ("1MiB", "4MiB", "64MiB"):
            row = res[size]
            out.append(f"| {cfg} | {size} | {row['max_rss_over_live_MiB']:.0f} | "
                       f"{row['max_live_over_rss_MiB']:.0f} | "
                       f"{row['residual_after_free_MiB']:.0f} | "
                       f"{row['residual_after_malloc_trim_MiB']:.0f} |")
    first = next(iter(results["allocator"].values()))
    if "error" not in first:
        out += ["", "Untouched pages (glibc default): " + ", ".join(
            f"{k}: +{first[k]:.0f} MiB" for k in
            ("np.empty 64MiB untouched", "np.zeros 64MiB untouched",
             "np.zeros 64MiB after writing"))]

    print("part 3: false pauses and true positives", file=sys.stderr)
    pipe: dict[str, Any] = {}
    for case in (*LOOPS, *TRUE_CASES):
        for mode in ("observe", "enforce"):
            if mode == "enforce" and case not in ("none", "hold 1GiB", "grow 10MiB/step",
                                                  "temp 500MiB every 10 steps",
                                                  TRUE_CASES[1]):
                continue
            pipe[f"{case} | {mode}"] = run_child(["pipe", case, mode, *extra])
    results["pipeline"] = pipe
    out += ["", "## 3. Backstop vs a training loop (budget 256 MiB, bound 345.6 MiB; "
            "sampled every 2 ms)", "",
            "| training loop / case | mode | steps/s | stalled s | % samples paused | "
            "% false pauses | pause episodes | max booked | max growth | max true | "
            "unaccounted median / max | detect delay ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for key, row in pipe.items():
        case, mode = key.split(" | ")
        if "error" in row:
            out.append(f"| {case} | {mode} | ERROR {row['error'][-300:]!r} |")
            continue
        out.append(
            f"| {case} | {mode} | {row['steps_per_s']:.1f} | {row['stalled_s']:.2f} | "
            f"{row['pct_samples_paused']:.0f} | {row['pct_samples_false_pause']:.0f} | "
            f"{row['pause_episodes']} | {row['max_booked_MiB']:.0f} | "
            f"{row['max_growth_MiB']:.0f} | {row['max_true_MiB']:.0f} | "
            f"{row['unaccounted_median_MiB']:.0f} / {row['unaccounted_max_MiB']:.0f} | "
            f"{fmt(row['detect_delay_ms'], 0)} |")

    print("part 4: attribution", file=sys.stderr)
    attr = run_child(["attr", *extra])
    results["attribution"] = attr
    out += ["", "## 4. Two iterators in one process (train + eval, 256 MiB each)", ""]
    if "error" in attr:
        out.append(f"ERROR {attr['error'][-500:]!r}")
    else:
        tr = attr["train"]
        out += [
            "| figure | MiB |", "|---|---:|",
            f"| train: growth since its start, max | {tr['max_growth_MiB']:.0f} |",
            f"| train: own booked, max | {tr['max_booked_MiB']:.0f} |",
            f"| train: % samples its backstop would pause | {tr['pct_samples_paused']:.0f}% |",
            "| train: growth - own booked (per-iterator 'unaccounted'), median / max | "
            f"{attr['train_own_unaccounted_median_MiB']:.0f} / "
            f"{attr['train_own_unaccounted_max_MiB']:.0f} |",
            "| growth - booked of all live iterators (process-wide), median / max | "
            f"{attr['process_unaccounted_median_MiB']:.0f} / "
            f"{attr['process_unaccounted_max_MiB']:.0f} |",
            "| eval: growth - own booked, lowest median over eval runs | "
            f"{attr['eval_growth_minus_booked_min_median_MiB']:.0f} |",
        ]
    results["seconds"] = time.perf_counter() - started
    text = "\n".join([f"Machine: {results['machine']}; {results['seconds']:.0f} s.", "", *out])
    print(text)
    path = ROOT / "benchmarks" / "results" / ("backstop-quick.json" if args.quick
                                               else "backstop.json")
    path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
