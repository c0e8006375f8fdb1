"""The budget (G1) against the adversary's cases of issue 23, on one or two source trees.

    python benchmarks/bench_g1_adversary.py [--src OLD_SRC] [--src NEW_SRC] [--only NAME]

Each case runs in a fresh child with the tree's ``src`` first on ``sys.path``. A
sampler thread reads the Pss_Anon + Pss_Shmem of the child and every process under
it (``/proc/<pid>/smaps_rollup``) every few milliseconds; the case reports its peak
growth over the start, the bound it must stay within (budget + 10% + 64 MiB, plus
the one element the user's own code made where the case has one), and how it ended
(finished, or which error). Prints one row per case and tree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

MIB = 1 << 20

# Shared by every child: the sampler (PSS of the process tree) and the result line.
PRELUDE = r'''
import json, os, sys, threading, time
def _tree(pid):
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as handle:
                children = [int(t) for t in handle.read().split()]
        except OSError:
            continue
        found.extend(children); frontier.extend(children)
    return found
def _pss():
    total = 0
    for pid in _tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total
class Sampler:
    def __init__(self):
        self.start = _pss(); self.peak = self.start; self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True); self.thread.start()
    def run(self):
        last = time.monotonic()
        while not self.stop:
            self.peak = max(self.peak, _pss()); time.sleep(0.003)
            if time.monotonic() - last > 1.0:  # so a case that hangs still says how far it grew
                last = time.monotonic()
                print(f"@@PEAK@@ {self.peak - self.start}", flush=True)
    def growth(self):
        self.stop = True; self.thread.join(); self.peak = max(self.peak, _pss())
        return self.peak - self.start
def report(sampler, outcome, **extra):
    print("@@RESULT@@ " + json.dumps({"growth": sampler.growth(), "outcome": outcome, **extra}))
def drain(ds, delay=0.0):
    """Iterate ``ds`` under the sampler; report how it ended."""
    s = Sampler(); n = 0
    try:
        for _ in ds:
            n += 1
            if delay:
                time.sleep(delay)
        report(s, f"finished ({n} elements)")
    except Exception as e:
        report(s, type(e).__name__ + ": " + str(e)[:160])
import numpy as np
import headrace as hr
MiB = 1 << 20
'''

# name: (budget MiB, extra bound bytes (one element the user's code made), code)
CASES: dict[str, tuple[int, int, str]] = {
    "process map, outputs 128 B -> 2 MB after 3,000": (64, 0, '''
def grow(i):
    return np.ones(16 if i < 3000 else 2_000_000 // 8, np.float64)
if __name__ == "__main__":
    ds = hr.Dataset.range(3600).map(grow, num_parallel_calls=2, workers="processes")
    ds = ds.with_options(hr.Options(memory_budget=64 * MiB))
    drain(ds, 0.0005)
'''),
    "thread map, outputs 128 B -> 400 KB after 3,000": (32, 0, '''
def grow(i):
    return np.ones(16 if i < 3000 else 400_000 // 8, np.float64)
ds = hr.Dataset.range(4000).map(grow, num_parallel_calls=2)
ds = ds.with_options(hr.Options(memory_budget=32 * MiB))
drain(ds, 0.0002)
'''),
    "process map, one 256 MiB output": (64, 256 * MIB, '''
def giant(i):
    return np.ones(256 * MiB // 8 if i == 5 else 16, np.float64)
if __name__ == "__main__":
    ds = hr.Dataset.range(20).map(giant, num_parallel_calls=2, workers="processes")
    ds = ds.with_options(hr.Options(memory_budget=64 * MiB))
    drain(ds)
'''),
    "thread map, one 256 MiB output": (64, 256 * MIB, '''
def giant(i):
    return np.ones(256 * MiB // 8 if i == 5 else 16, np.float64)
ds = hr.Dataset.range(20).map(giant, num_parallel_calls=2)
ds = ds.with_options(hr.Options(memory_budget=64 * MiB))
drain(ds)
'''),
    "thread map, a list of 1 M ints": (32, 36 * MIB, '''
def many(i):
    return list(range(1_000_000)) if i == 3 else [i]
ds = hr.Dataset.range(10).map(many, num_parallel_calls=2)
ds = ds.with_options(hr.Options(memory_budget=32 * MiB))
drain(ds)
'''),
    "8 pipelines on a 64 MiB default, prefetch(64) of 1 MiB": (64, 0, '''
import headrace.core.run as run
from headrace._memory.budget import MemoryBudget
run._default_budget = MemoryBudget(64 * MiB)
def gen():
    for i in range(200):
        yield np.full(MiB // 8, i, np.float64)
pipes = [hr.Dataset.from_generator(gen, output_signature=hr.TensorSpec((MiB // 8,), np.float64)).prefetch(64)
         for _ in range(8)]
s = Sampler()
try:
    its = [iter(p) for p in pipes]
    for it in its:
        next(it)
    time.sleep(1.0)
    for _ in range(30):
        for it in its:
            next(it)
    booked = run._default_budget.peak if hasattr(run._default_budget, "peak") else None
    report(s, "finished", booked_peak=booked)
except Exception as e:
    report(s, type(e).__name__ + ": " + str(e)[:120])
'''),
    "a 48 MB line in a text file": (16, 0, '''
import tempfile
path = os.path.join(tempfile.mkdtemp(), "lines.txt")
with open(path, "wb") as f:
    f.write(b"short\\n" * 1000 + b"x" * 48_000_000 + b"\\n" + b"after\\n" * 10)
ds = hr.TextLineDataset(path).with_options(hr.Options(memory_budget=16 * MiB))
drain(ds)
'''),
    "a 9 KB GIF: 8000x8000 screen, 400 frames": (64, 0, '''
import io, struct, zlib
import headrace.image as hi
def gif():
    out = bytearray(b"GIF89a" + struct.pack("<HH", 8000, 8000) + bytes([0x80, 0, 0]))
    out += bytes(6)  # a 2-colour global table
    out += b"!\\xff\\x0bNETSCAPE2.0\\x03\\x01\\x00\\x00\\x00"
    for k in range(400):
        out += b"!\\xf9\\x04\\x00\\x00\\x00\\x00\\x00"
        out += b"," + struct.pack("<HHHH", k % 8000, 0, 1, 1) + b"\\x00"
        out += bytes([2, 2, 0x4c, 0x01, 0])  # LZW min size 2: clear, 0, end
    out += b";"
    return bytes(out)
data = gif()
ds = hr.Dataset.from_tensor_slices([data]).map(lambda b: hi.decode_gif(b)).with_options(
    hr.Options(memory_budget=64 * MiB))
s = Sampler()
try:
    list(ds)
    report(s, "finished", nbytes=len(data))
except Exception as e:
    report(s, type(e).__name__ + ": " + str(e)[:160], nbytes=len(data))
'''),
}


def run_case(src: str, name: str, timeout: float = 120) -> dict[str, object]:
    budget, extra, code = CASES[name]
    env = dict(os.environ, PYTHONPATH=src, PYTHONWARNINGS="ignore")
    # A file, not -c: worker processes (forkserver) import the main module by its path.
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="g1_case_", delete=False) as f:
        f.write(PRELUDE + textwrap.dedent(code))
    try:
        done = subprocess.run([sys.executable, f.name], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        peaks = [int(line.split()[1]) for line in out.splitlines() if line.startswith("@@PEAK@@")]
        return {"outcome": f"still running after {timeout:.0f} s (killed)",
                "growth": max(peaks, default=-1),
                "bound": int(budget * MIB * 1.1) + 64 * MIB + extra}
    finally:
        os.unlink(f.name)
    for line in done.stdout.splitlines():
        if line.startswith("@@RESULT@@ "):
            result: dict[str, object] = json.loads(line.split(" ", 1)[1])
            result["bound"] = int(budget * MIB * 1.1) + 64 * MIB + extra
            return result
    return {"outcome": f"crashed rc={done.returncode}: {done.stderr[-300:]}", "growth": -1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", help="a tree's src directory (repeatable)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args(argv)
    sources = args.src or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")]
    broken = 0
    for name in CASES:
        if args.only and args.only not in name:
            continue
        for src in sources:
            result = run_case(src, name)
            growth, bound = int(result["growth"]), int(result.get("bound", 0))  # type: ignore[call-overload]
            held = 0 <= growth <= bound
            broken += not held
            print(f"{name:<58} {os.path.basename(os.path.dirname(os.path.abspath(src))):<12} "
                  f"growth {growth / MIB:8.1f} MiB  bound {bound / MIB:7.1f} MiB  "
                  f"{'ok ' if held else 'OVER'}  {result['outcome']}", flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
