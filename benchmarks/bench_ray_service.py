"""headrace.ray.DataService vs Ray Data on the same cluster and TFRecord files.

Side by side in one run, on a local 2-node Ray cluster (``ray.cluster_utils.Cluster``,
one CPU per node): TFRecord files of ``tf.train.Example`` records (a 64-float
feature and a label), read, parsed, transformed (x * 2 + 1) and delivered to one
consumer in batches of 256 rows, by

* ``headrace``: ``DataService(TFRecordDataset(files).batch(256).parse_examples(...)
  .map(...), num_workers=2)`` and its consumer, and
* ``ray_data``: ``ray.data.read_tfrecords(files).map_batches(...).iter_batches(256)``.

Reported: rows/s (best of ``--repeats``), and the peak resident memory of each node's
Ray processes (its raylet's worker processes, sampled every 50 ms; the object store's
shared memory counts where a worker maps it) and of the driver; ratios headrace /
Ray Data. Usage: ``python benchmarks/bench_ray_service.py [--files 8] [--records 4000]``;
results go to ``benchmarks/results/ray_service.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import headrace as hr
from headrace._persist.writers import save_tfrecords
from headrace.io.example import FixedLenFeature

BATCH = 256
WIDTH = 64


def write_files(folder: str, files: int, records: int) -> list[str]:
    paths = []
    for f in range(files):
        rows = hr.Dataset.range(records).map(lambda i, f=f: {
            "x": np.full(WIDTH, float(i % 97), np.float32), "y": np.int64(f * records + i)})
        (written,) = save_tfrecords(rows, os.path.join(folder, f"d{f}"), num_shards=1,
                                    progress=False)
        paths.append(written)
    return paths


def transform(batch: dict[str, Any]) -> dict[str, Any]:
    x = batch["x"]
    if x.dtype == object:  # Ray Data's read_tfrecords gives a list feature as arrays
        x = np.stack(x)
    return {"x": np.asarray(x, np.float32) * 2 + 1, "y": np.asarray(batch["y"])}


class Sampler:
    """Peak RSS per raylet (its worker processes) and of this driver."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self.driver = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            for proc in psutil.process_iter(["name"]):
                if proc.info["name"] != "raylet":
                    continue
                total = 0
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        total += child.memory_info().rss
                self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), total)
            self.driver = max(self.driver, me.memory_info().rss)
            time.sleep(0.05)

    def close(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join()
        return {"node_max": max(self.peaks.values(), default=0), "driver": self.driver}


def run_headrace(paths: list[str]) -> tuple[float, int]:
    from headrace.ray import DataService

    features = {"x": FixedLenFeature((WIDTH,), np.float32), "y": FixedLenFeature((), np.int64)}
    dataset = hr.TFRecordDataset(paths).batch(BATCH).parse_examples(features).map(transform)
    service = DataService(dataset, num_workers=2, memory_budget="64MiB", chunk_size=4,
                          num_cpus=1)
    try:
        start = time.perf_counter()
        rows = sum(len(batch["y"]) for batch in service.consumer(0, 1))
        return time.perf_counter() - start, rows
    finally:
        service.shutdown()


def run_ray_data(paths: list[str]) -> tuple[float, int]:
    import ray.data

    start = time.perf_counter()
    data = ray.data.read_tfrecords(paths).map_batches(transform, batch_format="numpy")
    rows = sum(len(batch["y"]) for batch in data.iter_batches(batch_size=BATCH,
                                                              batch_format="numpy"))
    return time.perf_counter() - start, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "ray_service.md"))
    args = parser.parse_args(argv)
    import ray
    from ray.cluster_utils import Cluster

    folder = tempfile.mkdtemp()
    paths = write_files(folder, args.files, args.records)
    total = args.files * args.records
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 200 << 20, "include_dashboard": False})
    nodes.add_node(num_cpus=1, object_store_memory=200 << 20)
    ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
    results: dict[str, dict[str, float]] = {}
    try:
        for name, run in (("headrace", run_headrace), ("ray_data", run_ray_data)):
            best, memory = float("inf"), {"node_max": 0, "driver": 0}
            for _ in range(args.repeats):
                sampler = Sampler()
                seconds, rows = run(paths)
                peaks = sampler.close()
                assert rows == total, (name, rows, total)
                best = min(best, seconds)
                memory = {k: max(memory[k], peaks[k]) for k in memory}
            results[name] = {"rows_per_s": total / best, **memory}
    finally:
        ray.shutdown()
        nodes.shutdown()
    hr_, rd = results["headrace"], results["ray_data"]
    lines = [
        f"# DataService vs Ray Data ({args.files} files x {args.records} records, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "2-node local cluster, 1 CPU per node)",
        "",
        "| | rows/s | peak RSS per node (MiB) | driver peak RSS (MiB) |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['rows_per_s']:,.0f} | {r['node_max'] / 2**20:,.0f} | "
                     f"{r['driver'] / 2**20:,.0f} |")
    lines += ["", f"throughput headrace / Ray Data: {hr_['rows_per_s'] / rd['rows_per_s']:.2f}; "
              f"peak node memory headrace / Ray Data: {hr_['node_max'] / rd['node_max']:.2f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
