"""What naming an element's origin in errors costs the fast path: before vs after.

    python benchmarks/bench_origin.py --before /work/main/src --after src [--rounds 5]

Each side runs in its own fresh interpreter with ``PYTHONPATH`` set to one source tree
(the code before the change and after it), alternating sides round by round so that
machine load hits both alike; the parent prints medians of the CPU time per element
(``time.process_time``: user+system of all the process's threads) and of the wall-clock rate, and
writes ``results/origin.md``. The scenarios are the paths that pay per element: a
parallel map records one origin per element it pulls (a sequential map pays nothing
until its function raises).

1. ``TFRecordDataset`` of 200,000 records of 100 bytes -> ``map(len, 2 threads)``
2. the same -> ``map(len)`` (sequential)
3. the same with ``shuffle(1000)`` before the map (its buffer keeps a token per element)
4. ``from_tensor_slices`` of 200,000 rows -> ``shuffle`` -> ``map(2 threads)``
   (an index-gathering source: the origin is the row's index)
5. ``TFRecordDataset -> prefetch(64) -> map(len)``, sequential and on 2 threads (the
   read-ahead thread takes a token per element and hands it out with it)
6. the same records in 4 files -> ``interleave(cycle_length=2, num_parallel_calls=2)``
   -> ``map(len)`` (each slot's read-ahead keeps tokens)
7. ``TFRecordDataset -> shuffle(1000) -> batch(64) -> unbatch -> map(len)`` (the batch
   keeps its rows' tokens, the unbatch one per batch)
8. ``TFRecordDataset -> prefetch(64) -> batch(64)``: nothing asks for origins, so
   nothing may be paid
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORDS = 200_000
SCENARIOS = {
    "tfrecord-map-threads": "TFRecordDataset -> map(len, num_parallel_calls=2)",
    "tfrecord-map-seq": "TFRecordDataset -> map(len)",
    "tfrecord-shuffle-map-seq": "TFRecordDataset -> shuffle(1000) -> map(len)",
    "slices-shuffle-map-threads": "from_tensor_slices -> shuffle -> map(2 threads)",
    "tfrecord-prefetch-map-seq": "TFRecordDataset -> prefetch(64) -> map(len)",
    "tfrecord-prefetch-map-threads": "TFRecordDataset -> prefetch(64) -> map(len, 2 threads)",
    "interleave-threads-map-seq": "4 files -> interleave(2 threads) -> map(len)",
    "tfrecord-shuffle-batch-unbatch-map-seq":
        "TFRecordDataset -> shuffle(1000) -> batch(64) -> unbatch -> map(len)",
    "tfrecord-prefetch-batch-no-origins": "TFRecordDataset -> prefetch(64) -> batch(64) (no map)",
}
PARTS = 4


def child(scenario: str, path: str) -> dict[str, float]:
    import numpy as np

    import headrace as hr

    parallel = 2 if scenario.endswith("threads") else None
    if scenario.startswith("interleave"):
        parts = [f"{path}.part{i}" for i in range(PARTS)]
        ds = hr.Dataset.from_tensor_slices(parts).interleave(
            hr.TFRecordDataset, cycle_length=2, num_parallel_calls=2
        ).map(len, num_parallel_calls=parallel)
    elif scenario.startswith("tfrecord"):
        ds = hr.TFRecordDataset(path)
        if "shuffle" in scenario:
            ds = ds.shuffle(1000, seed=1)
        if "prefetch" in scenario:
            ds = ds.prefetch(64)
        if "batch" in scenario:
            ds = ds.batch(64)
        if "unbatch" in scenario:
            ds = ds.unbatch()
        if "no-origins" not in scenario:
            ds = ds.map(len, num_parallel_calls=parallel)
    else:
        ds = hr.Dataset.from_tensor_slices(np.arange(RECORDS)).shuffle(1000, seed=1).map(
            lambda x: x + 1, num_parallel_calls=2)
    count = 0
    for _ in ds.take(1000):  # warm-up: imports, thread start, chunk size
        pass
    before, started = time.process_time(), time.perf_counter()  # (every thread's CPU)
    for element in ds:
        count += len(element) if "no-origins" in scenario else 1
    wall = time.perf_counter() - started
    cpu = time.process_time() - before
    return {"us_cpu_per_element": 1e6 * cpu / count, "k_elements_per_s": count / wall / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", nargs=2)
    parser.add_argument("--only", nargs="*", help="scenario names (default: all)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    sys.path.insert(0, args.after)
    from headrace.io.tfrecord.writer import write_tfrecord

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.tfrecord")
        write_tfrecord(path, (b"r" * 100 for _ in range(RECORDS)))
        for part in range(PARTS):
            write_tfrecord(f"{path}.part{part}", (b"r" * 100 for _ in range(RECORDS // PARTS)))
        results: dict[str, dict[str, list[dict[str, float]]]] = {}
        for scenario in args.only or SCENARIOS:
            for _ in range(args.rounds):
                for side, tree in (("before", args.before), ("after", args.after)):
                    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
                    out = subprocess.run(
                        [sys.executable, __file__, "--before", args.before, "--after",
                         args.after, "--child", scenario, path],
                        env=env, capture_output=True, text=True, check=True,
                    ).stdout
                    results.setdefault(scenario, {}).setdefault(side, []).append(
                        json.loads(out.strip().splitlines()[-1]))
    lines = [
        "# Origin probing overhead (bench_origin.py)", "",
        f"`python benchmarks/bench_origin.py --before {args.before} --after {args.after} "
        f"--rounds {args.rounds}`; medians of {args.rounds} alternating runs; machine: "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end.", "",
        "| scenario | CPU us/element before | after | ratio | k elements/s before | after |",
        "|---|---|---|---|---|---|",
    ]
    for scenario, sides in results.items():
        med = {side: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for side, runs in sides.items()}
        b, a = med["before"], med["after"]
        lines.append(
            f"| {SCENARIOS[scenario]} | {b['us_cpu_per_element']:.2f} | "
            f"{a['us_cpu_per_element']:.2f} | "
            f"{a['us_cpu_per_element'] / b['us_cpu_per_element']:.3f} | "
            f"{b['k_elements_per_s']:.0f} | {a['k_elements_per_s']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(__file__).parent.joinpath("results", "origin.md").write_text(text)


if __name__ == "__main__":
    main()
