"""A user's exception raised in a worker process comes back as that element's error,
whatever its ``__init__`` takes; a failure of the collector thread fails the pool
loudly instead of leaving ``next()`` waiting.

Each case is drawn from a seeded generator (which elements fail, with which kind of
exception, how many workers) and compared with the same pipeline on threads (the
oracle: no pickling on the way)."""

from __future__ import annotations

import functools
import random
import threading
from typing import Any

import numpy as np
import proc_error_fns as fns
import pytest

import headrace as hr
from headrace._errors import WorkerError, WorkerPoolError
from headrace._workers import processes

#: Longer than any of these pipelines takes; a pipeline still running then hangs.
HANG_SECONDS = 60.0


def run_guarded(ds: hr.Dataset, limit: int = 200, pool_errors: int = 5) -> list[Any]:
    """Every position of ``ds``: ("value", list) or ("error", type name, message, notes),
    read on a thread, so a hang fails the test instead of blocking it; up to ``limit``
    positions, or ``pool_errors`` WorkerPoolErrors."""
    got: list[Any] = []
    done = threading.Event()

    def consume() -> None:
        try:
            with iter(ds) as iterator:
                while len(got) < limit:
                    try:
                        value = next(iterator)
                    except StopIteration:
                        return
                    except Exception as error:
                        notes = "\n".join(getattr(error, "__notes__", []))
                        got.append(("error", type(error).__name__, str(error), notes))
                        if isinstance(error, WorkerPoolError) and sum(
                                entry[1] == "WorkerPoolError" for entry in got) >= pool_errors:
                            return
                    else:
                        got.append(("value", np.asarray(value).tolist()))
        finally:
            done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert done.wait(HANG_SECONDS), f"hang: no element and no error after {len(got)} positions"
    return got


def draw_plan(rng: random.Random, count: int) -> dict[int, str]:
    bad = rng.sample(range(count), k=min(count, rng.randint(1, 5)))
    return {row: rng.choice(fns.KINDS) for row in bad}


def expected_from_threads(oracle: list[Any]) -> list[Any]:
    """The oracle's positions as the processes must give them: the user's type and
    message, or (an exception that cannot travel at all) a WorkerError with both."""
    cannot_travel = {fns.LockInArgs.__name__}
    out = []
    for entry in oracle:
        if entry[0] == "error" and entry[1] in cannot_travel:
            out.append(("error", "WorkerError", f"{entry[1]}: {entry[2]}"))
        else:
            out.append(entry[:3])
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_process_map_gives_each_user_error_in_its_place(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.randint(8, 40)
    plan = draw_plan(rng, count)
    fn = functools.partial(fns.raise_on, plan)
    calls = rng.randint(1, 3)
    source = hr.Dataset.range(count)
    oracle = run_guarded(source.map(fn, num_parallel_calls=calls, workers="threads"))
    got = run_guarded(source.map(fn, num_parallel_calls=calls, workers="processes"))
    assert [entry[:3] for entry in got] == expected_from_threads(oracle)
    for row, entry in enumerate(got):
        if entry[0] == "error":  # the stage and the element are named
            assert f"element {row}" in entry[3] and "map" in entry[3], entry


@pytest.mark.parametrize("seed", range(2))
def test_a_process_interleave_gives_each_inner_user_error_in_its_place(seed: int) -> None:
    rng = random.Random(100 + seed)
    shards, rows = rng.randint(2, 5), rng.randint(3, 8)
    plan = draw_plan(rng, shards * rows)
    fn = functools.partial(fns.inner_raising, plan, rows)
    cycle = rng.randint(2, 3)

    def build(workers: str) -> hr.Dataset:
        return hr.Dataset.range(shards).interleave(
            fn, cycle_length=cycle, num_parallel_calls=2, workers=workers)

    oracle = run_guarded(build("threads"))
    got = run_guarded(build("processes"))
    assert [entry[:3] for entry in got] == expected_from_threads(oracle)
    for entry in got:
        if entry[0] == "error":  # the inner stage and its element are named
            assert "element" in entry[3] and "interleave" in entry[3], entry


@pytest.mark.parametrize("seed", range(2))
def test_a_failing_collector_fails_the_pool_at_every_next(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(200 + seed)
    fail_after = rng.randint(0, 3)
    real = processes._dispatch
    seen = [0]

    def breaking(pool: Any, worker: Any, message: tuple[Any, ...]) -> bool:
        if message[0] == "done":
            seen[0] += 1
            if seen[0] > fail_after:
                raise RuntimeError("injected collector fault")
        return real(pool, worker, message)

    monkeypatch.setattr(processes, "_dispatch", breaking)
    ds = hr.Dataset.range(400).map(
        functools.partial(fns.raise_on, {}), num_parallel_calls=2, workers="processes")
    got = run_guarded(ds, limit=450)
    errors = [entry for entry in got if entry[0] == "error"]
    assert errors, "the collector's failure was never raised"
    assert len(errors) == 5 and len(got) < 400
    first = got.index(errors[0])
    # from the failure on, every next() raises the pool's error (never a value, never a hang)
    assert all(entry[:2] == ("error", "WorkerPoolError") for entry in got[first:]), got[first:]
    assert "injected collector fault" in errors[0][2]
    assert issubclass(WorkerPoolError, WorkerError)


def chain_of(error: BaseException | None, depth: int = 0) -> Any:
    """``error``'s chain as comparable data: type, message, cause, context, suppressed."""
    if error is None or depth > 10:
        return None
    return (type(error).__name__, str(error), chain_of(error.__cause__, depth + 1),
            chain_of(error.__context__, depth + 1), error.__suppress_context__)


def chains(ds: hr.Dataset) -> list[Any]:
    out: list[Any] = []
    with iter(ds) as iterator:
        while True:
            try:
                out.append(("value", int(next(iterator))))
            except StopIteration:
                return out
            except Exception as error:
                out.append(("error", chain_of(error)))


@pytest.mark.parametrize("seed", range(3))
def test_a_process_map_keeps_the_users_cause_and_context_chain(seed: int) -> None:
    # the oracle: the same map on threads (the chain as raised); the worker's traceback
    # is a note, not a __cause__ in the user's chain's place
    rng = random.Random(500 + seed)
    count = rng.randint(6, 20)
    steps = ["cause", "context", "suppressed", "custom"]
    plan = {row: [rng.choice(steps) for _ in range(rng.randint(0, 4))]
            for row in rng.sample(range(count), k=rng.randint(1, 5))}
    fn = functools.partial(fns.chained_error, plan)
    source = hr.Dataset.range(count)
    oracle = chains(source.map(fn, num_parallel_calls=2, workers="threads"))
    got = chains(source.map(fn, num_parallel_calls=2, workers="processes"))
    assert got == oracle, plan
    with iter(source.map(fn, num_parallel_calls=2, workers="processes")) as iterator:
        for _ in range(min(plan)):
            next(iterator)
        with pytest.raises(Exception) as caught:
            next(iterator)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "its traceback there" in notes and "chained_error" in notes
