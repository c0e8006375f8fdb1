"""A headrace.Dataset handed straight to torch's DataLoader or to Keras's ``model.fit``
fails with an error that names the adapter to use (``to_torch()``, ``to_keras()``),
raised where each framework probes its input; NumPy still sees no array protocol.
"""

from __future__ import annotations

import gc
import operator

import numpy as np
import pytest

import headrace as hr


def _dataset() -> hr.Dataset:
    x = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    return hr.Dataset.from_tensor_slices((x, x[:, 0])).batch(16)


def test_numpy_sees_no_array_protocol() -> None:
    ds = _dataset()
    assert not hasattr(ds, "__array__")
    as_array = np.asarray(ds)  # as before: an object scalar, nothing read
    assert as_array.shape == () and as_array.dtype == object and as_array.item() is ds


@pytest.mark.parametrize(
    ("kind", "workers"),
    [("known", 0), pytest.param("known", 2, marks=pytest.mark.slow), ("infinite", 0),
     ("unknown", 0)],
)
def test_torch_dataloader_names_to_torch(kind: str, workers: int) -> None:
    """Known length: torch asks for samples (in a worker with num_workers > 0: the
    message reaches the main process). Unknown or infinite: its sampler asks len()."""
    torch = pytest.importorskip("torch")
    ds = _dataset()
    if kind == "infinite":
        ds = ds.repeat()
    elif kind == "unknown":
        ds = ds.filter(operator.is_not)  # (x is not y): keeps all; pickles for workers
    loader = torch.utils.data.DataLoader(
        ds, num_workers=workers, multiprocessing_context="forkserver" if workers else None
    )
    batches = iter(loader)
    with pytest.raises(TypeError) as caught:
        next(batches)
    del batches  # its worker processes and pipes go now, within this test
    gc.collect()
    message = str(caught.value)
    assert "DataLoader(ds.to_torch(), batch_size=None)" in message
    assert "map-style" in message
    if kind == "known":  # the length is known: torch got as far as asking for samples
        assert "asked for the samples at [0]" in message
    # and the adapter the message names works: every batch, in order
    batches = list(torch.utils.data.DataLoader(_dataset().to_torch(), batch_size=None))
    assert [tuple(b[0].shape) for b in batches] == [(16, 4)] * 4


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_keras_model_names_to_keras(call: str) -> None:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    ds = _dataset()
    with pytest.raises(TypeError, match=r"pass ds\.to_keras\(\) to fit/evaluate/predict"):
        getattr(model, call)(ds, verbose=0)
    if call == "fit":
        with pytest.raises(TypeError, match=r"validation_data=val\.to_keras\(\)"):
            model.fit(_dataset().to_keras(), validation_data=ds, verbose=0)
        history = model.fit(_dataset().to_keras(), epochs=1, verbose=0)  # what it names works
        assert len(history.history["loss"]) == 1
