"""Served consumers under random lives: G1, G3 and G4 for ``headrace.serve``/``connect``.

A generator of cases: a random pipeline (element sizes that grow mid-stream, views
of larger arrays, shuffles, parallel and process maps, a process interleave,
prefetch), served to k consumers, each a chain of real processes: a life connects
(resuming from the last life's checkpoint), reads up to a random stop, saves its
state, then closes or dies by SIGKILL, and the next life takes over. Checked:

- coverage: each consumer's values, across its lives, are exactly its part of the
  stream (``stream[i::k]``, in order), so the parts are disjoint and together are
  the stream, whatever the stops, deaths and timing (or, where its part of the
  budget cannot hold the pipeline, a prefix of it and a MemoryBudgetError);
- booked: sampled all along in the producer, the bytes booked on its one budget
  (every consumer's run and the segments) stay within the budget plus the
  overdrafts it counts, and each consumer's run within the budget;
- measured: each consumer process's RssAnon + RssShmem growth stays within
  budget + 10% + 64 MiB (G1's measured bound), and so does the producer's;
- everything returned: the budget is back to 0, no segment left.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import served_fns
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._workers import shm
from headrace._workers.processes import start_method

KEY = b"served-fuzz"
CONTEXT = multiprocessing.get_context(start_method())
MiB = 1 << 20


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 60))
    budget = draw(st.sampled_from([8, 16, 32])) * MiB
    nbytes = draw(st.sampled_from([1 << 10, 16 << 10, 128 << 10]))
    grow_at = draw(st.integers(0, n + 1))
    element = functools.partial(served_fns.sized, nbytes=nbytes, grow_at=grow_at)
    ds = hr.Dataset.range(n)
    described = [f"range({n}) of {nbytes} B, 8x from {grow_at}"]
    if draw(st.booleans()):
        size, seed = draw(st.integers(1, 20)), draw(st.integers(0, 9))
        ds = ds.shuffle(size, seed=seed)
        described.append(f"shuffle({size}, seed={seed})")
    where = draw(st.sampled_from(["sequential", "threads", "processes"]))
    if where == "sequential":
        ds = ds.map(element)
    else:
        ds = ds.map(element, num_parallel_calls=2, workers=where)
    described.append(f"map on {where}")
    if draw(st.booleans()):  # the stream read again through a process interleave
        ds = hr.Dataset.range(2).interleave(
            functools.partial(served_fns.half_of, ds), cycle_length=2, num_parallel_calls=2,
            workers="processes",
        )
        described.append("process interleave of its halves")
    if draw(st.booleans()):
        depth = draw(st.sampled_from([1, 4, -1]))
        ds = ds.prefetch(depth)
        described.append(f"prefetch({depth})")
    k = draw(st.integers(1, 3))
    lives = [
        [(draw(st.integers(1, 12)), draw(st.booleans())) for _ in range(draw(st.integers(0, 3)))]
        for _ in range(k)
    ]
    return {"dataset": ds.with_options(hr.Options(memory_budget=budget)), "k": k,
            "budget": budget, "lives": lives, "pipeline": " -> ".join(described)}


def run_consumer(
    address: str, index: int, lives: list[tuple[int, bool]], tmp: Path
) -> tuple[list[int], list[int], str | None]:
    """Consumer ``index``'s chain of lives, one process each: its values, growths, and
    the MemoryBudgetError that refused its run, if one did."""
    state = tmp / f"state-{index}.json"
    values: list[int] = []
    growths: list[int] = []
    for life, (stop, die) in enumerate([*lives, (1 << 30, False)]):
        out = tmp / f"out-{index}-{life}.json"
        proc = CONTEXT.Process(target=served_fns.consume_until,
                               args=(address, index, KEY, str(state), str(out), stop, die))
        proc.start()
        code = served_fns.exit_code(proc)  # (None: lost by the forkserver; judged by `out`)
        assert code in (-signal.SIGKILL if die else 0, None), (index, life, code)
        result = json.loads(out.read_text())
        values += result["values"]
        growths.append(result["growth"])
        if result["refused"]:
            return values, growths, result["refused"]
        state.write_text(json.dumps(result["state"]))
        if result["ended"]:
            break
    return values, growths, None


def check(case: dict[str, Any], tmp: Path) -> None:
    dataset, k, budget = case["dataset"], case["k"], case["budget"]
    try:
        stream = [served_fns.number(e) for e in dataset]
    except hr.MemoryBudgetError as error:  # the pipeline cannot run under this budget at
        # all (1 MiB elements through a process interleave's two 4 MiB slots under 8 MiB):
        # refused clearly by the oracle itself, so there is nothing to serve
        assert "at once" in str(error), error
        reject()
    address = str(tmp / "s.sock")
    bound = int(budget * 1.1) + 64 * MiB
    problems: list[str] = []
    done = threading.Event()
    start = served_fns.charged()
    producer_peak = [start]
    results: dict[int, tuple[list[int], list[int], str | None]] = {}
    with hr.serve(dataset, k, address, authkey=KEY) as server:

        def sample() -> None:  # the producer's books and memory, all along
            while not done.is_set():
                # overdrafts read on either side of the use: one that starts or ends
                # between two reads must not look like a breach
                before = server.overdrawn()
                used = server.budget.used
                overdrawn = max(before, server.overdrawn())
                if used > budget + overdrawn:
                    problems.append(f"booked {used} > budget {budget} + overdrafts {overdrawn}")
                for index, booked in server.booked().items():  # (its overdrafts are counted
                    if booked > budget + overdrawn:  # in the server's)
                        problems.append(f"consumer {index}'s run booked {booked} > {budget}")
                producer_peak[0] = max(producer_peak[0], served_fns.charged())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def consumer(index: int) -> None:
            results[index] = run_consumer(address, index, case["lives"][index], tmp)

        threads = [threading.Thread(target=consumer, args=(i,)) for i in range(k)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        done.set()
        sampler.join()
        deadline = time.monotonic() + 10
        while server.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connected == []
        assert server.budget.used == 0 and server.segments.held == 0
    assert problems == [], problems[:5]
    for index in range(k):
        values, growths, refused = results[index]
        where = f"consumer {index} of {k}, lives {case['lives'][index]}"
        if refused is None:
            assert values == stream[index::k], where
        else:  # its part of the budget (1/(k+1)) cannot hold the pipeline's minima: a clear
            # refusal, after nothing but a prefix of its part
            assert "MiB at once" in refused and values == stream[index::k][: len(values)], where
        assert max(growths) <= bound, (index, growths, bound)
    if not any(refused for _, _, refused in results.values()):
        assert sorted(v for values, _, _ in results.values() for v in values) == sorted(stream)
    assert producer_peak[0] - start <= bound
    gone = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"headrace-{os.getpid()}-serve")]
    assert gone == []


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_served_consumers_with_random_lives_cover_the_stream_within_the_budget(
    case: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check(case, tmp_path_factory.mktemp("served-fuzz"))


@pytest.mark.slow
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_many_served_consumers_with_random_lives_cover_the_stream_within_the_budget(
    case: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check(case, tmp_path_factory.mktemp("served-fuzz"))
