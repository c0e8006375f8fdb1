"""One iterator shared by threads (as a tf.data iterator may be): every element comes
out exactly once. Oracle: the same pipeline drained by one thread (as a multiset: which
thread gets which element is up to the scheduler)."""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest

import headrace as hr


def _pipeline(rng: random.Random) -> hr.Dataset:
    ds = hr.Dataset.range(rng.randint(2_000, 6_000))
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["shuffle", "map", "interleave", "prefetch", "filter"])
        if op == "shuffle":
            ds = ds.shuffle(rng.choice([10, 1000]), seed=rng.randrange(100))
        elif op == "map":
            ds = ds.map(lambda x: x * 3, num_parallel_calls=rng.choice([None, 2, 4]))
        elif op == "interleave":
            ds = ds.interleave(lambda x: hr.Dataset.from_tensors(x).repeat(2),
                               cycle_length=4, num_parallel_calls=rng.choice([None, 4]))
        elif op == "prefetch":
            ds = ds.prefetch(rng.choice([1, 16]))
        else:
            ds = ds.filter(lambda x: x % 7 != 3)
    return ds


def _key(element: Any) -> Any:
    return int(np.asarray(element))


@pytest.mark.parametrize("seed", range(8))
def test_threads_sharing_an_iterator_get_each_element_once(seed: int) -> None:
    rng = random.Random(seed)
    ds = _pipeline(rng)
    expected = Counter(_key(e) for e in ds)
    got: list[list[Any]] = [[] for _ in range(rng.randint(2, 4))]
    errors: list[BaseException] = []
    with iter(ds) as iterator:

        def drain(out: list[Any]) -> None:
            try:
                for element in iterator:
                    out.append(_key(element))
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=drain, args=(out,)) for out in got]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    assert not errors
    assert Counter(x for out in got for x in out) == expected


def test_an_iterator_called_from_inside_its_own_next_is_refused_not_hung() -> None:
    """A map function that pulls from the iterator running it would wait for itself
    (one thread at a time in the stages): it gets a RuntimeError in its element's
    place, and the iterator goes on."""
    holder: dict[str, Any] = {}

    def fn(x: Any) -> Any:
        if int(x) == 3:
            return next(holder["iterator"])
        return x

    with iter(hr.Dataset.range(6).map(fn)) as iterator:
        holder["iterator"] = iterator
        assert [int(next(iterator)) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(RuntimeError, match="inside its own next"):
            next(iterator)
        assert [int(x) for x in iterator] == [4, 5]
