"""Keras 3 ``model.fit/evaluate/predict`` on headrace datasets, on two backends, and the
MemoryMonitor callback (a deliberate leak is flagged, a clean run is not)."""

from __future__ import annotations

import pytest

from headrace.adapters.keras import fit_trend

pytest.importorskip("keras")

from keras_script import run_keras_script


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_fit_evaluate_predict_and_memory_monitor(backend: str) -> None:
    if backend != "tensorflow":
        pytest.importorskip(backend)
    out = run_keras_script("keras_fit.py", backend)
    assert out["backend"] == backend
    # One pass per epoch: 24,000 rows / 500 = 48 steps, every epoch, no .repeat().
    assert out["steps_per_epoch"] == [48] * 5
    assert out["fit_warnings"] == []  # neither "ran out of data" nor a memory warning
    accuracy = out["accuracy"]
    assert isinstance(accuracy, list) and accuracy[-1] > 0.75  # it really learned
    assert len(out["val_loss"]) == 5  # type: ignore[arg-type]
    assert out["predict_shape"] == [2000, 1]
    assert set(out["evaluate"]) >= {"loss", "accuracy"}  # type: ignore[arg-type]
    assert out["infinite_steps"] == [7, 7]
    # 48 MiB of data through a 16 MiB budget, memory flat across epochs.
    memory = out["epoch_memory_mib"]
    assert isinstance(memory, list) and max(memory[1:]) - min(memory[1:]) < 16, memory
    assert out["step_samples"] == 5 * 4  # every 10 steps: 4 per epoch
    # The leak (24 MiB per epoch) is flagged with its slope; the clean run is not.
    assert len(out["leak_warnings"]) == 1, out  # type: ignore[arg-type]
    assert "MiB per epoch" in out["leak_warnings"][0]  # type: ignore[index]
    assert 20 < out["leak_slope_mib"] < 28  # type: ignore[operator]
    assert out["clean_warnings"] == [], out
    if backend == "tensorflow":
        # Keras's defaults (one replica, one step per call) take the NumPy batches as
        # they are; several replicas or steps per call get a tf.data.Dataset. Both
        # routes train on the same batches in the same order: the same weights.
        assert (out["tf_route"], out["route_spe1"], out["route_spe2"]) == (
            "numpy", "numpy", "tf.data")
        assert out["max_weight_diff"] < 1e-5
        # Two CPU replicas on the tf.data route, over read-only memmap batches (handed
        # to TensorFlow as views, they crashed this step with SIGSEGV).
        assert (out["mirrored_route"], out["mirrored_steps"]) == ("tf.data", [12])
        # Unknown cardinality ends each epoch at the end of the data, as tf.data does.
        assert out["unknown_steps"] == [12, 12, 12]


def test_trend_flags_growth_only_beyond_its_noise() -> None:
    import random

    rng = random.Random(0)
    for case in range(200):
        slope = rng.choice([0.0, 0.0, 1.0, 30.0]) * 2**20
        noise = rng.choice([0.1, 1.0, 4.0]) * 2**20
        values = [int(100 * 2**20 + slope * i + rng.gauss(0, noise)) for i in range(8)]
        trend = fit_trend(values, min_growth=2 * 2**20, z=3.0)
        if slope == 0:
            assert not trend.leaking, (case, trend)
        if slope >= 30 * 2**20:
            assert trend.leaking and abs(trend.slope - slope) < 3 * noise, (case, trend)
    assert not fit_trend([1, 2], 0, 3.0).leaking  # too few epochs to say
