"""``zip``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np
import pytest
from transform_cases import ints

import headrace as hr


def test_zip_concatenate_enumerate(source) -> None:
    zipped = list(hr.Dataset.zip({"a": source(3), "b": source(5)}))
    assert [(int(e["a"]), int(e["b"])) for e in zipped] == [(0, 0), (1, 1), (2, 2)]
    assert ints(source(2).concatenate(source(3))) == [0, 1, 0, 1, 2]
    assert [(int(i), int(v)) for i, v in source(3).enumerate(start=5)] == [(5, 0), (6, 1), (7, 2)]
    with pytest.raises(hr.ElementSpecError, match="dtypes differ"):
        source(2).concatenate(hr.Dataset.from_tensor_slices(np.zeros(2, np.float32)))
