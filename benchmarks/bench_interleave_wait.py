"""Interleave when reads wait: does AUTOTUNE start threads, and does it pay?

headrace's ``interleave(num_parallel_calls=AUTOTUNE)`` reads sequentially while
its pulls compute (page-cached files: threads only add hand-offs) and switches
every slot to reading ahead on threads once the pulls mostly wait. This script
shows the second half: 32 TFRecord files of 500 records, read through
``interleave(cycle_length=16)`` where every record waits ``WAIT_S`` (a stand-in
for a network file system or object store answering each read: ``time.sleep``
releases the GIL exactly as a blocking read does), then ``batch(256)``.

Sides, each in its own fresh process (``_harness.run_child``):

* headrace-seq: no ``num_parallel_calls`` (the floor: every wait in a row);
* headrace-autotune: ``num_parallel_calls=AUTOTUNE`` (reports whether it switched);
* tf-interleave-autotune: tf.data with ``num_parallel_calls=AUTOTUNE``, the wait in
  a ``tf.py_function`` (tf.data's way to run Python per element).

Run: ``python benchmarks/bench_interleave_wait.py`` (about a minute); writes
``benchmarks/results/interleave-wait.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import child_main, fmt_rate, fmt_ratio, md_table, report_head, spawn, write_report

FILES, RECORDS_PER_FILE, CYCLE, BATCH = 32, 500, 16, 256
WAIT_S = 0.0002
SIDES = ["headrace-seq", "headrace-autotune", "tf-interleave-autotune"]


def _write_files(directory: str) -> list[str]:
    from headrace.io.example import serialize_example
    from headrace.io.tfrecord import write_tfrecord

    paths = []
    for f in range(FILES):
        path = os.path.join(directory, f"part-{f:03d}.tfr")
        write_tfrecord(
            path,
            (serialize_example({"id": f * RECORDS_PER_FILE + i}) for i in range(RECORDS_PER_FILE)),
        )
        paths.append(path)
    return paths


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    side, files = cfg["side"], cfg["files"]
    switched: bool | None = None
    if side.startswith("headrace"):
        import numpy as np

        import headrace as hr

        def wait(record: Any) -> Any:
            time.sleep(WAIT_S)
            return record

        def make() -> Any:
            parallel = hr.AUTOTUNE if side == "headrace-autotune" else None
            return hr.Dataset.from_tensor_slices(np.array(files, dtype=object)).interleave(
                lambda f: hr.TFRecordDataset(f).map(wait),
                cycle_length=CYCLE,
                num_parallel_calls=parallel,
            ).batch(BATCH)

        def count(iterator: Any) -> int:
            return sum(len(batch) for batch in iterator)

    else:
        import tensorflow as tf

        def wait_tf(record: Any) -> Any:
            time.sleep(WAIT_S)
            return record

        def make() -> Any:
            inner = lambda f: tf.data.TFRecordDataset(f).map(  # noqa: E731
                lambda r: tf.py_function(wait_tf, [r], tf.string)
            )
            return tf.data.Dataset.from_tensor_slices(files).interleave(
                inner, cycle_length=CYCLE, num_parallel_calls=tf.data.AUTOTUNE
            ).batch(BATCH)

        def count(iterator: Any) -> int:
            return sum(int(batch.shape[0]) for batch in iterator)

    best = float("inf")
    records = 0
    for _ in range(cfg["passes"]):
        iterator = iter(make())
        start = time.perf_counter()
        records = count(iterator)
        best = min(best, time.perf_counter() - start)
        if side == "headrace-autotune":
            switched = _interleave_threaded(iterator._tree)
    return {"records": records, "seconds": best, "switched": switched}


def _interleave_threaded(node: Any) -> bool | None:
    """Whether the interleave in a headrace iterator tree reads on threads (by now)."""
    if hasattr(node, "threaded"):
        return bool(node.threaded)
    for inner in getattr(node, "inputs", ()):
        found = _interleave_threaded(inner)
        if found is not None:
            return found
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, {"interleave-wait": _child})
    info, sections = report_head(
        f"Interleave when every read waits {WAIT_S * 1e6:.0f} µs",
        sys.executable,
        f"each side in its own fresh process, best of {args.passes} passes.",
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        files = _write_files(directory)
        results = {
            side: spawn(
                __file__,
                sys.executable,
                {"kind": "interleave-wait", "side": side, "files": files, "passes": args.passes},
                timeout=600,
            )
            for side in SIDES
        }
    total = FILES * RECORDS_PER_FILE
    floor = total * WAIT_S
    tf = results["tf-interleave-autotune"]
    tf_rate = total / tf["seconds"] if "seconds" in tf else None
    rows = []
    for side, res in results.items():
        if "error" in res:
            rows.append([side, "ERROR: " + res["error"], "", "", ""])
            continue
        rate = res["records"] / res["seconds"]
        rows.append([
            side,
            fmt_rate(rate),
            fmt_ratio(rate, tf_rate),
            f"{floor / res['seconds']:.1f}x",
            {True: "yes", False: "no", None: "—"}[res["switched"]],
        ])
    sections += [
        f"{FILES} files x {RECORDS_PER_FILE} records, cycle_length {CYCLE}, batch({BATCH}). "
        f"'vs waits in a row': the sequential floor ({total} x {WAIT_S * 1e6:.0f} µs = "
        f"{floor:.1f} s) over the time taken.",
        "",
        md_table(
            ["side", "records/s", "vs tf", "vs waits in a row", "AUTOTUNE switched to threads"],
            rows,
        ),
        "",
    ]
    write_report("interleave-wait", sections, {"machine": info, "results": results}, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
