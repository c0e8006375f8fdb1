"""Run by test_keras_checkpoint.py with KERAS_BACKEND set: a real model.fit interrupted
mid-run and resumed from IteratorCheckpoint; prints RESULT <json> with the batches
each run's steps saw (the first column of each batch, recorded inside the model)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import Any

import keras
import numpy as np

import headrace as hr
from headrace.keras import IteratorCheckpoint

EPOCHS = 4


class Recording(keras.Model):  # type: ignore[misc]
    """A one-layer model that records the first column of each batch a training step
    gives it (not the call Keras builds it with)."""

    def __init__(self, seen: list[list[float]]) -> None:
        super().__init__()
        self.record = seen.append  # (a list attribute would be tracked: copied)
        self.dense = keras.layers.Dense(1)

    def call(self, x: Any, training: bool | None = None) -> Any:
        if training:
            self.record(np.asarray(keras.ops.convert_to_numpy(x))[:, 0].tolist())
        return self.dense(x)


class Crash(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("the machine went away")


def pipeline() -> hr.Dataset:
    """Built anew for each run, as a new process would: 12 batches, reshuffled per epoch."""
    x = np.arange(96 * 3, dtype=np.float32).reshape(96, 3)
    y = (x[:, 0] % 2).astype(np.float32)
    return hr.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=5).batch(8)


def fit(callbacks: list[Any], seen: list[list[float]], initial_epoch: int = 0) -> None:
    model = Recording(seen)
    model.compile("sgd", "mse", run_eagerly=True)
    adapter = callbacks[0].adapter if callbacks else None
    start = len(seen)
    with contextlib.suppress(KeyboardInterrupt):  # the Crash callback's
        model.fit(adapter, epochs=EPOCHS, initial_epoch=initial_epoch, callbacks=callbacks,
                  verbose=0)
    if keras.backend.backend() == "tensorflow" and seen[start] == seen[start + 1]:
        del seen[start]  # Keras's TF trainer first calls the model on batch 1 to build it


def main() -> None:
    folder = tempfile.mkdtemp()
    uninterrupted: list[list[float]] = []
    fit([IteratorCheckpoint(pipeline().to_keras(), os.path.join(folder, "whole.json"))],
        uninterrupted)
    result: dict[str, Any] = {"backend": keras.backend.backend(), "whole": uninterrupted}
    for name, save_freq, crash in (("steps", 4, (1, 5)), ("epoch", "epoch", (2, 3)),
                                   ("last", 4, (1, 11))):
        path = os.path.join(folder, f"{name}.json")
        before: list[list[float]] = []
        fit([IteratorCheckpoint(pipeline().to_keras(), path, save_freq=save_freq),
             Crash(*crash)], before)
        resumed: list[list[float]] = []
        callback = IteratorCheckpoint(pipeline().to_keras(), path, save_freq=save_freq)
        fit([callback], resumed, initial_epoch=callback.initial_epoch)
        assert callback.restored is not None
        result[name] = {"before": before, "resumed": resumed,
                        "epoch": callback.restored["epoch"], "step": callback.restored["step"]}
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
