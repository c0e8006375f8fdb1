"""Before/after for the engine's hot paths: the same headrace scenarios on two source trees.

    python benchmarks/bench_ab.py OLD_SRC NEW_SRC [--rounds 5]
    python benchmarks/bench_ab.py OLD_SRC NEW_SRC --instructions [--jobs 4] [--keep DIR]

Each scenario runs in a fresh child per tree, alternating, best of ``rounds``; prints
rows (or records) per second for each tree and the ratio new/old. Used to check that
a change to the core costs no throughput (issue: core v2, "within 5%").

Wall-clock ratios swing with the load of a shared machine; ``--instructions`` counts
the instructions of one ``go()`` under valgrind's callgrind instead (all threads of the
child; worker processes are not counted), with fewer rows, and prints the spread between
two runs of the same tree beside the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

SCENARIOS = {
    "array batch(1000)": """
x = np.zeros((ROWS, 250), np.float64)
ds = hr.Dataset.from_tensor_slices(x).batch(1000)
def go():
    return sum(len(b) for b in ds)
""",
    "array shuffle(all) batch(1000)": """
x = np.zeros((ROWS, 250), np.float64)
ds = hr.Dataset.from_tensor_slices(x).shuffle(ROWS, seed=1).batch(1000)
def go():
    return sum(len(b) for b in ds)
""",
    "array batch(1024), per-batch overhead": """
x = np.zeros((ROWS, 8), np.float32)
ds = hr.Dataset.from_tensor_slices(x).batch(1024)
def go():
    n = 0
    for b in ds:
        n += len(b)
    return n
""",
    "generator -> prefetch -> batch(64)": """
def gen():
    for i in range(ROWS):
        yield np.full(16, i, np.float32)
ds = hr.Dataset.from_generator(gen, output_signature=hr.TensorSpec((16,), np.float32))
ds = ds.prefetch(hr.AUTOTUNE).batch(64)
def go():
    return sum(len(b) for b in ds)
""",
    "range -> map(2 threads) -> shuffle(1000) -> batch(64)": """
ds = hr.Dataset.range(ROWS).map(lambda i: np.full(16, i, np.float32), num_parallel_calls=2)
ds = ds.shuffle(1000, seed=0).batch(64)
def go():
    return sum(len(b) for b in ds)
""",
    "range -> map(2 threads, deterministic=False) -> batch(64)": """
ds = hr.Dataset.range(ROWS).map(lambda i: np.full(16, i, np.float32), num_parallel_calls=2,
                                   deterministic=False).batch(64)
def go():
    return sum(len(b) for b in ds)
""",
    "range -> map(2 processes) -> batch(256)": """
ds = hr.Dataset.range(ROWS).map(np.negative, num_parallel_calls=2, workers="processes")
ds = ds.batch(256)
def go():
    return sum(len(b) for b in ds)
""",
    "save_tfrecords of small dicts": """
import shutil
ds = hr.Dataset.range(ROWS).map(lambda i: {"x": np.full(8, i, np.float32), "y": i})
def go():
    out = os.path.join(TMP, f"saved{os.getpid()}")  # children may run side by side
    shutil.rmtree(out, ignore_errors=True)
    ds.save_tfrecords(out, num_shards=2, progress=False)
    return ROWS
""",
    "TFRecord read + batch(1024) + parse": """
from headrace.io.example import FixedLenFeature
path = os.path.join(TMP, f"r{ROWS}.tfrecord")
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
path = os.path.join(TMP, f"r{ROWS}.tfrecord")
if not os.path.exists(path):
    write_tfrecord(path, [serialize_example({"x": np.full(40, i, np.float32), "y": np.int64(i)})
                          for i in range(ROWS)])
""",
}


#: Rows per scenario: (wall-clock mode, instruction mode). Callgrind runs CPython ~50x
#: slower, so the instruction mode runs fewer rows, still enough that the instructions
#: counted in one go() are at least 10x their spread between two runs of the same tree
#: (the table prints that spread).
ROWS = {
    "array batch(1000)": (250_000, 25_000),
    "array shuffle(all) batch(1000)": (250_000, 25_000),
    "array batch(1024), per-batch overhead": (2_000_000, 200_000),
    "generator -> prefetch -> batch(64)": (100_000, 5_000),
    "range -> map(2 threads) -> shuffle(1000) -> batch(64)": (100_000, 5_000),
    "range -> map(2 threads, deterministic=False) -> batch(64)": (100_000, 5_000),
    "range -> map(2 processes) -> batch(256)": (200_000, 20_000),
    "save_tfrecords of small dicts": (50_000, 2_000),
    "TFRecord read + batch(1024) + parse": (200_000, 10_000),
}

CHILD = """
import os, sys, time, json
import numpy as np
import headrace as hr
TMP = {tmp!r}
ROWS = {rows}
{body}
go()  # warm
best = None
for _ in range(3):
    t = time.perf_counter(); n = go(); dt = time.perf_counter() - t
    best = dt if best is None else min(best, dt)
print(json.dumps({{"rate": n / best}}))
"""

#: The instruction mode's child, one per tree and round: it imports numpy and headrace
#: once under callgrind (most of a child's cost there), then forks a fresh process per
#: scenario, so each scenario still starts from a bare interpreter. Callgrind dumps its
#: counters (all threads, summed) at each client request and zeroes them, so the dump
#: taken right after go() holds exactly the instructions go() ran, in every thread, and
#: none of startup or warm-up.
INSTR_CHILD = """
import ctypes, gc, os, sys, traceback
import numpy as np
import headrace as hr
TMP = {tmp!r}
OUT = {out!r}
_callgrind = ctypes.CDLL({lib!r})
for slug, rows, body in {scenarios!r}:
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            g = {{"__name__": "__main__", "np": np, "hr": hr, "os": os, "TMP": TMP, "ROWS": rows}}
            exec(body, g)
            g["go"]()  # warm: imports, first-call caches, valgrind's translations
            gc.collect()
            _callgrind.hr_callgrind_dump(("before " + slug).encode())
            n = g["go"]()
            _callgrind.hr_callgrind_dump(("go " + slug).encode())
            with open(os.path.join(OUT, slug + ".rows"), "w") as f:
                f.write(str(n))
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(f"scenario {{slug}} failed")
"""

#: A C call into callgrind's client-request mechanism. Callgrind's toggles are per thread
#: (CALLGRIND_TOGGLE_COLLECT, --toggle-collect, and CALLGRIND_ZERO_STATS act on the
#: calling thread only), so they would miss the work of map and prefetch threads; a
#: dump, without --separate-threads, writes and zeroes the costs of all threads.
CALLGRIND_C = """
#include <valgrind/callgrind.h>
void hr_callgrind_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""

#: The trigger line callgrind writes into the dump taken right after a scenario's go().
GO_TRIGGER = "desc: Trigger: Client Request: go "


def run(src: str, body: str, rows: int, tmp: str) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", CHILD.format(tmp=tmp, rows=rows, body=body)],
                         env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.splitlines()[-1])["rate"])


def setup(src: str, body: str, rows: int, tmp: str) -> None:
    env = {**os.environ, "PYTHONPATH": src}
    code = f"import os\nimport numpy as np\nTMP = {tmp!r}\nROWS = {rows}\n{body}"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    os.sync()


def build_callgrind_helper(tmp: str) -> str:
    """Compile the client-request helper; a clear error where valgrind or gcc is missing."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (callgrind) on PATH")
    source = os.path.join(tmp, "hr_callgrind.c")
    lib = os.path.join(tmp, "libhr_callgrind.so")
    with open(source, "w") as f:
        f.write(CALLGRIND_C)
    try:
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", lib, source],
                       capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise SystemExit(f"--instructions needs gcc and valgrind/callgrind.h to build "
                         f"{source}: {detail.strip()}") from None
    return lib


def count(src: str, names: list[str], tmp: str, lib: str,
          keep: str) -> dict[str, tuple[int, int]]:
    """Instructions each scenario's go() runs under callgrind (all threads of its process;
    worker processes run outside it, --trace-children=no), and the rows it returned."""
    out = tempfile.mkdtemp(dir=tmp)
    scenarios = [(slug(name), ROWS[name][1], SCENARIOS[name]) for name in names]
    code = INSTR_CHILD.format(tmp=tmp, out=out, lib=lib, scenarios=scenarios)
    env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0"}
    cmd = ["valgrind", "--tool=callgrind", "-q", "--trace-children=no",
           f"--callgrind-out-file={os.path.join(out, 'callgrind.out.%p')}", sys.executable, "-c", code]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"callgrind child for {src} failed ({done.returncode}):\n{done.stderr}")
    counted: dict[str, int] = {}
    for file in sorted(os.listdir(out)):
        if not file.startswith("callgrind.out."):
            continue
        path = os.path.join(out, file)
        with open(path) as f:
            lines = f.read().splitlines()
        trigger = [line for line in lines if line.startswith(GO_TRIGGER)]
        if not trigger:
            continue
        name = trigger[0][len(GO_TRIGGER):]
        counted[name] = int([line for line in lines if line.startswith("totals:")][-1].split()[1])
        if keep:
            shutil.copy(path, f"{keep}.{name}")
    result = {}
    for name in names:
        if slug(name) not in counted:
            raise SystemExit(f"no callgrind dump of {name!r} from {src} in {out}")
        with open(os.path.join(out, slug(name) + ".rows")) as f:
            result[name] = (counted[slug(name)], int(f.read()))
    shutil.rmtree(out)
    return result


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def instructions_table(args: argparse.Namespace, tmp: str) -> None:
    lib = build_callgrind_helper(tmp)
    rounds = args.rounds or 2
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout
    print(f"Instructions per row of one go(), {version.strip()} callgrind, {rounds} runs per "
          "tree alternating; noise: the largest spread between runs of the same tree.\n")
    print("| scenario | rows | before (instr/row) | after (instr/row) | after / before "
          "| noise (instr/row) | noise / before |")
    print("|---|---|---|---|---|---|---|")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    names = [name for name in SCENARIOS if args.only in name]
    for name in names:
        if name in SETUP:
            setup(args.old, SETUP[name], ROWS[name][1], tmp)
    # One callgrind child per tree and round, alternating old and new; counts do not
    # depend on the load, so --jobs runs them side by side.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = {(side, r): pool.submit(
                    count, src, names, tmp, lib,
                    os.path.join(args.keep, f"{side}.{r}") if args.keep else "")
                for r in range(rounds) for side, src in (("old", args.old), ("new", args.new))}
        counts = {key: run.result() for key, run in runs.items()}
    for name in names:
        per_row = {side: [instr / n for instr, n in (counts[side, r][name] for r in range(rounds))]
                   for side in ("old", "new")}
        old = sum(per_row["old"]) / rounds
        new = sum(per_row["new"]) / rounds
        noise = max(max(v) - min(v) for v in per_row.values())
        flag = "" if noise * 10 <= min(old, new) else " (under 10x noise: more rows)"
        print(f"| {name} | {ROWS[name][1]:,} | {old:,.1f} | {new:,.1f} | {new / old:.3f} "
              f"| {noise:,.1f} | {noise / old:.2%}{flag} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs per tree (default 3; 2 with --instructions)")
    parser.add_argument("--only", default="", help="run the scenarios whose name has this")
    parser.add_argument("--instructions", action="store_true",
                        help="count the instructions of one go() under callgrind instead of "
                             "timing: immune to other jobs on the machine")
    parser.add_argument("--keep", default="",
                        help="with --instructions: copy each go()'s callgrind dump into this "
                             "folder, for callgrind_annotate")
    parser.add_argument("--jobs", type=int, default=1,
                        help="with --instructions: callgrind children (one per tree and round) "
                             "run side by side")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    if args.instructions:
        instructions_table(args, tmp)
        return
    rounds = args.rounds or 3
    print("| scenario | before (/s) | after (/s) | after / before |")
    print("|---|---|---|---|")
    for name, body in SCENARIOS.items():
        if args.only not in name:
            continue
        rows = ROWS[name][0]
        if name in SETUP:
            setup(args.old, SETUP[name], rows, tmp)
        old = new = 0.0
        for _ in range(rounds):
            old = max(old, run(args.old, body, rows, tmp))
            new = max(new, run(args.new, body, rows, tmp))
        print(f"| {name} | {old:,.0f} | {new:,.0f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
