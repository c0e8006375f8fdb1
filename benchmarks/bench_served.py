"""One reader serving k trainer processes (``headrace.serve``): moving arrays to consumers.

Side by side in one run, each side a fresh set of consumer processes: the time
for k consumers to receive N arrays of S bytes each (their parts of one
stream) from

* ``served``: ``headrace.serve`` (payloads through pooled shared memory), and
* ``queue``: ``multiprocessing.Queue`` per consumer (pickled through a pipe),
  the usual hand-rolled alternative.

Reported: median wall seconds of ``--repeats`` runs, GB/s, and the ratio
queue / served. Usage: ``python benchmarks/bench_served.py [--mib 1] [--count 400]``;
results go to ``benchmarks/results/served.md`` with the machine noted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import headrace as hr
from headrace._workers.processes import start_method

KEY = b"bench-served"


def make_array(width: int, i: Any) -> Any:
    return np.full(width, int(i) % 251, dtype=np.uint8)


def served_consumer(address: str, index: int) -> None:
    total = 0
    with hr.connect(address, index, authkey=KEY) as part:
        for element in part:
            total += int(element[0])


def batch_consumer(address: str, index: int, counts: Any) -> None:
    records = 0
    with hr.connect(address, index, authkey=KEY) as part:
        for labels, _ in part:
            records += len(labels)
    counts[index] = records


def queue_consumer(queue: Any) -> None:
    while True:
        element = queue.get()
        if element is None:
            return


def side_served(k: int, count: int, width: int) -> float:
    import functools

    dataset = hr.Dataset.range(count).map(functools.partial(make_array, width)).prefetch(4)
    address = os.path.join(tempfile.mkdtemp(), "bench.sock")
    context = multiprocessing.get_context(start_method())
    with hr.serve(dataset, k, address, authkey=KEY):
        procs = [context.Process(target=served_consumer, args=(address, i)) for i in range(k)]
        started = time.perf_counter()
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        return time.perf_counter() - started


def side_queue(k: int, count: int, width: int) -> float:
    context = multiprocessing.get_context(start_method())
    queues = [context.Queue(maxsize=4) for _ in range(k)]
    procs = [context.Process(target=queue_consumer, args=(queues[i],)) for i in range(k)]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    for i in range(count):
        queues[i % k].put(make_array(width, i))
    for queue in queues:
        queue.put(None)
    for proc in procs:
        proc.join()
    return time.perf_counter() - started


def write_shards(directory: str, files: int, records: int) -> list[str]:
    """``files`` TFRecord files of ~200 B Examples (32 floats, a label, an id)."""
    from headrace.io.example import serialize_example
    from headrace.io.tfrecord import write_tfrecord

    rng = np.random.default_rng(0)
    paths = []
    for f in range(files):
        path = os.path.join(directory, f"part-{f:02d}.tfrecord")
        write_tfrecord(path, [serialize_example({
            "x": rng.random(32, dtype=np.float32), "y": np.int64(r), "id": f"{f}-{r}".encode(),
        }) for r in range(records)])
        paths.append(path)
    return paths


def side_policy(paths: list[str], records: int, k: int, policy: str) -> tuple[float, float]:
    """Wall seconds for k consumer processes to receive their parts of the parsed stream,
    and the producer's (this process's) CPU seconds."""
    from headrace.io.example import FixedLenFeature

    spec = {"x": FixedLenFeature((32,), np.float32), "y": FixedLenFeature((), np.int64),
            "id": FixedLenFeature((), bytes)}
    dataset = hr.TFRecordDataset(paths).batch(1024).parse_examples(spec).map(
        lambda e: (e["y"], e["x"]))
    address = os.path.join(tempfile.mkdtemp(), "bench.sock")
    context = multiprocessing.get_context(start_method())
    counts = context.Array("q", k)
    cpu = time.process_time()
    with hr.serve(dataset, k, address, authkey=KEY, shard_policy=policy):
        procs = [context.Process(target=batch_consumer, args=(address, i, counts))
                 for i in range(k)]
        started = time.perf_counter()
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        wall, producer_cpu = time.perf_counter() - started, time.process_time() - cpu
    assert [proc.exitcode for proc in procs] == [0] * k, "a consumer failed"
    assert sum(counts) == records, (list(counts), records)
    return wall, producer_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--records", type=int, default=1_600_000,
                        help="records of the shard-policy scenario (16 files)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "served.md"))
    args = parser.parse_args()
    width = int(args.mib * (1 << 20))
    rows = []
    for k in (1, 2):
        served, queued = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            served.append(side_served(k, args.count, width))
            queued.append(side_queue(k, args.count, width))
        s, q = statistics.median(served), statistics.median(queued)
        gb = args.count * width / 1e9
        rows.append(f"| {k} | {s:.2f} | {gb / s:.2f} | {q:.2f} | {gb / q:.2f} | {q / s:.2f}x |")
    paths = write_shards(tempfile.mkdtemp(), 16, args.records // 16)
    policy_rows = []
    for policy in ("data", "file"):
        runs = [side_policy(paths, 16 * (args.records // 16), 2, policy)
                for _ in range(args.repeats)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        policy_rows.append(f"| {policy} | {wall:.2f} | {16 * (args.records // 16) / wall / 1e6:.2f} | "
                           f"{cpu:.2f} |")
    text = "\n".join([
        "# One reader serving k consumer processes",
        "",
        f"{args.count} arrays of {args.mib:g} MiB, split among k consumer processes; median of "
        f"{args.repeats} runs (wall time includes starting the consumers).",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
        f"Python {platform.python_version()}, start method {start_method()}.",
        f"Command: `python benchmarks/bench_served.py --mib {args.mib:g} --count {args.count} "
        f"--records {args.records}`",
        "",
        "| k | served s | served GB/s | mp.Queue s | mp.Queue GB/s | queue / served |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"## Shard policy: {args.records:,} Examples of ~200 B in 16 TFRecord files, "
        "batched by 1024 and parsed, served to 2 consumer processes",
        "",
        "`shard_policy=\"data\"`: each consumer's part reads and parses the whole stream and "
        "keeps every 2nd batch; `\"file\"`: each part reads only its own files.",
        "",
        "| shard_policy | wall s | M records/s | producer CPU s |",
        "| --- | --- | --- | --- |",
        *policy_rows,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
