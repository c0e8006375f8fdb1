"""headrace's own cost per element and per batch, stage by stage, against plain Python/NumPy.

Usage::

    .venv/bin/python benchmarks/bench_overhead.py            # ~1-2 min
    .venv/bin/python benchmarks/bench_overhead.py --quick    # ~20 s, smaller data
    .venv/bin/python benchmarks/bench_overhead.py --src ../other-tree/src   # another headrace
    .venv/bin/python benchmarks/bench_overhead.py --profile  # + where the batch path's time goes

Every stage runs twice in the *same* process, one pass after the other: the headrace
pipeline, and a plain loop that does the same work without headrace (slicing an array,
calling the map function, iterating a generator, reading records with ``struct``).
Passes alternate (headrace, loop, headrace, loop, ...) so a burst of load from other jobs
on the shared machine hits both; each side's **best** pass is its rate, and

    overhead per unit = (best headrace pass - best loop pass) / units

in µs per element for element-wise stages and µs per batch for batched ones: what headrace
adds, whatever the work costs. The median-based figure is shown beside it; when the two
disagree much, the machine was busy — re-run. A headrace pass includes ``iter(dataset)``
(building the iterator tree), as a user's epoch does.

Unlike ``bench_core.py`` this does not spawn a process per side: both sides of a stage
share the interpreter, the allocator and the data, which is what makes a difference of a
few µs measurable. It measures no memory (``bench_core.py`` does).

``--src PATH`` puts ``PATH`` first on ``sys.path`` before ``headrace`` is imported, so two
source trees can be compared with the same script and data; the results page records
which tree ran (git HEAD and a hash of its sources).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import _harness

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Stage:
    """One row of the table: a headrace pass and a baseline pass over the same work."""

    name: str
    unit: str  # "element" or "batch"
    units: int  # elements or batches per pass
    rows: int  # rows (elements of the source) per pass, for the rows/s columns
    headrace: Callable[[], Any]
    baseline: Callable[[], Any]
    baseline_label: str
    hr_times: list[float] = field(default_factory=list)
    base_times: list[float] = field(default_factory=list)
    check: str = ""


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run_stage(stage: Stage, passes: int) -> None:
    """Alternate headrace and baseline passes; check both computed the same thing."""
    _timed(stage.headrace)  # warm-up: imports, first-touch of pages, caches
    _timed(stage.baseline)
    for _ in range(passes):
        gc.collect()
        t_hr, out_hr = _timed(stage.headrace)
        gc.collect()
        t_base, out_base = _timed(stage.baseline)
        stage.hr_times.append(t_hr)
        stage.base_times.append(t_base)
    if out_hr != out_base:
        stage.check = f"MISMATCH: headrace {out_hr!r} vs baseline {out_base!r}"


def _overhead_us(stage: Stage, pick: Callable[[list[float]], float]) -> float:
    return (pick(stage.hr_times) - pick(stage.base_times)) / stage.units * 1e6


def _rate(rows: int, seconds: float) -> str:
    per_s = rows / seconds
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f} M/s"
    return f"{per_s / 1e3:.1f} k/s"


# --------------------------------------------------------------------------- the stages


def build_stages(hr: Any, quick: bool, tmpdir: str) -> list[Stage]:
    """Every stage of the table, with data scaled to ``quick`` or a full run."""
    Dataset = hr.Dataset
    stages: list[Stage] = []
    batch = 1024

    # -- batched array paths: one slice (or one gather) per batch -----------------------
    rows_big = (1 << 18) if quick else (1 << 21)  # x 512 B = 128 MiB / 1 GiB
    big = np.empty((rows_big, 512), dtype=np.uint8)
    big[:] = np.arange(512, dtype=np.uint8)  # touch every page (anonymous, resident)
    big[:, 0] = np.arange(rows_big) % 251
    n_batches = -(-rows_big // batch)

    def consume_col(batches: Any) -> int:
        total = 0
        for b in batches:
            total += int(b[:, 0].sum())  # touches one byte per row (one column)
        return total

    def numpy_slices() -> Iterator[np.ndarray[Any, Any]]:
        for i in range(0, rows_big, batch):
            yield big[i : i + batch]

    def numpy_slice_loop() -> int:
        total = 0
        for i in range(0, rows_big, batch):
            total += int(big[i : i + batch][:, 0].sum())
        return total

    stages.append(
        Stage(
            f"from_tensor_slices(uint8 {big.nbytes >> 20} MiB).batch({batch})",
            "batch",
            n_batches,
            rows_big,
            lambda: consume_col(Dataset.from_tensor_slices(big).batch(batch)),
            numpy_slice_loop,
            "for i in range(0, n, 1024): X[i:i+1024]",
        )
    )
    rows_f = rows_big // 4 if not quick else rows_big
    bigf = np.ones((rows_f, 128), dtype=np.float32)
    bigf[:, 0] = np.arange(rows_f) % 251
    n_batches_f = -(-rows_f // batch)

    def numpy_slice_loop_f() -> float:
        total = 0.0
        for i in range(0, rows_f, batch):
            total += float(bigf[i : i + batch][:, 0].sum())
        return total

    def consume_col_f(batches: Any) -> float:
        total = 0.0
        for b in batches:
            total += float(b[:, 0].sum())
        return total

    stages.append(
        Stage(
            f"from_tensor_slices({{'x': float32 {bigf.nbytes >> 20} MiB, 'y': int64}})"
            f".batch({batch})",
            "batch",
            n_batches_f,
            rows_f,
            lambda: consume_col_f(
                b["x"]
                for b in Dataset.from_tensor_slices({"x": bigf, "y": np.arange(rows_f)}).batch(
                    batch
                )
            ),
            numpy_slice_loop_f,
            "dict of X[i:i+1024] slices per batch (x only consumed)",
        )
    )
    stages.append(
        Stage(
            f"from_tensor_slices(uint8).batch({batch}).prefetch(2)",
            "batch",
            n_batches,
            rows_big,
            lambda: consume_col(Dataset.from_tensor_slices(big).batch(batch).prefetch(2)),
            numpy_slice_loop,
            "for i in range(0, n, 1024): X[i:i+1024]",
        )
    )
    rows_sh = rows_big // 4  # a gather copies every row: keep a pass short
    small_big = big[:rows_sh]
    n_batches_sh = -(-rows_sh // batch)

    def numpy_gather_loop() -> int:
        perm = np.random.default_rng(1).permutation(rows_sh)
        total = 0
        for i in range(0, rows_sh, batch):
            total += int(small_big[perm[i : i + batch]][:, 0].sum())
        return total

    stages.append(
        Stage(
            f"from_tensor_slices(uint8 {small_big.nbytes >> 20} MiB).shuffle(n).batch({batch})",
            "batch",
            n_batches_sh,
            rows_sh,
            lambda: consume_col(
                Dataset.from_tensor_slices(small_big).shuffle(rows_sh, seed=1).batch(batch)
            ),
            numpy_gather_loop,
            "X[perm[i:i+1024]] (permutation + gather)",
        )
    )
    rows_1m = (1 << 18) if quick else (1 << 20)
    n_elem_batches = -(-rows_1m // batch)

    def range_batches() -> int:
        total = 0
        for b in Dataset.range(rows_1m).batch(batch):
            total += int(b[-1])
        return total

    def numpy_range_batches() -> int:
        total = 0
        for i in range(0, rows_1m, batch):
            total += int(np.arange(i, min(i + batch, rows_1m), dtype=np.int64)[-1])
        return total

    stages.append(
        Stage(
            f"range(n).batch({batch})",
            "batch",
            n_elem_batches,
            rows_1m,
            range_batches,
            numpy_range_batches,
            "np.arange(i, i+1024)",
        )
    )

    # -- element-wise stages: small elements ----------------------------------------------
    n_el = 48 * 1024 if quick else 192 * 1024  # multiples of 64 and 1024 (blocks, inners)
    rows64 = np.zeros((n_el, 64), dtype=np.uint8)
    rows64[:, 0] = np.arange(n_el) % 251

    def fn(x: Any) -> Any:
        return x + 1

    def pred(x: Any) -> bool:
        return bool(x % 3 == 0)

    def hr_sum(ds: Any) -> int:
        total = 0
        for x in ds:
            total += int(x)
        return total

    def hr_sum_rows(ds: Any) -> int:
        total = 0
        for row in ds:
            total += int(row[0])
        return total

    def loop_range(work: Callable[[Any], Any] = lambda x: x) -> Callable[[], int]:
        def run() -> int:
            total = 0
            for i in range(n_el):
                total += int(work(np.int64(i)))
            return total

        return run

    def loop_rows() -> int:
        total = 0
        for i in range(n_el):
            total += int(rows64[i][0])
        return total

    element_stages: list[tuple[str, Callable[[], Any], Callable[[], Any], str]] = [
        ("range(n) (elements)", lambda: hr_sum(Dataset.range(n_el)), loop_range(),
         "for i in range(n): np.int64(i)"),
        ("from_tensor_slices(64 B rows) (elements)",
         lambda: hr_sum_rows(Dataset.from_tensor_slices(rows64)), loop_rows,
         "for i in range(n): X[i]"),
        ("range(n).map(fn)", lambda: hr_sum(Dataset.range(n_el).map(fn)), loop_range(fn),
         "fn(np.int64(i))"),
        ("range(n).map(fn, num_parallel_calls=2)",
         lambda: hr_sum(Dataset.range(n_el).map(fn, num_parallel_calls=2)), loop_range(fn),
         "fn(np.int64(i))"),
    ]

    def loop_filter() -> int:
        total = 0
        for i in range(n_el):
            x = np.int64(i)
            if pred(x):
                total += int(x)
        return total

    element_stages.append(
        ("range(n).filter(pred)", lambda: hr_sum(Dataset.range(n_el).filter(pred)), loop_filter,
         "if pred(np.int64(i))")
    )
    element_stages.append(
        ("range(10 n).take(n)", lambda: hr_sum(Dataset.range(10 * n_el).take(n_el)),
         loop_range(), "for i in range(n): np.int64(i)")
    )
    element_stages.append(
        ("from_tensor_slices(64 B rows).prefetch(2)",
         lambda: hr_sum_rows(Dataset.from_tensor_slices(rows64).prefetch(2)), loop_rows,
         "for i in range(n): X[i]")
    )
    element_stages.append(
        ("range(n).map(fn).prefetch(2)",
         lambda: hr_sum(Dataset.range(n_el).map(fn).prefetch(2)), loop_range(fn),
         "fn(np.int64(i))")
    )
    blocks = rows64.reshape(n_el // 64, 64, 64)

    def loop_unbatch() -> int:
        total = 0
        for block in blocks:
            for row in block:
                total += int(row[0])
        return total

    element_stages.append(
        ("from_tensor_slices(64x64 B blocks).unbatch()",
         lambda: hr_sum_rows(Dataset.from_tensor_slices(blocks).unbatch()), loop_unbatch,
         "for b in blocks: for row in b")
    )

    def gen() -> Iterator[np.ndarray[Any, Any]]:
        for i in range(n_el):
            yield rows64[i]

    spec = hr.TensorSpec((64,), np.uint8)

    def loop_gen() -> int:
        total = 0
        for row in gen():
            total += int(row[0])
        return total

    element_stages.append(
        ("from_generator(64 B rows)",
         lambda: hr_sum_rows(Dataset.from_generator(gen, output_signature=spec)), loop_gen,
         "for row in gen()")
    )
    cycle, per_inner = 4, 1024
    n_inner = n_el // per_inner

    def hr_interleave() -> int:
        ds = Dataset.range(n_inner).interleave(
            lambda i: Dataset.range(i * per_inner, (i + 1) * per_inner), cycle_length=cycle
        )
        return hr_sum(ds)

    def loop_interleave() -> int:
        total = 0
        outer = iter(range(n_inner))
        slots: list[Iterator[int] | None] = [None] * cycle
        for k in range(cycle):
            i = next(outer, None)
            slots[k] = None if i is None else iter(range(i * per_inner, (i + 1) * per_inner))
        active = sum(s is not None for s in slots)
        while active:
            for k in range(cycle):
                it = slots[k]
                if it is None:
                    continue
                x = next(it, None)
                if x is None:
                    i = next(outer, None)
                    if i is None:
                        slots[k] = None
                        active -= 1
                        continue
                    it = slots[k] = iter(range(i * per_inner, (i + 1) * per_inner))
                    x = next(it)
                total += int(np.int64(x))
        return total

    element_stages.append(
        (f"range({n_inner}).interleave(range({per_inner}), cycle_length={cycle})",
         hr_interleave, loop_interleave, "round-robin over Python iterators")
    )

    # -- TFRecord small records -----------------------------------------------------------
    from headrace.io.tfrecord import write_tfrecord

    n_rec = n_el
    records = [bytes([i % 251]) * 100 for i in range(n_rec)]
    path = os.path.join(tmpdir, "small.tfrecord")
    write_tfrecord(path, records)

    def hr_records() -> int:
        total = 0
        for record in hr.TFRecordDataset(path):
            total += record[0]
        return total

    def loop_records() -> int:
        total = 0
        with open(path, "rb") as file:
            data = file.read()
        offset, end, unpack = 0, len(data), struct.unpack_from
        while offset < end:
            (length,) = unpack("<Q", data, offset)
            record = data[offset + 12 : offset + 12 + length]
            offset += 16 + length
            total += record[0]
        return total

    element_stages.append(
        (f"TFRecordDataset({n_rec} x 100 B records)", hr_records, loop_records,
         "read file, struct.unpack lengths, slice (no CRC)")
    )

    def hr_record_batches() -> int:
        total = 0
        for b in hr.TFRecordDataset(path).batch(batch):
            total += len(b)
        return total

    def loop_record_batches() -> int:
        total = 0
        with open(path, "rb") as file:
            data = file.read()
        offset, end, unpack = 0, len(data), struct.unpack_from
        while offset < end:
            out = []
            while offset < end and len(out) < batch:
                (length,) = unpack("<Q", data, offset)
                out.append(data[offset + 12 : offset + 12 + length])
                offset += 16 + length
            arr = np.empty(len(out), dtype=object)
            arr[:] = out
            total += len(arr)
        return total

    for name, hr_fn, base_fn, label in element_stages:
        stages.append(Stage(name, "element", n_el, n_el, hr_fn, base_fn, label))
    # filter keeps a third: its per-element figure is per *input* element (n_el)
    stages.append(
        Stage(
            f"TFRecordDataset({n_rec} x 100 B).batch({batch})",
            "batch",
            -(-n_rec // batch),
            n_rec,
            hr_record_batches,
            loop_record_batches,
            "struct.unpack loop into object arrays of 1024 (no CRC)",
        )
    )
    return stages


# --------------------------------------------------------------------------- the batch-path profile


def profile_batch_path(hr: Any, quick: bool) -> list[str]:
    """Where ``from_tensor_slices(X).batch(1024)``'s per-batch time goes, function by function.

    Two views: cProfile's per-call times of the functions on the path (inflated by the
    profiler's own per-call cost, useful for *which* functions and how many calls per
    batch), and a direct timing of each step with everything else held fixed (timeit,
    best of 5), which is what the µs figures in the results page are.
    """
    import cProfile
    import pstats
    import timeit

    rows = (1 << 17) if quick else (1 << 20)
    x = np.zeros((rows, 512), dtype=np.uint8)
    nb = rows // 1024
    lines = ["## Profile of `from_tensor_slices(X).batch(1024)`", ""]

    def epoch() -> None:
        for b in hr.Dataset.from_tensor_slices(x).batch(1024):
            b[0, 0]

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        epoch()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats_rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "headrace" not in file:
            continue
        short = file.split("headrace/", 1)[-1]
        stats_rows.append((tt, ct, nc, f"{short}:{line} {func}"))
    stats_rows.sort(reverse=True)
    lines += [
        f"cProfile, 5 epochs of {nb} batches (profiler overhead included; the ratio of calls "
        "to batches says how often each runs):",
        "",
        _harness.md_table(
            ["function", "calls / batch", "own µs / batch", "cumulative µs / batch"],
            [
                (name, f"{nc / (5 * nb):.2f}", f"{tt / (5 * nb) * 1e6:.2f}",
                 f"{ct / (5 * nb) * 1e6:.2f}")
                for tt, ct, nc, name in stats_rows[:20]
            ],
        ),
        "",
    ]

    # direct timings of each step of one batch (no profiler)
    from headrace._memory.buffer import NO_RESERVATION

    it = iter(hr.Dataset.from_tensor_slices(x).repeat().batch(1024))
    tree = it._tree
    steps: list[tuple[str, str, dict[str, Any]]] = [
        ("whole DatasetIterator.__next__", "nx(it)", {"nx": next, "it": it}),
        ("  tree.next_reserved() (all below the root)", "f()", {"f": tree.next_reserved}),
    ]
    inner = getattr(tree, "inner", None)
    if inner is not None:
        steps.append(("    next(GatherBatchIterator) (indices + slice)", "nx(g)",
                      {"nx": next, "g": inner}))
    ctx = it.context
    b = next(it)
    steps += [
        ("    ctx.sizeof(batch) (cost of the view)", "f(b)", {"f": ctx.sizeof, "b": b}),
        ("  NO_RESERVATION.release()", "r.release()", {"r": NO_RESERVATION}),
        ("  time.perf_counter() (x2 per next)", "f()", {"f": time.perf_counter}),
        ("X[i:i+1024] (the NumPy slice itself)", "x[0:1024]", {"x": x}),
    ]
    number = 20_000 if quick else 100_000
    measured = []
    for label, stmt, env in steps:
        best = min(timeit.repeat(stmt, number=number, repeat=5, globals=env))
        measured.append((label, f"{best / number * 1e6:.3f}"))
    lines += [
        "Direct timings (timeit, best of 5, no profiler), µs per call on a `repeat()`ed "
        "pipeline (so no epoch boundary):",
        "",
        _harness.md_table(["step", "µs"], measured),
        "",
    ]
    return lines


# --------------------------------------------------------------------------- main


def _stats_on(hr: Any, mode: str) -> None:
    """Make every ``iter(dataset)`` of the passes run with a sampler (and probes, for
    ``profile``), as a user leaving stats on would."""
    from headrace.profiling.probe import Instrumenter
    from headrace.profiling.timeline import Sampler

    plain_iter = hr.Dataset.__iter__

    def with_stats(dataset: Any) -> Any:
        instrumenter = None
        if mode == "profile":
            instrumenter = Instrumenter(dataset.node)
            instrumenter.attach()
            instrumenter.expect_run()
        try:
            iterator = plain_iter(dataset)
        finally:
            if instrumenter is not None:
                instrumenter.detach()
        sampler = Sampler(instrumenter, interval=0.05)
        sampler.watch(iterator)
        sampler.start()
        return iterator  # the sampler stops itself once the iterator is gone

    hr.Dataset.__iter__ = with_stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", help="import headrace from this source tree (put first on sys.path)")
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer passes")
    parser.add_argument("--passes", type=int, default=None, help="timed passes per side")
    parser.add_argument("--only", default="", help="comma-separated substrings of stage names")
    parser.add_argument("--profile", action="store_true", help="add the batch-path profile")
    parser.add_argument("--out", default=None, help="results stem (default overhead[-quick])")
    parser.add_argument(
        "--stats", choices=["off", "monitor", "profile"], default="off",
        help="run every headrace pass with stats on: 'monitor' samples over time (no "
        "per-element cost), 'profile' also counts and times every pull of every stage",
    )
    args = parser.parse_args(argv)
    src = Path(args.src).resolve() if args.src else REPO / "src"
    sys.path.insert(0, str(src))
    import headrace as hr

    if args.stats != "off":
        _stats_on(hr, args.stats)

    started = time.perf_counter()
    passes = args.passes or (3 if args.quick else 7)
    info = _harness.machine_info(sys.executable)
    info["headrace_source"] = {"path": str(src), **_harness.source_fingerprint(src / "headrace")}
    info["stats"] = args.stats
    info["headrace_imported_from"] = os.path.dirname(hr.__file__)
    with tempfile.TemporaryDirectory(prefix="hr-overhead-") as tmpdir:
        stages = build_stages(hr, args.quick, tmpdir)
        wanted = [part for part in args.only.split(",") if part]
        if wanted:
            stages = [s for s in stages if any(part in s.name for part in wanted)]
        for stage in stages:
            print(f"  {stage.name} ...", file=sys.stderr, flush=True)
            try:
                run_stage(stage, passes)
            except Exception as exc:  # one broken stage must not lose the others
                stage.check = f"ERROR {type(exc).__name__}: {exc}"
    rows = []
    for s in stages:
        if not s.hr_times:
            rows.append((s.name, "—", "—", "—", "—", "—", s.check))
            continue
        unit = "µs/batch" if s.unit == "batch" else "µs/element"
        rows.append(
            (
                s.name,
                _rate(s.rows, min(s.hr_times)),
                _rate(s.rows, min(s.base_times)),
                f"{_overhead_us(s, min):.2f} {unit}",
                f"{_overhead_us(s, statistics.median):.2f}",
                s.baseline_label,
                s.check
                or ("headrace faster than this baseline" if _overhead_us(s, min) < 0 else ""),
            )
        )
    title = "headrace overhead per element and per batch"
    sections = [
        f"# {title}",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; `bench_overhead.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`; {passes} timed passes per "
        "side, alternating. Rates are rows (source elements) per second of the best pass; "
        "overhead = (best headrace pass - best baseline pass) / units; the median column "
        "uses median passes.",
        "",
        "## Machine",
        "",
        "\n".join(f"- **{key}**: {value}" for key, value in info.items()),
        "",
        "## Overhead by stage",
        "",
        _harness.md_table(
            ["stage", "headrace rows/s", "baseline rows/s", "overhead (best)",
             "overhead (median)", "baseline", "notes"],
            rows,
        ),
        "",
    ]
    if args.profile:
        sections += profile_batch_path(hr, args.quick)
    notes = RESULTS / "overhead-analysis.md"  # hand-written: where the time goes, what changed
    if notes.exists() and not args.quick:
        sections += [notes.read_text().rstrip(), ""]
    total = time.perf_counter() - started
    sections.append(
        f"Total wall time: {total:.0f} s; 1-min load average at start "
        f"{info['loadavg_1min_at_start']}, at end {_harness.loadavg()} "
        f"({os.cpu_count()} cores; above that, other jobs shared the CPUs)."
    )
    markdown = "\n".join(sections) + "\n"
    print(markdown)
    stem = args.out or ("overhead-quick" if args.quick else "overhead")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(markdown)
    raw = {
        "machine": info,
        "passes": passes,
        "stages": [
            {
                "name": s.name,
                "unit": s.unit,
                "units": s.units,
                "rows": s.rows,
                "headrace_s": s.hr_times,
                "baseline_s": s.base_times,
                "baseline": s.baseline_label,
                "check": s.check,
            }
            for s in stages
        ],
        "total_s": total,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    print(f"wrote {RESULTS / (stem + '.md')} and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
