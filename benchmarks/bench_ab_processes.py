"""Before/after for worker processes: process maps and a process interleave on two trees.

    python benchmarks/bench_ab_processes.py OLD_SRC NEW_SRC [--rounds 3]

As :mod:`bench_ab` (a fresh child per tree, alternating, best of ``rounds``), over
the output sizes a worker's packing and allowance see: outputs in the pickle
(128 B), one segment per chunk (64 KiB), outputs of a MiB and of 16 MiB; and a
process interleave (one output per chunk, the interleave's own chunking). The
functions come from ``tests/support/process_fns.py`` (workers import them by name).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from bench_ab import run

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support")

_MAP = """
import functools
sys.path.insert(0, {tests!r})
import process_fns
fn = functools.partial(process_fns.jump_output, 1 << 62, {size}, 0, {seconds})
ds = (hr.Dataset.range({n}).map(fn, num_parallel_calls=2, workers="processes")
      .with_options(hr.Options(memory_budget="{budget}")))
def go():
    n = 0
    with iter(ds) as iterator:
        for element in iterator:
            n += 1
    return n
"""

_INTERLEAVE = """
import functools
sys.path.insert(0, {tests!r})
import process_fns
shard = functools.partial(process_fns.shard_arrays, rows=500, width=32)
ds = (hr.Dataset.range(8)
      .interleave(shard, cycle_length=4, num_parallel_calls=2, workers="processes")
      .with_options(hr.Options(memory_budget="256MiB")))
def go():
    n = 0
    with iter(ds) as iterator:
        for element in iterator:
            n += 1
    return n
"""

SCENARIOS = {
    "process map, 128 B outputs, 100 us/element": _MAP.format(
        tests=TESTS, size=128, seconds=100e-6, n=8000, budget="64MiB"),
    "process map, 64 KiB outputs, 50 us/element": _MAP.format(
        tests=TESTS, size=64 << 10, seconds=50e-6, n=6000, budget="64MiB"),
    "process map, 1 MiB outputs": _MAP.format(
        tests=TESTS, size=1 << 20, seconds=0.0, n=1000, budget="64MiB"),
    "process map, 16 MiB outputs": _MAP.format(
        tests=TESTS, size=16 << 20, seconds=0.0, n=100, budget="512MiB"),
    "process interleave, rows of 256 B": _INTERLEAVE.format(tests=TESTS),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-k", default="", help="only scenarios whose name contains this")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    print("| scenario | before (/s) | after (/s) | after / before |")
    print("|---|---|---|---|")
    for name, body in SCENARIOS.items():
        if args.k not in name:
            continue
        old = new = 0.0
        for _ in range(args.rounds):
            old = max(old, run(args.old, body, tmp))
            new = max(new, run(args.new, body, tmp))
        print(f"| {name} | {old:,.0f} | {new:,.0f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
