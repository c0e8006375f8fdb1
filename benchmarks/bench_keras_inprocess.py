"""Keras 3 ``model.fit`` steps/s, three inputs side by side in ONE process, one model.

On a shared 2-core box, fresh processes run minutes apart see different loads;
here the inputs take turns (one epoch each, nine rounds), so a burst of load
hits all of them alike. Inputs: the pipeline in tf.data; headrace through
``tf.data.Dataset.from_generator`` (the route ``to_tf`` took before, kept
here as the "before"); headrace through ``ds.to_keras()``. Reports the median
steps/s and CPU per step (all threads), each also as a ratio to tf.data's.

Run: ``python benchmarks/bench_keras_inprocess.py``; writes results/keras-inprocess.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h
from bench_frameworks import BATCH, ROWS, _arrays

ROUNDS = 9


class _Elements:
    """The old ``to_tf`` route's generator: one headrace iterator per pass."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self) -> Iterator[Any]:
        with iter(self.dataset) as elements:
            yield from elements


def main() -> int:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    started = time.perf_counter()
    import keras
    import tensorflow as tf

    import headrace as hr
    from headrace.adapters.tf import tf_signature

    images, labels = _arrays()
    x = images.reshape(ROWS, -1)[:, :256].astype("float32") / 255
    y = labels.astype("float32")
    ds = hr.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=0).batch(BATCH).prefetch(2)
    steps = -(-ROWS // BATCH)
    before = tf.data.Dataset.from_generator(
        _Elements(ds), output_signature=tf_signature(ds.element_spec)
    ).apply(tf.data.experimental.assert_cardinality(steps))
    inputs = {
        "tf.data": tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=0).batch(
            BATCH).prefetch(2),
        "headrace, before (from_generator)": before,
        "headrace, ds.to_keras()": ds.to_keras(),
    }
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    for data in inputs.values():
        model.fit(data, epochs=1, verbose=0)  # warm-up: tracing
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in inputs}
    for _ in range(ROUNDS):
        for name, data in inputs.items():
            cpu, wall = time.process_time(), time.perf_counter()
            model.fit(data, epochs=1, verbose=0)
            runs[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    wall_of = {name: statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu_of = {name: statistics.median(c for _, c in r) for name, r in runs.items()}
    rows = [[name, f"{steps / wall_of[name]:.0f}", f"{wall_of['tf.data'] / wall_of[name]:.2f}x",
             f"{1000 * cpu_of[name] / steps:.2f}", f"{cpu_of[name] / cpu_of['tf.data']:.2f}x"]
            for name in inputs]
    report, sections = h.report_head("Keras fit, inputs side by side in one process",
                                     sys.executable, "`python benchmarks/bench_keras_inprocess.py`")
    sections += [
        "## Results", "",
        f"{ROWS:,} rows of 256 float32 features, batches of {BATCH} ({steps} steps), shuffled, "
        f"prefetch(2); a Dense(64)-Dense(1) model; {ROUNDS} rounds, one epoch per input per "
        "round; medians.", "",
        h.md_table(["input", "steps/s", "vs tf.data", "CPU ms/step", "CPU vs tf.data"], rows), "",
    ]
    h.write_report("keras-inprocess", sections, {"machine": report, "runs": runs}, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
