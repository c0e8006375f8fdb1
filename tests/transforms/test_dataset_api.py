"""``dataset_api``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import pytest

import headrace as hr


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: hr.Dataset.range(3).batch(0), "batch_size must be > 0"),
        (lambda: hr.Dataset.range(3).shuffle(0), "buffer_size must be > 0"),
        (lambda: hr.Dataset.range(3).prefetch(-3), "buffer_size must be >= 0"),
        (lambda: hr.Dataset.range(3).take(1.5), "count must be an int"),
        (lambda: hr.Dataset.range(3).repeat("2"), "repeat: count"),
        (lambda: hr.Dataset.range(3).map(lambda x: x, num_parallel_calls=0), "num_parallel_calls"),
        (lambda: hr.Options(memory_budget="lots"), "cannot parse byte size 'lots'"),
        (lambda: hr.Options(memory_budget=-5), "must be positive"),
    ],
)
def test_bad_arguments_fail_at_build_time(build, message) -> None:
    with pytest.raises(hr.InvalidArgumentError, match=message):
        build()


def test_cardinality() -> None:
    assert hr.Dataset.range(10).batch(3).cardinality() == 4
    assert hr.Dataset.range(10).repeat().cardinality() == hr.INFINITE
    assert hr.Dataset.range(10).filter(lambda x: True).cardinality() == hr.UNKNOWN
    assert hr.Dataset.range(10).shard(3, 0).cardinality() == 4
    assert len(hr.Dataset.range(10).skip(4)) == 6
