"""Process workers (issue 10): side by side with tf.data, PyTorch's DataLoader and pickling.

Scenarios, each side in a fresh interpreter, one after the other:

1. ``python_map``: a pure-Python function of about 1 ms per element over 2,000
   elements: headrace on 1 thread (sequential map), headrace with 2 worker
   processes, tf.data's ``map(py_function, num_parallel_calls=2)``, and PyTorch's
   DataLoader with 2 workers. Target: 2 processes >= 1.8x one thread.
   ``--workers N`` runs the parallel sides with N workers over N/2 times the
   elements (the many-core target: 16 processes >= 12x one thread); a side whose
   framework is not installed (tf.data on the GPU machine) is left out.
2. ``move_arrays``: a worker makes three 1 GiB arrays and hands them to the
   consumer: headrace (shared memory) vs ``multiprocessing.Queue`` (pickling).
   Time and peak of the process tree's RssAnon + RssShmem.
3. ``unique_memory``: unique memory (USS) of each worker after one epoch over an
   in-memory list of path strings, 1 vs 2 workers: headrace vs PyTorch's DataLoader.

Wall times on this shared 2-core machine are noisy; each side's CPU time (the
whole process tree's) is reported beside them. Run:

    PYTHONPATH=src python benchmarks/bench_workers.py [--quick]

and it writes benchmarks/results/workers.md and workers.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
MIB = 1 << 20


def python_work(x: Any) -> Any:
    """About 1 ms of pure Python here (holds the GIL throughout)."""
    total = 0
    for i in range(25_000):
        total += i ^ 7
    return x


def make_gib(i: Any) -> Any:
    import numpy as np

    array = np.empty(GIB, np.uint8)
    array.fill(int(i) + 1)
    return array


def path_length(path: Any) -> int:
    return len(path)


# -- process tree measurements ----------------------------------------------------------


# The peak sampler runs in a process of its own: a sampling thread in the measured
# process would hold its GIL (reading every process's smaps costs up to 0.5 CPU-ms per
# image of a GIL-bound pipeline) and slow a Python-heavy side but not one whose work runs
# without the GIL (tf.data). It is left out of the tree it measures.
_NOT_MEASURED: set[int] = set()


def tree_pids(root: int | None = None) -> list[int]:
    import psutil

    me = psutil.Process(root)
    pids = [me.pid] + [child.pid for child in me.children(recursive=True)]
    return [pid for pid in pids if pid not in _NOT_MEASURED]


def tree_cpu() -> float:
    import psutil

    total = 0.0
    for pid in tree_pids():
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def tree_charged(root: int | None = None) -> int:
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _sample_tree(root: int) -> None:
    """The sampler process: the tree's peak every 10 ms until a line on stdin."""
    import select

    _NOT_MEASURED.add(os.getpid())
    peak = tree_charged(root)
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0.01)[0]:
        peak = max(peak, tree_charged(root))
    print(max(peak, tree_charged(root)), flush=True)


class PeakSampler:
    """The measured tree's peak Pss (anon + shmem), sampled from another process."""

    def __init__(self) -> None:
        self.start = tree_charged()
        self.cpu = 0.0  # the sampler's CPU is not the tree's: it runs outside it
        self.process = subprocess.Popen(
            [sys.executable, "-c",
             f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_workers; "
             f"bench_workers._sample_tree({os.getpid()})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _NOT_MEASURED.add(self.process.pid)
        assert self.process.stdout is not None and self.process.stdout.readline() == "ready\n"

    def stop(self) -> int:
        out, _ = self.process.communicate("stop\n")
        return int(out.strip()) - self.start


# -- sides (run in a fresh child) -------------------------------------------------------


def _skip(iterator: Any, count: int) -> None:
    for _ in range(count):
        next(iterator)


def side_python_map(name: str, count: int, workers: int = 2) -> dict[str, Any]:
    # Start-up is outside the clock for every side: the first element comes from the
    # first worker up, while the others may still be starting (on 16 cores that is
    # seconds of CPU), so the clock starts after two elements per worker.
    warm = 1 if name.endswith("1 thread") else 2 * workers
    cpu0 = time.process_time()
    if name.startswith("headrace"):
        import headrace as hr

        ds = hr.Dataset.range(count)
        if name == "headrace 1 thread":
            ds = ds.map(python_work)
        else:
            ds = ds.map(python_work, num_parallel_calls=workers, workers="processes")
        iterator = iter(ds)
        _skip(iterator, warm)
        started, cpu0 = time.perf_counter(), tree_cpu()
        n = sum(1 for _ in iterator)
    elif name.startswith("tf.data py_function"):
        import tensorflow as tf

        ds = tf.data.Dataset.range(count).map(
            lambda x: tf.py_function(python_work, [x], tf.int64), num_parallel_calls=workers
        )
        iterator = iter(ds)
        _skip(iterator, warm)
        started, cpu0 = time.perf_counter(), tree_cpu()
        n = sum(1 for _ in iterator)
    else:  # torch DataLoader
        import torch.utils.data as tud

        class Items(tud.Dataset[int]):
            def __len__(self) -> int:
                return count

            def __getitem__(self, index: int) -> int:
                return int(python_work(index))

        loader = tud.DataLoader(
            Items(), batch_size=None, num_workers=workers, multiprocessing_context="fork"
        )
        iterator = iter(loader)
        _skip(iterator, warm)
        started, cpu0 = time.perf_counter(), tree_cpu()
        n = sum(1 for _ in iterator)
    seconds = time.perf_counter() - started
    return {"elements": n, "seconds": seconds, "per_s": n / seconds,
            "cpu_seconds": tree_cpu() - cpu0}


def side_move_arrays(name: str, count: int) -> dict[str, Any]:
    sampler = PeakSampler()
    started = time.perf_counter()
    checksum = 0
    if name == "headrace shared memory":
        import headrace as hr

        ds = hr.Dataset.range(count).map(make_gib, num_parallel_calls=1, workers="processes")
        with iter(ds.with_options(hr.Options(memory_budget="3GiB"))) as iterator:
            for array in iterator:
                checksum += int(array[-1])
                del array
    else:
        import multiprocessing as mp

        context = mp.get_context("forkserver")
        queue = context.Queue(maxsize=1)
        process = context.Process(target=_queue_producer, args=(queue, count))
        process.start()
        for _ in range(count):
            array = queue.get()
            checksum += int(array[-1])
            del array
        process.join()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "gib_per_s": count / seconds, "peak_growth": sampler.stop(),
            "checksum": checksum}


def _queue_producer(queue: Any, count: int) -> None:
    for i in range(count):
        queue.put(make_gib(i))


def side_unique_memory(name: str, workers: int, strings: int) -> dict[str, Any]:
    from headrace._workers.memory import worker_memory

    paths = [f"/data/train/shard-{i % 1000:04d}/image-{i:09d}.jpeg" for i in range(strings)]
    source_bytes = sum(map(sys.getsizeof, paths)) + sys.getsizeof(paths)

    def worker_uss(pids: list[int]) -> list[int]:
        # the workers by their pids (the forkserver and resource tracker are children too;
        # a size filter stopped working once the forkserver preloaded numpy for them)
        found = [worker_memory(pid) for pid in pids]
        assert all(memory is not None for memory in found) and found, pids
        return [memory.uss for memory in found if memory is not None]

    if name == "headrace":
        import headrace as hr

        ds = hr.Dataset.from_generator(
            lambda: iter(paths), output_signature=hr.TensorSpec((), str)
        ).map(path_length, num_parallel_calls=workers, workers="processes")
        iterator = iter(ds)
        next(iterator)
        pids = [memory.pid for memory in iterator.stats().workers[0].processes]
        start = worker_uss(pids)
        for _ in iterator:
            pass
        end = worker_uss(pids)
        iterator.close()
    else:
        import torch.utils.data as tud

        class Paths(tud.Dataset[int]):
            def __len__(self) -> int:
                return len(paths)

            def __getitem__(self, index: int) -> int:
                return len(paths[index])

        # persistent: the workers outlive the epoch, so their memory can be read at its end
        loader = tud.DataLoader(Paths(), batch_size=256, num_workers=workers,
                                multiprocessing_context="fork", persistent_workers=True)
        iterator = iter(loader)
        next(iterator)
        pids = [worker.pid for worker in iterator._workers]  # type: ignore[attr-defined]
        start = worker_uss(pids)
        for _ in iterator:
            pass
        end = worker_uss(pids)
    return {"source_bytes": source_bytes, "uss_start": start, "uss_end": end,
            "growth_per_worker": [e - s for s, e in zip(sorted(start), sorted(end), strict=False)]}


# -- driver -------------------------------------------------------------------------------


def child(argv: list[str]) -> None:
    config = json.loads(argv[0])
    scenario = config.pop("scenario")
    result = {"python_map": side_python_map, "move_arrays": side_move_arrays,
              "unique_memory": side_unique_memory}[scenario](**config)
    print("@@RESULT@@ " + json.dumps(result), flush=True)


def run(config: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    done = subprocess.run(
        [sys.executable, str(Path(__file__)), "--child", json.dumps(config)],
        capture_output=True, text=True, env=env, timeout=1200, check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("@@RESULT@@ "):
            return {**config, **json.loads(line[len("@@RESULT@@ "):])}
    return {**config, "error": done.stderr[-2000:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--strings", type=int, default=None,
                        help="path strings in scenario 3's source (default 3 M; 21 M is ~2 GiB)")
    parser.add_argument("--workers", type=int, default=2,
                        help="workers of scenario 1's parallel sides (default 2)")
    parser.add_argument("--out", default=None, help="results stem (default workers[-SCENARIO])")
    parser.add_argument("--only", choices=("python_map", "move_arrays", "unique_memory"),
                        help="one scenario; the report goes to workers-<scenario>.md/.json")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    results: list[dict[str, Any]] = []
    count = 400 if args.quick else 2000  # ~2 s on one thread: start-up noise amortised
    n = args.workers
    sides = ["headrace 1 thread", f"headrace {n} processes", f"tf.data py_function x{n}",
             f"torch DataLoader {n} workers"]
    installed = {"tf.data": importlib.util.find_spec("tensorflow") is not None,
                 "torch": importlib.util.find_spec("torch") is not None}
    configs = [{"scenario": "python_map", "name": name, "workers": n,
                # the parallel sides get n/2 times the elements: the same ~1-2 s of wall
                "count": count if name.endswith("1 thread") else count * max(1, n // 2) + 2 * n}
               for name in sides if installed.get(name.split()[0], True)]
    arrays = 2 if args.quick else 3
    configs += [{"scenario": "move_arrays", "name": name, "count": arrays}
                for name in ("headrace shared memory", "multiprocessing.Queue pickling")]
    strings = args.strings or (1_000_000 if args.quick else 3_000_000)
    configs += [{"scenario": "unique_memory", "name": name, "workers": workers,
                 "strings": strings}
                for name in ("headrace", "torch DataLoader") for workers in (1, 2)]
    for config in configs:
        if args.only in (None, config["scenario"]):
            results.append(run(config))
            print(results[-1], flush=True)
    out = HERE / "results"
    stem = args.out or (f"workers-{args.only}" if args.only else "workers")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# Process workers (benchmarks/bench_workers.py)", "",
        f"Machine: {os.cpu_count()} CPUs, shared with other engineers' jobs (noisy); "
        f"load average at the end {os.getloadavg()[0]:.1f}. Python {sys.version.split()[0]}.",
    ]
    base = next((r.get("per_s") for r in results if r.get("name") == "headrace 1 thread"), 1)
    sections = {
        "python_map": ("1. Pure-Python map, ~1 ms per element",
                       "| side | elements/s | wall s | CPU s (process tree) | vs 1 thread |",
                       lambda r: f"| {r['name']} | {r['per_s']:.0f} | {r['seconds']:.2f} | "
                                 f"{r['cpu_seconds']:.2f} | {r['per_s'] / base:.2f}x |"),
        "move_arrays": ("2. Moving 1 GiB arrays from a worker to the consumer",
                        "| side | arrays | GiB/s | peak growth of tree Pss_Anon+Pss_Shmem |",
                        lambda r: f"| {r['name']} | {r['count']} | {r['gib_per_s']:.2f} | "
                                  f"{r['peak_growth'] / MIB:.0f} MiB |"),
        "unique_memory": (
            "3. Unique memory of the workers over an in-memory list of path strings",
            "| side | workers | source | USS growth per worker in one epoch |",
            lambda r: f"| {r['name']} | {r['workers']} | {r['strings']:,} strings, "
                      f"{r['source_bytes'] / MIB:.0f} MiB | "
                      + ", ".join(f"{g / MIB:.1f} MiB" for g in r["growth_per_worker"]) + " |"),
    }
    for scenario, (title, header, row) in sections.items():
        mine = [r for r in results if r["scenario"] == scenario]
        if not mine:
            continue
        lines += ["", f"## {title}", "", header, "|" + "---|" * header.count(" | ") + "---|"]
        lines += [f"| {r['name']} | error |" if "error" in r else row(r) for r in mine]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
