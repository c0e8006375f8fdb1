"""Issue 10, benchmark 2: TFRecord read + parse of ~200 B Examples across 2 processes.

    python benchmarks/bench_workers_tfrecord.py [--records N] [--repeats R]

The data is scenario 1 of bench_tfrecord.py (Examples of ``x``: 32 float32,
``y``: int64, ``id``: bytes, 16 files), written once by a child. Each side runs
in a fresh subprocess, the sides interleaved over ``--repeats`` rounds; the
median of the rounds is reported. Sides:

- ``headrace-2proc``: ``files.interleave(shard, cycle_length=2,
  num_parallel_calls=2, workers="processes")`` where ``shard(f)`` is
  ``TFRecordDataset(f).batch(1024).parse_examples(spec)``: two worker
  processes read and parse, batches come back through shared memory;
- ``headrace``: the same pipeline in this process (``TFRecordDataset(files)``);
- ``tf-parallel-reads``, ``tf-seq-map-autotune``: tf.data's best configurations
  of bench_tfrecord.py (``num_parallel_reads=AUTOTUNE``, parallel parse map,
  prefetch).

Because the machine is shared (other engineers' jobs run beside), CPU time per
record is reported beside wall clock: for headrace-2proc the consumer's CPU
plus its workers' (read from /proc before they stop); for tf.data its
process's CPU (all its threads). Results: benchmarks/results/workers-tfrecord.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SIDES = ("headrace-2proc", "headrace", "tf-parallel-reads", "tf-seq-map-autotune")
BATCH = 1024


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (from /proc; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shard(path: Any, spec: Any) -> Any:
    """One file's batches, parsed (module level: it is pickled to the workers)."""
    import headrace as hr

    return hr.TFRecordDataset(os.fsdecode(path)).batch(BATCH).parse_examples(spec)


def _workers_cpu(iterator: Any) -> dict[int, float]:
    return {p.pid: _cpu_of(p.pid) for w in iterator.stats().workers for p in w.processes}


def _first_batch(
    iterator: Any, numpy: Any = lambda y: y
) -> tuple[int, int, float, float, dict[int, float]]:
    """Take the first batch (warm-up), then start the clocks: its records and y-sum
    count in the checksum, not in the timing (the rates below leave them out)."""
    y = numpy(next(iterator)["y"])
    before = _workers_cpu(iterator) if hasattr(iterator, "stats") else {}
    return len(y), int(y.sum()), time.perf_counter(), time.process_time(), before


def run_side(side: str, directory: str) -> dict[str, Any]:
    from bench_tfrecord import _files, _small_spec

    files = _files(directory)
    records = total = 0
    worker_cpu = 0.0
    if side.startswith("headrace"):
        import numpy as np

        import headrace as hr

        spec = _small_spec("hr")
        if side == "headrace-2proc":
            ds = hr.Dataset.from_tensor_slices(np.array(files, dtype=object)).interleave(
                functools.partial(shard, spec=spec), cycle_length=2, num_parallel_calls=2,
                workers="processes",
            )
        else:
            ds = hr.TFRecordDataset(files).batch(BATCH).parse_examples(spec)
        with iter(ds) as iterator:
            # the first batch (not timed) starts the workers: imports, forkserver
            records, total, started, cpu, before = _first_batch(iterator)
            for batch in iterator:
                records += len(batch["y"])
                total += int(batch["y"].sum())
            after = _workers_cpu(iterator)
        worker_cpu = sum(after[pid] - before.get(pid, 0.0) for pid in after)
    else:
        import tensorflow as tf

        spec = _small_spec("tf")
        auto = tf.data.AUTOTUNE

        def parse(serialized: Any) -> Any:
            return tf.io.parse_example(serialized, spec)

        reads = auto if side == "tf-parallel-reads" else None
        ds = (
            tf.data.TFRecordDataset(files, num_parallel_reads=reads)
            .batch(BATCH)
            .map(parse, num_parallel_calls=auto)
            .prefetch(auto)
        )
        iterator = iter(ds)  # the first batch (not timed) traces the graph
        records, total, started, cpu, _ = _first_batch(iterator, lambda y: y.numpy())
        for batch in iterator:
            y = batch["y"].numpy()
            records += len(y)
            total += int(y.sum())
    wall = time.perf_counter() - started
    own_cpu = time.process_time() - cpu
    return {
        "side": side, "records": records, "y_sum": total, "wall_s": wall, "timed": records - BATCH,
        "cpu_s": own_cpu + worker_cpu, "worker_cpu_s": worker_cpu,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side")
    parser.add_argument("--dir")
    args = parser.parse_args()
    if args.side:  # a child: one side, one JSON line
        print(json.dumps(run_side(args.side, args.dir)))
        return 0
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src"), "TF_CPP_MIN_LOG_LEVEL": "3"}
    with tempfile.TemporaryDirectory() as tmp:
        gen = subprocess.run(
            [sys.executable, "-c",
             f"import sys, json; sys.path.insert(0, {str(HERE)!r}); "
             "from bench_tfrecord import _child_gen; "
             "print(json.dumps(_child_gen(json.loads(sys.argv[1]))))",
             json.dumps({"what": "small", "dir": tmp, "records": args.records})],
            env=env, capture_output=True, text=True, check=True,
        )
        data = json.loads(gen.stdout.strip().splitlines()[-1])
        rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for _ in range(args.repeats):
            for side in SIDES:
                done = subprocess.run(
                    [sys.executable, __file__, "--side", side, "--dir", tmp],
                    env=env, capture_output=True, text=True, check=False,
                )
                if done.returncode:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(done.stdout.strip().splitlines()[-1])
                assert (result["records"], result["y_sum"]) == (data["records"], data["y_sum"])
                rounds[side].append(result)
    load = os.getloadavg()
    lines = [
        "# Benchmark 2 of issue 10: TFRecord read + parse across 2 processes",
        "",
        f"{args.records:,} Examples of ~200 B in 16 files, batch {BATCH}; median of "
        f"{args.repeats} interleaved rounds, each side in a fresh process, timed after its "
        "first batch (worker start-up and graph tracing left out). "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load average at the end {load[0]:.1f} (a shared machine: other jobs ran beside). "
        f"Reproduce: `python benchmarks/bench_workers_tfrecord.py --records {args.records} "
        f"--repeats {args.repeats}`.",
        "",
        "| side | records/s (wall) | vs best tf.data | CPU us / record | vs best tf.data |",
        "|---|---|---|---|---|",
    ]
    med = {
        side: (
            statistics.median(r["timed"] / r["wall_s"] for r in results),
            statistics.median(r["cpu_s"] / r["timed"] * 1e6 for r in results),
        )
        for side, results in rounds.items()
    }
    best_tf = max((s for s in SIDES if s.startswith("tf")), key=lambda s: med[s][0])
    for side in SIDES:
        rate, cpu = med[side]
        lines.append(
            f"| {side} | {rate:,.0f} | {rate / med[best_tf][0]:.2f}x | {cpu:.2f} | "
            f"{med[best_tf][1] / cpu:.2f}x less |"
        )
    lines += [
        "",
        f"Best tf.data configuration: {best_tf}. Target (issue 10): headrace-2proc >= 5x "
        "tf.data's best records/s.",
        "",
    ]
    out = HERE / "results" / "workers-tfrecord.md"
    out.write_text("\n".join(lines))
    (HERE / "results" / "workers-tfrecord.json").write_text(json.dumps(rounds, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
