"""IteratorCheckpoint: a real ``model.fit`` interrupted after some steps (or at an
epoch's start) and resumed in a new fit over a freshly built pipeline: the batches
the training steps see after the resume are the uninterrupted run's, batch for
batch, reshuffled epochs included, on the TensorFlow, JAX and torch backends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import headrace as hr
from headrace._errors import CheckpointError

pytest.importorskip("keras")

from keras_script import run_keras_script


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_fit_interrupted_and_resumed_sees_the_uninterrupted_batches(backend: str) -> None:
    if backend != "tensorflow":
        pytest.importorskip(backend)
    out = run_keras_script("keras_resume.py", backend)
    assert out["backend"] == backend
    whole = out["whole"]
    assert len(whole) == 4 * 12  # 4 epochs of 12 batches
    epochs = [sorted(row for batch in whole[i : i + 12] for row in batch) for i in (0, 12)]
    assert whole[:12] != whole[12:24] and epochs[0] == epochs[1]  # reshuffled, same rows
    # saved every 4 steps, crashed after step 6 of epoch 1: resumes after step 4
    steps = out["steps"]
    assert (steps["epoch"], steps["step"]) == (1, 4)
    assert steps["before"] == whole[: 12 + 6]
    assert steps["resumed"] == whole[12 + 4 :]
    # saved at epochs' ends, crashed in epoch 2: resumes at epoch 2's first batch
    at_epoch = out["epoch"]
    assert (at_epoch["epoch"], at_epoch["step"]) == (2, 0)
    assert at_epoch["before"] == whole[: 24 + 4]
    assert at_epoch["resumed"] == whole[24:]
    # saved at an epoch's last step (12 of 12), crashed before its end: resumes at the
    # next epoch's first batch (an epoch resumed with no step left crashed Keras's JAX
    # trainer, attacks9)
    last = out["last"]
    assert (last["epoch"], last["step"]) == (2, 0)
    assert last["before"] == whole[:24]
    assert last["resumed"] == whole[24:]


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    from headrace.keras import IteratorCheckpoint

    ds = hr.Dataset.from_tensor_slices(np.arange(8)).batch(2)
    with pytest.raises(TypeError, match=r"ds\.to_keras\(\)"):
        IteratorCheckpoint(ds, tmp_path / "a.json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive int"):
        IteratorCheckpoint(ds.to_keras(), tmp_path / "a.json", save_freq=0)
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"b\.json is not JSON"):
        IteratorCheckpoint(ds.to_keras(), tmp_path / "b.json")
    (tmp_path / "c.json").write_text('{"epoch": 1}')
    with pytest.raises(CheckpointError, match="not a headrace Keras checkpoint"):
        IteratorCheckpoint(ds.to_keras(), tmp_path / "c.json")
    fresh = IteratorCheckpoint(ds.to_keras(), tmp_path / "d.json")
    assert fresh.initial_epoch == 0 and fresh.restored is None
