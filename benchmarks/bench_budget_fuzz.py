"""The large budget-fuzzer sweep (G1): N random pipelines, each in a fresh child process batch.

Usage: python benchmarks/bench_budget_fuzz.py [N=1000] [--start S] [--processes]

Uses the generator and runner of ``tests/support/fuzz_pipelines.py`` (the CI test runs a
small sweep of the same); every pipeline runs twice, to check its order. Writes ``benchmarks/results/budget_fuzz.md``: how many
pipelines finished, raised MemoryBudgetError, or failed; how many breached a
share, passed the budget by more than their counted overdraft, or grew past
budget + 10% + 64 MiB; and the worst growth against its bound.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from fuzz_pipelines import newer_spec, process_spec, random_spec  # noqa: E402

BATCH = 25


def run_batch(seeds: list[int], processes: bool = False, newer: bool = False) -> list[dict]:
    draw = newer_spec if newer else process_spec if processes else random_spec
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "fuzz_pipelines.py")],
        input=json.dumps([draw(seed) for seed in seeds]),
        capture_output=True, text=True, timeout=1800, check=False,
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    ran = {r["seed"] for r in results}
    for seed in seeds:  # a crashed child: every pipeline it did not report is a failure
        if seed not in ran:
            results.append({"seed": seed, "outcome": f"error: child exited {done.returncode}: "
                            + done.stderr[-300:], "violations": [], "accounted_peak": 0,
                            "overdrawn_peak": 0, "budget": 0, "growth": 0, "bound": 1,
                            "elements": 0, "seconds": 0})
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("count", nargs="?", type=int, default=1000)
    parser.add_argument("--start", type=int, default=100_000)
    parser.add_argument("--processes", action="store_true",
                        help="pipelines with maps on worker processes (tests' process_spec), "
                        "process interleaves and image decodes booked from their headers")
    parser.add_argument("--newer", action="store_true",
                        help="every pipeline with a process interleave and an image decode "
                        "(tests' newer_spec)")
    args = parser.parse_args()
    run = functools.partial(run_batch, processes=args.processes, newer=args.newer)
    seeds = list(range(args.start, args.start + args.count))
    started = time.perf_counter()
    # One batch at a time: two concurrent children would measure each other's noise less
    # than their own growth, but they share the machine's memory bandwidth.
    batches = [seeds[i:i + BATCH] for i in range(0, len(seeds), BATCH)]
    with ThreadPoolExecutor(1) as pool:
        results = [r for batch in pool.map(run, batches) for r in batch]
        # G3: every pipeline a second time, in another process: same elements, same order.
        again = {r["seed"]: r for batch in pool.map(run, batches) for r in batch}
    unstable = [r for r in results
                if (r["outcome"], r["elements"], r.get("order"))
                != (again[r["seed"]]["outcome"], again[r["seed"]]["elements"],
                    again[r["seed"]].get("order"))]
    elapsed = time.perf_counter() - started
    ok = [r for r in results if r["outcome"] == "ok"]
    refused = [r for r in results if r["outcome"].startswith("MemoryBudgetError")]
    errors = [r for r in results if r["outcome"].startswith("error")]
    breaches = [r for r in results if r["violations"]]
    over_books = [r for r in results
                  if r["accounted_peak"] > r["budget"] + r["overdrawn_peak"]]
    overdrafts = [r for r in results if r["overdrawn_peak"] > 0]
    over_rss = [r for r in results if r["growth"] > r["bound"]]
    worst = max(results, key=lambda r: r["growth"] / r["bound"])
    lines = [
        "# Budget fuzzer sweep" + (" (process interleaves and image decodes)" if args.newer
                                   else " (process maps)" if args.processes else ""),
        "",
        f"{len(results)} random pipelines (seeds {seeds[0]}..{seeds[-1]}), "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"{elapsed:.0f} s. Reproduce: `python benchmarks/bench_budget_fuzz.py {args.count} "
        f"--start {args.start}{' --processes' if args.processes else ''}"
        f"{' --newer' if args.newer else ''}`.",
        "",
        "| outcome | pipelines |",
        "|---|---|",
        f"| finished | {len(ok)} |",
        f"| MemoryBudgetError (minimum working sets do not fit) | {len(refused)} |",
        f"| other error (a bug) | {len(errors)} |",
        f"| a booking took a stage past its share (breach) | {len(breaches)} |",
        f"| accounted bytes passed the budget beyond counted overdrafts | {len(over_books)} |",
        f"| parallel-map overdraft used (outputs outgrew their estimate) | {len(overdrafts)} |",
        f"| RssAnon+RssShmem growth > budget + 10% + 64 MiB | {len(over_rss)} |",
        f"| a second run gave other elements or another order (G3) | {len(unstable)} |",
        "",
        f"Worst growth: {worst['growth'] / 2**20:.0f} MiB of a {worst['bound'] / 2**20:.0f} MiB "
        f"bound (seed {worst['seed']}): measured/bound {worst['growth'] / worst['bound']:.2f}.",
        "",
    ]
    for r in (errors + breaches + over_books + over_rss)[:20]:
        lines.append(f"- seed {r['seed']}: {r['outcome'][:200]} {r['violations'][:1]} "
                     f"growth {r['growth'] >> 20} MiB / bound {r['bound'] >> 20} MiB")
    for r in unstable[:20]:
        second = again[r["seed"]]
        lines.append(f"- seed {r['seed']} (G3): {r['elements']} elements, then "
                     f"{r['outcome'][:80]}; run again: {second['elements']} elements, then "
                     f"{second['outcome'][:80]}")
    out = ROOT / "benchmarks" / "results" / (
        "budget_fuzz-newer.md" if args.newer
        else "budget_fuzz-processes.md" if args.processes else "budget_fuzz.md"
    )
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if errors or breaches or over_books or over_rss or unstable else 0


if __name__ == "__main__":
    raise SystemExit(main())
