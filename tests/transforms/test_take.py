"""``take``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import pytest
from transform_cases import ints

import headrace as hr


def test_repeat_take_skip_shard(source) -> None:
    assert ints(source(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert ints(source(3).repeat(0)) == []
    assert ints(source(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert ints(source(0).repeat()) == []
    assert ints(source(5).take(-1)) == list(range(5))
    assert ints(source(5).skip(-1)) == []
    assert ints(source(5).skip(2)) == [2, 3, 4]
    assert ints(source(10).shard(3, 1)) == [1, 4, 7]
    with pytest.raises(hr.InvalidArgumentError, match="between 0 and 2"):
        source(10).shard(3, 3)
    with pytest.raises(hr.InvalidArgumentError, match="greater than zero"):
        source(10).shard(0, 0)
