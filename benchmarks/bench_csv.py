"""CSV -> batches of 1024: headrace (arrow and pure engines) vs tf.data's routes vs raw pyarrow.

Each side runs in its own fresh process (peak RSS growth is per process). Usage:
    python benchmarks/bench_csv.py [--rows 1000000] [--cols 20]
Writes benchmarks/results/csv.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SIDES = {
    "headrace-arrow": """
import headrace as hr, pyarrow.csv  # pyarrow imported before the clock, as for pyarrow-raw
ds = hr.read_csv(PATH, 1024, column_defaults=[[0.0]] * COLS, engine="arrow")
rows = sum(len(b["c0"]) for b in ds)""",
    "headrace-pure": """
import headrace as hr
ds = hr.read_csv(PATH, 1024, column_defaults=[[0.0]] * COLS, engine="pure")
rows = sum(len(b["c0"]) for b in ds)""",
    "tf-textline-decode": """
import tensorflow as tf
ds = tf.data.TextLineDataset(PATH).skip(1).batch(1024).map(
    lambda l: tf.io.decode_csv(l, [[0.0]] * COLS), num_parallel_calls=tf.data.AUTOTUNE
).prefetch(tf.data.AUTOTUNE)
rows = sum(int(b[0].shape[0]) for b in ds)""",
    "tf-csvdataset": """
import tensorflow as tf
ds = tf.data.experimental.CsvDataset(PATH, [[0.0]] * COLS, header=True).batch(1024)
rows = sum(int(b[0].shape[0]) for b in ds)""",
    "pyarrow-raw": """
import pyarrow as pa, pyarrow.csv as pc
reader = pc.open_csv(PATH, convert_options=pc.ConvertOptions(
    column_types={f"c{i}": pa.float32() for i in range(COLS)}))
rows = 0
for batch in reader:
    cols = [batch.column(i).to_numpy() for i in range(COLS)]
    rows += batch.num_rows""",
    # The same reader delivering what the other sides deliver: dicts of 1024-row NumPy
    # columns (zero-copy slices of each Arrow batch, joined across batch edges).
    "pyarrow-1024": """
import numpy as np, pyarrow as pa, pyarrow.csv as pc
reader = pc.open_csv(PATH, convert_options=pc.ConvertOptions(
    column_types={f"c{i}": pa.float32() for i in range(COLS)}))
names = [f"c{i}" for i in range(COLS)]
def batches():
    carry = None
    for record_batch in reader:
        cols = [record_batch.column(i).to_numpy() for i in range(COLS)]
        first = 0
        if carry is not None:
            first = 1024 - len(carry[0])
            cols0 = [np.concatenate([c, d[:first]]) for c, d in zip(carry, cols)]
            if len(cols0[0]) < 1024:
                carry = cols0
                continue
            yield dict(zip(names, cols0))
            carry = None
        n = len(cols[0])
        while first + 1024 <= n:
            yield {k: c[first:first + 1024] for k, c in zip(names, cols)}
            first += 1024
        carry = [c[first:] for c in cols] if first < n else None
    if carry is not None:
        yield dict(zip(names, carry))
rows = sum(len(b["c0"]) for b in batches())""",
}

RUNNER = """
import time, resource, json
def charged():
    t = 0
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon:", "RssShmem:")):
            t += int(line.split()[1]) * 1024
    return t
PATH, COLS = {path!r}, {cols}
{imports}
start = time.perf_counter(); base = charged(); cpu = time.process_time()
{body}
seconds = time.perf_counter() - start
cpu = time.process_time() - cpu  # every thread of the process
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"rows": rows, "seconds": seconds, "cpu_s": cpu, "peak_rss": peak}}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cols", type=int, default=20)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each side, interleaved; the median is reported")
    args = parser.parse_args(argv)
    import numpy as np

    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "data.csv")
    rng = np.random.default_rng(0)
    with open(path, "w") as handle:
        handle.write(",".join(f"c{i}" for i in range(args.cols)) + "\n")
        for start in range(0, args.rows, 100_000):
            block = rng.random((min(100_000, args.rows - start), args.cols)).astype(np.float32)
            np.savetxt(handle, block, fmt="%.6g", delimiter=",")
    runs: dict[str, list[dict[str, float]]] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TF_CPP_MIN_LOG_LEVEL": "3"}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):  # interleaved: a burst of load hits every side alike
        for side in args.sides.split(","):
            imports, _, body = SIDES[side].strip().partition("\n")
            code = RUNNER.format(path=path, cols=args.cols, imports=imports, body=body)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            assert r["rows"] == args.rows, (side, r)
            runs.setdefault(side, []).append(r)
            print(f"{side:22s} {r['rows'] / r['seconds'] / 1e6:6.3f} M rows/s  "
                  f"cpu {r['cpu_s']:5.2f} s  "
                  f"peak RSS {r['peak_rss'] / 2**20:6.0f} MiB", flush=True)
    rate = {side: statistics.median(r["rows"] / r["seconds"] / 1e6 for r in rs)
            for side, rs in runs.items()}
    rss = {side: max(r["peak_rss"] for r in rs) / 2**20 for side, rs in runs.items()}
    megabytes = os.path.getsize(path) / 1e6
    cpu = {side: statistics.median(r["cpu_s"] for r in rs) / megabytes * 1000
           for side, rs in runs.items()}
    lines = [f"# CSV {args.rows:,} rows x {args.cols} float columns -> batches of 1024",
             "", f"Machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}; each side "
             f"in its own process, {args.repeats} interleaved runs, median rows/s, highest peak "
             f"RSS; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
             "(the machine is shared).", "",
             f"CPU: process CPU time (all threads) per MB of CSV ({megabytes:.0f} MB), median — "
             "what the side costs whatever the load.", "",
             "| side | M rows/s | runs | CPU ms/MB | peak RSS (MiB) |", "|---|---|---|---|---|"]
    for side, rs in runs.items():
        each = " ".join(f"{r['rows'] / r['seconds'] / 1e6:.2f}" for r in rs)
        lines.append(f"| {side} | {rate[side]:.3f} | {each} | {cpu[side]:.1f} | "
                     f"{rss[side]:.0f} |")
    if {"headrace-arrow", "tf-textline-decode", "pyarrow-raw"} <= rate.keys():
        lines += ["", f"headrace-arrow vs tf.data's best (TextLineDataset + batched decode_csv): "
                  f"{rate['headrace-arrow'] / rate['tf-textline-decode']:.2f}x rows/s (target "
                  f">= 3x), {rss['headrace-arrow'] / rss['tf-textline-decode']:.2f}x peak RSS "
                  f"(target <= 0.33x); vs raw pyarrow: "
                  f"{rate['headrace-arrow'] / rate['pyarrow-raw']:.2f}x (target >= 0.9x)."]
    if {"headrace-arrow", "pyarrow-1024"} <= rate.keys():
        lines += ["", "vs pyarrow's reader cut into the same 1024-row dicts of NumPy columns "
                  f"(pyarrow-1024): {rate['headrace-arrow'] / rate['pyarrow-1024']:.2f}x rows/s, "
                  f"{cpu['headrace-arrow'] / cpu['pyarrow-1024']:.2f}x its CPU per MB."]
    if {"headrace-arrow", "tf-textline-decode", "pyarrow-raw"} <= rate.keys():
        lines += ["", f"CPU per MB: headrace-arrow uses "
                  f"{cpu['tf-textline-decode'] / cpu['headrace-arrow']:.2f}x less than tf.data's "
                  f"best, {cpu['headrace-arrow'] / cpu['pyarrow-raw']:.2f}x raw pyarrow's."]
    out_path = os.path.join(os.path.dirname(__file__), "results", "csv.md")
    with open(out_path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
