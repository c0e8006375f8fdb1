"""Nothing lost around worker processes (issue 22, items 9-11): generated faults.

A generator draws pipelines around a process map (a shuffle before it, a thread
map, a batch, a prefetch, ``ignore_errors`` after it) and injects faults at random
elements: the function raises, kills its worker once (a marker file makes the
retry succeed), kills every worker that runs it, or returns an output that
cannot be pickled. The oracle is the fault-free run: the same pipeline with a
sequential map whose function raises where an element really fails. The process
run must give exactly the oracle's outcomes, position by position (each element,
or its error, once), and a state taken right after any error, or at a random
point, must resume into exactly the rest.

A second generator breaks the pool itself (a killed worker whose successor cannot
start): the stage then raises :class:`~headrace.WorkerPoolError` at every
``next()`` (``ignore_errors`` does not swallow it), and a state taken after it
resumes, in a new iterator, with nothing lost and nothing twice.

Worker processes are costly on 2 cores: a few cases by default, more in ``slow``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from typing import Any

import numpy as np
import process_fns
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._workers import processes, shm

FAULTS = ("raise", "kill_once", "kill_always", "unsendable")


def own_segments() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"headrace-{os.getpid()}-")]


def norm(value: Any) -> Any:
    """A comparable outcome: arrays by dtype, shape and a digest of their bytes."""
    if isinstance(value, np.ndarray):
        digest = hashlib.blake2b(np.ascontiguousarray(value).tobytes(), digest_size=8)
        return ("array", value.dtype.str, value.shape, digest.hexdigest())
    if isinstance(value, tuple):
        return tuple(norm(v) for v in value)
    return value


def outcomes(
    iterator: Any,
    limit: int,
    states: dict[int, Any] | None = None,
    cuts: frozenset[int] = frozenset(),
    got: list[Any] | None = None,
) -> list[Any]:
    """Every position: the element (normalized) or ``("error", kind)``, into ``got``;
    with ``states``, the iterator's state at each position in ``cuts`` and right after
    each error."""
    got = [] if got is None else got
    while len(got) < limit:
        if states is not None and len(got) in cuts:
            states[len(got)] = iterator.get_state()
        try:
            got.append(norm(next(iterator)))
        except StopIteration:
            return got
        except process_fns.Failing:
            got.append(("error", "raise"))
        except hr.WorkerPoolError:
            raise
        except hr.WorkerError:
            got.append(("error", "worker"))
        else:
            continue
        if states is not None:
            states[len(got)] = iterator.get_state()
    return got


def build(
    n: int,
    map_fn: Any,
    shuffle: int | None,
    after: list[str],
    ignore: bool,
    workers: int | None,
    deterministic: bool = True,
) -> hr.Dataset:
    ds = hr.Dataset.range(n)
    if shuffle is not None:
        ds = ds.shuffle(8, seed=shuffle)
    if workers is None:
        ds = ds.map(map_fn)
    else:
        ds = ds.map(map_fn, num_parallel_calls=workers, workers="processes",
                    deterministic=deterministic)
    for op in after:
        if op == "thread_map":
            ds = ds.map(np.negative, num_parallel_calls=2)
        elif op == "batch":
            ds = ds.batch(3)
        elif op == "prefetch":
            ds = ds.prefetch(2)
    if ignore:
        ds = ds.ignore_errors()
    return ds.with_options(hr.Options(memory_budget="64MiB"))


@st.composite
def fault_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(20, 90))
    faulty = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True))
    plan = tuple(sorted((x, draw(st.sampled_from(FAULTS))) for x in faulty))
    return {
        "n": n,
        "plan": plan,
        "size": draw(st.sampled_from([3, 5_000])),  # in the pickle, or through shared memory
        "shuffle": draw(st.one_of(st.none(), st.integers(0, 9))),
        "after": draw(st.lists(st.sampled_from(["thread_map", "batch", "prefetch"]),
                               max_size=2, unique=True)),
        "ignore": draw(st.booleans()),
        "workers": draw(st.integers(1, 2)),
        "cut": draw(st.integers(0, n)),
        # out of order: the same multiset (batches would differ: no batch then)
        "deterministic": draw(st.booleans()),
    }


def check_fault_case(case: dict[str, Any]) -> None:
    plan, size, n = case["plan"], case["size"], case["n"]
    shape = (case["shuffle"], case["after"], case["ignore"])
    oracle_ds = build(n, functools.partial(process_fns.oracle_faulty, plan, size), *shape, None)
    with iter(oracle_ds) as iterator:
        expected = outcomes(iterator, 10 * n)
    limit = len(expected) + 20  # a broken stage raising forever must not loop here
    with tempfile.TemporaryDirectory() as markers, warnings.catch_warnings():
        warnings.simplefilter("ignore", hr.HeadraceWarning)  # "worker ... replaced"
        deterministic = case["deterministic"] or "batch" in case["after"]
        ds = build(n, functools.partial(process_fns.faulty, plan, markers, size), *shape,
                   case["workers"], deterministic)
        states: dict[int, Any] = {}
        with iter(ds) as iterator:
            got = outcomes(iterator, limit, states if deterministic else None,
                           frozenset({case["cut"]}))
        if not deterministic:  # each element or its error once, in any order (no resume:
            # out of order, a state is at-least-once)
            assert sorted(map(repr, got)) == sorted(map(repr, expected)), f"plan {plan}"
        else:
            assert got == expected, f"plan {plan}"
        # resume right after the first error, and at the drawn cut: the rest, exactly once
        after_error = [p for p, o in enumerate(got, 1) if isinstance(o, tuple) and o[:1] == ("error",)]
        for position in sorted({*after_error[:1], case["cut"]} & set(states)):
            with iter(ds) as resumed:
                resumed.set_state(states[position])
                assert outcomes(resumed, limit) == expected[position:], (
                    f"plan {plan}, resumed at {position}")
    assert own_segments() == []


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(fault_cases())
def test_faults_in_process_maps_lose_nothing(case: dict[str, Any]) -> None:
    check_fault_case(case)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fault_cases())
def test_faults_in_process_maps_lose_nothing_many(case: dict[str, Any]) -> None:
    check_fault_case(case)


def test_one_unsendable_output_fails_its_element_only() -> None:
    """Issue 22: one output that cannot be pickled failed its whole chunk (45 errors
    for 1 element); each unsendable output is its own element's WorkerError."""
    bad = {7, 100, 101, 250}
    plan = tuple((x, "unsendable") for x in sorted(bad))
    fn = functools.partial(process_fns.faulty, plan, "/nonexistent", 3)
    ds = hr.Dataset.range(300).map(fn, num_parallel_calls=2, workers="processes")
    got = []
    with iter(ds) as iterator:
        for _ in range(400):
            try:
                got.append(int(next(iterator)[0]))
            except StopIteration:
                break
            except hr.WorkerError as error:
                assert "cannot be sent back" in str(error) and "Unsendable" in str(error)
                (note,) = [n for n in error.__notes__ if " on element " in n]
                got.append(("error", int(note.rsplit(" ", 1)[-1])))
    assert got == [("error", x) if x in bad else x for x in range(300)]


def test_a_replacement_killed_while_it_starts_is_replaced_again() -> None:
    """A worker killed (SIGKILL) before it loaded the function, after another worker of
    its pool had loaded it, is the machine's fault (the OOM killer, a kill of a fresh
    pid): replaced like any other death; it ended the stage (the outsider's attack)."""
    import gc
    import signal
    import time

    fn = functools.partial(process_fns.value_with, process_fns.SlowToLoad(0.5))
    ds = hr.Dataset.range(200).map(fn, num_parallel_calls=2, workers="processes")
    got: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hr.HeadraceWarning)  # "worker ... replaced"
        with iter(ds) as iterator:
            got += [int(next(iterator)) for _ in range(20)]
            (pool,) = [o for o in gc.get_objects()
                       if isinstance(o, processes.ProcessPool) and not o.closed]
            old = pool.workers[0].process.pid
            os.kill(old, signal.SIGKILL)  # the victim, then its replacement as it starts
            deadline = time.monotonic() + 30
            while pool.workers[0].process.pid == old and time.monotonic() < deadline:
                time.sleep(0.0005)
            fresh = pool.workers[0]
            assert not fresh.ready  # (it takes 0.5 s to load the function)
            os.kill(fresh.process.pid, signal.SIGKILL)
            got += [int(x) for x in iterator]
    assert got == list(range(200))


# -- a pool that cannot go on ------------------------------------------------------------


@st.composite
def broken_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(20, 80))
    return {
        "n": n,
        "kill": draw(st.integers(1, n - 1)),
        "size": draw(st.sampled_from([3, 5_000])),
        "shuffle": draw(st.one_of(st.none(), st.integers(0, 9))),
        # (not batch: a batch being assembled when its input breaks loses its rows on
        # resume, a known gap: the batch's state is its input's, taken mid-batch)
        "after": draw(st.lists(st.sampled_from(["thread_map", "prefetch"]),
                               max_size=2, unique=True)),
        "ignore": draw(st.booleans()),
        "workers": draw(st.integers(1, 2)),
    }


def _no_second_start(spawn: Any) -> Any:
    """``ProcessPool._spawn`` that starts a pool's workers once, and fails to replace one."""

    def spawn_once(pool: Any, worker: Any) -> None:
        if worker.process is not None:
            raise OSError("no more processes (injected)")
        spawn(pool, worker)

    return spawn_once


def check_broken_case(case: dict[str, Any]) -> None:
    n, size = case["n"], case["size"]
    shape = (case["shuffle"], case["after"], case["ignore"])
    plan = ((case["kill"], "kill_once"),)
    oracle_ds = build(n, functools.partial(process_fns.oracle_faulty, plan, size), *shape, None)
    with iter(oracle_ds) as iterator:
        expected = outcomes(iterator, 10 * n)
    with tempfile.TemporaryDirectory() as markers:
        ds = build(n, functools.partial(process_fns.faulty, plan, markers, size), *shape,
                   case["workers"])
        got: list[Any] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(processes.ProcessPool, "_spawn",
                          _no_second_start(processes.ProcessPool._spawn))
            iterator = iter(ds)
            with pytest.raises(hr.WorkerPoolError, match="could not start"):
                outcomes(iterator, len(expected) + 20, got=got)
            for _ in range(3):  # it stays broken: never the end of the data, nor skipped
                with pytest.raises(hr.WorkerPoolError):
                    next(iterator)
            state = iterator.get_state()  # (after the error, raised again and again)
            iterator.close()
        # what came out before the error, then a new iterator resumed: all of it, once
        with iter(ds) as again:
            again.set_state(state)
            rest = outcomes(again, len(expected) + 20)
        assert got + rest == expected
    assert own_segments() == []


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(broken_cases())
def test_a_broken_pool_raises_for_good_and_resumes_exactly(case: dict[str, Any]) -> None:
    check_broken_case(case)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_cases())
def test_a_broken_pool_raises_for_good_and_resumes_exactly_many(case: dict[str, Any]) -> None:
    check_broken_case(case)
