"""cache() and save/load against tf.data: second-epoch throughput and peak memory.

Scenarios (each side in fresh processes, one after the other; see README.md):

- **disk cache, 2nd epoch**: ``range(n).map(make).cache(file)`` — a first process
  writes the cache (not timed), a fresh one reads it: its first pass is sampled for
  peak RSS (the reading pass's alone), the next three are timed without the sampler
  (best of three), for headrace's and tf.data's.
- **disk cache, batched**: the same followed by ``.batch(1024)`` (small records) or
  ``.batch(32)`` (large), as a training loop reads it: headrace decodes these
  batches column by column from the file. Reported against tf.data's
  ``cache(filename).batch(n)``, against a plain read of the same file (the bound), and
  against a read of each batch's records into a fresh array plus one CRC32C pass over
  them (the least a reader that checks every byte can do: one copy, one checksum).
- **load**: ``save(dir)`` first, in its own process (not timed), then timed passes
  over ``load(dir)`` in a fresh one; and over ``load(dir).batch(n)`` (batched as above).
- **page cache**: plain 1 MiB ``read()`` calls over headrace's cache file, warm in the
  page cache: the bandwidth bound for the large records.
- **3x budget**: one ``cache()``d dataset three times headrace's budget, read by three
  separate ``iter()`` calls (as Keras makes one per epoch: the first writes the cache,
  spilling past its share; the next two read the kept cache; tf.data's in-memory
  cache holds it all), with the peak growth of anonymous + shared memory against
  budget + 10% + 64 MiB.

Records: 200,000 small ones (16 float32 + an int64) and 20,000 of 100 KB
(``--quick``: a tenth). Usage: ``python benchmarks/bench_cache.py [--quick] [--large]``
(``--large``: the large-record read scenarios only; ``--batched``: the batched disk-cache
scenarios only, small and large). CPU seconds (user + system) per GB
are reported beside wall time: on a shared machine they are the steadier measure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h

MiB = 1 << 20
#: The batch of the batched scenarios, by record kind (the sizes a training loop uses).
BATCH = {"small": 1024, "large": 32}


def _make(lib: str, kind: str) -> Any:
    """The source pipeline, the same data in both libraries, made fresh (not a constant)."""
    if lib == "hr":
        import numpy as np

        import headrace as hr

        if kind == "small":
            return lambda n: hr.Dataset.range(n).map(
                lambda i: {"x": np.full(16, i, np.float32), "y": i},
                output_signature={"x": hr.TensorSpec((16,), np.float32), "y": hr.TensorSpec((), np.int64)},
            )
        return lambda n: hr.Dataset.range(n).map(
            lambda i: np.full(100_000, i % 251, np.uint8),
            output_signature=hr.TensorSpec((100_000,), np.uint8),
        )
    import tensorflow as tf

    if kind == "small":
        return lambda n: tf.data.Dataset.range(n).map(
            lambda i: {"x": tf.fill([16], tf.cast(i, tf.float32)), "y": i}
        )
    return lambda n: tf.data.Dataset.range(n).map(
        lambda i: tf.fill([100_000], tf.cast(i % 251, tf.uint8))
    )


def _drain(iterator: Any) -> int:
    count = 0
    for _ in iterator:
        count += 1
    return count


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    lib, kind, mode, n, work = cfg["lib"], cfg["records"], cfg["mode"], cfg["n"], cfg["dir"]
    make = _make(lib, kind)
    ds = make(n)
    options = None
    if lib == "hr":
        import headrace as hr

        options = hr.Options(memory_budget=cfg.get("budget", 256 * MiB))
    prefix = os.path.join(work, f"{lib}-{kind}{'-batched' if mode.endswith('_batch') else ''}")
    if mode == "memory":  # one cached dataset, iterated by separate iterators (as Keras does)
        return _kept_cache(lib, ds.cache(), options, cfg["iterators"], n)

    def pipeline() -> Any:
        if mode == "cache_file":
            out = ds.cache(prefix)
        elif mode == "cache_batch":
            out = ds.cache(prefix).batch(BATCH[kind])
        elif mode in ("load", "load_batch"):
            out = (hr.Dataset.load(prefix) if lib == "hr" else _tf().data.Dataset.load(prefix))
            if mode == "load_batch":
                out = out.batch(BATCH[kind])
        else:
            out = ds.cache().repeat(2)
        return out.with_options(options) if lib == "hr" else out

    if cfg.get("phase") == "write":  # untimed preparation, in a process of its own
        if mode in ("cache_file", "cache_batch"):
            _drain(iter(pipeline()) if lib == "hr" else pipeline().as_numpy_iterator())
        elif lib == "hr":
            ds.with_options(options).save(prefix)
        else:
            ds.save(prefix)
        return {"written": True}
    passes = []
    memory: dict[str, Any] = {}
    expected = -(-n // BATCH[kind]) if mode.endswith("_batch") else n
    # The first pass (the fresh process's) is sampled for memory; the timed passes are
    # not: the sampler's thread takes the GIL every 5 ms, which slows a pipeline driven
    # from Python (headrace's) but not one running in C++ threads (tf.data's).
    for number in range(cfg["passes"] + 1):
        sampler = h.MemorySampler().start() if number == 0 else None
        start, cpu = time.perf_counter(), time.process_time()
        iterator = iter(pipeline()) if lib == "hr" else pipeline().as_numpy_iterator()
        count = _drain(iterator)
        if sampler is None:
            passes.append((time.perf_counter() - start, time.process_time() - cpu))
        else:
            memory = sampler.stop()
        del iterator
        assert count == (2 * n if mode == "memory" else expected), count
    best = min(p[0] for p in passes)
    cpu_best = min(p[1] for p in passes)  # the least CPU seconds (user + system) of a pass
    out: dict[str, Any] = {"best_s": best, "cpu_s": cpu_best, "passes": passes, "elements": n, **memory}
    if mode in ("cache_file", "cache_batch") and lib == "hr":  # the bound: a plain read
        data = prefix + ".hrcache"
        out["file_bytes"] = os.path.getsize(data)
        reads = []
        for _ in range(3):
            start, cpu = time.perf_counter(), time.process_time()
            with open(data, "rb", buffering=0) as file:
                while file.read(1 << 20):
                    pass
            reads.append((time.perf_counter() - start, time.process_time() - cpu))
        out["page_cache_s"] = min(wall for wall, _ in reads)
        out["page_cache_cpu_s"] = min(cpu for _, cpu in reads)
        if mode == "cache_batch":
            floor = [_read_and_check(data, n, BATCH[kind]) for _ in range(3)]
            out["floor_s"] = min(wall for wall, _ in floor)
            out["floor_cpu_s"] = min(cpu for _, cpu in floor)
    return out


def _read_and_check(data: str, n: int, batch: int) -> tuple[float, float]:
    """The least a verified read can do: each batch's records read by one ``preadv``
    into a fresh array (as a batch is), then one CRC32C pass over them (headrace's C
    CRC) — one copy and one checksum pass, no framing, no decode, no Python per record.
    (wall s, CPU s)."""
    import numpy as np

    from headrace.io._crc32c import crc32c

    record = os.path.getsize(data) // n
    start, cpu = time.perf_counter(), time.process_time()
    descriptor = os.open(data, os.O_RDONLY)
    try:
        for first in range(0, n, batch):
            rows = np.empty((min(batch, n - first) * record,), np.uint8)
            os.preadv(descriptor, [rows], first * record)
            crc32c(rows)
    finally:
        os.close(descriptor)
    return time.perf_counter() - start, time.process_time() - cpu


def _kept_cache(lib: str, cached: Any, options: Any, iterators: int, n: int) -> dict[str, Any]:
    """``iterators`` separate iterators over one ``cache()``d dataset, under one memory
    sampler: the first reads the source (headrace spills past its share), the later ones
    read the kept cache."""
    if lib == "hr":
        cached = cached.with_options(options)
    sampler = h.MemorySampler().start()
    start = time.perf_counter()
    counts = [
        _drain(iter(cached) if lib == "hr" else cached.as_numpy_iterator())
        for _ in range(iterators)
    ]
    elapsed = time.perf_counter() - start
    memory = sampler.stop()
    assert counts == [n] * iterators, counts
    return {"best_s": elapsed, "elements": n, **memory}


def _tf() -> Any:
    import tensorflow as tf

    return tf


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return h.child_main(sys.argv[2], {"run": child})
    quick = "--quick" in sys.argv
    large_only = "--large" in sys.argv  # the large-record scenarios alone (the read path)
    batched_only = "--batched" in sys.argv  # the batched disk-cache scenarios alone
    scale = 10 if quick else 1
    python = sys.executable
    started = time.perf_counter()
    info, sections = h.report_head(
        "cache() and save/load vs tf.data", python,
        f"`python benchmarks/bench_cache.py{' --quick' if quick else ''}"
        f"{' --large' if large_only else ''}{' --batched' if batched_only else ''}`",
    )
    report: dict[str, Any] = {"machine": info, "results": {}}
    work = tempfile.mkdtemp(prefix="bench-cache-")
    try:
        rows = []
        kinds = (("small", 200_000 // scale), ("large", 20_000 // scale))
        modes = (
            ("cache_batch", "load_batch") if batched_only
            else ("cache_file", "cache_batch", "load", "load_batch")
        )
        for kind, n in kinds[1:] if large_only else kinds:
            for mode in modes:
                found = {}
                for lib in ("hr", "tf"):
                    cfg = {"kind": "run", "lib": lib, "records": kind, "mode": mode, "n": n,
                           "passes": 3, "dir": work}
                    # written by one process, read by a fresh one: the reading pass's
                    # memory is its own, not what the writing pass left behind
                    wrote = h.spawn(__file__, python, {**cfg, "phase": "write"}, timeout=1800)
                    found[lib] = h.spawn(__file__, python, cfg, timeout=1800)
                    if wrote.get("error"):
                        found[lib] = wrote
                    report["results"][f"{kind}-{mode}-{lib}"] = found[lib]
                ours, theirs = found["hr"], found["tf"]
                if ours.get("error") or theirs.get("error"):
                    rows.append([f"{n:,} {kind}, {mode}", "ERROR", "", "", "", "", "", "", ""])
                    continue
                rate = n / ours["best_s"]
                cell = f"{rate / 1e6:.3f} M/s" if kind == "small" else (
                    f"{n * 100_000 / ours['best_s'] / 1e9:.2f} GB/s"
                )
                bound = ""
                gigabytes = n * (100_000 if kind == "large" else 72) / 1e9
                if "page_cache_s" in ours:
                    bound = f"{ours['file_bytes'] / ours['page_cache_s'] / 1e9:.2f} GB/s " + (
                        f"({ours['page_cache_s'] / ours['best_s']:.2f} of it); "
                        f"{ours['page_cache_cpu_s'] / (ours['file_bytes'] / 1e9):.3f} CPU s/GB "
                        f"({ours['page_cache_cpu_s'] / ours['cpu_s']:.2f} of ours)"
                    )
                if "floor_s" in ours:  # read + CRC only: what checking every byte costs
                    floor = (
                        f"{ours['file_bytes'] / ours['floor_s'] / 1e9:.2f} GB/s "
                        f"({ours['floor_s'] / ours['best_s']:.2f} of it; a plain read is "
                        f"{ours['page_cache_s'] / ours['floor_s']:.2f} of it); "
                        f"{ours['floor_cpu_s'] / (ours['file_bytes'] / 1e9):.3f} CPU s/GB"
                    )
                else:
                    floor = ""
                cpu = (
                    f"{ours['cpu_s'] / gigabytes:.3f} vs {theirs['cpu_s'] / gigabytes:.3f} "
                    f"({theirs['cpu_s'] / ours['cpu_s']:.2f}x)"
                )
                scenario = {
                    "cache_file": "2nd epoch of cache(file)",
                    "cache_batch": f"2nd epoch of cache(file).batch({BATCH[kind]})",
                    "load": "load()",
                    "load_batch": f"load().batch({BATCH[kind]})",
                }[mode]
                rss = (ours.get("kernel_peak_rss_growth"), theirs.get("kernel_peak_rss_growth"))
                rows.append([
                    f"{n:,} {kind}, {scenario}",
                    cell,
                    h.fmt_ratio(theirs["best_s"], ours["best_s"]),
                    cpu,
                    h.fmt_mib(rss[0]),
                    h.fmt_mib(rss[1]),
                    f"{rss[0] / rss[1]:.2f}" if rss[0] and rss[1] else "",
                    bound,
                    floor,
                ])
        sections += [
            "## Reading a disk cache and a saved dataset",
            "",
            h.md_table(
                ["scenario", "headrace", "vs tf.data (wall)",
                 "CPU s/GB: headrace vs tf.data (ratio)", "headrace peak RSS growth",
                 "tf.data peak RSS growth", "RSS growth ratio",
                 "plain read of the same file (share of it we reach)",
                 "read + CRC of the same file, batch by batch (share we reach)"],
                rows,
            ),
            "",
        ]
        if large_only or batched_only:
            h.write_report(
                "cache-large" if large_only else "cache-batched", sections, report, started
            )
            return 0
        budget = 64 * MiB
        n = 3 * budget // 100_000
        big = {}
        for lib in ("hr", "tf"):
            cfg = {"kind": "run", "lib": lib, "records": "large", "mode": "memory", "n": n, "passes": 1,
                   "dir": work, "budget": budget, "iterators": 3}
            big[lib] = h.spawn(__file__, python, cfg, timeout=1800)
            report["results"][f"3x-budget-{lib}"] = big[lib]
        bound = int(budget * 1.1) + 64 * MiB
        sections += [
            f"## cache() of {n:,} x 100 KB (3x headrace's {budget // MiB} MiB budget), read by 3 "
            "separate iterators (the first writes, the next two read the kept cache)",
            "",
            h.md_table(
                ["side", "time", "peak growth anon+shm", "kernel peak RSS growth", "bound (budget + 10% + 64 MiB)"],
                [
                    [lib, f"{r.get('best_s', 0):.2f} s", h.fmt_mib(r.get("peak_growth")),
                     h.fmt_mib(r.get("kernel_peak_rss_growth")),
                     h.fmt_mib(bound) if lib == "hr" else "(no cap)"]
                    for lib, r in big.items()
                ],
            ),
            "",
        ]
        report["bound_3x"] = bound
    finally:
        shutil.rmtree(work, ignore_errors=True)
    h.write_report("cache-quick" if quick else "cache", sections, report, started)
    print(json.dumps({k: v.get("best_s") for k, v in report["results"].items()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
