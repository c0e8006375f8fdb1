"""TFRecord benchmarks: headrace side by side with tf.data (read, parse, write, interleave).

    python benchmarks/bench_tfrecord.py [--quick] [--only 1,2,3,4]

Every side of every scenario runs in its own fresh subprocess, one after the other, on
the same files (written once per run into a temporary directory by a separate child).
The parent prints markdown tables with PASS/FAIL per target and writes
``benchmarks/results/tfrecord.md`` and ``tfrecord.json`` (``tfrecord-quick.*`` with
``--quick``). See benchmarks/README.md for what each number means.

Scenarios (throughput and memory against tf.data):

1. Small records: 200,000 Examples of ~200 bytes (``x``: 32 float32, ``y``: int64,
   ``id``: bytes) in 16 files; read + batch(1024) + parse. headrace
   ``TFRecordDataset(files).batch(1024).parse_examples(spec)`` vs tf.data's best of three
   configurations. Targets: >= 2x tf.data records/s, <= 1/5 of tf's whole-process peak
   RSS, no more memory growth during iteration than tf.data.
2. Large records: 20,000 Examples of 100 KB of bytes (~2 GB) in 16 files, in page cache;
   read + batch(32), with and without parsing the bytes feature. GB/s vs tf.data and vs
   the machine's page-cache read bandwidth (a ``readinto`` loop into a preallocated
   buffer, measured in the same run). Targets: >= tf.data, >= half the bandwidth.
3. Writing 200,000 Examples to 16 shards: headrace ``save_tfrecords`` (unbatched and
   ``batched=True``) vs ``tf.train.Example.SerializeToString`` + ``TFRecordWriter``
   (the writers of bench_tfrecord_write.py). No target: records/s and memory reported.
4. Interleave over 1,000 small files (cycle_length 16), then batch(1024): records/s,
   peak RSS, peak open descriptors. Targets: >= tf.data records/s, <= 1/3 of its peak
   RSS, never more descriptors than headrace's cap.

This module imports only the standard library at top level (plus the stdlib-only
``_harness``), so a child loads only its own side's libraries.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    MIB,
    MemorySampler,
    child_main,
    fmt_mib,
    fmt_rate,
    fmt_ratio,
    md_table,
    pass_fail,
    read_status,
    report_head,
    spawn,
    write_report,
)

SMALL_FILES = 16
SMALL_BATCH = 1024
LARGE_FILES = 16
LARGE_BATCH = 32
LARGE_PAYLOAD = 100 * 1024
INTERLEAVE_FILES = 1000
CYCLE = 16
SMALL_CAP = 8  # a headrace side of scenario 4 runs under max_open_files=8 < cycle_length

S1_SIDES = (
    "headrace",
    "headrace-global-shuffle",
    "tf-seq",
    "tf-seq-map-autotune",
    "tf-parallel-reads",
)
S2_SIDES = (
    "readinto-1MiB",
    "readinto-16MiB",
    "headrace",
    "headrace-noparse",
    "tf-seq",
    "tf-seq-noparse",
    "tf-parallel-reads",
)
S3_SIDES = ("tf", "headrace", "headrace-batched")
S4_SIDES = (
    "headrace-autotune",
    "headrace-seq",
    f"headrace-autotune-cap{SMALL_CAP}",
    "tf-interleave-autotune",
    "tf-parallel-reads16",
)


# =========================================================================== helpers


class FdSampler:
    """Daemon thread sampling open descriptors every ``interval`` s.

    Two peaks, both minus the count before the timed passes: all of ``/proc/self/fd``
    (threads' eventfds and pipes too), and only descriptors on files under ``data_dir`` —
    what headrace's file cap governs (the memory sampler's transient ``/proc`` reads and
    this thread's own ``listdir`` are excluded from the latter). A sample is not atomic:
    a data file opened between the listing and the ``readlink`` pass can take the number
    the listing's own descriptor had, and be counted twice — so a sampled peak can read
    one over the truth. For headrace the pool's peak is exact; the suite proves the cap
    by counting the open and close calls themselves.
    """

    def __init__(self, data_dir: str, interval: float = 0.002) -> None:
        self.interval = interval
        self.prefix = os.path.realpath(data_dir) + os.sep
        self.baseline_all, self.baseline_data = self._count()
        self.peak_all, self.peak_data = self.baseline_all, self.baseline_data
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fd-sampler", daemon=True)
        self._thread.start()

    def _count(self) -> tuple[int, int]:
        n_all = n_data = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile (e.g. listdir's own descriptor)
            n_all += 1
            n_data += target.startswith(self.prefix)
        return n_all, n_data

    def _run(self) -> None:
        while not self._stop.is_set():
            self._update()
            self._stop.wait(self.interval)

    def _update(self) -> None:
        n_all, n_data = self._count()
        self.peak_all, self.peak_data = max(self.peak_all, n_all), max(self.peak_data, n_data)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._update()
        return {
            "peak_fd_growth": self.peak_all - self.baseline_all,
            "peak_data_fds": self.peak_data - self.baseline_data,
        }


def _small_spec(lib: str) -> dict[str, Any]:
    if lib == "tf":
        import tensorflow as tf

        return {
            "x": tf.io.FixedLenFeature([32], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64),
            "id": tf.io.FixedLenFeature([], tf.string),
        }
    import numpy as np

    from headrace.io.example import FixedLenFeature

    return {
        "x": FixedLenFeature((32,), np.float32),
        "y": FixedLenFeature((), np.int64),
        "id": FixedLenFeature((), bytes),
    }


def _large_spec(lib: str) -> dict[str, Any]:
    if lib == "tf":
        import tensorflow as tf

        return {"data": tf.io.FixedLenFeature([], tf.string)}
    from headrace.io.example import FixedLenFeature

    return {"data": FixedLenFeature((), bytes)}


def _files(directory: str) -> list[str]:
    return sorted(
        os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".tfr")
    )


def _measure_passes(
    make_iter: Any, consume: Any, passes: int, *, fd_dir: str | None = None
) -> dict[str, Any]:
    """Warm-up pass (imports, page cache, graph tracing), then ``passes`` timed passes.

    Memory: ``MemorySampler`` baseline just before the first timed pass's pipeline is
    built; whole-process peak RSS = max(VmHWM before the sampler resets it, VmHWM after).
    """
    consume(make_iter())  # warm-up
    gc.collect()
    hwm_before = read_status().get("VmHWM", 0)
    times: list[float] = []
    cpu: list[float] = []
    result: Any = None
    fd_sampler = FdSampler(fd_dir) if fd_dir else None
    with MemorySampler() as sampler:
        for _ in range(passes):
            start, cpu_start = time.perf_counter(), time.process_time()
            result = consume(make_iter())
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        mem = sampler.stop()
    fds = fd_sampler.stop() if fd_sampler is not None else {}
    hwm_after = read_status().get("VmHWM", 0)
    out = {
        "pass_s": times,
        "pass_cpu_s": cpu,
        "best_s": min(times),
        "median_s": statistics.median(times),
        "best_cpu_s": min(cpu),
        "whole_peak_rss": max(hwm_before, hwm_after),
        **fds,
        "result": result,
        **mem,
    }
    return out


# =========================================================================== children


def _child_gen(cfg: dict[str, Any]) -> dict[str, Any]:
    """Write the data of one scenario with headrace's writer (not timed)."""
    import numpy as np

    from headrace.io.example import serialize_example
    from headrace.io.tfrecord import write_tfrecord

    what, directory, records = cfg["what"], cfg["dir"], cfg["records"]
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    n_files = {"small": SMALL_FILES, "large": LARGE_FILES, "many": INTERLEAVE_FILES}[what]
    payloads = [rng.bytes(LARGE_PAYLOAD) for _ in range(8)] if what == "large" else []
    y_sum = 0
    for f in range(n_files):
        start, stop = f * records // n_files, (f + 1) * records // n_files
        if what == "large":
            recs = (
                serialize_example({"data": b"%08d" % i + payloads[i % 8][8:]})
                for i in range(start, stop)
            )
        else:
            x = rng.random((stop - start, 32), dtype=np.float32)
            y = rng.integers(0, 1000, stop - start)
            y_sum += int(y.sum())
            recs = (
                serialize_example({"x": x[i], "y": int(y[i]), "id": b"id-%08d" % (start + i)})
                for i in range(stop - start)
            )
        write_tfrecord(os.path.join(directory, f"part-{f:05d}.tfr"), recs)
    paths = _files(directory)
    return {
        "files": len(paths),
        "bytes": sum(os.path.getsize(p) for p in paths),
        "records": records,
        "y_sum": y_sum,
    }


def _count_small(lib: str) -> Any:
    """Consumer for small-record batches: (records, sum of y) — a checksum across sides."""
    if lib == "tf":

        def consume_tf(iterator: Any) -> tuple[int, int]:
            n = total = 0
            for batch in iterator:
                y = batch["y"].numpy()
                n += len(y)
                total += int(y.sum())
            return n, total

        return consume_tf

    def consume_hr(iterator: Any) -> tuple[int, int]:
        n = total = 0
        for batch in iterator:
            y = batch["y"]
            n += len(y)
            total += int(y.sum())
        return n, total

    return consume_hr


def _child_small(cfg: dict[str, Any]) -> dict[str, Any]:
    """Scenario 1: read + batch(1024) + parse of the 16 small-record files."""
    side, files = cfg["side"], _files(cfg["dir"])
    if side.startswith("headrace"):
        import headrace as hr

        spec = _small_spec("hr")

        def make_iter() -> Any:
            # No prefetch: for small records a background thread costs (GIL hand-offs)
            # more than it overlaps. tf.data injects one; scenario 2 adds it.
            if side == "headrace-global-shuffle":  # an exact permutation of all records
                ds = hr.TFRecordDataset(files, indexed=True).global_shuffle(seed=1)
            else:
                ds = hr.TFRecordDataset(files)
            return iter(ds.batch(SMALL_BATCH).parse_examples(spec))

        consume = _count_small("hr")
    else:
        import tensorflow as tf

        spec = _small_spec("tf")
        auto = tf.data.AUTOTUNE

        def parse(serialized: Any) -> Any:
            return tf.io.parse_example(serialized, spec)

        def make_iter() -> Any:
            if side == "tf-seq":
                ds = tf.data.TFRecordDataset(files).batch(SMALL_BATCH).map(parse)
            elif side == "tf-seq-map-autotune":
                ds = (
                    tf.data.TFRecordDataset(files)
                    .batch(SMALL_BATCH)
                    .map(parse, num_parallel_calls=auto)
                    .prefetch(auto)
                )
            elif side == "tf-parallel-reads":
                ds = (
                    tf.data.TFRecordDataset(files, num_parallel_reads=auto)
                    .batch(SMALL_BATCH)
                    .map(parse, num_parallel_calls=auto)
                    .prefetch(auto)
                )
            else:
                raise ValueError(side)
            return iter(ds)

        consume = _count_small("tf")
    out = _measure_passes(make_iter, consume, cfg["passes"])
    out["records"], out["y_sum"] = out.pop("result")
    return out


def _child_large(cfg: dict[str, Any]) -> dict[str, Any]:
    """Scenario 2: read + batch(32) (+ parse) of ~2 GB of 100 KB records, or plain readinto."""
    side, files = cfg["side"], _files(cfg["dir"])
    total_bytes = sum(os.path.getsize(p) for p in files)
    if side.startswith("readinto"):
        size = (16 if side.endswith("16MiB") else 1) * MIB
        buffer = bytearray(size)
        view = memoryview(buffer)

        def make_iter() -> Any:
            return iter(files)

        def consume(paths: Any) -> tuple[int, int]:
            nbytes = 0
            for path in paths:
                with open(path, "rb", buffering=0) as f:
                    while n := f.readinto(view):
                        nbytes += n
            return nbytes, 0

    elif side.startswith("headrace"):
        import headrace as hr

        spec = _large_spec("hr")
        parse = not side.endswith("noparse")

        def make_iter() -> Any:
            ds = hr.TFRecordDataset(files).batch(LARGE_BATCH)
            if parse:
                ds = ds.parse_examples(spec)
            # tf.data appends prefetch(AUTOTUNE) by itself (inject_prefetch); say it here.
            return iter(ds.prefetch(hr.AUTOTUNE))

        def consume(iterator: Any) -> tuple[int, int]:
            nbytes = records = 0
            for batch in iterator:
                values = batch["data"] if parse else batch
                records += len(values)
                nbytes += sum(len(v) for v in values)
            return nbytes, records

    else:
        import tensorflow as tf

        spec = _large_spec("tf")
        auto = tf.data.AUTOTUNE
        parse = not side.endswith("noparse")

        def make_iter() -> Any:
            if side == "tf-parallel-reads":
                ds = tf.data.TFRecordDataset(files, num_parallel_reads=auto).batch(LARGE_BATCH)
            else:
                ds = tf.data.TFRecordDataset(files).batch(LARGE_BATCH)
            if parse:
                ds = ds.map(lambda s: tf.io.parse_example(s, spec), num_parallel_calls=auto)
            return iter(ds.prefetch(auto) if side == "tf-parallel-reads" else ds)

        def consume(iterator: Any) -> tuple[int, int]:
            nbytes = records = 0
            for batch in iterator:
                values = batch["data"] if parse else batch
                records += int(values.shape[0])
                nbytes += int(tf.reduce_sum(tf.strings.length(values)))
            return nbytes, records

    out = _measure_passes(make_iter, consume, cfg["passes"])
    out["payload_bytes"], out["records"] = out.pop("result")
    out["file_bytes"] = total_bytes
    out["gb_per_s"] = total_bytes / out["best_s"] / 1e9
    out["gb_per_s_median"] = total_bytes / out["median_s"] / 1e9
    out["gb_per_cpu_s"] = total_bytes / out["best_cpu_s"] / 1e9 if out["best_cpu_s"] else None
    return out


def _child_write(cfg: dict[str, Any]) -> dict[str, Any]:
    """Scenario 3: the writers of bench_tfrecord_write.py, timed passes into a scratch dir."""
    import shutil

    from bench_tfrecord_write import WRITERS, make_columns

    side, records = cfg["side"], cfg["records"]
    columns = make_columns(records)
    write = WRITERS[side]
    scratch = tempfile.mkdtemp(prefix=f"bench-write-{side}-", dir=cfg["dir"])
    on_disk = [0]

    def make_iter() -> Any:
        shutil.rmtree(scratch, ignore_errors=True)
        return columns

    def consume(cols: Any) -> int:
        write(cols, scratch)
        on_disk[0] = sum(
            e.stat().st_size for e in os.scandir(scratch) if e.name.endswith(".tfrecord")
        )
        return len(cols["y"])

    try:
        out = _measure_passes(make_iter, consume, cfg["passes"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["records"] = out.pop("result")
    out["bytes_on_disk"] = on_disk[0]
    return out


def _child_interleave(cfg: dict[str, Any]) -> dict[str, Any]:
    """Scenario 4: interleave over 1,000 files, cycle_length 16, then batch(1024)."""
    side, files = cfg["side"], _files(cfg["dir"])
    cap = None
    pool_stats: Any = None
    if side.startswith("headrace"):
        import numpy as np

        import headrace as hr
        from headrace.io.filepool import get_default_pool

        names = np.array(files, dtype=object)
        options = hr.Options(max_open_files=SMALL_CAP) if "cap" in side else None
        cap = SMALL_CAP if options else get_default_pool().max_open_files

        def make_iter() -> Any:
            source = hr.Dataset.from_tensor_slices(names)
            if side.startswith("headrace-autotune"):
                ds = source.interleave(
                    hr.TFRecordDataset, cycle_length=CYCLE, num_parallel_calls=hr.AUTOTUNE
                )
            else:
                ds = source.interleave(hr.TFRecordDataset, cycle_length=CYCLE)
            ds = ds.batch(SMALL_BATCH)
            if options is not None:
                ds = ds.with_options(options)
            return iter(ds)

        def consume(iterator: Any) -> int:
            return sum(len(batch) for batch in iterator)

    else:
        import tensorflow as tf

        auto = tf.data.AUTOTUNE

        def make_iter() -> Any:
            if side == "tf-interleave-autotune":
                ds = tf.data.Dataset.from_tensor_slices(files).interleave(
                    tf.data.TFRecordDataset, cycle_length=CYCLE, num_parallel_calls=auto
                )
            else:
                ds = tf.data.TFRecordDataset(files, num_parallel_reads=CYCLE)
            return iter(ds.batch(SMALL_BATCH))

        def consume(iterator: Any) -> int:
            return sum(int(batch.shape[0]) for batch in iterator)

    out = _measure_passes(make_iter, consume, cfg["passes"], fd_dir=cfg["dir"])
    out["records"] = out.pop("result")
    out["cap"] = cap
    if side.startswith("headrace"):
        from headrace.io.filepool import get_default_pool

        pool_stats = get_default_pool().stats()
        out["pool_peak_open_files"] = pool_stats.peak_open_files
        out["pool_max_open_files"] = pool_stats.max_open_files
    return out


CHILDREN = {
    "gen": _child_gen,
    "small": _child_small,
    "large": _child_large,
    "write": _child_write,
    "interleave": _child_interleave,
}


# =========================================================================== parent


def _spawn(python: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    return spawn(__file__, python, cfg, timeout)


def _ok(res: dict[str, Any] | None) -> bool:
    return bool(res) and not res.get("error")  # type: ignore[union-attr]


def _rate(res: dict[str, Any], key: str = "records") -> float:
    return res[key] / res["best_s"]


def _error_row(side: str, res: dict[str, Any], width: int) -> list[Any]:
    return [side, "ERROR"] + [""] * (width - 3) + [res.get("error", "")]


def _rate_table(results: dict[str, Any], expected: int, ref: str | None) -> str:
    header = [
        "side",
        "records/s (best)",
        "records/s (median)",
        f"vs {ref}" if ref else "vs best tf",
        "records per CPU-s",
        "whole-process peak RSS",
        "peak growth anon+shm",
        "kernel peak RSS growth",
        "notes",
    ]
    ref_rate = _rate(results[ref]) if ref and _ok(results.get(ref)) else None
    rows = []
    for side, res in results.items():
        if not _ok(res):
            rows.append(_error_row(side, res, len(header)))
            continue
        note = "" if res["records"] == expected else f"records {res['records']} != {expected}"
        rows.append(
            [
                side,
                fmt_rate(_rate(res)),
                fmt_rate(res["records"] / res["median_s"]),
                fmt_ratio(_rate(res), ref_rate),
                fmt_rate(res["records"] / res["best_cpu_s"]),
                fmt_mib(res["whole_peak_rss"]),
                fmt_mib(res["peak_growth"]),
                fmt_mib(res.get("kernel_peak_rss_growth")),
                note,
            ]
        )
    return md_table(header, rows)


def _best_tf(results: dict[str, Any]) -> str | None:
    tf_sides = [s for s, r in results.items() if s.startswith("tf") and _ok(r)]
    return max(tf_sides, key=lambda s: _rate(results[s])) if tf_sides else None


def scenario1(results: dict[str, Any], gen: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    best = _best_tf(results)
    expected = gen["records"]
    for res in results.values():
        if _ok(res) and res["y_sum"] != gen["y_sum"]:
            res["checksum_mismatch"] = True
    lines = [_rate_table(results, expected, best), ""]
    lines.append(f"Best tf.data configuration: **{best}**.")
    hr_res = results.get("headrace")
    targets: list[list[Any]] = []
    if best and _ok(hr_res):
        tf_res = results[best]
        speed = _rate(hr_res) / _rate(tf_res)
        cpu_speed = (hr_res["records"] / hr_res["best_cpu_s"]) / (
            tf_res["records"] / tf_res["best_cpu_s"]
        )
        rss = hr_res["whole_peak_rss"] / tf_res["whole_peak_rss"]
        targets += [
            [f"S1 records/s >= 2x tf.data ({best})", f"{speed:.2f}x", pass_fail(speed >= 2)],
            ["S1 (info) records per CPU-s vs same tf config", f"{cpu_speed:.2f}x", "info"],
            [
                "S1 whole-process peak RSS <= 1/5 of tf's",
                f"{rss:.3f} (1/{1 / rss:.1f})",
                pass_fail(rss <= 0.2),
            ],
        ]
        tf_growth = min(
            r["peak_growth"] for s, r in results.items() if s.startswith("tf") and _ok(r)
        )
        targets.append(
            [
                "S1 growth during iteration <= tf.data's (smallest tf config)",
                f"{fmt_mib(hr_res['peak_growth'])} vs {fmt_mib(tf_growth)}",
                pass_fail(hr_res["peak_growth"] <= tf_growth),
            ]
        )
        bad = [s for s, r in results.items() if r.get("checksum_mismatch")]
        if bad:
            targets.append(["S1 sum(y) checksum equals the written data", ", ".join(bad), "FAIL"])
    return lines, targets


def scenario2(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    header = [
        "side",
        "GB/s (best)",
        "GB/s (median)",
        "GB per CPU-s",
        "vs page-cache bw",
        "whole-process peak RSS",
        "peak growth anon+shm",
        "notes",
    ]
    bw_sides = [s for s in results if s.startswith("readinto") and _ok(results[s])]
    bandwidth = max((results[s]["gb_per_s"] for s in bw_sides), default=None)
    rows = []
    for side, res in results.items():
        if not _ok(res):
            rows.append(_error_row(side, res, len(header)))
            continue
        note = ""
        if not side.startswith("readinto") and res["records"] != res.get("expected", 0):
            note = f"records {res['records']}"
        rows.append(
            [
                side,
                f"{res['gb_per_s']:.2f}",
                f"{res['gb_per_s_median']:.2f}",
                f"{res['gb_per_cpu_s']:.2f}" if res["gb_per_cpu_s"] else "—",
                fmt_ratio(res["gb_per_s"], bandwidth),
                fmt_mib(res["whole_peak_rss"]),
                fmt_mib(res["peak_growth"]),
                note,
            ]
        )
    lines = [md_table(header, rows), ""]
    targets: list[list[Any]] = []
    for parse in (True, False):
        hr_side = "headrace" if parse else "headrace-noparse"
        tf_sides = ("tf-seq", "tf-parallel-reads") if parse else ("tf-seq-noparse",)
        tf_ok = [s for s in tf_sides if _ok(results.get(s))]
        hr_res = results.get(hr_side)
        if not _ok(hr_res) or not tf_ok:
            continue
        best = max(tf_ok, key=lambda s: results[s]["gb_per_s"])
        ratio = hr_res["gb_per_s"] / results[best]["gb_per_s"]
        label = "read+batch+parse" if parse else "read+batch"
        targets.append([f"S2 {label} GB/s >= tf.data ({best})", f"{ratio:.2f}x", pass_fail(ratio >= 1)])
        if bandwidth:
            share = hr_res["gb_per_s"] / bandwidth
            targets.append(
                [
                    f"S2 {label} >= 1/2 page-cache bandwidth ({bandwidth:.2f} GB/s)",
                    f"{share:.2f}",
                    pass_fail(share >= 0.5),
                ]
            )
    return lines, targets


def scenario3(results: dict[str, Any], records: int) -> tuple[list[str], list[list[Any]]]:
    lines = [_rate_table(results, records, "tf"), ""]
    targets: list[list[Any]] = []
    for side in ("headrace", "headrace-batched"):
        if _ok(results.get(side)) and _ok(results.get("tf")):
            ratio = _rate(results[side]) / _rate(results["tf"])
            targets.append(
                [f"S3 {side} write records/s vs tf (no target)", f"{ratio:.2f}x", "info"]
            )
    return lines, targets


def scenario4(results: dict[str, Any], records: int) -> tuple[list[str], list[list[Any]]]:
    header = [
        "side",
        "records/s (best)",
        "records/s (median)",
        "vs best tf",
        "records per CPU-s",
        "whole-process peak RSS",
        "peak growth anon+shm",
        "peak data-file fds",
        "peak fds, all",
        "pool peak / cap",
        "notes",
    ]
    best = _best_tf(results)
    ref_rate = _rate(results[best]) if best else None
    rows = []
    for side, res in results.items():
        if not _ok(res):
            rows.append(_error_row(side, res, len(header)))
            continue
        pool = (
            f"{res['pool_peak_open_files']} / {res['cap']}"
            if "pool_peak_open_files" in res
            else "—"
        )
        rows.append(
            [
                side,
                fmt_rate(_rate(res)),
                fmt_rate(res["records"] / res["median_s"]),
                fmt_ratio(_rate(res), ref_rate),
                fmt_rate(res["records"] / res["best_cpu_s"]),
                fmt_mib(res["whole_peak_rss"]),
                fmt_mib(res["peak_growth"]),
                res["peak_data_fds"],
                res["peak_fd_growth"],
                pool,
                "" if res["records"] == records else f"records {res['records']} != {records}",
            ]
        )
    lines = [md_table(header, rows), "", f"Best tf.data configuration: **{best}**."]
    targets: list[list[Any]] = []
    if best is None:
        return lines, targets
    tf_res = results[best]
    for side in [s for s in results if s.startswith("headrace")]:
        res = results[side]
        if not _ok(res):
            continue
        ratio = _rate(res) / _rate(tf_res)
        rss = res["whole_peak_rss"] / tf_res["whole_peak_rss"]
        targets += [
            [f"S4 {side} records/s >= tf.data ({best})", f"{ratio:.2f}x", pass_fail(ratio >= 1)],
            [f"S4 {side} whole-process peak RSS <= 1/3 of tf's", f"{rss:.3f}", pass_fail(rss <= 1 / 3)],
            [
                f"S4 {side} open descriptors <= cap {res['cap']}",
                f"data-file fds {res['peak_data_fds']}, pool peak {res['pool_peak_open_files']}",
                pass_fail(max(res["peak_data_fds"], res["pool_peak_open_files"]) <= res["cap"]),
            ],
        ]
    return lines, targets


def parent(args: argparse.Namespace) -> int:
    only = {int(s) for s in args.only.split(",")} if args.only else {1, 2, 3, 4}
    python, quick = args.python, args.quick
    passes = args.passes or (1 if quick else 3)
    info, sections = report_head(
        f"headrace TFRecord benchmarks{' (--quick)' if quick else ''}",
        python,
        f"each side in its own fresh process, one warm-up pass then best of {passes} "
        "timed passes.",
    )
    timeout = args.timeout or (300.0 if quick else 900.0)
    scale = 10 if quick else 1
    small_n, large_n, many_n = 200_000 // scale, 20_000 // scale, 200_000 // scale
    report: dict[str, Any] = {"machine": info, "quick": quick, "passes": passes}
    targets: list[list[Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="headrace-bench-tfr-", dir=args.tmpdir) as tmp:

        def gen(what: str, records: int) -> tuple[str, dict[str, Any]]:
            directory = os.path.join(tmp, what)
            res = _spawn(
                python, {"kind": "gen", "what": what, "dir": directory, "records": records}, timeout
            )
            if res.get("error"):
                raise RuntimeError(f"writing the {what} data failed: {res}")
            return directory, res

        def run(kind: str, sides: tuple[str, ...], directory: str, **extra: Any) -> Any:
            return {
                side: _spawn(
                    python,
                    {"kind": kind, "side": side, "dir": directory, "passes": passes, **extra},
                    timeout,
                )
                for side in sides
            }

        if 1 in only:
            directory, g = gen("small", small_n)
            report["scenario1_data"] = g
            res = run("small", S1_SIDES, directory)
            report["scenario1"] = res
            lines, t = scenario1(res, g)
            targets += t
            sections += [
                f"## 1. Small records: {small_n:,} Examples ({g['bytes'] / small_n:.0f} B each"
                f" on disk) in {SMALL_FILES} files, read + batch({SMALL_BATCH}) + parse",
                "",
                "headrace: `TFRecordDataset(files).batch(1024).parse_examples(spec)` (no prefetch: "
                "for small records its thread costs more than it overlaps). "
                "headrace-global-shuffle: `TFRecordDataset(files, indexed=True).global_shuffle"
                "(seed=1)`, then the same: every record in an exact random order, read by "
                "offset (tf.data has no counterpart for TFRecord files). tf-seq: "
                "`TFRecordDataset(files).batch(1024).map(parse_example)`; "
                "tf-seq-map-autotune: same with `map(num_parallel_calls=AUTOTUNE).prefetch"
                "(AUTOTUNE)`; tf-parallel-reads: plus `num_parallel_reads=AUTOTUNE`. Consumer: "
                "`sum(batch['y'])` (checked against the written data).",
                "",
                *lines,
                "",
            ]
        if 2 in only:
            directory, g = gen("large", large_n)
            report["scenario2_data"] = g
            _read_all(directory)  # into the page cache before any child runs
            res = run("large", S2_SIDES, directory)
            for r in res.values():
                r["expected"] = large_n
            report["scenario2"] = res
            lines, t = scenario2(res)
            targets += t
            sections += [
                f"## 2. Large records: {large_n:,} Examples of {LARGE_PAYLOAD // 1024} KB bytes"
                f" ({g['bytes'] / 1e9:.2f} GB in {LARGE_FILES} files, in page cache),"
                f" batch({LARGE_BATCH})",
                "",
                "GB/s = file bytes / pass time. readinto-*: plain Python `f.readinto` loop into"
                " a preallocated buffer (the machine's page-cache read bandwidth from Python)."
                " headrace: `TFRecordDataset(files).batch(32).parse_examples({'data': bytes})"
                ".prefetch(AUTOTUNE)` (tf.data injects that prefetch itself);"
                " -noparse: without parse. tf-seq: `TFRecordDataset(files).batch(32).map("
                "parse_example)`; tf-parallel-reads: `num_parallel_reads=AUTOTUNE`, parallel map,"
                " prefetch. Consumers touch every record's length.",
                "",
                *lines,
                "",
            ]
        if 3 in only:
            res = run("write", S3_SIDES, tmp, records=small_n)
            report["scenario3"] = res
            lines, t = scenario3(res, small_n)
            targets += t
            sections += [
                f"## 3. Writing {small_n:,} Examples to 16 shards",
                "",
                "tf: `tf.train.Example(...).SerializeToString()` + `tf.io.TFRecordWriter`, "
                "contiguous shards. headrace: `from_tensor_slices(columns).save_tfrecords(dir, "
                "num_shards=16)` (also fsyncs, renames atomically and writes `.hrx` indexes); "
                "headrace-batched: from `.batch(1024)` with `batched=True`. Writers from "
                "bench_tfrecord_write.py.",
                "",
                *lines,
                "",
            ]
        if 4 in only:
            directory, g = gen("many", many_n)
            report["scenario4_data"] = g
            res = run("interleave", S4_SIDES, directory)
            report["scenario4"] = res
            lines, t = scenario4(res, many_n)
            targets += t
            sections += [
                f"## 4. Interleave over {INTERLEAVE_FILES:,} files ({many_n:,} records of"
                f" {g['bytes'] / many_n:.0f} B), cycle_length {CYCLE}, then batch({SMALL_BATCH})",
                "",
                "headrace-autotune: `from_tensor_slices(files).interleave(TFRecordDataset, "
                "cycle_length=16, num_parallel_calls=AUTOTUNE)`; -seq: without "
                f"num_parallel_calls; -cap{SMALL_CAP}: autotune under "
                f"`Options(max_open_files={SMALL_CAP})`. tf-interleave-autotune: the same "
                "with tf.data; tf-parallel-reads16: `TFRecordDataset(files, "
                "num_parallel_reads=16)`. Open fds: /proc/self/fd sampled every 2 ms,"
                " minus the count before the timed passes (data-file: only descriptors on the data"
                " files; all: every descriptor, threads' eventfds and pipes too); pool peak:"
                " headrace's exact "
                "`get_default_pool().stats().peak_open_files`.",
                "",
                *lines,
                "",
            ]
    sections += ["## Targets", "", md_table(["target", "measured", "verdict"], targets), ""]
    report["targets"] = targets
    stem = "tfrecord-quick" if quick else "tfrecord"
    if args.only:
        stem += "-only" + args.only.replace(",", "")
    write_report(stem, sections, report, started)
    return 0


def _read_all(directory: str) -> None:
    buffer = memoryview(bytearray(16 * MIB))
    for path in _files(directory):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/10 of the data, 1 pass")
    parser.add_argument("--only", help="comma-separated scenario numbers, e.g. 1,4")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the children")
    parser.add_argument("--timeout", type=float, help="seconds per child before it counts as hung")
    parser.add_argument("--passes", type=int, help="timed passes per child (default 3, 1 quick)")
    parser.add_argument("--tmpdir", help="where to write the data (default: the system's tmp)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, CHILDREN)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
