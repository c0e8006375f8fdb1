"""Fingerprints tell different user functions apart, and stay the same across processes (G4)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace.core.fingerprint import function_fingerprint


def test_lambdas_with_the_same_name_but_different_code_do_not_share_checkpoints() -> None:
    plus = hr.Dataset.range(10).map(lambda x: x + 1)
    times = hr.Dataset.range(10).map(lambda x: x * 1000)
    assert plus.fingerprint() != times.fingerprint()
    with iter(plus) as iterator:
        next(iterator)
        state = iterator.get_state()
    with iter(times) as other, pytest.raises(hr.CheckpointError, match="different pipeline"):
        other.set_state(state)


def make_adder(k: object):  # type: ignore[no-untyped-def]
    return lambda x: x + k


def make_filter(allowed: object):  # type: ignore[no-untyped-def]
    return lambda x: x in allowed


class Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, x: float) -> float:
        return x * self.factor


def scaled(x: float, factor: float = 2.0) -> float:
    return x * factor


def scaled_other_default(x: float, factor: float = 3.0) -> float:
    return x * factor


simple_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3),
    max_leaves=6,
)


@given(simple_values, simple_values)
@settings(max_examples=200, deadline=None)
def test_closure_values_count_by_value(a: object, b: object) -> None:
    same = function_fingerprint(make_adder(a)) == function_fingerprint(make_adder(b))
    assert same == (repr(a) == repr(b) and type(a) is type(b))


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda x: x + 1, lambda x: x + 2),  # constants
        (lambda x: x + 1, lambda x: x - 1),  # code
        (lambda x: np.sin(x), lambda x: np.cos(x)),  # names used
        (make_adder(1), make_adder(2)),  # closure cells
        (make_adder(1), make_adder(1.0)),  # 1 and 1.0 are different values
        (make_filter(frozenset({"a"})), make_filter(frozenset({"b"}))),
        (scaled, scaled_other_default),  # defaults
        (functools.partial(scaled, factor=2), functools.partial(scaled, factor=5)),
        (Scale(2.0), Scale(3.0)),  # callable objects: their attributes
        (np.add, np.multiply),  # builtin callables: their names
        (lambda x: (lambda y: y + 1)(x), lambda x: (lambda y: y + 2)(x)),  # nested code
    ],
)
def test_different_functions_get_different_fingerprints(first: object, second: object) -> None:
    assert function_fingerprint(first) != function_fingerprint(second)


@pytest.mark.parametrize(
    "build",
    [
        lambda: make_adder(3),
        lambda: make_filter(frozenset({"x", "y", "z"})),
        lambda: functools.partial(scaled, factor=2),
        lambda: Scale(4.0),
    ],
)
def test_equal_functions_get_equal_fingerprints(build: object) -> None:
    assert callable(build)
    assert function_fingerprint(build()) == function_fingerprint(build())


def test_a_closure_over_itself_or_a_huge_object_is_described_quickly() -> None:
    def recursive(x: int) -> int:
        return recursive(x - 1) if x else 0

    class Node:
        def __init__(self, children: list[object]) -> None:
            self.children = children

    tree = Node([Node([Node(list(range(200))) for _ in range(200)]) for _ in range(200)])
    huge = make_adder(tree)
    assert function_fingerprint(recursive) == function_fingerprint(recursive)
    assert function_fingerprint(huge) == function_fingerprint(huge)


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import headrace as hr
    k = 7
    allowed = {"a", "b", "c", "d"}
    ds = (
        hr.Dataset.range(50)
        .map(lambda x: x * k + 1)
        .filter(lambda x: str(int(x) % 5) in allowed | {"1", "3"})
        .shuffle(8, seed=1)
        .batch(3)
    )
    gen = hr.Dataset.from_generator(
        lambda n: iter(range(n)), hr.TensorSpec((), np.int64), args=(5,)
    )
    print(json.dumps([ds.fingerprint(), gen.fingerprint()]))
    """
)


def test_fingerprints_are_the_same_in_every_process() -> None:
    """Never id()- or hash-seed-based: new processes with different hash seeds agree."""
    outputs = []
    for hash_seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
            timeout=120, check=True,
        )
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0][0] != outputs[0][1]
