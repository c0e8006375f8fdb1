"""``batch``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np
import pytest

import headrace as hr


def test_batch_and_drop_remainder(source) -> None:
    batches = [b.tolist() for b in source(7).batch(3)]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in source(7).batch(3, drop_remainder=True)] == [[0, 1, 2], [3, 4, 5]]
    assert source(7).batch(3, drop_remainder=True).element_spec.shape == (3,)
    assert source(7).batch(3).element_spec.shape == (None,)


def test_batch_shape_mismatch_names_element_and_shapes() -> None:
    ds = hr.Dataset.from_generator(
        lambda: iter([np.zeros(2), np.zeros(2), np.zeros(3)]),
        output_signature=hr.TensorSpec((None,), np.float64),
    ).batch(4)
    with pytest.raises(hr.ElementSpecError, match=r"element 2 has shape \(3,\).*element 0.*\(2,\)"):
        list(ds)
