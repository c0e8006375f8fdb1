"""``cast``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np

import headrace as hr


def test_cast_lowers_precision_of_chosen_components() -> None:
    data = {"x": np.ones((4, 3), np.float32), "y": np.arange(4)}
    (element,) = list(hr.Dataset.from_tensor_slices(data).cast({"x": np.float16}).batch(4))
    assert element["x"].dtype == np.float16 and element["y"].dtype == np.int64
    (pair,) = list(hr.Dataset.from_tensor_slices((data["x"], data["y"])).cast(np.float16).batch(4))
    assert pair[0].dtype == np.float16 and pair[1].dtype == np.int64
