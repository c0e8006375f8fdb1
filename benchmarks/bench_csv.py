"""CSV -> batches of 1024: headrace (arrow and pure engines) vs tf.data's routes vs raw pyarrow.

Each side runs in its own fresh process (peak RSS growth is per process). Usage:
    python benchmarks/bench_csv.py [--rows 1000000] [--cols 20]
Writes benchmarks/results/csv.md. Other cases (``--case``), each side by side with its
anchor in one run, written to benchmarks/results/csv_<case>.md:

* ``quoted``: a ~32 MB file whose first column is quoted text (with delimiters,
  newlines and escaped quotes inside) and 8 float columns: ``read_csv`` vs pyarrow's
  own streaming reader (``open_csv``) and ``read_csv``, columns to NumPy.
* ``seed004``: seed 004's ``TextLineDataset.skip(1).map(decode_csv([[0.0]] * 100))
  .batch(32)``, code unchanged but the import: ``headrace.tf_compat`` vs TensorFlow.
* ``make``: ``make_csv_dataset`` (one epoch, unshuffled: the columnar path) on the
  float file, vs TensorFlow's and vs headrace's ``CsvDataset(...).batch``; and both
  shuffled with the defaults (buffer of 10,000 rows; headrace's shuffles columns),
  also vs ``CsvDataset(...).batch``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

QUOTED_SIDES = {
    "headrace-arrow": """
import headrace as hr, pyarrow.csv  # pyarrow imported before the clock, as for pyarrow
ds = hr.read_csv(PATH, 1024, column_defaults=[[b""]] + [[0.0]] * COLS, engine="arrow")
rows = sum(len(b["name"]) for b in ds)""",
    "pyarrow-open_csv": """
import pyarrow as pa, pyarrow.csv as pc
types = {"name": pa.binary(), **{f"c{i}": pa.float32() for i in range(COLS)}}
reader = pc.open_csv(PATH, parse_options=pc.ParseOptions(newlines_in_values=True),
                     convert_options=pc.ConvertOptions(column_types=types))
rows = 0
for batch in reader:
    cols = [batch.column(i).to_numpy(zero_copy_only=False) for i in range(COLS + 1)]
    rows += batch.num_rows""",
    "pyarrow-read_csv": """
import pyarrow as pa, pyarrow.csv as pc
types = {"name": pa.binary(), **{f"c{i}": pa.float32() for i in range(COLS)}}
table = pc.read_csv(PATH, parse_options=pc.ParseOptions(newlines_in_values=True),
                    convert_options=pc.ConvertOptions(column_types=types))
cols = [table.column(i).to_numpy() for i in range(COLS + 1)]
rows = table.num_rows""",
}

SEED004_SIDES = {
    side: f"""
import {module} as tf
dataset = tf.data.TextLineDataset(PATH)
dataset = dataset.skip(1) # Skip header row if present
dataset = dataset.map(lambda line: tf.io.decode_csv(line, record_defaults=[[0.0]] * 100))
dataset = dataset.batch(32)
dataset = dataset.prefetch(buffer_size=tf.data.AUTOTUNE)
rows = sum(int(b[0].shape[0]) for b in dataset)"""
    for side, module in (("headrace-tf_compat", "headrace.tf_compat"), ("tf.data", "tensorflow"))
}

MAKE_SIDES = {
    "headrace-make_csv_dataset": """
import headrace as hr, pyarrow.csv
ds = hr.make_csv_dataset(PATH, 1024, num_epochs=1, shuffle=False)
rows = sum(len(b["c0"]) for b in ds)""",
    "tf-make_csv_dataset": """
import tensorflow as tf
ds = tf.data.experimental.make_csv_dataset(PATH, 1024, num_epochs=1, shuffle=False)
rows = sum(int(b["c0"].shape[0]) for b in ds)""",
    "headrace-CsvDataset": """
import headrace as hr, pyarrow.csv
ds = hr.CsvDataset(PATH, [[0.0]] * COLS, header=True).batch(1024)
rows = sum(len(b[0]) for b in ds)""",
    "headrace-make-shuffled": """
import headrace as hr, pyarrow.csv
ds = hr.make_csv_dataset(PATH, 1024, num_epochs=1, shuffle_seed=1)
rows = sum(len(b["c0"]) for b in ds)""",
    "tf-make-shuffled": """
import tensorflow as tf
ds = tf.data.experimental.make_csv_dataset(PATH, 1024, num_epochs=1, shuffle_seed=1)
rows = sum(int(b["c0"].shape[0]) for b in ds)""",
}

#: case -> (sides, (measured side, anchor side, target ratio)..., columns, rows)
CASES: dict[str, tuple[dict[str, str], list[tuple[str, str, float]], int, int]] = {
    "quoted": (QUOTED_SIDES, [("headrace-arrow", "pyarrow-open_csv", 0.9),
                              ("headrace-arrow", "pyarrow-read_csv", 0.9)], 8, 370_000),
    "seed004": (SEED004_SIDES, [("headrace-tf_compat", "tf.data", 2.0)], 100, 50_000),
    "make": (MAKE_SIDES, [("headrace-make_csv_dataset", "tf-make_csv_dataset", 3.0),
                          ("headrace-make_csv_dataset", "headrace-CsvDataset", 0.9),
                          ("headrace-make-shuffled", "tf-make-shuffled", 3.0),
                          ("headrace-make-shuffled", "headrace-CsvDataset", 0.9)], 20, 300_000),
}


def write_data(path: str, case: str, rows: int, cols: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    with open(path, "w") as handle:
        if case != "quoted":
            handle.write(",".join(f"c{i}" for i in range(cols)) + "\n")
            for start in range(0, rows, 100_000):
                block = rng.random((min(100_000, rows - start), cols)).astype(np.float32)
                np.savetxt(handle, block, fmt="%.6g", delimiter=",")
            return
        words = ["alpha", "be,ta", 'ga""mma', "del\nta", "", "eps ilon"]
        handle.write("name," + ",".join(f"c{i}" for i in range(cols)) + "\n")
        for start in range(0, rows, 100_000):
            block = rng.random((min(100_000, rows - start), cols)).astype(np.float32)
            handle.writelines(
                f'"{words[(start + i) % 6]} {start + i}",' + ",".join(f"{v:.6g}" for v in row)
                + "\n" for i, row in enumerate(block))


def run_case(case: str, rows: int | None, repeats: int) -> int:
    """One of the CASES, its sides interleaved; writes results/csv_<case>.md."""
    sides, ratios, cols, default_rows = CASES[case]
    rows = rows or default_rows
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "data.csv")
    try:
        write_data(path, case, rows, cols)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
               "TF_CPP_MIN_LOG_LEVEL": "3"}
        runs: dict[str, list[dict[str, float]]] = {}
        load_before = os.getloadavg()[0]
        for _ in range(repeats):
            for side, text in sides.items():
                imports, _, body = text.strip().partition("\n")
                code = RUNNER.format(path=path, cols=cols, imports=imports, body=body)
                out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, env=env, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                assert r["rows"] == rows, (side, r)
                runs.setdefault(side, []).append(r)
                print(f"{side:26s} {r['rows'] / r['seconds']:10.0f} rows/s  cpu "
                      f"{r['cpu_s']:6.2f} s  peak RSS {r['peak_rss'] / 2**20:6.0f} MiB",
                      flush=True)
        load_after = os.getloadavg()[0]
        megabytes = os.path.getsize(path) / 1e6
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rate = {side: statistics.median(r["rows"] / r["seconds"] for r in rs)
            for side, rs in runs.items()}
    cpu = {side: statistics.median(r["cpu_s"] for r in rs) for side, rs in runs.items()}
    lines = [f"# CSV case `{case}`: {rows:,} rows, {megabytes:.1f} MB", "",
             f"Command: `PYTHONPATH=src python benchmarks/bench_csv.py --case {case}`. "
             f"{os.cpu_count()} cores, Python {sys.version.split()[0]}; each side in its own "
             f"process, {repeats} interleaved runs, medians; load average {load_before:.1f} "
             f"before, {load_after:.1f} after (the machine is shared: wall-clock rows/s "
             "moves with the load, process CPU time (all threads) much less).", "",
             "| side | rows/s | runs (rows/s) | CPU s | peak RSS (MiB) |",
             "|---|---|---|---|---|"]
    for side, rs in runs.items():
        each = " ".join(f"{r['rows'] / r['seconds']:.0f}" for r in rs)
        lines.append(f"| {side} | {rate[side]:.0f} | {each} | {cpu[side]:.2f} | "
                     f"{max(r['peak_rss'] for r in rs) / 2**20:.0f} |")
    lines.append("")
    for measured, anchor, target in ratios:
        lines.append(f"- {measured} vs {anchor}: {rate[measured] / rate[anchor]:.2f}x rows/s, "
                     f"{cpu[anchor] / cpu[measured]:.2f}x by CPU time (target >= {target}x)")
    out_path = os.path.join(os.path.dirname(__file__), "results", f"csv_{case}.md")
    with open(out_path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(ratios):]))
    return 0


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
print(json.dumps({{"rows": rows, "seconds": seconds, "cpu_s": cpu, "peak_rss": peak}}),
      flush=True)
# Measured and printed: skip the interpreter's shutdown, where a process that read with
# pyarrow sometimes aborts ("terminate called without an active exception", ~1 run in
# 6 under load) after the work is done, which would end the whole benchmark.
import os; os._exit(0)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="floats", choices=["floats", *CASES])
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--cols", type=int, default=20)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each side, interleaved; the median is reported")
    args = parser.parse_args(argv)
    if args.case != "floats":
        return run_case(args.case, args.rows, args.repeats)
    args.rows = args.rows or 1_000_000
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
