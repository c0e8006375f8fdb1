"""What a process map's packing costs per output, for tiny outputs (issue 23: no
throughput regression).

Issue 23 packs each output as the worker makes it (:class:`~headrace._workers.shm.OutputWriter`)
instead of pickling a chunk's outputs as one list. For tiny outputs that made a
map 0.8x as fast as before: the worker ran ~28 Python calls per output (the
whole-chunk pickle: ~10, most of them pickle's own hooks) and the consumer ~6
to read each back (the whole-chunk pickle: none). The generator here draws
chunks of small outputs of mixed kinds and checks two things against oracles:
the outputs come back equal to what the function made (and rebuild errors stay
in their places), and the Python calls per output on each side stay within a
bound (counted by cProfile: deterministic, unlike a timing on a shared machine).
"""

from __future__ import annotations

import cProfile
import itertools
import pickle
import pstats
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from headrace._workers import shm
from headrace._workers.processes import _run_chunk

#: Python calls per output, at most, for this mix of kinds: the worker's loop, the
#: output's cost (its allowance needs it; a tuple or dict is walked), its pack (one
#: dump, whose pickle hooks run ~5 times for a NumPy scalar), and the consumer's read.
#: Measured: 18.5 and 1.7 (before: 30.5 and 5.7; the old whole-chunk pickle, which
#: had no allowance to cost outputs for: 6.5 and ~0).
WORKER_CALLS = 21
CONSUMER_CALLS = 2.5


def _small(rng: random.Random, i: int) -> Any:
    """A tiny output of one of the kinds a map of scalars or short records makes."""
    kind = rng.randrange(8)
    if kind == 0:
        return np.int64(i)
    if kind == 1:
        return np.float32(i / 3)
    if kind == 2:
        return i * 7
    if kind == 3:
        return (i, "x" * (i % 5))
    if kind == 4:
        return np.arange(i % 6, dtype=np.int32)
    if kind == 5:
        return {"id": i, "score": i / 2}
    if kind == 6:
        return f"row-{i}"
    return None


def _calls(fn: Callable[[], Any]) -> tuple[int, Any]:
    profile = cProfile.Profile()
    profile.enable()
    try:
        out = fn()
    finally:
        profile.disable()
    return sum(entry[1] for entry in pstats.Stats(profile).stats.values()), out  # type: ignore[attr-defined]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and bool(a == b)


def _no_segment(nbytes: int, capacity: int) -> Any:
    raise AssertionError("tiny outputs need no segment")


@pytest.mark.parametrize("seed", range(4))
def test_tiny_outputs_come_back_equal_at_few_calls_per_output(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.randrange(300, 1200)
    elements = [_small(rng, i) for i in range(count)]
    expected = list(elements)  # the function: identity (the oracle is the input)

    def worker() -> shm.Outputs:
        writer = shm.OutputWriter(_no_segment, 0, 1 << 40, 1 << 20)
        errors = _run_chunk(lambda x: x, list(elements), lambda p: None, writer,
                            1 << 40, 1 << 41, "map")
        assert not errors
        return writer.finish()

    sent, packed = _calls(worker)
    maps = shm.SegmentMaps()
    read, (got, unreadable) = _calls(lambda: maps.unpack_outputs(packed))
    assert not unreadable
    assert len(got) == count
    assert all(_same(a, b) for a, b in zip(expected, got, strict=True)), seed
    assert sent / count <= WORKER_CALLS, f"{sent / count:.1f} calls per output in the worker"
    assert read / count <= CONSUMER_CALLS, f"{read / count:.1f} calls per output to read back"


_FAIL_REBUILD = False


def _rebuild(value: int) -> Any:
    if _FAIL_REBUILD:
        raise ValueError(f"cannot rebuild {value} here")
    return ("rebuilt", value)


class _Flaky:
    """Pickles as a call that raises where it is rebuilt (the consumer, in the test)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _rebuild, (self.value,)


@pytest.mark.parametrize("seed", range(6))
def test_a_run_that_raises_while_read_fails_from_that_output_on_alone(seed: int) -> None:
    """Oracle: the per-output rule. The outputs of a run before the one whose rebuilding
    raises come back whole; it and the rest of its run fail in their places (they may
    refer to it through the memo); other runs are whole. (A run is read whole first,
    and again output by output when that raises.)"""
    global _FAIL_REBUILD
    rng = random.Random(seed)
    count = rng.randrange(40, 400)
    bad = sorted(rng.sample(range(count), rng.randrange(1, 4)))
    outputs = [_Flaky(i) if i in bad else _small(rng, i) for i in range(count)]
    writer = shm.OutputWriter(_no_segment)
    for position, obj in enumerate(outputs):
        writer.add(obj, count - position)
    packed = writer.finish()
    starts = [p for p, (_, _, fresh) in enumerate(packed.ends) if fresh] + [count]
    failing: set[int] = set()
    for begin, end in itertools.pairwise(starts):
        first_bad = next((p for p in bad if begin <= p < end), None)
        if first_bad is not None:
            failing.update(range(first_bad, end))
    _FAIL_REBUILD = True
    try:
        got, unreadable = shm.SegmentMaps().unpack_outputs(packed)
    finally:
        _FAIL_REBUILD = False
    assert set(unreadable) == failing, seed
    for position in failing:
        assert got[position] is None
        assert isinstance(unreadable[position], (ValueError, pickle.UnpicklingError))
    for position in set(range(count)) - failing:
        assert _same(outputs[position], got[position]), (seed, position)
