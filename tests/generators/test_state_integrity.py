"""Iterator states carry a checksum over every field (integrity, not security).

A state whose position was edited by hand can still be *valid* (a smaller or
larger counter in range): without a checksum, restoring it would skip or repeat
elements silently. A generator takes real states from random pipelines at random
steps, makes one random edit anywhere in them (a number moved, a string changed,
a field removed or added, a list shortened), and ``set_state`` must refuse every
one with a CheckpointError naming the checksum — never resume, never raise
anything else. The same holds for a served consumer's state, whose inner
position is the producer's sealed state.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_paths import field_paths

import headrace as hr
from headrace.core.state import seal
from headrace.testing import assert_elements_equal, take_elements


def _double(x: Any) -> Any:
    return x * 2


def _even(x: Any) -> Any:
    return bool(np.all(x % 2 == 0))


def _gen(n: int) -> Any:
    yield from range(n)


SOURCES = {
    "range": lambda n: hr.Dataset.range(n),
    "slices": lambda n: hr.Dataset.from_tensor_slices(np.arange(n, dtype=np.int64) * 3),
    "generator": lambda n: hr.Dataset.from_generator(
        _gen, args=(n,), output_signature=hr.TensorSpec((), np.int64)
    ),
}
STAGES = {
    "map": lambda ds: ds.map(_double),
    "filter": lambda ds: ds.filter(_even),
    "shuffle": lambda ds: ds.shuffle(7, seed=3),
    # (dropping the remainder: a batch of batches needs equal inner batches)
    "batch": lambda ds: ds.batch(3, drop_remainder=True),
    "take": lambda ds: ds.take(40),
    "skip": lambda ds: ds.skip(2),
    "repeat": lambda ds: ds.repeat(2),
    "prefetch": lambda ds: ds.prefetch(2),
    "cache": lambda ds: ds.cache(),
}




def _edit(state: dict[str, Any], path: tuple[Any, ...], how: int, amount: int) -> bool:
    """Change the field at ``path`` (one of several edits); False if it stayed equal."""
    parent: Any = state
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    old = parent[key]
    if how == 0 and isinstance(old, bool):
        parent[key] = not old
    elif how == 0 and isinstance(old, (int, float)):
        parent[key] = old + amount
    elif how == 0 and isinstance(old, str):
        parent[key] = old + "x"
    elif how == 1 and isinstance(parent, dict):
        del parent[key]
    elif how == 1 and isinstance(parent, list):
        parent.pop(key)
    elif how == 2 and isinstance(old, dict):
        old["extra"] = amount
    elif how == 2 and isinstance(old, list):
        old.append(amount)
    else:
        parent[key] = None if old is not None else amount
    return True


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[str, int, list[str]]:
    source = draw(st.sampled_from(sorted(SOURCES)))
    stages = draw(st.lists(st.sampled_from(sorted(STAGES)), max_size=4))
    return source, draw(st.integers(1, 30)), stages


def _build(source: str, n: int, stages: list[str]) -> hr.Dataset:
    ds = SOURCES[source](n)
    for stage in stages:
        ds = STAGES[stage](ds)
    return ds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pipeline=pipelines(),
    data=st.data(),
)
def test_any_edit_of_a_state_is_refused_and_the_unedited_one_resumes_exactly(
    pipeline: tuple[str, int, list[str]], data: st.DataObject
) -> None:
    ds = _build(*pipeline)
    total = len(take_elements(iter(ds), 10_000))
    step = data.draw(st.integers(0, total), label="step")
    with iter(ds) as iterator:
        take_elements(iterator, step)
        state: dict[str, Any] = json.loads(json.dumps(iterator.get_state()))
        rest = take_elements(iterator, 10_000)
    with iter(ds) as restored:  # the oracle: a state untouched resumes exactly
        restored.set_state(copy.deepcopy(state))
        resumed = take_elements(restored, 10_000)
    assert len(resumed) == len(rest)
    for a, b in zip(resumed, rest, strict=True):
        assert_elements_equal(a, b)
    candidates = [p for p in field_paths(state) if p != ("checksum",)]
    path = data.draw(st.sampled_from(candidates), label="path")
    how = data.draw(st.integers(0, 3), label="how")
    amount = data.draw(st.sampled_from([-2, -1, 1, 2, 7]), label="amount")
    edited = copy.deepcopy(state)
    _edit(edited, path, how, amount)
    with iter(ds) as iterator, pytest.raises(hr.CheckpointError) as refused:
        iterator.set_state(edited)
    if path[0] not in ("format", "version"):  # (those say which format they expected)
        assert "checksum" in str(refused.value), str(refused.value)


def test_a_state_without_its_checksum_is_refused() -> None:
    ds = hr.Dataset.range(10)
    with iter(ds) as iterator:
        next(iterator)
        state = iterator.get_state()
    del state["checksum"]
    with iter(ds) as other, pytest.raises(hr.CheckpointError, match="no 'checksum' field"):
        other.set_state(state)


def test_a_moved_position_no_longer_skips_elements_silently() -> None:
    """The reproduction: a position moved forward, still in range, used to resume and
    lose the elements in between."""
    ds = hr.Dataset.from_tensor_slices(np.arange(100))
    with iter(ds) as iterator:
        take_elements(iterator, 10)
        state = json.loads(json.dumps(iterator.get_state()))
    moved = json.loads(json.dumps(state).replace('"position": 10', '"position": 14'))
    assert moved != state
    with iter(ds) as other, pytest.raises(hr.CheckpointError, match="checksum"):
        other.set_state(moved)
    with iter(ds) as other:  # sealed again (a buggy producer): the fields are still checked
        other.set_state(seal(moved))
        assert int(next(other)) == 14


KEY = b"state-integrity"


@pytest.mark.parametrize("edit", ["forward", "backward"])
def test_a_served_consumer_state_with_an_edited_source_position_is_refused(
    tmp_path: Path, edit: str
) -> None:
    dataset = hr.Dataset.range(60)
    address = str(tmp_path / "s.sock")
    with hr.serve(dataset, 2, address, authkey=KEY), hr.connect(address, 1, authkey=KEY) as part:
        head = [int(next(part)) for _ in range(6)]
        state = json.loads(json.dumps(part.get_state()))
        rest = [int(e) for e in part]
    assert head + rest == list(range(1, 60, 2))
    positions = [p for p in field_paths(state) if p[-1] == "position"]
    assert positions, state  # the source's position, inside the producer's state
    edited = copy.deepcopy(state)
    parent: Any = edited
    for key in positions[0][:-1]:
        parent = parent[key]
    parent["position"] += 2 if edit == "forward" else -2
    with hr.serve(dataset, 2, address, authkey=KEY):
        with hr.connect(address, 1, authkey=KEY) as other, pytest.raises(
            hr.CheckpointError, match="checksum"
        ):
            other.set_state(edited)
        with hr.connect(address, 1, authkey=KEY, state=state) as resumed:  # the oracle
            assert [int(e) for e in resumed] == rest
