"""Before/after for the engine's hot paths: the same headrace scenarios on two source trees.

    python benchmarks/bench_ab.py OLD_SRC NEW_SRC [--rounds 5]

Each scenario runs in a fresh child per tree, alternating, best of ``rounds``; prints
rows (or records) per second for each tree and the ratio new/old. Used to check that
a change to the core costs no throughput (issue: core v2, "within 5%").

    python benchmarks/bench_ab.py OLD_SRC NEW_SRC --instructions

counts instead the instructions each tree executes per row (valgrind's callgrind:
one pass of the scenario at a tenth of its size, less the same child making the
pipeline without iterating it). On a shared or busy machine, where wall-clock
ratios swing by 10-40% from run to run, the counts repeat to a fraction of a
percent; they measure the work on the consumer's thread, so scenarios whose cost is
in other processes are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

SCENARIOS = {
    "array batch(1000)": """
x = np.zeros((250_000, 250), np.float64)
ds = hr.Dataset.from_tensor_slices(x).batch(1000)
def go():
    return sum(len(b) for b in ds)
""",
    "array shuffle(all) batch(1000)": """
x = np.zeros((250_000, 250), np.float64)
ds = hr.Dataset.from_tensor_slices(x).shuffle(250_000, seed=1).batch(1000)
def go():
    return sum(len(b) for b in ds)
""",
    "array batch(1024), per-batch overhead": """
x = np.zeros((2_000_000, 8), np.float32)
ds = hr.Dataset.from_tensor_slices(x).batch(1024)
def go():
    n = 0
    for b in ds:
        n += len(b)
    return n
""",
    "generator -> prefetch -> batch(64)": """
def gen():
    for i in range(100_000):
        yield np.full(16, i, np.float32)
ds = hr.Dataset.from_generator(gen, output_signature=hr.TensorSpec((16,), np.float32))
ds = ds.prefetch(hr.AUTOTUNE).batch(64)
def go():
    return sum(len(b) for b in ds)
""",
    "range -> map(2 threads) -> shuffle(1000) -> batch(64)": """
ds = hr.Dataset.range(100_000).map(lambda i: np.full(16, i, np.float32), num_parallel_calls=2)
ds = ds.shuffle(1000, seed=0).batch(64)
def go():
    return sum(len(b) for b in ds)
""",
    "range -> map(2 threads, deterministic=False) -> batch(64)": """
ds = hr.Dataset.range(100_000).map(lambda i: np.full(16, i, np.float32), num_parallel_calls=2,
                                   deterministic=False).batch(64)
def go():
    return sum(len(b) for b in ds)
""",
    "range -> map(2 processes) -> batch(256)": """
ds = hr.Dataset.range(200_000).map(np.negative, num_parallel_calls=2, workers="processes")
ds = ds.batch(256)
def go():
    return sum(len(b) for b in ds)
""",
    "save_tfrecords of small dicts": """
import shutil
ds = hr.Dataset.range(50_000).map(lambda i: {"x": np.full(8, i, np.float32), "y": i})
def go():
    out = os.path.join(TMP, "saved")
    shutil.rmtree(out, ignore_errors=True)
    ds.save_tfrecords(out, num_shards=2, progress=False)
    return 50_000
""",
    "TFRecord read + batch(1024) + parse": """
from headrace.io.example import FixedLenFeature
path = os.path.join(TMP, "r.tfrecord")
spec = {"x": FixedLenFeature((40,), np.float32), "y": FixedLenFeature((), np.int64)}
ds = hr.TFRecordDataset(path).batch(1024).parse_examples(spec)
def go():
    return sum(len(b["y"]) for b in ds)
""",
}

#: Inputs a scenario reads, made once before its rounds (by the old tree) and synced
#: to disk: both trees read the same bytes, and no child is timed while the writeback
#: of a file another one just wrote competes with it.
SETUP = {
    "TFRecord read + batch(1024) + parse": """
from headrace.io.example import serialize_example
from headrace.io.tfrecord import write_tfrecord
path = os.path.join(TMP, "r.tfrecord")
if not os.path.exists(path):
    write_tfrecord(path, [serialize_example({"x": np.full(40, i, np.float32), "y": np.int64(i)})
                          for i in range(200_000)])
""",
}

CHILD = """
import os, sys, time, json
import numpy as np
import headrace as hr
TMP = {tmp!r}
{body}
go()  # warm
best = None
for _ in range(3):
    t = time.perf_counter(); n = go(); dt = time.perf_counter() - t
    best = dt if best is None else min(best, dt)
print(json.dumps({{"rate": n / best}}))
"""


COUNTED = """
import os, sys
import numpy as np
import headrace as hr
TMP = {tmp!r}
{body}
if {iterate}:
    print("rows", go())
"""

#: Sizes divided by ten under callgrind (it runs Python ~50x slower).
_SMALLER = {"2_000_000": "200_000", "250_000": "25_000", "200_000": "20_000",
            "100_000": "10_000", "50_000": "5_000"}


def instructions(src: str, body: str, tmp: str) -> float:
    """Instructions per row of one pass of ``body``'s ``go()`` under ``src``."""
    for big, small in _SMALLER.items():
        body = body.replace(big, small)
    env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0"}
    counts, rows = [], 0
    for iterate in (False, True):
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
             sys.executable, "-c", COUNTED.format(tmp=tmp, body=body, iterate=iterate)],
            env=env, capture_output=True, text=True, check=True)
        counts.append(int(re.search(r"Collected : (\d+)", done.stderr).group(1)))
        if iterate:
            rows = int(re.search(r"^rows (\d+)", done.stdout, re.M).group(1))
    return (counts[1] - counts[0]) / rows


def run(src: str, body: str, tmp: str) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", CHILD.format(tmp=tmp, body=body)],
                         env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.splitlines()[-1])["rate"])


def setup(src: str, body: str, tmp: str) -> None:
    env = {**os.environ, "PYTHONPATH": src}
    code = f"import os\nimport numpy as np\nTMP = {tmp!r}\n{body}"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    os.sync()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="run the scenarios whose name has this")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per row under callgrind instead of timing")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    if args.instructions:
        print("| scenario | before (instructions/row) | after | before / after |")
        print("|---|---|---|---|")
        for name, body in SCENARIOS.items():
            if args.only not in name or "processes" in name:
                continue
            if name in SETUP:
                setup(args.old, SETUP[name], tmp)
            old, new = instructions(args.old, body, tmp), instructions(args.new, body, tmp)
            print(f"| {name} | {old:,.0f} | {new:,.0f} | {old / new:.2f} |", flush=True)
        return
    print("| scenario | before (/s) | after (/s) | after / before |")
    print("|---|---|---|---|")
    for name, body in SCENARIOS.items():
        if args.only not in name:
            continue
        if name in SETUP:
            setup(args.old, SETUP[name], tmp)
        old = new = 0.0
        for _ in range(args.rounds):
            old = max(old, run(args.old, body, tmp))
            new = max(new, run(args.new, body, tmp))
        print(f"| {name} | {old:,.0f} | {new:,.0f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
