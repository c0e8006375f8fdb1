"""The doctor and lint over many random pipelines: no false alarms, and injected leaks found.

Pipelines come from the budget fuzzer's generator (``fuzz_pipelines.random_spec``:
random sources, element sizes and kinds, transformations and budgets). Each
sweep checks what a user acts on:

- a clean pipeline is never called leaking, and leaves nothing behind;
- a lint finding is true: the run that follows does what it predicted (the
  shuffle shrinks, the cache spills) — or, where the input's length was
  unknown, the finding said so and the input stayed under the length named;
- after a profile, lint (sizes measured) names every shrink and spill the
  run had;
- a leak injected at a random place in a random pipeline (a map keeping its
  elements, an iterator opened per epoch and never closed, a memo that never
  evicts) is found, and the first stage named is the one injected.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fuzz_pipelines as fuzz
import numpy as np
import pytest

import headrace as hr
from headrace._persist import memory_store as cache_module
from headrace._transforms import shuffle as shuffle_module
from headrace.profiling import diagnose, lint_recipe
from headrace.profiling.probe import recipe_nodes
from headrace.profiling.profiler import profile

#: Seeds of the sweeps (CI runs them all; a pipeline takes about a second, eight epochs).
CLEAN_SEEDS = range(0, 40)
LINT_SEEDS = range(0, 240)
#: The lint sweep in chunks: each a test of its own, short enough on a loaded machine.
LINT_CHUNKS = [LINT_SEEDS[k : k + 40] for k in range(0, len(LINT_SEEDS), 40)]
LEAK_CASES = 24


def _quiet_build(spec: dict[str, Any], custom: dict[str, Any] | None = None) -> hr.Dataset:
    return fuzz.build(spec, custom)


def _runs(ds: hr.Dataset) -> bool:
    """Whether one epoch runs to its end (some random budgets refuse a pipeline outright)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with iter(ds) as iterator:
                for _ in iterator:
                    pass
    except hr.MemoryBudgetError:
        return False
    return True


def _runnable_spec(seed: int, kind: str | None = None) -> dict[str, Any]:
    """The pipeline of ``seed``, or of the next seed (by 1,000s) whose run its budget admits
    (a random budget can refuse a random pipeline outright: that is not the doctor's case).
    With a leak ``kind``, elements stay small enough for this machine to hold eight epochs
    of what the leak keeps."""
    for draw in range(seed, seed + 10_000, 1000):
        spec = fuzz.random_spec(draw)
        if kind is not None:
            spec["base_bytes"] = min(spec["base_bytes"], 4 << 10 if kind == "keeps" else 16 << 10)
        if _runs(_quiet_build(spec)):
            return spec
    raise AssertionError(f"no runnable pipeline from seed {seed}")


# -- clean pipelines: no false leak ----------------------------------------------------------


SUPPORT = Path(__file__).parents[1] / "support"  # where fuzz_pipelines lives
_DIAGNOSE_ALONE = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import fuzz_pipelines
from headrace.profiling import diagnose
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    diagnosis = diagnose(fuzz_pipelines.build(json.loads(sys.argv[2])), epochs=8, lint=False)
print(json.dumps({"healthy": diagnosis.healthy, "report": diagnosis.format()}))
"""


@pytest.mark.parametrize("seed", CLEAN_SEEDS)
def test_clean_random_pipelines_are_never_called_leaking(seed: int) -> None:
    """Each diagnosis runs in a fresh interpreter, as a user's training script would: it
    measures the whole process and its children, which another test's leftovers in a
    shared test worker move (CI once saw +7.6 MiB per epoch that no stage traced)."""
    spec = _runnable_spec(seed)
    done = subprocess.run(
        [sys.executable, "-c", _DIAGNOSE_ALONE, str(SUPPORT), json.dumps(spec)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    diagnosis = json.loads(done.stdout.strip().splitlines()[-1])
    assert diagnosis["healthy"], f"seed {spec['seed']} {spec['ops']}:\n{diagnosis['report']}"


# -- lint: findings are true, and measured lint misses nothing --------------------------------


class _Spy:
    """Which shuffles shrank and which caches spilled, by recipe node, in one run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.shrunk: set[int] = set()
        self.spilled: set[int] = set()
        warn_shrink = shuffle_module._warn_shrink
        start_spill = cache_module.MemoryStore._start_spill

        def shrink(node: Any, *args: Any, **kwargs: Any) -> None:
            self.shrunk.add(id(node))
            warn_shrink(node, *args, **kwargs)

        def spill(store: Any, cost: int) -> None:
            self.spilled.add(id(store.node))
            start_spill(store, cost)

        monkeypatch.setattr(shuffle_module, "_warn_shrink", shrink)
        monkeypatch.setattr(cache_module.MemoryStore, "_start_spill", spill)


def _false_findings(
    findings: list[Any], nodes: dict[int, Any], stages: dict[int, Any], spy: _Spy
) -> list[str]:
    """Findings the run contradicted (see the module doc)."""
    wrong = []
    for finding in findings:
        kinds = {"shuffle-too-big": ("ShuffleNode", spy.shrunk),
                 "cache-too-big": ("CacheNode", spy.spilled)}
        if finding.code not in kinds:
            continue
        kind, happened = kinds[finding.code]
        keys = [key for key, node in nodes.items()
                if node.stage == finding.stage and type(node).__name__ == kind]
        if any(key in happened for key in keys):
            continue
        named = re.search(r"~([\d,]+) elements (?:have arrived|of)", finding.message)
        if "unknown" in finding.message and named:  # a condition: it never arose
            fits = int(named.group(1).replace(",", ""))
            per_pass = [
                stages[id(nodes[key].inputs[0])].elements_out
                / max(stages[id(nodes[key].inputs[0])].iterators, 1)
                for key in keys if id(nodes[key].inputs[0]) in stages
            ]
            if per_pass and all(count <= fits * 1.25 + 1 for count in per_pass):
                continue
        wrong.append(f"{finding.code} at {finding.stage}: {finding.message}")
    return wrong


def _representative(spec: dict[str, Any]) -> bool:
    """Sizes a sample can know: measured lint averages 1 element in 64, so a pipeline whose
    sizes jump 100x after a third, or follow a Pareto tail, can fool it either way; and it
    measures payloads, so a small view that pins a 4x larger array (the "views" elements,
    view_of_big maps) costs a buffer more than lint knows."""
    views = any(op[0] in ("map", "pmap", "xmap") and op[-1] == "view_of_big"
                for op in spec["ops"])
    return (spec["distribution"] == "uniform" or spec["source"] == "array") and not views


@pytest.mark.parametrize("seeds", LINT_CHUNKS, ids=lambda r: f"{r.start}-{r.stop}")
def test_lint_findings_come_true_and_measured_lint_names_every_shrink_and_spill(
    seeds: range, monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch)
    problems: list[str] = []
    checked = 0
    for seed in seeds:
        spec = fuzz.random_spec(seed)
        ds = _quiet_build(spec)
        before = lint_recipe(ds, sample=4)
        spy.shrunk.clear()
        spy.spilled.clear()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = profile(ds, progress=False, lint=False)
        except hr.MemoryBudgetError:
            continue
        checked += 1
        measured = lint_recipe(ds, measured=result.stages)
        nodes = {id(node): node for node in recipe_nodes(ds.node)}
        stages = {stage.key: stage for stage in result.stages}
        if _representative(spec):
            wrong = _false_findings(before, nodes, stages, spy)
            wrong += _false_findings(measured, nodes, stages, spy)
            said = {(f.code, f.stage) for f in measured}
            wrong += [f"missed shuffle-too-big at {nodes[key].stage}" for key in spy.shrunk
                      if ("shuffle-too-big", nodes[key].stage) not in said]
            wrong += [f"missed cache-too-big at {nodes[key].stage}" for key in spy.spilled
                      if ("cache-too-big", nodes[key].stage) not in said]
        else:  # a size-independent finding is still never false
            wrong = [f.code for f in before + measured
                     if f.code == "shuffle-too-big" and "will shrink" in f.message
                     and not spy.shrunk]
        for finding in before + measured:  # structural rules: true by construction
            named = [n for n in nodes.values() if n.stage == finding.stage]
            assert named, finding
            if finding.code == "parallel-above-cpus":
                assert any((getattr(n, "num_parallel_calls", None) or 0) > (os.cpu_count() or 1)
                           for n in named)
            if finding.code == "no-prefetch":
                assert type(ds.node).__name__ != "PrefetchNode"
            if finding.code == "decode-before-shuffle":
                # the map it names inflates by itself (not by a batch between it and the
                # shuffle), and the shuffle holds a sizeable part of its share
                decoder = re.match(r"(.+?) inflates elements ([\d.]+)x", finding.message)
                assert decoder is not None
                assert float(decoder.group(2)) >= 1.5
                held = [s for s in result.stages if s.name == finding.stage]
                assert any(s.peak >= s.share / 8 or s.key in spy.shrunk for s in held)
        problems += [f"seed {seed} {spec['ops']}: {text}" for text in wrong]
    assert checked >= len(seeds) * 0.7  # the sweep is not mostly refused pipelines
    assert not problems, "\n".join(problems)


def test_lint_does_not_promise_a_shrink_for_an_input_shorter_than_the_buffer() -> None:
    # 300 rows of 4 KiB under a small budget, shuffle(1,000,000): the buffer holds 300
    rows = hr.Dataset.from_tensor_slices(np.zeros((300, 4096), np.uint8))
    short = rows.padded_batch(1).shuffle(1_000_000, seed=0).prefetch(1)  # 300, streamed
    assert short.node.inputs[0].inputs[0].cardinality() == 300
    assert "shuffle-too-big" not in {
        f.code for f in lint_recipe(short.with_options(hr.Options(memory_budget="8MiB")),
                                    sample=2)
    }
    # ...and over a generator (length unknown) it says what would happen, as a condition
    stream = hr.Dataset.from_generator(
        lambda: (np.zeros(4096, np.uint8) for _ in range(300)),
        output_signature=hr.TensorSpec((4096,), np.uint8),
    ).shuffle(1_000_000, seed=0).prefetch(1).with_options(hr.Options(memory_budget="8MiB"))
    (finding,) = [f for f in lint_recipe(stream, sample=2) if f.code == "shuffle-too-big"]
    assert "once more than" in finding.message and "unknown" in finding.message


def test_decode_before_shuffle_measures_the_map_not_a_batch_after_it() -> None:
    budget = hr.Options(memory_budget="64MiB")
    rows = hr.Dataset.from_generator(
        lambda: (np.full(1024, i, np.uint8) for i in range(400)),
        output_signature=hr.TensorSpec((1024,), np.uint8),
    )
    # the map copies (1.0x); the batch of 64 makes 64 KiB elements: no decoding here
    copied = rows.map(np.copy).batch(64).shuffle(100, seed=0).prefetch(1).with_options(budget)
    assert "decode-before-shuffle" not in {f.code for f in lint_recipe(copied, sample=2)}
    # a real decoder (32x) before a shuffle that holds a good part of its share
    decoded = rows.map(lambda r: np.repeat(r, 32)).shuffle(1000, seed=0).prefetch(1)
    (finding,) = [f for f in lint_recipe(decoded.with_options(budget), sample=2)
                  if f.code == "decode-before-shuffle"]
    assert re.search(r"inflates elements 3[12]\.\dx", finding.message), finding.message
    # ...but not before a shuffle of two elements
    tiny = rows.map(lambda r: np.repeat(r, 32)).shuffle(2, seed=0).prefetch(1)
    assert "decode-before-shuffle" not in {
        f.code for f in lint_recipe(tiny.with_options(budget), sample=2)
    }


# -- injected leaks: found, and the stage named -------------------------------------------------

_KEPT: list[Any] = []
_SIDE: list[Any] = []


def _keeps_its_elements(*components: Any) -> Any:
    _KEPT.append(components)  # the bug: a list of everything seen, never emptied
    return components[0] if len(components) == 1 else components


class _Memo:
    """A memo keyed by a call counter: it never hits and never evicts."""

    def __init__(self) -> None:
        self.calls = 0
        self.results: dict[int, Any] = {}

    def __call__(self, *components: Any) -> Any:
        self.calls += 1
        self.results[self.calls] = np.ones(2048)  # 16 KiB a call, kept
        return components[0] if len(components) == 1 else components


def _opens_a_side_iterator() -> Iterator[np.int64]:
    """A generator that opens an iterator of another pipeline per epoch, never closed."""
    side = iter(hr.Dataset.range(10**9).map(lambda i: np.zeros(32 << 10, np.uint8)).prefetch(8))
    next(side)
    _SIDE.append(side)
    while True:
        yield np.int64(0)


def _first(*components: Any) -> Any:
    return components[0] if len(components) == 2 else components[:-1]


def _inject(kind: str) -> tuple[Callable[[Any, Any, Any], Any], str]:
    """An op for ``fuzz.build`` that injects one leak, and the stage it must be blamed on."""
    if kind == "keeps":
        return (lambda ds, op, spec: ds.map(_keeps_its_elements),
                "map(tests.profiling.test_doctor_sweep._keeps_its_elements)")
    if kind == "memo":
        memo = _Memo()

        def memoized(ds: Any, op: Any, spec: Any) -> Any:
            return ds.map(memo)

        memoized.memo = memo  # type: ignore[attr-defined]
        return memoized, "map(tests.profiling.test_doctor_sweep._Memo)"

    def side(ds: Any, op: Any, spec: Any) -> Any:
        opener = hr.Dataset.from_generator(
            _opens_a_side_iterator, output_signature=hr.TensorSpec((), np.int64)
        )
        return hr.Dataset.zip((ds, opener)).map(_first)

    return side, "from_generator"


def _leak_cases() -> list[tuple[int, str, int]]:
    """(seed, kind, position) for LEAK_CASES pipelines that run under their budget."""
    rng = random.Random(13)
    kinds = ("keeps", "memo", "iterator")
    cases = []
    seed = 0
    while len(cases) < LEAK_CASES:
        cases.append((seed, kinds[len(cases) % 3], rng.randint(0, 6)))
        seed += 1
    return cases


def _stage_names(ds: hr.Dataset) -> list[str]:
    return [str(node.stage) for node in recipe_nodes(ds.node)]


def _leaked_bytes(kind: str, memo: _Memo | None) -> int:
    """What the injected leak holds now (the ground truth the doctor is judged against)."""
    if kind == "keeps":
        return _sizeof(_KEPT)
    if kind == "memo":
        assert memo is not None
        return _sizeof(memo.results)
    return len(_SIDE) * 9 * (32 << 10)  # a prefetch(8) of 32 KiB arrays, one in hand


@pytest.mark.parametrize(("seed", "kind", "position"), _leak_cases())
def test_injected_leaks_are_found_and_blamed_on_their_stage(
    seed: int, kind: str, position: int
) -> None:
    spec = _runnable_spec(seed, kind)
    spec["ops"].insert(min(position, len(spec["ops"])), ["leak"])
    op, stage = _inject(kind)
    memo = getattr(op, "memo", None)
    ds = _quiet_build(spec, {"leak": op})
    truth: list[int] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            diagnosis = diagnose(ds, epochs=8, lint=False,
                                 on_epoch=lambda _: truth.append(_leaked_bytes(kind, memo)))
    finally:
        _KEPT.clear()
        for side in _SIDE:
            side.close()
        _SIDE.clear()
    # the leak's own growth over the epochs the doctor fits (after its warm-up of 2):
    # a leak behind a complete cache() stops after the first epoch, one above a take(1)
    # keeps a few bytes; the doctor must report what grows by 256 KiB an epoch or more
    per_epoch = (truth[-1] - truth[2]) / 5
    if per_epoch < 4 * diagnosis.min_leak:
        assert not diagnosis.leak or diagnosis.leaking_stages[0] == stage, diagnosis.format()
        return
    assert diagnosis.leak, f"{per_epoch:.0f} B/epoch leaked\n{diagnosis.format()}"
    assert stage in _stage_names(ds)
    assert diagnosis.leaking_stages[0] == stage, diagnosis.format()
    if kind == "iterator":  # its prefetch thread outlives every epoch, and is named
        assert any(text.startswith("headrace threads") for text in diagnosis.resources)


def _sizeof(value: Any) -> int:
    from headrace._memory.sizeof import sizeof

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sizeof(value)
