"""``unbatch``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np
import pytest
from transform_cases import ints

import headrace as hr


def test_unbatch_and_rebatch(source) -> None:
    assert ints(source(7).batch(3).unbatch()) == list(range(7))
    sizes = [len(b) for b in source(8).batch(4).rebatch([3, 1])]
    assert sizes == [3, 1, 3, 1]
    assert [b.tolist() for b in source(8).batch(4).rebatch([3, 1])][:2] == [[0, 1, 2], [3]]
    with pytest.raises(hr.InvalidArgumentError, match="must be batched"):
        source(3).rebatch(2)


def test_rebatch_of_batches_padded_to_other_widths_names_the_batch_and_component() -> None:
    """tf.data cannot join them either (FailedPreconditionError); NumPy's concatenate
    message named neither the stage nor the component."""
    ds = hr.Dataset.range(6).map(lambda x: {"v": np.arange(int(x) % 4)}).padded_batch(2)
    with pytest.raises(hr.ElementSpecError, match=(
            r"rebatch: batch 0 would take rows of shape \(1,\) and \(3,\) for component "
            r"\['v'\].*padded_shapes")) as raised:
        list(ds.rebatch(3))
    assert "concatenation axis" not in str(raised.value)
    # padded to one fixed width, the same batches rebatch
    fixed = hr.Dataset.range(6).map(lambda x: {"v": np.arange(int(x) % 4)})
    rows = [b["v"].shape for b in fixed.padded_batch(2, padded_shapes={"v": [4]}).rebatch(3)]
    assert rows == [(3, 4), (3, 4)]
