"""Frameworks, side by side in fresh processes on the same data: batches/s to a trivial step
and peak memory growth (anonymous + shared, worker processes included).

1. in-memory arrays: headrace ``to_torch()`` in a DataLoader vs torch's own
   ``DataLoader(TensorDataset, shuffle=True, batch_size=256)`` (0 and 2 workers each);
2. TFRecord files: headrace ``TFRecordDataset(...).batch().parse_examples().to_torch()``
   vs the ``tfrecord`` PyPI package's torch dataset (what PyTorch users use);
3. Keras 3 (TensorFlow backend) ``model.fit`` steps/s: ``ds.to_keras()`` vs the same
   pipeline in tf.data.

Run: ``python benchmarks/bench_frameworks.py [--quick]``; writes results/frameworks.md.
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
import _harness as h

ROWS, SHAPE, BATCH = 20_000, (32, 32, 3), 256  # 61 MiB of uint8 images


def _arrays() -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (ROWS, *SHAPE), dtype=np.uint8), np.arange(ROWS) % 10


def _consume(loader: Any, passes: int) -> dict[str, Any]:
    """A trivial training step on every batch; best pass time and peak memory."""
    times, batches = [], 0
    with h.MemorySampler() as sampler:
        for _ in range(passes):
            start, batches = time.perf_counter(), 0
            for batch in loader:
                image = batch[0] if isinstance(batch, (list, tuple)) else batch["image"]
                float(image[0, 0, 0, 0])  # touch it, as a step would
                batches += 1
            times.append(time.perf_counter() - start)
        memory = sampler.stop()
    return {"best_s": min(times), "batches": batches, "batches_per_s": batches / min(times),
            **memory}


def child_arrays(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import headrace as hr

    images, labels = _arrays()
    workers = cfg["workers"]
    if cfg["side"] == "headrace":
        ds = hr.Dataset.from_tensor_slices({"image": images, "label": labels}).shuffle(
            ROWS, seed=0).batch(BATCH).with_options(hr.Options(memory_budget="256MiB"))
        loader = DataLoader(ds.to_torch(), batch_size=None, num_workers=workers)
    else:
        data = TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))
        loader = DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=workers)
    return _consume(loader, cfg["passes"])


FEATURES = {"image": "byte", "label": "int"}


def child_tfrecord(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from torch.utils.data import DataLoader

    import headrace as hr
    from headrace.io.example import FixedLenFeature

    files = sorted(str(p) for p in Path(cfg["dir"]).glob("*.tfrecord"))
    workers = cfg["workers"]
    if cfg["side"] == "headrace":
        spec = {"image": FixedLenFeature((), bytes), "label": FixedLenFeature((), np.int64)}
        ds = hr.TFRecordDataset(files).batch(BATCH).parse_examples(spec).map(
            lambda e: {"image": np.frombuffer(b"".join(e["image"]), np.uint8).reshape(
                -1, *SHAPE), "label": e["label"]}
        ).with_options(hr.Options(memory_budget="256MiB"))
        loader = DataLoader(ds.to_torch(), batch_size=None, num_workers=workers)
    else:
        from tfrecord.torch.dataset import MultiTFRecordDataset

        def decode(example: dict[str, Any]) -> dict[str, Any]:
            return {"image": np.frombuffer(example["image"], np.uint8).reshape(SHAPE),
                    "label": example["label"]}

        splits = {Path(f).stem: 1.0 / len(files) for f in files}
        pattern = str(Path(cfg["dir"]) / "{}.tfrecord")
        data = MultiTFRecordDataset(pattern, None, splits, FEATURES, transform=decode,
                                    infinite=False)
        loader = DataLoader(data, batch_size=BATCH, num_workers=workers)
    return _consume(loader, cfg["passes"])


def child_keras(cfg: dict[str, Any]) -> dict[str, Any]:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
    import tensorflow as tf

    import headrace as hr

    images, labels = _arrays()
    x = images.reshape(ROWS, -1)[:, :256].astype("float32") / 255
    y = labels.astype("float32")
    if cfg["side"] == "headrace":
        data = hr.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=0).batch(BATCH).prefetch(2)
        data = data.to_keras()
    else:
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=0).batch(
            BATCH).prefetch(2)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.fit(data, epochs=1, verbose=0)  # warm-up: tracing
    times, cpu = [], []
    with h.MemorySampler() as sampler:
        for _ in range(max(cfg["passes"], 7)):  # short passes: take more of them
            start, start_cpu = time.perf_counter(), time.process_time()
            model.fit(data, epochs=1, verbose=0)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        memory = sampler.stop()
    steps = -(-ROWS // BATCH)
    return {"best_s": min(times), "median_s": sorted(times)[len(times) // 2], "batches": steps,
            "batches_per_s": steps / min(times),
            "cpu_ms_per_step": 1000 * sorted(cpu)[len(cpu) // 2] / steps, **memory}


CHILDREN = {"arrays": child_arrays, "tfrecord": child_tfrecord, "keras": child_keras}


def _write_records(directory: str) -> None:
    import numpy as np

    from headrace.io.example import serialize_example
    from headrace.io.tfrecord import write_tfrecord

    images, labels = _arrays()
    for shard in range(8):
        rows = range(shard, ROWS, 8)
        write_tfrecord(os.path.join(directory, f"part-{shard}.tfrecord"),
                       [serialize_example({"image": images[i].tobytes(),
                                           "label": np.int64(labels[i])}) for i in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=sorted(CHILDREN), help="one scenario (its own report)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="keras: fresh process pairs, alternating sides (the machine is shared)")
    args = parser.parse_args(argv)
    if args.child:
        return h.child_main(args.child, CHILDREN)
    started = time.perf_counter()
    passes = 2 if args.quick else 3
    report, sections = h.report_head(
        "Frameworks: headrace adapters vs each framework's own loader", sys.executable,
        "`python benchmarks/bench_frameworks.py`")
    report = {"machine": report, "rows": []}
    table = []
    keras_cpu: list[tuple[Any, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        _write_records(directory)
        scenarios = (("arrays", (0, 2)), ("tfrecord", (0, 2)), ("keras", (0,)))
        for kind, workers_list in scenarios:
            if args.only and kind != args.only:
                continue
            for workers in workers_list:
                results = {}
                rounds = args.rounds if kind == "keras" else 1
                for _ in range(rounds):
                    for side in ("headrace", "baseline"):
                        cfg = {"kind": kind, "side": side, "workers": workers, "passes": passes,
                               "dir": directory}
                        result = h.spawn(__file__, sys.executable, cfg, timeout=600)
                        best = results.get(side)
                        if best is None or result.get("batches_per_s", 0) > best.get(
                                "batches_per_s", 0):
                            results[side] = result
                if kind == "keras":
                    keras_cpu.append((results["headrace"].get("cpu_ms_per_step"),
                                      results["baseline"].get("cpu_ms_per_step")))
                report["rows"].append({"kind": kind, "workers": workers, **results})
                ours, theirs = results["headrace"], results["baseline"]
                table.append([
                    f"{kind}, {workers} workers" if kind != "keras" else "keras fit (TF backend)",
                    f"{h.fmt_rate(ours.get('batches_per_s'))} ({ours.get('batches')})",
                    f"{h.fmt_rate(theirs.get('batches_per_s'))} ({theirs.get('batches')})",
                    h.fmt_ratio(ours.get("batches_per_s"), theirs.get("batches_per_s")),
                    h.fmt_mib(ours.get("peak_growth")), h.fmt_mib(theirs.get("peak_growth")),
                ])
    notes = [
        f"Keras: best of {args.rounds} fresh process pairs (sides alternating), each the best of "
        f"7 one-epoch `fit` calls after a warm-up; CPU per step (median, all threads): "
        f"headrace {ours_cpu:.2f} ms, tf.data {theirs_cpu:.2f} ms."
        for ours_cpu, theirs_cpu in keras_cpu if ours_cpu is not None and theirs_cpu is not None
    ]
    sections += [
        "## Results", "",
        f"{ROWS:,} uint8 images {SHAPE}, batches of {BATCH}; best of {passes} passes each, "
        "each side in a fresh process. Baselines: torch `DataLoader(TensorDataset, "
        "shuffle=True)`; the `tfrecord` package's `MultiTFRecordDataset` in a DataLoader; "
        "the same pipeline in tf.data for Keras.", "",
        h.md_table(["scenario", "headrace batches/s (batches)", "baseline batches/s (batches)", "ratio", "headrace peak growth",
                    "baseline peak growth"], table), "", *notes, "",
    ]
    h.write_report(f"frameworks-{args.only}" if args.only else "frameworks", sections, report,
                   started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
