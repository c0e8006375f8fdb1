"""Writing Examples to TFRecord shards: headrace ``save_tfrecords`` vs TensorFlow.

200,000 Examples of ~200 bytes (``x``: 32 float32, ``y``: int64, ``id``: bytes) from NumPy
columns into 16 shards (contiguous blocks of 12,500), measured as records/s:

* tf: ``tf.train.Example(...).SerializeToString()`` per row + ``tf.io.TFRecordWriter``,
  the idiomatic TensorFlow loop (values passed as Python lists, its faster form);
* headrace: ``Dataset.from_tensor_slices(columns).save_tfrecords(dir, num_shards=16)``
  - one Example per element, *including* what TF does not do: fsync of every shard,
  atomic renames, and building the ``.hrx`` index of every shard;
* headrace-batched: the same from ``.batch(1024)`` with ``batched=True`` (round-robin).

Each side runs in its own fresh subprocess (imports and peak RSS do not mix), after a
small warm-up write. The machines are shared and noisy, so the sides alternate: each of
``--repeats`` rounds runs every side once, in a fresh process, and the best round counts. Peak RSS is the process's ``ru_maxrss``
(imports included); "growth" is anonymous+shared memory above the level after the data
was loaded (G1's measure in docs/guarantees.md, sampled every 5 ms).

    python benchmarks/bench_tfrecord_write.py [--records N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import MemorySampler

SHARDS = 16
MODES = ("tf", "headrace", "headrace-batched")


def make_columns(records: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    ids = np.empty(records, dtype=object)
    ids[:] = [b"id-%08d" % i for i in range(records)]
    return {
        "x": rng.random((records, 32), dtype=np.float32),
        "y": rng.integers(0, 1000, records),
        "id": ids,
    }


def write_tf(columns: dict[str, Any], directory: str) -> None:
    import tensorflow as tf

    os.makedirs(directory, exist_ok=True)
    x, y, ids = columns["x"], columns["y"].tolist(), columns["id"]
    records = len(y)
    for shard in range(SHARDS):
        start, stop = shard * records // SHARDS, (shard + 1) * records // SHARDS
        path = os.path.join(directory, f"part-{shard:05d}-of-{SHARDS:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(start, stop):
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(
                                float_list=tf.train.FloatList(value=x[i].tolist())
                            ),
                            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                            "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[ids[i]])),
                        }
                    )
                )
                writer.write(example.SerializeToString())


def write_headrace(columns: dict[str, Any], directory: str) -> None:
    import headrace as hr

    hr.Dataset.from_tensor_slices(columns).save_tfrecords(
        directory, num_shards=SHARDS, progress=False
    )


def write_headrace_batched(columns: dict[str, Any], directory: str) -> None:
    import headrace as hr
    from headrace._persist.writers import save_tfrecords

    dataset = hr.Dataset.from_tensor_slices(columns).batch(1024)
    save_tfrecords(dataset, directory, num_shards=SHARDS, progress=False, batched=True)


WRITERS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "tf": write_tf,
    "headrace": write_headrace,
    "headrace-batched": write_headrace_batched,
}


def child(mode: str, data_path: str, repeats: int) -> None:
    with np.load(data_path, allow_pickle=True) as archive:
        columns = {key: archive[key] for key in archive.files}
    write = WRITERS[mode]
    scratch = tempfile.mkdtemp(prefix=f"bench-write-{mode}-")
    try:
        write({key: value[:1000] for key, value in columns.items()}, scratch)  # warm-up
        shutil.rmtree(scratch)
        timings = []
        with MemorySampler() as sampler:
            for _ in range(repeats):
                start = time.perf_counter()
                write(columns, scratch)
                timings.append(time.perf_counter() - start)
                on_disk = sum(
                    e.stat().st_size for e in os.scandir(scratch) if e.name.endswith(".tfrecord")
                )
                shutil.rmtree(scratch)
            memory = sampler.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "records": len(columns["y"]),
                "best_s": min(timings),
                "timings": timings,
                "bytes_on_disk": on_disk,
                "peak_rss_mib": peak_kib / 1024,
                "growth_mib": memory["peak_growth"] / (1 << 20),
            }
        )
    )


def measure(mode: str, data_path: str, repeats: int) -> dict[str, Any]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    output = subprocess.run(
        [sys.executable, __file__, "--child", mode, data_path, "--repeats", str(repeats)],
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
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DATA"))
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.repeats)
        return 0
    with tempfile.TemporaryDirectory() as directory:
        data_path = os.path.join(directory, "columns.npz")
        np.savez(data_path, **make_columns(args.records))
        rounds = [
            {mode: measure(mode, data_path, 1) for mode in MODES} for _ in range(args.repeats)
        ]
    results = {}
    for mode in MODES:
        runs = [one[mode] for one in rounds]
        results[mode] = max(runs, key=lambda run: run["records_per_s"])
        results[mode]["peak_rss_mib"] = max(run["peak_rss_mib"] for run in runs)
        results[mode]["all_records_per_s"] = [round(run["records_per_s"]) for run in runs]
    baseline = results["tf"]["records_per_s"]
    print(f"{args.records:,} Examples -> {SHARDS} shards, best of {args.repeats} rounds")
    for mode, result in results.items():
        print(
            f"{mode:17s} {result['records_per_s'] / 1e3:8.1f} k records/s  "
            f"x{result['records_per_s'] / baseline:5.2f} vs tf  "
            f"{result['bytes_on_disk'] / result['records']:6.1f} B/record on disk  "
            f"peak RSS {result['peak_rss_mib']:7.1f} MiB  "
            f"growth {result['growth_mib']:6.1f} MiB  "
            f"(rounds: {', '.join(f'{r / 1e3:.0f}k' for r in result['all_records_per_s'])})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
