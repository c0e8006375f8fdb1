"""One index algebra: take, skip, shard and repeat against plain Python lists (issue 27).

Each of these stages describes how it maps positions with one ``IndexMap``; the
random access ``global_shuffle`` reads, the index stream a run over a random-access
source reads and the element stream over a generator are all derived from it.
Random chains of them (with seeded shuffles) over range, array and generator
sources are checked here against list slicing, element ``i`` of the random access
against element ``i`` of the run, and a checkpoint taken at a random point against
the rest of the run. States the stages wrote before their shared layout (format
version 3) must resume element for element too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._errors import InvalidArgumentError
from headrace._transforms._element_access import element_access
from headrace.core.indexing import (
    IndexMap,
    IndexStream,
    Indices,
    MappedIterator,
    RandomAccess,
    Reach,
    Refusal,
    mapped_access,
    mapped_indices,
)
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, ShardRole, Traits, UnaryNode
from headrace.core.state import seal
from headrace.testing import take_elements

Step = tuple[Any, ...]


def _values(ds: hr.Dataset) -> list[Any]:
    return [np.asarray(x).tolist() for x in ds.as_numpy_iterator()]


def generator(n: int) -> hr.Dataset:
    return hr.Dataset.from_generator(
        lambda: iter(range(n)), output_signature=hr.TensorSpec((), np.int64)
    )


def _source(kind: str, n: int) -> tuple[hr.Dataset, list[int]]:
    if kind == "range":
        return hr.Dataset.range(n), list(range(n))
    if kind == "slices":
        return hr.Dataset.from_tensor_slices(np.arange(n, dtype=np.int64) * 10 + 7), [
            10 * i + 7 for i in range(n)
        ]
    return generator(n), list(range(n))


_STEP = st.one_of(
    st.tuples(st.just("take"), st.integers(-2, 12)),
    st.tuples(st.just("skip"), st.integers(-2, 12)),
    st.integers(1, 4).flatmap(lambda k: st.tuples(st.just("shard"), st.just(k), st.integers(0, k - 1))),
    st.tuples(st.just("repeat"), st.integers(0, 3)),
    st.tuples(st.just("repeat_take"), st.integers(0, 20)),  # repeat() forever, then take
    st.tuples(st.just("shuffle"), st.integers(1, 8), st.integers(0, 2**31), st.booleans()),
    st.tuples(st.just("global_shuffle"), st.integers(0, 2**31), st.booleans()),
)


def _build(
    kind: str, n: int, steps: list[Step], batch: tuple[int, bool] | None
) -> tuple[hr.Dataset, list[Any] | None, list[Step]]:
    """The pipeline, the elements plain lists say it gives (None after a shuffle that
    draws a new order each run) and the steps it applied."""
    ds, expected = _source(kind, n)
    oracle: list[Any] | None = expected
    applied: list[Step] = []
    for step in steps:
        name = step[0]
        if name == "take":
            ds = ds.take(step[1])
            oracle = oracle if oracle is None or step[1] < 0 else oracle[: step[1]]
        elif name == "skip":
            ds = ds.skip(step[1])
            oracle = oracle if oracle is None else [] if step[1] < 0 else oracle[step[1] :]
        elif name == "shard":
            ds = ds.shard(step[1], step[2])
            oracle = oracle if oracle is None else oracle[step[2] :: step[1]]
        elif name in ("repeat", "repeat_take"):
            # repeat() then take(k): k copies are enough, cut to k below
            ds = ds.repeat(step[1]) if name == "repeat" else ds.repeat().take(step[1])
            times = step[1]
            if oracle is not None:
                oracle = (oracle * times)[: step[1]] if name == "repeat_take" else oracle * times
        elif name == "shuffle":
            ds = ds.shuffle(step[1], seed=step[2], reshuffle_each_iteration=step[3])
            oracle = None if step[3] else _permuted(ds, oracle)  # each run its own order
        else:  # global_shuffle: only over an input with element i, and not an empty one
            access = element_access(ds.node)
            if isinstance(access, Refusal) or len(access) == 0:
                with pytest.raises(InvalidArgumentError, match="global_shuffle"):
                    ds.global_shuffle(seed=step[1], reshuffle_each_iteration=step[2])
                continue
            ds = ds.global_shuffle(seed=step[1], reshuffle_each_iteration=step[2])
            oracle = None if step[2] else _permuted(ds, oracle)
        applied.append(step)
    if batch is not None:
        size, drop = batch
        ds = ds.batch(size, drop_remainder=drop)
        if oracle is not None:
            oracle = [oracle[i : i + size] for i in range(0, len(oracle), size)]
            oracle = [b for b in oracle if len(b) == size or not drop]
    return ds, oracle, applied


def _permuted(ds: hr.Dataset, oracle: list[Any] | None) -> list[Any] | None:
    """A seeded shuffle's order, read from the run: a permutation of what came in."""
    if oracle is None:
        return None
    order = _values(ds)
    assert sorted(order) == sorted(oracle)
    return order


def _restore(ds: hr.Dataset, state: dict[str, Any]) -> list[Any]:
    with iter(ds) as iterator:
        iterator.set_state(json.loads(json.dumps(state)))
        return [np.asarray(x).tolist() for x in iterator]


def _checkpoint(ds: hr.Dataset, count: int) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """A run's first ``count`` elements, its state then, and the rest of that run (a
    reshuffling stage orders each run anew: the state must give back this one's)."""
    with iter(ds) as iterator:
        head = [np.asarray(x).tolist() for x in take_elements(iterator, count)]
        state: dict[str, Any] = json.loads(json.dumps(iterator.get_state()))
        return head, state, [np.asarray(x).tolist() for x in iterator]


# -- the layout version 3 wrote, from the shared one ---------------------------------------


def _indices_state(tree: Any) -> dict[str, Any] | None:
    """The index stream's state in an iterator's state tree (None if it has none)."""
    if isinstance(tree, dict):
        if "indices" in tree:
            found: dict[str, Any] = tree["indices"]
            return found
        children = list(tree.values())
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    for child in children:
        found_below = _indices_state(child)
        if found_below is not None:
            return found_below
    return None


def _as_version_3(state: dict[str, Any], steps: list[Step]) -> dict[str, Any]:
    """``state`` (of a chain of take/skip/shard/repeat over indices) in the layout
    version 3 wrote: each stage's own counter, named its own way."""
    old = json.loads(json.dumps(state))
    del old["checksum"]
    old["version"] = 3
    stream = _indices_state(old["state"])
    stages: list[Step] = []
    for step in steps:
        if step[0] == "repeat_take":
            stages += [("repeat", -1), ("take", step[1])]
        elif step != ("take", step[1]) or step[1] >= 0:  # take(-1) has no stream
            stages.append(step)
    if stream is None:  # skip(-1) on top reads nothing and has no stream
        assert stages[-1][0] == "skip" and stages[-1][1] < 0
        return seal(old)
    for step in reversed(stages):
        consumed = stream.pop("consumed")
        name = step[0]
        if name == "take":
            stream["remaining"] = step[1] - consumed
        elif name == "skip":
            stream["remaining" if step[1] < 0 else "to_skip"] = max(step[1] - consumed, 0)
        elif name == "shard":
            stream["seen"] = consumed
        else:
            stream["count"] = -1 if step[1] < 0 else step[1]
            stream["produced"] = consumed
        stream = stream["inner"]
    assert "position" in stream, stream  # the source's, reached through every stage
    return seal(old)


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["range", "slices", "generator"]),
    n=st.integers(0, 25),
    steps=st.lists(_STEP, max_size=5),
    batch=st.none() | st.tuples(st.integers(1, 5), st.booleans()),
    data=st.data(),
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_random_chains_agree_with_list_slicing(
    kind: str, n: int, steps: list[Step], batch: tuple[int, bool] | None, data: st.DataObject
) -> None:
    ds, oracle, applied = _build(kind, n, steps, batch)
    run = _values(ds)
    if oracle is not None:
        assert run == oracle

    names = {step[0] for step in applied}
    addressable = (
        kind != "generator"
        and not names & {"shuffle", "repeat_take"}
        and (batch is None or batch[1])
    )
    access = element_access(ds.node)
    assert isinstance(access, RandomAccess) == addressable, access
    if isinstance(access, RandomAccess):
        assert len(access) == len(run)
        if "global_shuffle" not in names:  # (global_shuffle's access is its input's order)
            assert [np.asarray(access.get(i)).tolist() for i in range(len(run))] == run
            if run:
                backwards = np.asarray(access.get_many(np.arange(len(run))[::-1])).tolist()
                assert backwards == run[::-1]

    point = data.draw(st.integers(0, len(run)), label="checkpoint after")
    head, state, rest = _checkpoint(ds, point)
    assert len(head) == point and len(head + rest) == len(run)
    assert _restore(ds, state) == rest
    if kind != "generator" and names <= {"take", "skip", "shard", "repeat", "repeat_take"}:
        assert head + rest == run
        assert _restore(ds, _as_version_3(state, applied)) == rest


def test_a_global_shuffle_over_a_cut_global_shuffle_keeps_the_cut_elements() -> None:
    cut = hr.Dataset.range(10).global_shuffle(seed=1, reshuffle_each_iteration=False).take(3)
    again = cut.global_shuffle(seed=0, reshuffle_each_iteration=False)
    assert sorted(_values(again)) == sorted(_values(cut))


# -- states version 3 wrote, resumed -------------------------------------------------------

# What headrace wrote before the four stages shared one layout, after 0, 1, ...
# elements (the last after the run had ended): [iteration, state tree, the rest of
# that run as that headrace gave it].
_VERSION_3_STATES: list[tuple[str, Callable[[], hr.Dataset], list[Any]]] = [
    (
        'generator(12).skip(2).take(7).shard(2, 1)',
        lambda: generator(12).skip(2).take(7).shard(2, 1),
        [
            [1, {"inner": {"inner": {"inner": {"produced": 0}, "to_skip": 2}, "remaining": 7}, "position": 0}, [3, 5, 7]],
            [2, {"inner": {"inner": {"inner": {"produced": 4}, "to_skip": 0}, "remaining": 5}, "position": 2}, [5, 7]],
            [3, {"inner": {"inner": {"inner": {"produced": 6}, "to_skip": 0}, "remaining": 3}, "position": 4}, [7]],
            [4, {"inner": {"inner": {"inner": {"produced": 9}, "to_skip": 0}, "remaining": 0}, "position": 7}, []],
        ],
    ),
    (
        'generator(5).take(3)',
        lambda: generator(5).take(3),
        [
            [1, {"inner": {"produced": 0}, "remaining": 3}, [0, 1, 2]],
            [2, {"inner": {"produced": 1}, "remaining": 2}, [1, 2]],
            [3, {"inner": {"produced": 2}, "remaining": 1}, [2]],
            [4, {"inner": {"produced": 3}, "remaining": 0}, []],
        ],
    ),
    (
        'generator(8).shard(3, 2).skip(1).repeat(2)',
        lambda: generator(8).shard(3, 2).skip(1).repeat(2),
        [
            [1, {"epoch": 0, "produced": 0, "inner": {"inner": {"inner": {"produced": 0}, "position": 0}, "to_skip": 1}}, [5, 5]],
            [2, {"epoch": 0, "produced": 1, "inner": {"inner": {"inner": {"produced": 6}, "position": 6}, "to_skip": 0}}, [5]],
            [3, {"epoch": 1, "produced": 1, "inner": None}, []],
        ],
    ),
    (
        'generator(4).take(6).skip(-1)',
        lambda: generator(4).take(6).skip(-1),
        [
            [1, {}, []],
        ],
    ),
    (
        'hr.Dataset.range(20).skip(3).take(9).shard(2, 1)',
        lambda: hr.Dataset.range(20).skip(3).take(9).shard(2, 1),
        [
            [1, {"indices": {"inner": {"inner": {"inner": {"position": 0}, "to_skip": 3}, "remaining": 9}, "seen": 0}}, [4, 6, 8, 10]],
            [2, {"indices": {"inner": {"inner": {"inner": {"position": 5}, "to_skip": 0}, "remaining": 7}, "seen": 2}}, [6, 8, 10]],
            [3, {"indices": {"inner": {"inner": {"inner": {"position": 7}, "to_skip": 0}, "remaining": 5}, "seen": 4}}, [8, 10]],
            [4, {"indices": {"inner": {"inner": {"inner": {"position": 9}, "to_skip": 0}, "remaining": 3}, "seen": 6}}, [10]],
            [5, {"indices": {"inner": {"inner": {"inner": {"position": 12}, "to_skip": 0}, "remaining": 0}, "seen": 9}}, []],
        ],
    ),
    (
        'hr.Dataset.range(4).skip(-1).repeat(3).take(5)',
        lambda: hr.Dataset.range(4).skip(-1).repeat(3).take(5),
        [
            [1, {"indices": {"inner": {"epoch": 3, "count": 0, "produced": 0, "inner": {"inner": {"position": 0}, "remaining": 0}}, "remaining": 5}}, []],
        ],
    ),
    (
        'hr.Dataset.range(5).shuffle(3, seed=7).repeat(2).skip(2).take(7)',
        lambda: hr.Dataset.range(5).shuffle(3, seed=7).repeat(2).skip(2).take(7),
        [
            [1, {"indices": {"inner": {"inner": {"epoch": 0, "count": 2, "produced": 0, "inner": {"seed": 7, "epoch": [1, 0], "drawn": 0, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 2}, "remaining": 7}}, [4, 3, 2, 0, 3, 1, 2]],
            [2, {"indices": {"inner": {"inner": {"epoch": 0, "count": 2, "produced": 3, "inner": {"seed": 7, "epoch": [2, 0], "drawn": 3, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 6}}, [3, 4, 0, 3, 1, 2]],
            [3, {"indices": {"inner": {"inner": {"epoch": 0, "count": 2, "produced": 4, "inner": {"seed": 7, "epoch": [3, 0], "drawn": 4, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 5}}, [0, 0, 3, 4, 1]],
            [4, {"indices": {"inner": {"inner": {"epoch": 0, "count": 2, "produced": 5, "inner": {"seed": 7, "epoch": [4, 0], "drawn": 5, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 4}}, [2, 3, 0, 1]],
            [5, {"indices": {"inner": {"inner": {"epoch": 1, "count": 2, "produced": 1, "inner": {"seed": 7, "epoch": [5, 1], "drawn": 1, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 3}}, [2, 3, 4]],
            [6, {"indices": {"inner": {"inner": {"epoch": 1, "count": 2, "produced": 2, "inner": {"seed": 7, "epoch": [6, 1], "drawn": 2, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 2}}, [3, 4]],
            [7, {"indices": {"inner": {"inner": {"epoch": 1, "count": 2, "produced": 3, "inner": {"seed": 7, "epoch": [7, 1], "drawn": 3, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 1}}, [2]],
            [8, {"indices": {"inner": {"inner": {"epoch": 2, "count": 2, "produced": 0, "inner": {"seed": 7, "epoch": [8, 2], "drawn": 0, "inner_start": {"position": 0}, "capacity": 3}}, "to_skip": 0}, "remaining": 0}}, []],
        ],
    ),
    (
        'hr.Dataset.range(6).repeat(2).batch(4)',
        lambda: hr.Dataset.range(6).repeat(2).batch(4),
        [
            [1, {"inputs": [{"indices": {"epoch": 0, "count": 2, "produced": 0, "inner": {"position": 0}}}]}, [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]]],
            [2, {"inputs": [{"indices": {"epoch": 0, "count": 2, "produced": 4, "inner": {"position": 4}}}]}, [[4, 5, 0, 1], [2, 3, 4, 5]]],
            [3, {"inputs": [{"indices": {"epoch": 1, "count": 2, "produced": 2, "inner": {"position": 2}}}]}, [[2, 3, 4, 5]]],
            [4, {"inputs": [{"indices": {"epoch": 2, "count": 2, "produced": 0, "inner": {"position": 0}}}]}, []],
        ],
    ),
    (
        'hr.Dataset.range(7).repeat().shard(3, 2).take(5)',
        lambda: hr.Dataset.range(7).repeat().shard(3, 2).take(5),
        [
            [1, {"indices": {"inner": {"inner": {"epoch": 0, "count": -1, "produced": 0, "inner": {"position": 0}}, "seen": 0}, "remaining": 5}}, [2, 5, 1, 4, 0]],
            [2, {"indices": {"inner": {"inner": {"epoch": 0, "count": -1, "produced": 3, "inner": {"position": 3}}, "seen": 3}, "remaining": 4}}, [5, 1, 4, 0]],
            [3, {"indices": {"inner": {"inner": {"epoch": 0, "count": -1, "produced": 6, "inner": {"position": 6}}, "seen": 6}, "remaining": 3}}, [1, 4, 0]],
            [4, {"indices": {"inner": {"inner": {"epoch": 1, "count": -1, "produced": 2, "inner": {"position": 2}}, "seen": 9}, "remaining": 2}}, [4, 0]],
            [5, {"indices": {"inner": {"inner": {"epoch": 1, "count": -1, "produced": 5, "inner": {"position": 5}}, "seen": 12}, "remaining": 1}}, [0]],
            [6, {"indices": {"inner": {"inner": {"epoch": 0, "count": 0, "produced": 0, "inner": {"position": 0}}, "seen": 15}, "remaining": 0}}, []],
        ],
    ),
    (
        'hr.Dataset.range(3).take(0).repeat(2).skip(1)',
        lambda: hr.Dataset.range(3).take(0).repeat(2).skip(1),
        [
            [1, {"indices": {"inner": {"epoch": 2, "count": 0, "produced": 0, "inner": {"inner": {"position": 0}, "remaining": 0}}, "to_skip": 0}}, []],
        ],
    ),
    (
        'hr.Dataset.from_tensor_slices(list(range(10, 19))).skip(2).repeat(2).shard(4, 3)',
        lambda: hr.Dataset.from_tensor_slices(list(range(10, 19))).skip(2).repeat(2).shard(4, 3),
        [
            [1, {"indices": {"inner": {"epoch": 0, "count": 2, "produced": 0, "inner": {"inner": {"position": 0}, "to_skip": 2}}, "seen": 0}}, [15, 12, 16]],
            [2, {"indices": {"inner": {"epoch": 0, "count": 2, "produced": 4, "inner": {"inner": {"position": 6}, "to_skip": 0}}, "seen": 4}}, [12, 16]],
            [3, {"indices": {"inner": {"epoch": 1, "count": 2, "produced": 1, "inner": {"inner": {"position": 3}, "to_skip": 0}}, "seen": 8}}, [16]],
            [4, {"indices": {"inner": {"epoch": 2, "count": 2, "produced": 0, "inner": {"inner": {"position": 0}, "to_skip": 2}}, "seen": 14}}, []],
        ],
    ),
]


def _version_3(ds: hr.Dataset, tree: dict[str, Any], iteration: int = 0) -> dict[str, Any]:
    return seal(
        {
            "format": "headrace.iterator",
            "version": 3,
            "fingerprint": ds.node.fingerprint(),
            "iteration": iteration,
            "state": tree,
        }
    )


@pytest.mark.parametrize(
    ("make", "states"),
    [pytest.param(make, states, id=name) for name, make, states in _VERSION_3_STATES],
)
def test_states_written_by_version_3_resume_element_for_element(
    make: Callable[[], hr.Dataset], states: list[Any]
) -> None:
    ds = make()
    run = _values(ds)
    assert len(states) == len(run) + 1
    for point, (iteration, tree, rest) in enumerate(states):
        assert _restore(ds, _version_3(ds, tree, iteration)) == rest, point


def test_a_version_3_repeat_of_another_count_is_refused_naming_it() -> None:
    ds = hr.Dataset.range(9).repeat(3)
    tree = {"indices": {"epoch": 1, "count": 2, "produced": 4, "inner": {"position": 4}}}
    with iter(ds) as iterator, pytest.raises(hr.CheckpointError, match="repeat has count=3"):
        iterator.set_state(_version_3(ds, tree))


def test_a_version_3_take_counter_out_of_range_is_refused_naming_it() -> None:
    ds = hr.Dataset.range(100).take(10)
    tree = {"indices": {"inner": {"position": 0}, "remaining": 11}}
    with iter(ds) as iterator, pytest.raises(hr.CheckpointError, match=r"take: .*\(take\(10\)\)"):
        iterator.set_state(_version_3(ds, tree))


def test_the_shared_layout_counts_what_each_stage_consumed() -> None:
    ds = hr.Dataset.range(20).skip(3).take(9).shard(2, 1).repeat(2)
    # 4, 6, 8 came: shard read six of take's elements (3..8), take six of skip's, and
    # skip nine of the source's
    state = _checkpoint(ds, 3)[1]
    assert state["state"] == {
        "indices": {
            "inner": {"inner": {"inner": {"inner": {"position": 9}, "consumed": 9}, "consumed": 6}, "consumed": 6},
            "consumed": 3,
            "epoch": 0,
        }
    }


# -- a new stage of this kind: one map, nothing in core/indexing.py ------------------------


class _Slice(IndexMap):
    """Input positions ``start, start + step, ...`` below ``stop``: ``list[start:stop:step]``."""

    def __init__(self, start: int, stop: int, step: int) -> None:
        super().__init__(f"slice({start}, {stop}, {step})")
        self.start, self.stop, self.step = start, stop, step

    def length(self, size: int) -> int:
        return len(range(self.start, min(self.stop, size), self.step))

    def position(self, indices: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
        return indices * self.step + self.start

    def _first(self, consumed: int) -> int:
        behind = max(consumed - self.start, 0)
        return self.start + -(-behind // self.step) * self.step

    def want(self, consumed: int, count: int) -> int:
        first = self._first(consumed)
        if first >= self.stop or count <= 0:
            return 0
        last = min(first + (count - 1) * self.step, self.stop - 1)
        last -= (last - self.start) % self.step
        return last - consumed + 1

    def select(self, consumed: int, block: Indices) -> Indices:
        return block[self._first(consumed) - consumed : self.stop - consumed : self.step]


class _SliceNode(UnaryNode):
    stage = "slice"

    def __init__(self, source: Node, start: int, stop: int, step: int) -> None:
        super().__init__(source)
        self.bounds = (start, stop, step)

    def params(self) -> tuple[Any, ...]:
        return self.bounds

    def index_map(self) -> _Slice:
        return _Slice(*self.bounds)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        start, stop, step = self.bounds
        return len(range(start, stop if inner < 0 else min(stop, inner), step))

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return mapped_access(self.index_map(), reach(self.inputs[0]))

    def traits(self) -> Traits:
        return Traits()

    def wrap_indices(
        self, make_inner: Callable[[Context], IndexStream], ctx: Context
    ) -> IndexStream | None:
        return mapped_indices(self.index_map(), make_inner, ctx)

    def stream_iterator(self, inner: Iterator, ctx: Context) -> Iterator:
        return MappedIterator(inner, self.index_map())


@pytest.mark.parametrize("kind", ["range", "generator"])
@pytest.mark.parametrize("bounds", [(2, 11, 3), (0, 5, 1), (4, 40, 7), (30, 40, 2), (1, 2, 5)])
@pytest.mark.parametrize("batch", [None, 2])
def test_a_new_stage_needs_one_map_for_access_indices_elements_and_state(
    kind: str, bounds: tuple[int, int, int], batch: int | None
) -> None:
    source, values = _source(kind, 20)
    ds = source.derive(_SliceNode(source.node, *bounds))
    expected: list[Any] = values[slice(*bounds)]
    if batch:
        ds = ds.batch(batch)
        expected = [expected[i : i + batch] for i in range(0, len(expected), batch)]
    run = _values(ds)
    assert run == expected
    access = element_access(ds.node)
    if kind == "range" and not batch:
        assert isinstance(access, RandomAccess)
        assert [np.asarray(access.get(i)).tolist() for i in range(len(access))] == expected
    for point in range(len(run) + 1):
        head, state, rest = _checkpoint(ds, point)
        assert head + rest == run and _restore(ds, state) == rest


def test_a_repeat_past_its_last_epoch_reads_nothing_more_even_over_an_endless_input() -> None:
    # (what a version-3 state at its end restores to; reading its input out would hang)
    ds = hr.Dataset.range(3).repeat().repeat(2)
    with iter(ds) as endless:
        next(endless)
        state = json.loads(json.dumps(endless.get_state()))
    state["state"]["indices"]["epoch"] = 2
    del state["checksum"]
    with iter(ds) as iterator:
        iterator.set_state(seal(state))
        assert list(iterator) == []
        assert iterator.get_state()["state"]["indices"]["epoch"] == 2
    state["state"]["indices"]["epoch"] = 3
    del state["checksum"]
    with iter(ds) as iterator, pytest.raises(hr.CheckpointError, match=r"\[0, 2\] \(repeat\(2\)\)"):
        iterator.set_state(seal(state))
