"""Per-record parsing, fused: ``map(parse_single_example).batch(n)`` vs the batched form.

    python benchmarks/bench_parse_fusion.py [--records 200000] [--repeats 5]

One file of small Examples (``label`` int64, ``x`` 32 float32, ``tags`` 0-7 int64 as a
VarLenFeature), read + batch(1024) + parse, by:

* headrace ``TFRecordDataset(f).map(lambda r: parse_single_example(r, spec)).batch(1024)``
  (the tf.data recipe, fused into one columnar parse per batch),
* headrace ``TFRecordDataset(f).batch(1024).parse_examples(spec)`` (the batched form),
* headrace's per-record map when fusion is defeated (FixedLen features only: an
  unfused batch of VarLen rows cannot stack),
* tf.data ``map(parse_single_example, AUTOTUNE).batch(1024)`` and
  ``batch(1024).map(parse_example, AUTOTUNE)``, in a child process (so TensorFlow's
  threads and memory stay out of headrace's runs).

headrace's variants run interleaved, ``--repeats`` times each, in one process; medians
are reported. Target: fused within 10% of the batched form (ratio >= 0.90). Writes
``benchmarks/results/parse_fusion.md``.
"""

from __future__ import annotations

import argparse
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

BATCH = 1024


def write_file(path: str, records: int) -> None:
    import numpy as np

    from headrace.io.example import encode_example_columns
    from headrace.io.tfrecord import write_tfrecord

    rng = np.random.default_rng(0)
    columns = {
        "label": rng.integers(0, 10, records),
        "x": rng.random((records, 32), dtype=np.float32),
        "tags": [rng.integers(0, 100, rng.integers(0, 8)) for _ in range(records)],
    }
    write_tfrecord(path, encode_example_columns(columns))


def headrace_runs(path: str, repeats: int) -> dict[str, float]:
    import numpy as np

    import headrace as hr
    from headrace.io import example as hx

    spec = {
        "label": hx.FixedLenFeature([], np.int64),
        "x": hx.FixedLenFeature([32], np.float32),
        "tags": hx.VarLenFeature(np.int64),
    }
    fixed = {"label": spec["label"], "x": spec["x"]}

    class Hidden:  # the same parse, out of fusion's sight
        def __call__(self, record: Any) -> Any:
            return getattr(hx, "parse_" + "single_example")(record, fixed)

    variants = {
        "fused map(parse_single_example).batch": lambda: hr.TFRecordDataset(path).map(
            lambda r: hx.parse_single_example(r, spec)).batch(BATCH),
        "batch.parse_examples": lambda: hr.TFRecordDataset(path).batch(BATCH).parse_examples(
            spec),
        "unfused per-record map (FixedLen only)": lambda: hr.TFRecordDataset(path).map(
            Hidden()).batch(BATCH),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(repeats):
        order = names[repeat % 2 :] + names[: repeat % 2]  # alternate who runs first
        for name in order:
            build = variants[name]
            if name.startswith("unfused") and len(times[name]) >= 2:
                continue  # slow and stable: two runs are enough
            dataset = build()
            start = time.perf_counter()
            count = sum(len(batch["label"]) for batch in dataset)
            times[name].append(time.perf_counter() - start)
            assert count > 0
    return {name: statistics.median(values) for name, values in times.items()}


def tf_runs(path: str, repeats: int) -> dict[str, float]:
    import tensorflow as tf

    spec = {
        "label": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([32], tf.float32),
        "tags": tf.io.VarLenFeature(tf.int64),
    }
    variants = {
        "tf.data map(parse_single_example, AUTOTUNE).batch": lambda: tf.data.TFRecordDataset(
            path).map(lambda r: tf.io.parse_single_example(r, spec), tf.data.AUTOTUNE).batch(
            BATCH),
        "tf.data batch.map(parse_example, AUTOTUNE)": lambda: tf.data.TFRecordDataset(
            path).batch(BATCH).map(lambda r: tf.io.parse_example(r, spec), tf.data.AUTOTUNE),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, build in variants.items():
            dataset = build()
            start = time.perf_counter()
            for _batch in dataset:
                pass
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child-tf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_tf:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        print(json.dumps(tf_runs(args.child_tf, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "records.tfrecord")
        write_file(path, args.records)
        ours = headrace_runs(path, args.repeats)
        child = subprocess.run(
            [sys.executable, __file__, "--child-tf", path, "--repeats", str(args.repeats)],
            capture_output=True, text=True, check=True,
        )
        theirs = json.loads(child.stdout.strip().splitlines()[-1])
    rows = {**ours, **theirs}
    batched = ours["batch.parse_examples"]
    ratio = batched / ours["fused map(parse_single_example).batch"]
    lines = [
        "# map(parse_single_example).batch: fused vs batched parse, and tf.data",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; {args.records:,} records, batch {BATCH}, "
        f"median of {args.repeats} runs (tf.data in a child process).",
        f"Command: `python benchmarks/bench_parse_fusion.py --records {args.records} "
        f"--repeats {args.repeats}`",
        "",
        "| pipeline | records/s | vs headrace batch.parse_examples |",
        "|---|---:|---:|",
    ]
    for name, seconds in rows.items():
        lines.append(f"| {name} | {args.records / seconds:,.0f} | {batched / seconds:.2f}x |")
    verdict = "PASS" if ratio >= 0.90 else "FAIL"
    lines += ["", f"Target: fused >= 0.90x of batch.parse_examples: {ratio:.2f}x — {verdict}"]
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(__file__).resolve().parent / "results" / "parse_fusion.md"
    out.write_text(report)


if __name__ == "__main__":
    main()
