"""Sequential TFRecord read + batched Example parse: headrace vs tf.data.

Writes 200,000 Examples of ~200 bytes (``x``: 32 float32, ``y``: int64, ``id``: bytes)
into 16 files, then measures records/s for

* headrace: ``open_tfrecord(...).read_batch(1024)`` + ``parse_example`` (C extension),
* headrace-pure: the same with ``HEADRACE_PURE_PYTHON=1``,
* tf.data: ``TFRecordDataset(files).batch(1024).map(tf.io.parse_example)``,

each in its own fresh subprocess (so imports and peak RSS do not mix), after one warm-up
pass that also puts the files in the page cache. Prints ratios and peak RSS.

    python benchmarks/bench_tfrecord_parse.py [--records N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

FILES = 16
BATCH = 1024


def write_data(directory: str, records: int) -> list[str]:
    from headrace.io.example import serialize_example
    from headrace.io.tfrecord import TFRecordWriter

    rng = np.random.default_rng(0)
    paths = [os.path.join(directory, f"part-{i:02d}.tfrecord") for i in range(FILES)]
    per_file = records // FILES
    for file_index, path in enumerate(paths):
        with TFRecordWriter(path) as writer:
            writer.write_many(
                [
                    serialize_example(
                        {
                            "x": rng.random(32, dtype=np.float32),
                            "y": int(rng.integers(0, 1000)),
                            "id": b"id-%08d" % (file_index * per_file + i),
                        }
                    )
                    for i in range(per_file)
                ]
            )
    return paths


def run_headrace(paths: list[str]) -> int:
    from headrace.io.example import FixedLenFeature, parse_example
    from headrace.io.tfrecord import open_tfrecord

    spec = {
        "x": FixedLenFeature([32], np.float32),
        "y": FixedLenFeature([], np.int64),
        "id": FixedLenFeature([], bytes),
    }
    count = 0
    for path in paths:
        with open_tfrecord(path) as reader:
            while batch := reader.read_batch(BATCH):
                count += len(parse_example(batch, spec)["y"])
    return count


def run_tf(paths: list[str]) -> int:
    import tensorflow as tf

    spec = {
        "x": tf.io.FixedLenFeature([32], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
        "id": tf.io.FixedLenFeature([], tf.string),
    }
    dataset = (
        tf.data.TFRecordDataset(paths).batch(BATCH).map(lambda s: tf.io.parse_example(s, spec))
    )
    return sum(int(batch["y"].shape[0]) for batch in dataset)


def child(mode: str, directory: str, repeats: int) -> None:
    paths = sorted(os.path.join(directory, name) for name in os.listdir(directory))
    run = run_tf if mode == "tf" else run_headrace
    run(paths)  # warm-up: imports, page cache
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = run(paths)
        timings.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"records": count, "best_s": min(timings), "peak_rss_mib": peak_kib / 1024}))


def measure(mode: str, directory: str, repeats: int) -> dict[str, Any]:
    env = dict(os.environ, HEADRACE_PURE_PYTHON="1" if mode == "headrace-pure" else "0")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    output = subprocess.run(
        [sys.executable, __file__, "--child", mode, directory, "--repeats", str(repeats)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    result["records_per_s"] = result["records"] / result["best_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"))
    parser.add_argument("--skip-pure", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.repeats)
        return 0
    with tempfile.TemporaryDirectory() as directory:
        paths = write_data(directory, args.records)
        size = sum(os.path.getsize(path) for path in paths)
        print(f"{args.records} records, {size / args.records:.0f} B/record on disk, {FILES} files")
        modes = ["tf", "headrace"] + ([] if args.skip_pure else ["headrace-pure"])
        results = {mode: measure(mode, directory, args.repeats) for mode in modes}
    baseline = results["tf"]["records_per_s"]
    for mode, result in results.items():
        print(
            f"{mode:14s} {result['records_per_s'] / 1e6:6.3f} M records/s  "
            f"x{result['records_per_s'] / baseline:5.2f} vs tf.data  "
            f"peak RSS {result['peak_rss_mib']:7.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
