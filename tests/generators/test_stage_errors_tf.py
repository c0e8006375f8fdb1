"""Stages that carry something from element to element, with elements' errors in place:
against tf.data element for element, and restored at every position.

scan (its state), unique (the values seen), group_by_window (open groups), window
(elements held for later windows), enumerate (the count) and zip (the partner's
position) over a map that raises for random elements. Oracles: TensorFlow itself for
the stream with its errors in place, and the uninterrupted run for a state taken at
every position and resumed in a fresh iterator. Each of these broke in the seventh
outsider attack: a restore right after an error raised it again (replaying stages), a
window kept the elements before the error and shifted every later window, and an error
did not move enumerate's count or a zip partner.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from transform_cases import positions

import headrace as hr

pytestmark = pytest.mark.tf


class Planted(Exception):
    """A fault the case planted."""


def _hr_fault(bad: set[int]) -> Any:
    def fault(x: Any) -> Any:
        if int(x) in bad:
            raise Planted(f"element {int(x)}")
        return x

    return fault


def _tf_fault(bad: set[int]) -> Any:
    bads = tf.constant(sorted(bad) or [-1], tf.int64)

    def fault(x: Any) -> Any:
        hit = tf.reduce_any(tf.equal(x, bads))
        with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(hit), [x])]):
            return tf.identity(x)

    return fault


def _pipeline(api: Any, case: dict[str, Any]) -> Any:
    """The case's pipeline on tf.data (``api`` is tf.data) or headrace, each element
    one int64 (groups and windows folded into one number)."""
    fault = _tf_fault(case["bad"]) if api is tf.data else _hr_fault(case["bad"])
    values = [(i * 7) % case["modulo"] for i in range(case["n"])]
    ds = api.Dataset.from_tensor_slices(np.asarray(values, np.int64)).map(fault)
    stage, k = case["stage"], case["k"]
    if stage == "scan":
        return ds.scan(np.int64(0), lambda s, x: (s + x, s * 100 + x))
    if stage == "unique":
        return ds.unique()
    if stage == "enumerate":
        return ds.enumerate().map(lambda i, x: i * 1000 + x)
    if stage == "zip":
        return api.Dataset.zip((ds, api.Dataset.range(500, 600))).map(lambda x, y: x * 1000 + y)
    if stage == "window":
        return ds.window(k, shift=case["shift"], stride=case["stride"]).flat_map(
            lambda w: w.batch(k).map(lambda b: _fold(b)))
    return ds.group_by_window(lambda x: x % 2, lambda key, w: w.batch(k), window_size=k).map(
        _fold)


def _fold(batch: Any) -> Any:
    """A batch as one int64: its values as digits of base 1000, and its length."""
    if isinstance(batch, np.ndarray):
        return np.int64(sum(int(v) * 1000 ** i for i, v in enumerate(batch)) * 10 + len(batch))
    n = tf.shape(batch, out_type=tf.int64)[0]
    weights = tf.pow(tf.constant(1000, tf.int64), tf.range(n, dtype=tf.int64))
    return tf.reduce_sum(batch * weights) * 10 + n


def _tf_positions(dataset: Any) -> list[Any]:
    got: list[Any] = []
    iterator = iter(dataset)
    while len(got) < 400:
        try:
            got.append(int(next(iterator)))
        except StopIteration:
            break
        except tf.errors.InvalidArgumentError:
            got.append("error")
    return got


def _cases(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n = rng.randint(0, 24)
        cases.append({
            "stage": rng.choice(("scan", "unique", "enumerate", "zip", "window", "group")),
            "n": n,
            "modulo": rng.choice((5, 11, 97)),
            "bad": set(rng.sample(range(97), rng.randint(0, 4))),
            "k": rng.randint(1, 4),
            "shift": rng.randint(1, 4),
            "stride": rng.randint(1, 3),
        })
    return cases


@pytest.mark.parametrize("block", range(3))
def test_errors_in_place_match_tf_and_every_position_restores(block: int) -> None:
    for case in _cases(25, 7000 + block):
        expected = _tf_positions(_pipeline(tf.data, case))
        ds = _pipeline(hr, case)
        with iter(ds) as iterator:
            got = positions(iterator, Planted)
        assert [g if isinstance(g, int) else "error" for g in got] == expected, case
        for at in range(len(got) + 1):
            with iter(ds) as original:
                head = positions(original, Planted, limit=at)
                state = json.loads(json.dumps(original.get_state()))
            with iter(ds) as restored:
                restored.set_state(state)
                assert head + positions(restored, Planted) == got, (case, at)
