"""Write the docs' performance table from the benchmark results (never by hand).

Usage: ``python benchmarks/readme_table.py`` after ``bench_core.py`` (and
``bench_tfrecord.py``, if run). Reads ``benchmarks/results/core.json`` and
``benchmarks/results/tfrecord.json``, and replaces the text between the
``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->`` markers in
docs/performance.md with a table of ratios against tf.data and the machine they ran on.
``--check`` exits 1 if the page's table is not what the results say.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
MiB = 1 << 20


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _rate(side: dict[str, Any]) -> float:
    return float(side.get("rows_per_s") or 0.0)


def _growth(side: dict[str, Any]) -> float:
    return float(side.get("peak_growth") or 0.0) / MiB


def _core_rows(core: dict[str, Any]) -> list[str]:
    rows = []
    for key, label in (
        ("scenario1", "500 MB array -> batch(1000)"),
        ("scenario2", "500 MB array -> shuffle(all) -> batch(1000)"),
    ):
        sides = core.get(key, {})
        ours, theirs = sides.get("headrace", {}), sides.get("tf.data", {})
        if _rate(ours) and _rate(theirs):
            rows.append(
                f"| {label} | {_rate(ours) / 1e6:.2f} M rows/s | "
                f"{_rate(ours) / _rate(theirs):.0f}x | {_growth(ours):.0f} MiB | "
                f"{_growth(theirs):,.0f} MiB |"
            )
    cells = [cell for cell in core.get("scenario3", []) if cell.get("headrace")]
    if cells:
        within = sum(
            1
            for cell in cells
            if _growth(cell["headrace"]) * MiB <= cell["headrace"].get("bound", 0)
        )
        worst = max(cells, key=lambda c: c["headrace"]["peak_growth"] / c["headrace"]["bound"])
        rows.append(
            f"| budgets 64 MiB / 256 MiB / 1 GiB vs pipelines asking for far more "
            f"({len(cells)} cells) | {within}/{len(cells)} within budget + 10% + 64 MiB | | "
            f"worst: {_growth(worst['headrace']):.0f} MiB of {worst['headrace']['bound'] / MiB:.0f}"
            f" MiB bound ({worst['budget_name']}, {worst['pipeline']}) | up to "
            f"{max(_growth(c.get('tf.data', {})) for c in cells):,.0f} MiB |"
        )
    return rows


def _fastest(sides: dict[str, Any], prefix: str) -> tuple[str, dict[str, Any]] | None:
    """The fastest side named ``prefix...`` (by best pass); sides that skip parsing excluded."""
    found = [
        (name, side)
        for name, side in sides.items()
        if name.startswith(prefix) and not name.endswith("noparse") and side.get("best_s")
    ]
    return min(found, key=lambda item: item[1]["best_s"]) if found else None


def _tfrecord_rows(tfrecord: dict[str, Any]) -> list[str]:
    rows = []
    scenarios = (
        ("scenario1", "headrace", "tf", "TFRecord read + parse, 200k x 200 B", "records"),
        ("scenario2", "headrace", "tf", "TFRecord read + parse, 20k x 100 KB", "bytes"),
        (
            "scenario3",
            "headrace-batched",
            "tf",
            "TFRecord write, 200k Examples, 16 shards",
            "records",
        ),
        (
            "scenario4",
            "headrace-autotune",
            "tf",
            "interleave over 1,000 files, cycle 16, num_parallel_calls=AUTOTUNE",
            "records",
        ),
        ("scenario4", "headrace-seq", "tf", "same, sequential interleave", "records"),
    )
    for key, ours_name, theirs_prefix, label, unit in scenarios:
        sides = tfrecord.get(key, {})
        ours, theirs = sides.get(ours_name), _fastest(sides, theirs_prefix)
        if not ours or not ours.get("best_s") or theirs is None:
            continue
        if unit == "bytes":
            speed = f"{ours['file_bytes'] / ours['best_s'] / 1e9:.2f} GB/s"
        else:
            speed = f"{ours['records'] / ours['best_s'] / 1e6:.2f} M records/s"
        rows.append(
            f"| {label} | {speed} | {theirs[1]['best_s'] / ours['best_s']:.2f}x "
            f"(best tf: {theirs[0]}) | {ours['whole_peak_rss'] / MiB:.0f} MiB peak RSS | "
            f"{theirs[1]['whole_peak_rss'] / MiB:.0f} MiB peak RSS |"
        )
    return rows


def _interleave_wait_rows(report: dict[str, Any] | None) -> list[str]:
    """bench_interleave_wait.py: AUTOTUNE when every read waits (it should use threads)."""
    if report is None:
        return []
    results = report["results"]
    ours, theirs = results.get("headrace-autotune", {}), results.get("tf-interleave-autotune", {})
    if "seconds" not in ours or "seconds" not in theirs:
        return []
    switched = "switched to threads" if ours.get("switched") else "stayed sequential"
    return [
        f"| interleave, cycle 16, every read waiting 200 µs (32 files x 500), AUTOTUNE | "
        f"{ours['records'] / ours['seconds'] / 1e6:.3f} M records/s ({switched}) | "
        f"{theirs['seconds'] / ours['seconds']:.2f}x | — | — |"
    ]


def _workers_rows(rounds: dict[str, list[dict[str, Any]]] | None) -> list[str]:
    """bench_workers_tfrecord.py at 1 M records: read + parse in 2 worker processes against
    tf.data's best configuration, medians of the interleaved rounds."""
    if not rounds or not rounds.get("headrace-2proc"):
        return []

    def median_rate(side: str) -> float:
        return statistics.median(r["timed"] / r["wall_s"] for r in rounds[side])

    ours = median_rate("headrace-2proc")
    best, theirs = max((median_rate(side), side) for side in rounds if side.startswith("tf-"))
    records = rounds["headrace-2proc"][0]["records"]
    return [
        f"| TFRecord read + parse, {records / 1e6:g}M x 200 B, 2 worker processes "
        f"(`workers=\"processes\"`) | {ours / 1e6:.2f} M records/s | {ours / best:.2f}x "
        f"(best tf: {theirs}) | — | — |"
    ]


def _device_table() -> list[str]:
    """The many-core and GPU rows (``benchmarks/device.sh`` on a lent 16-core machine with
    one GPU), as a table of their own: another machine, and no tf.data there."""
    gpu, workers = _load("host-to-gpu"), _load("workers-device-16")
    if gpu is None or gpu.get("config", {}).get("device") != "cuda":
        return []
    machine, rows = gpu["machine"], gpu["rows"]
    lines = [
        "",
        f"On a lent machine with {machine['cores']} cores ({machine['cpu']}), one NVIDIA "
        f"H200 and {machine['ram_gib']} GiB, Python {machine['python']}, NumPy "
        f"{machine['numpy']}, PyTorch {machine['torch']} (no TensorFlow there): "
        "`bash benchmarks/device.sh`.",
        "",
        "| scenario | headrace | vs the best PyTorch way |",
        "|---|---|---|",
    ]
    others = [r for r in rows[1:] if r.get("gb_per_s")]
    if rows[0].get("gb_per_s") and others:
        best = max(others, key=lambda r: r["gb_per_s"])
        lines.append(
            f"| shuffled 224x224x3 uint8 batches of 256 to the GPU, `to_torch(device, "
            f"pin_memory=True)` | {rows[0]['gb_per_s']:.1f} GB/s | "
            f"{rows[0]['gb_per_s'] / best['gb_per_s']:.1f}x ({best['side']}, "
            f"{best['workers']} workers) |")
    if workers:
        by_name = {r["name"]: r for r in workers if "per_s" in r}
        one = by_name.get("headrace 1 thread")
        ours = next((r for n, r in by_name.items() if n.endswith(" processes")), None)
        theirs = next((r for n, r in by_name.items() if n.startswith("torch")), None)
        if one and ours and theirs:
            lines.append(
                f"| 1 ms pure-Python map, {ours['workers']} worker processes | "
                f"{ours['per_s'] / one['per_s']:.1f}x one thread | "
                f"{ours['per_s'] / theirs['per_s']:.2f}x (DataLoader, {theirs['workers']} "
                "workers) |")
    return lines


def build_table() -> str:
    core, tfrecord = _load("core"), _load("tfrecord")
    if core is None:
        raise SystemExit("no benchmarks/results/core.json: run benchmarks/bench_core.py first")
    machine = core.get("machine", {})
    lines = [
        f"Measured on {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{machine.get('ram_gib', '?')} GiB, Python {machine.get('python', '?')}, "
        f"NumPy {machine.get('numpy', '?')}, TensorFlow {machine.get('tensorflow', '?')}; "
        "each side in its own fresh process, best of several passes. Memory is the peak "
        "growth of anonymous + shared memory during iteration.",
        "",
        "| scenario | headrace | vs tf.data | headrace memory | tf.data memory |",
        "|---|---|---|---|---|",
        *_core_rows(core),
    ]
    if tfrecord is not None:
        lines += _tfrecord_rows(tfrecord)
    lines += _workers_rows(_load("workers-tfrecord-1m"))
    lines += _interleave_wait_rows(_load("interleave-wait"))
    scenario4 = core.get("scenario4", {})
    ours, theirs = scenario4.get("headrace", {}), scenario4.get("tensorflow", {})
    if ours and theirs:
        lines.append(
            f"| `import` | {ours['import_s'] * 1000:.0f} ms | "
            f"{theirs['import_s'] / ours['import_s']:.0f}x faster | "
            f"{ours['VmRSS'] / MiB:.0f} MiB RSS | {theirs['VmRSS'] / MiB:.0f} MiB RSS |"
        )
    lines += _device_table()
    lines.append("")
    lines.append(
        "Regenerate with `python benchmarks/bench_core.py && python benchmarks/bench_tfrecord.py "
        "&& python benchmarks/bench_workers_tfrecord.py --records 1000000 --repeats 5 --out "
        "workers-tfrecord-1m && python benchmarks/bench_interleave_wait.py && python "
        "benchmarks/readme_table.py`; full tables in `benchmarks/results/`."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    readme = ROOT / "docs" / "performance.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{START}\n{build_table()}\n{END}{tail}"
    if args.check:
        return 0 if updated == text else 1
    readme.write_text(updated)
    print(build_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
