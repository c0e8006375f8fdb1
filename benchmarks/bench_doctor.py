"""What ``headrace doctor`` costs against a plain epoch of the same pipeline (issue 24).

An image-like pipeline: ``--images`` small JPEGs (40x40, made here with Pillow,
about 2 KB each, held in memory) -> map(a Python function: decode, random
32x32 crop, random flip, float32 in [0, 1], normalized, a small dict of
metadata) -> batch(64) -> prefetch(2). The map allocates several arrays and
Python objects an element, which is what makes ``tracemalloc`` expensive.

Each side runs in its own fresh interpreter (the same data, one side after the
other) and reports wall and process CPU seconds per epoch:

* **plain**: one warm-up epoch, then ``--epochs`` timed ones (``with iter(ds)``).
* **plain-traced-1**: the plain side under ``tracemalloc.start(1)``: what even the
  shallowest tracing costs this map.
* **profile**: ``headrace.profiling.profile(ds, epochs=...)`` (lint included).
* **doctor**: ``diagnose(ds)``, the doctor's default (8 epochs), the whole call
  (lint, every measure, attribution) divided by its 8 epochs.
* **doctor --deep**: ``diagnose(..., deep=True)``: ``tracemalloc`` with 16 frames
  over every epoch, which was the doctor's only mode before issue 24.
* **doctor-leaking**: the default doctor on the same pipeline with a map that
  keeps 4 KiB an element in a list of its closure: the doctor finds the leak and
  names the list that keeps it, with no traced epoch.
* **doctor-hidden-leak**: the same leak kept where no holder analysis looks (a
  list inside a tuple): the doctor then runs its short traced pass (3 more epochs
  under ``tracemalloc`` with deep tracebacks) to say where it was allocated. The
  worst case of the default doctor; its cost is divided by the 8 measured epochs.

The ratios are against the plain epoch: issue 24 asks for doctor <= 2x.

    PYTHONPATH=src python benchmarks/bench_doctor.py [--images 5000] [--epochs 3]

writes benchmarks/results/doctor.json (doctor-<images>.json for another
``--images``); the markdown table is printed, and benchmarks/results/doctor.md
quotes runs of it with their load.
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import (  # noqa: E402 -- after the path insert
    RESULTS,
    child_env,
    child_main,
    loadavg,
    md_table,
    run_child,
)

#: The doctor's default. Its least, 5 (3 fitted), asks a 4-sigma t-test with one degree of
#: freedom: noise under 1e-4 of the slope, which a 2 MiB/epoch leak here did not always meet.
DOCTOR_EPOCHS = 8
DEFAULT_IMAGES = 5000
SIDES = ("plain", "plain-traced-1", "profile", "doctor", "doctor-deep", "doctor-leaking", "doctor-hidden-leak")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pipeline(images: int, leak: str = "") -> Any:
    """The benchmark's dataset (deterministic: the same JPEGs and draws in every child)."""
    import io

    import numpy as np
    from PIL import Image

    import headrace as hr
    import headrace.image as hi

    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)
    blobs = []
    for k in range(images):
        buffer = io.BytesIO()
        Image.fromarray(np.roll(base, k, axis=0)).save(buffer, format="JPEG", quality=85)
        blobs.append(buffer.getvalue())
    labels = np.arange(images) % 10
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    kept: list[Any] = []
    hidden: tuple[list[Any]] = ([],)

    def augment(blob: Any, label: Any) -> Any:
        image = hi.decode_jpeg(blob)
        top, left = rng.integers(0, 9, 2)
        image = image[top : top + 32, left : left + 32]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        x = (image.astype(np.float32) / 255.0 - mean) / 0.25
        meta = {"label": int(label), "box": [int(top), int(left), 32, 32]}
        return x, np.int64(meta["label"])

    def keep(x: Any, label: Any) -> Any:
        kept.append(np.ones(512))  # 4 KiB an element, never freed
        return x, label

    def hide(x: Any, label: Any) -> Any:
        hidden[0].append(np.ones(512))
        return x, label

    ds = hr.Dataset.from_tensor_slices((np.array(blobs, dtype=object), labels)).map(augment)
    if leak:
        ds = ds.map(keep if leak == "kept" else hide)
    return ds.batch(64).prefetch(2)


def _child(config: dict[str, Any]) -> dict[str, Any]:
    import warnings

    side, images, epochs = config["kind"], config["images"], config["epochs"]
    leak = {"doctor-leaking": "kept", "doctor-hidden-leak": "hidden"}.get(side, "")
    ds = _pipeline(images, leak=leak)
    result: dict[str, Any] = {"side": side}
    if side.startswith("plain"):
        import tracemalloc

        if side == "plain-traced-1":
            tracemalloc.start(1)
        per = []
        for k in range(epochs + 1):
            wall, cpu = time.perf_counter(), _cpu()
            with iter(ds) as iterator:
                for _ in iterator:
                    pass
            if k:  # the first epoch warms caches and imports up
                per.append((time.perf_counter() - wall, _cpu() - cpu))
        result["epochs"] = epochs
        result["wall_s"] = sum(w for w, _ in per) / len(per)
        result["cpu_s"] = sum(c for _, c in per) / len(per)
        return result
    wall, cpu = time.perf_counter(), _cpu()
    if side == "profile":
        from headrace.profiling import profile

        profile(ds, epochs=epochs, progress=False)
        runs = epochs
    else:
        from headrace.profiling import diagnose

        options: dict[str, Any] = {}
        if side == "doctor-deep" and "deep" in inspect.signature(diagnose).parameters:
            options["deep"] = True  # (before issue 24 the doctor always ran this way)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            diagnosis = diagnose(ds, epochs=DOCTOR_EPOCHS, **options)
        result["leak"] = diagnosis.leak
        result["blamed"] = list(diagnosis.leaking_stages)
        result["epoch_s"] = [m.seconds for m in diagnosis.epochs]
        result["traced_epoch_s"] = [m.seconds for m in getattr(diagnosis, "traced_epochs", ())]
        runs = DOCTOR_EPOCHS
    result["epochs"] = runs
    result["wall_s"] = (time.perf_counter() - wall) / runs
    result["cpu_s"] = (_cpu() - cpu) / runs
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=DEFAULT_IMAGES)
    parser.add_argument("--epochs", type=int, default=3, help="plain and profile epochs")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, {side: _child for side in SIDES})
    started = time.perf_counter()
    load = loadavg()
    results: dict[str, dict[str, Any]] = {}
    for side in args.sides.split(","):
        config = {"kind": side, "images": args.images, "epochs": args.epochs}
        print(f"  running {side} ...", file=sys.stderr, flush=True)
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(config)]
        results[side] = run_child(argv, timeout=900, env=child_env())
        if results[side].get("error"):
            print(results[side].get("stderr_tail", ""), file=sys.stderr)
    plain = results.get("plain", {})
    rows = []
    for side, result in results.items():
        if result.get("error"):
            rows.append([side, "ERROR", result["error"], "", "", ""])
            continue
        ratio = (f"{result['wall_s'] / plain['wall_s']:.2f}x"
                 if plain.get("wall_s") else "")
        cpu_ratio = (f"{result['cpu_s'] / plain['cpu_s']:.2f}x" if plain.get("cpu_s") else "")
        verdict = ""
        if "leak" in result:
            verdict = f"leak: {', '.join(result['blamed']) or 'not traced'}" if result[
                "leak"] else "no leak"
        rows.append([side, f"{result['wall_s']:.2f}", ratio, f"{result['cpu_s']:.2f}",
                     cpu_ratio, verdict])
    table = md_table(["side", "wall s / epoch", "vs plain", "CPU s / epoch", "CPU vs plain",
                      "verdict"], rows)
    end_load = loadavg()
    print(f"{args.images} images, plain/profile {args.epochs} epochs, doctor "
          f"{DOCTOR_EPOCHS}; 1-min load average {load} at start, {end_load} at end; "
          f"total {time.perf_counter() - started:.0f} s\n")
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "doctor" if args.images == DEFAULT_IMAGES else f"doctor-{args.images}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"images": args.images, "epochs": args.epochs, "load_start": load, "load_end": end_load,
         "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
