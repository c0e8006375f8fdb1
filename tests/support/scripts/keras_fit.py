"""Run under one Keras backend (KERAS_BACKEND set by the caller); prints one JSON line.

Fits a small real model on a headrace dataset larger than its budget (a
memmapped .npy), with validation, evaluate and predict; counts the steps per
epoch and the warnings Keras gave; then a deliberate leak and a clean run
under MemoryMonitor.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import keras
import numpy as np

import headrace as hr
from headrace.adapters.keras import KerasAdapter, MemoryGrowthWarning, MemoryMonitor

if keras.backend.backend() == "tensorflow":  # two CPU replicas for a MirroredStrategy below
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

ROWS, WIDTH = 24_000, 512  # 48 MiB of float32 features, through a 16 MiB budget
tmp = tempfile.mkdtemp()
rng = np.random.default_rng(0)
features = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
np.save(os.path.join(tmp, "x.npy"), features)
labels = (features[:, :8].sum(1) > 0).astype(np.float32)
del features
np.save(os.path.join(tmp, "y.npy"), labels)

budget = hr.Options(memory_budget="16MiB")
train = (
    hr.Dataset.zip((hr.Dataset.from_npy(os.path.join(tmp, "x.npy")),
                    hr.Dataset.from_npy(os.path.join(tmp, "y.npy"))))
    .shuffle(ROWS, seed=0)
    .batch(500)
    .prefetch(2)
    .with_options(budget)
)
val = train.take(4)


class Steps(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.per_epoch: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        self.per_epoch[-1] += 1


def model() -> keras.Model:
    m = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
    m.compile(keras.optimizers.Adam(0.01), "binary_crossentropy", metrics=["accuracy"])
    return m


out: dict[str, object] = {"backend": keras.backend.backend()}
steps, monitor = Steps(), MemoryMonitor(every_n_steps=10)
net = model()
adapter = train.to_keras()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = net.fit(adapter, epochs=5, validation_data=val.to_keras(), verbose=0,
                      callbacks=[steps, monitor])
out["tf_route"] = adapter.tf_route
out["steps_per_epoch"] = steps.per_epoch
out["val_loss"] = history.history["val_loss"]
out["accuracy"] = history.history["accuracy"]
out["fit_warnings"] = sorted({str(w.message)[:80] for w in caught
                              if "ran out of data" in str(w.message)
                              or w.category is MemoryGrowthWarning})
out["epoch_memory_mib"] = [round(b / 2**20, 1) for _, b in monitor.epochs]
out["step_samples"] = len(monitor.steps)
trend = monitor.trend()
out["clean_slope_mib"] = trend.slope / 2**20
out["evaluate"] = net.evaluate(val.to_keras(), verbose=0, return_dict=True)
out["predict_shape"] = list(net.predict(val.to_keras(), verbose=0).shape)

# An infinite dataset needs steps_per_epoch, as in Keras.
steps = Steps()
net.fit(train.repeat().to_keras(), epochs=2, steps_per_epoch=7, verbose=0, callbacks=[steps])
out["infinite_steps"] = steps.per_epoch



def routes_agree() -> dict[str, object]:
    """TF backend: the direct NumPy route, the tf.data route (steps_per_execution=2) and
    a two-replica MirroredStrategy see the same batches in the same order: same weights."""
    # unshuffled: each route starts its iterators (and so its epochs' shuffle orders)
    # at its own time, tf.data's prefetch ahead of Keras's first call
    first = hr.Dataset.zip((hr.Dataset.from_npy(os.path.join(tmp, "x.npy")),
                            hr.Dataset.from_npy(os.path.join(tmp, "y.npy")))).batch(500).take(12)
    weights = model().get_weights()
    result: dict[str, object] = {}
    trained = {}
    for name, spe in (("numpy", 1), ("tf.data", 2)):
        net = model()
        net.compile(keras.optimizers.SGD(0.01), "binary_crossentropy", steps_per_execution=spe)
        net.set_weights(weights)
        adapter = first.to_keras()
        net.fit(adapter, epochs=2, verbose=0)
        result[f"route_spe{spe}"] = adapter.tf_route
        trained[name] = net.get_weights()
    result["max_weight_diff"] = max(float(np.abs(a - b).max())
                                    for a, b in zip(trained["numpy"], trained["tf.data"], strict=True))
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        net = model()
    adapter = first.to_keras()
    steps = Steps()
    net.fit(adapter, epochs=1, verbose=0, callbacks=[steps])
    result["mirrored_route"], result["mirrored_steps"] = adapter.tf_route, steps.per_epoch
    # Unknown cardinality (a filter): each epoch ends where the data does.
    steps = Steps()
    unknown = first.filter(lambda x, y: x.shape[0] > 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model().fit(unknown.to_keras(), epochs=3, verbose=0, callbacks=[steps])
    result["unknown_steps"] = steps.per_epoch
    result["unknown_warnings"] = sorted({str(w.message)[:60] for w in caught
                                         if "ran out" in str(w.message)})
    return result


if keras.backend.backend() == "tensorflow":
    out.update(routes_agree())
else:
    assert KerasAdapter(train).tf_route is None

# A deliberate leak: every epoch keeps 24 MiB it never drops.
small = hr.Dataset.from_tensor_slices(
    (np.ones((512, WIDTH), np.float32), np.ones(512, np.float32))).batch(128)
kept: list[np.ndarray] = []


class Leak(keras.callbacks.Callback):  # type: ignore[misc]
    def on_epoch_end(self, epoch: int, logs: object = None) -> None:
        kept.append(np.ones(24 * 2**20 // 8))


for name, extra in (("leak", [Leak()]), ("clean", [])):
    monitor = MemoryMonitor(every_n_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model().fit(small.to_keras(), epochs=8, verbose=0, callbacks=[*extra, monitor])
    out[f"{name}_warnings"] = [str(w.message) for w in caught if w.category is MemoryGrowthWarning]
    out[f"{name}_slope_mib"] = monitor.trend().slope / 2**20

print("RESULT " + json.dumps(out, default=float))
sys.stdout.flush()
