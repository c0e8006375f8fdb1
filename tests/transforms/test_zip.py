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


def test_concatenate_checks_specs_learnt_from_elements_before_it_runs() -> None:
    # A map without output_signature: its spec is learnt from an element. The run used to
    # yield scalars, then tuples (tf.data refuses the pipeline when it is built).
    tuples = hr.Dataset.range(2).map(lambda x: (x, x * 0.5))
    with pytest.raises(hr.ElementSpecError, match="different structures"):
        iter(hr.Dataset.range(3).concatenate(tuples))
    floats = hr.Dataset.range(2).map(lambda x: x * 0.5)
    with pytest.raises(hr.ElementSpecError, match="dtypes differ"):
        iter(hr.Dataset.range(3).concatenate(floats))
    with pytest.raises(hr.ElementSpecError, match="dtypes differ"):  # (read by index)
        iter(hr.Dataset.range(3).concatenate(floats).take(4))
    with pytest.raises(hr.ElementSpecError, match="dtypes differ"):
        iter(hr.Dataset.range(3).concatenate(floats).take(50))
    same = hr.Dataset.range(2).map(lambda x: x + 10)
    assert ints(hr.Dataset.range(3).concatenate(same)) == [0, 1, 2, 10, 11]
    assert ints(hr.Dataset.range(0).concatenate(same)) == [10, 11]  # (nothing to learn from)
