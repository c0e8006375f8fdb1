"""``map``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import pytest
from transform_cases import ints

import headrace as hr


def test_map_unpacks_tuples_like_tf_data(source) -> None:
    ds = hr.Dataset.zip(source(3), source(3)).map(lambda a, b: a * 10 + b)
    assert ints(ds) == [0, 11, 22]


@pytest.mark.parametrize("parallel", [2, hr.AUTOTUNE])
def test_parallel_map_keeps_order_by_default(source, parallel) -> None:
    assert ints(source(200).map(lambda x: x * 2, num_parallel_calls=parallel)) == [
        x * 2 for x in range(200)
    ]


def test_nondeterministic_parallel_map_yields_every_element_once(source) -> None:
    ds = source(300).map(lambda x: x + 1, num_parallel_calls=4, deterministic=False)
    assert sorted(ints(ds)) == list(range(1, 301))


def test_map_errors_reach_the_consumer(source) -> None:
    def explode(x):
        if x == 5:
            raise KeyError("boom at 5")
        return x

    for ds in (source(10).map(explode), source(10).map(explode, num_parallel_calls=2)):
        with pytest.raises(KeyError, match="boom at 5"):
            list(ds)
