"""Every recipe node declares what it can do in its own class (issue 27).

Sharding, ``global_shuffle``, the recipe lint and the adapters decide by asking a
node (``shard_role``, ``element_access``, ``traits``, ``cardinality``), never by
testing its class. A stage that forgot to declare one would silently get the base
class's answer (a zip once got "position-free" that way and mis-paired features
and labels): these tests refuse it instead, and check that the answers given
through the index algebra are the elements the pipeline delivers.
"""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import InvalidArgumentError
from headrace._transforms._element_access import element_access
from headrace._transforms.map import MapNode
from headrace._transforms.take import TakeNode
from headrace.core.indexing import RandomAccess, Refusal
from headrace.core.node import CAPABILITIES, Node, ShardRole, SourceNode, Traits, UnaryNode

SRC = Path(hr.__file__).parent


def _node_modules() -> list[str]:
    """The headrace modules that define a Node subclass, found in their source.

    Read rather than imported, so that the frameworks the adapters import are not
    loaded for this; the walk below then checks it found every class.
    """
    trees = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        trees[name] = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    known, grown = {"Node"}, True
    while grown:
        before = len(known)
        for classes in trees.values():
            known.update(c.name for c in classes if any(_base_name(b) in known for b in c.bases))
        grown = len(known) > before
    return sorted(name for name, classes in trees.items() if any(c.name in known for c in classes))


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


@functools.cache
def _node_classes() -> tuple[type[Node], ...]:
    """Every Node subclass headrace defines."""
    modules = _node_modules()
    for name in modules:
        importlib.import_module(name)
    found: list[type[Node]] = []
    pending = list(Node.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls not in found and cls.__module__ in modules:
            found.append(cls)
        pending.extend(cls.__subclasses__())
    return tuple(found)


def undeclared(cls: type[Node]) -> list[str]:
    """The capabilities ``cls`` neither declares in its body nor inherits from a base
    that shares them on purpose (``shared_capabilities``)."""
    missing = []
    for capability in CAPABILITIES:
        owner = next(k for k in cls.__mro__ if capability in vars(k))
        if owner is cls:
            continue
        shared = vars(owner).get("shared_capabilities", ())
        if owner not in (Node, UnaryNode) and capability in shared:
            continue
        missing.append(f"{cls.__qualname__}.{capability} (inherited from {owner.__qualname__})")
    return missing


def test_every_node_class_declares_every_capability() -> None:
    # (the two bases stages derive from; each source still declares its cardinality)
    classes = [cls for cls in _node_classes() if cls not in (UnaryNode, SourceNode)]
    assert len(classes) > 40  # the walk found the stages, not an empty list
    problems = [problem for cls in classes for problem in undeclared(cls)]
    assert problems == []


def test_shared_capabilities_are_declared_where_shared() -> None:
    for cls in _node_classes():
        shared = vars(cls).get("shared_capabilities", ())
        for capability in shared:
            assert capability in CAPABILITIES, (cls, capability)
            assert capability in vars(cls), f"{cls.__qualname__} shares {capability} it lacks"


def test_a_stage_that_forgets_is_named() -> None:
    class Forgot(UnaryNode):
        stage = "forgot"

        def cardinality(self) -> int:
            return self.inputs[0].cardinality()

    assert undeclared(Forgot) == [
        "test_a_stage_that_forgets_is_named.<locals>.Forgot.shard_role (inherited from Node)",
        "test_a_stage_that_forgets_is_named.<locals>.Forgot.element_access "
        "(inherited from Node)",
        "test_a_stage_that_forgets_is_named.<locals>.Forgot.traits (inherited from Node)",
    ]

    class NoCount(UnaryNode):  # UnaryNode's pass-through count is no declaration
        stage = "no_count"

        def shard_role(self) -> ShardRole:
            return ShardRole.POSITIONAL

        def element_access(self, reach: Any) -> RandomAccess | Refusal:
            return Refusal(self)

        def traits(self) -> Traits:
            return Traits()

    assert undeclared(NoCount) == [
        "test_a_stage_that_forgets_is_named.<locals>.NoCount.cardinality "
        "(inherited from UnaryNode)"
    ]


def test_only_a_sharing_base_passes_its_answers_on() -> None:
    class MyTake(TakeNode):  # take's answers are take's own, not shared
        stage = "my_take"

    class MyMap(MapNode):  # a map's are every map's (parse_examples is one)
        stage = "my_map"

    assert [p.split(" ")[0].rsplit(".", 1)[1] for p in undeclared(MyTake)] == list(CAPABILITIES)
    assert undeclared(MyMap) == []


# -- the index algebra against the pipeline it describes ---------------------------------

Step = Callable[[hr.Dataset, random.Random], hr.Dataset]

_STEPS: list[tuple[str, Step]] = [
    ("map", lambda ds, r: ds.map(lambda x: x * 3 + 1)),
    ("take", lambda ds, r: ds.take(r.choice([-1, 0, 3, 7, 50]))),
    ("skip", lambda ds, r: ds.skip(r.choice([-1, 0, 2, 5, 50]))),
    ("shard", lambda ds, r: ds.shard(n := r.randint(1, 4), r.randrange(n))),
    ("repeat", lambda ds, r: ds.repeat(r.randint(0, 3))),
    ("batch", lambda ds, r: ds.batch(r.randint(1, 4), drop_remainder=True)),
    ("enumerate", lambda ds, r: ds.enumerate(r.randint(0, 5)).map(lambda i, x: x + i)),
    ("zip", lambda ds, r: hr.Dataset.zip((ds, ds.map(lambda x: x - 1))).map(lambda a, b: a + b)),
    ("concatenate", lambda ds, r: ds.concatenate(ds.take(3))),
    ("prefetch", lambda ds, r: ds.prefetch(2)),
    ("cache", lambda ds, r: ds.cache()),
]


def _chains(count: int) -> list[list[str]]:
    r = random.Random(27)
    names = [name for name, _ in _STEPS]
    singles = [[name] for name in names]
    pairs = [list(pair) for pair in itertools.product(names, repeat=2)]
    return singles + pairs + [r.sample(names, r.randint(3, 5)) for _ in range(count)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.filterwarnings("ignore:cache. The calling iterator did not fully read")
def test_element_access_gives_the_elements_the_pipeline_delivers(seed: int) -> None:
    """Element ``i`` through the stages' index mappings is element ``i`` of the run."""
    steps = dict(_STEPS)
    r = random.Random(seed)
    for chain in _chains(12):
        ds = hr.Dataset.range(r.randint(0, 23))
        for name in chain:
            ds = steps[name](ds, r)
        access = element_access(ds.node)
        assert isinstance(access, RandomAccess), (chain, access)
        expected = [np.asarray(x) for x in ds.as_numpy_iterator()]
        assert len(access) == len(expected), chain
        got = [np.asarray(access.get(i)) for i in range(len(access))]
        assert [e.tolist() for e in got] == [e.tolist() for e in expected], chain
        if expected:
            many = np.asarray(access.get_many(np.arange(len(access))[::-1]))
            assert many.tolist() == [e.tolist() for e in reversed(expected)], chain


@pytest.mark.parametrize(
    ("build", "stage", "why"),
    [
        (lambda ds: ds.filter(lambda x: x > 2), "filter", ""),
        (lambda ds: ds.repeat(), "repeat", "an infinite repeat has no element i to shuffle to"),
        (lambda ds: ds.batch(3), "batch", "only with drop_remainder=True: a partial last batch"),
        (lambda ds: ds.shuffle(4, seed=1), "shuffle", ""),
        (lambda ds: ds.filter(lambda x: x > 2).map(lambda x: x), "filter", ""),
    ],
)
def test_a_stage_without_element_i_is_named(
    build: Callable[[hr.Dataset], hr.Dataset], stage: str, why: str
) -> None:
    refusal = element_access(build(hr.Dataset.range(10)).node)
    assert isinstance(refusal, Refusal)
    assert (refusal.stage, refusal.why) == (stage, why)
    with pytest.raises(InvalidArgumentError, match=f"; {stage} does not support"):
        build(hr.Dataset.range(10)).global_shuffle(seed=0)


_RANDOM_STAGES: list[tuple[str, Callable[[int | None], hr.Dataset]]] = [
    ("shuffle", lambda seed: hr.Dataset.range(40).shuffle(8, seed=seed)),
    ("global_shuffle", lambda seed: hr.Dataset.range(40).global_shuffle(seed=seed)),
    ("random", lambda seed: hr.Dataset.random(seed=seed).take(40)),
    ("sample_from_datasets", lambda seed: hr.Dataset.sample_from_datasets(
        [hr.Dataset.range(20), hr.Dataset.range(20, 40)], seed=seed)),
]


@pytest.mark.parametrize(("stage", "make"), _RANDOM_STAGES)
def test_data_sharding_asks_every_random_stage_for_its_seed(
    stage: str, make: Callable[[int | None], hr.Dataset]
) -> None:
    """Each worker of a DATA split runs the whole pipeline: a random stage says it has
    no seed (its trait), and is refused by name; seeded, the workers' parts together
    are exactly the unsharded elements."""
    with pytest.raises(InvalidArgumentError, match=f"stage '{stage}' has no seed"):
        hr.auto_shard(make(None).map(lambda x: x), "data", num_shards=2, index=0)
    seeded = make(5).map(lambda x: x)
    parts = [list(hr.auto_shard(seeded, "data", num_shards=2, index=i)) for i in range(2)]
    assert sorted(int(x) for part in parts for x in part) == sorted(int(x) for x in seeded)
