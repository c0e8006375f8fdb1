"""Before/after for the engine's hot paths: the same headrace scenarios on two source trees.

    python benchmarks/bench_ab.py OLD_SRC NEW_SRC [--rounds 5]

Each scenario runs in a fresh child per tree, alternating, best of ``rounds``; prints
rows (or records) per second for each tree and the ratio new/old. Used to check that
a change to the core costs no throughput (issue: core v2, "within 5%").
"""

from __future__ import annotations

import argparse
import json
import os
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
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
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
