"""``filter``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np
import pytest
from transform_cases import ints

import headrace as hr


def test_filter(source) -> None:
    assert ints(source(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    with pytest.raises(hr.ElementSpecError, match="scalar bool"):
        list(source(3).filter(lambda x: np.array([True, False])))
