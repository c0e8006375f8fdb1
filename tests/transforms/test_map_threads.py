"""A parallel map's worker threads (``_map_threads``): what the map relies on of its calls
(results, errors, cancelling, done callbacks), how many threads, and that they go."""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import CancelledError

import numpy as np
import pytest

import headrace as hr
from headrace._transforms._map_threads import MapThreads


def _map_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("headrace-map")]


def test_results_errors_and_waits_come_back_from_each_call() -> None:
    pool = MapThreads(2)
    gate = threading.Event()
    try:
        slow = pool.submit(lambda: gate.wait(5) and "slow")
        quick = [pool.submit(lambda x: x * 3, x) for x in range(20)]
        failing = pool.submit(lambda: {}["missing"])
        assert [call.result() for call in quick] == [x * 3 for x in range(20)]
        with pytest.raises(KeyError, match="missing"):  # its own type, raised by result()
            failing.result()
        threading.Timer(0.05, gate.set).start()
        assert slow.result() == "slow"  # the consumer blocks until the worker finishes
    finally:
        gate.set()
        pool.shutdown()


def test_a_cancelled_call_never_runs_and_calls_back_once() -> None:
    pool = MapThreads(1)
    gate, ran, seen = threading.Event(), [], []
    try:
        busy = pool.submit(gate.wait, 5)  # holds the only thread
        queued = pool.submit(ran.append, "queued")
        queued.add_done_callback(seen.append)
        assert queued.cancel() and queued.cancel()  # (cancelled: still True)
        assert seen == [queued]
        with pytest.raises(CancelledError):
            queued.result()
        gate.set()
        assert busy.result() is True
        assert not busy.cancel()  # done: too late
        pool.submit(ran.append, "after").result()
        assert ran == ["after"]  # the cancelled call was skipped
        assert seen == [queued]
    finally:
        gate.set()
        pool.shutdown()


def test_done_callbacks_run_once_before_or_after_the_call_ends() -> None:
    pool = MapThreads(2)
    gate, seen = threading.Event(), []
    try:
        call = pool.submit(gate.wait, 5)
        call.add_done_callback(lambda c: seen.append(("early", c.result())))
        gate.set()
        call.result()
        call.add_done_callback(lambda c: seen.append(("late", c.result())))
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:  # (the worker calls back
            time.sleep(0.001)  # just after it wakes the consumer)
        assert sorted(seen) == [("early", True), ("late", True)]
    finally:
        pool.shutdown()


def test_threads_start_as_calls_come_up_to_the_most_and_go_on_shutdown() -> None:
    before = set(_map_threads())
    pool = MapThreads(3)
    assert set(_map_threads()) == before  # none before a call
    gate = threading.Event()
    calls = [pool.submit(gate.wait, 5) for _ in range(6)]
    assert len(set(_map_threads()) - before) == 3
    gate.set()
    assert all(call.result() for call in calls)
    pool.shutdown()
    deadline = time.monotonic() + 5
    while set(_map_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(_map_threads()) - before == set()


def test_a_pool_dropped_without_shutdown_lets_its_threads_go() -> None:
    before = set(_map_threads())
    pool = MapThreads(2)
    assert [pool.submit(lambda x: x + 1, x).result() for x in range(4)] == [1, 2, 3, 4]
    del pool
    gc.collect()
    deadline = time.monotonic() + 5
    while set(_map_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(_map_threads()) - before == set()


@pytest.mark.usefixtures("no_thread_leak")
def test_a_parallel_map_abandoned_mid_epoch_leaves_no_thread() -> None:
    ds = hr.Dataset.range(10_000).map(lambda x: np.full(64, x), num_parallel_calls=3)
    for _ in range(5):
        iterator = iter(ds)
        assert [int(next(iterator)[0]) for _ in range(10)] == list(range(10))
        del iterator
    with iter(ds) as iterator:
        assert int(next(iterator)[0]) == 0


_LEFT_OPEN = """
import sys, time
import headrace as hr

def slow(i):
    time.sleep(0.5)
    return i

iterator = iter(hr.Dataset.range(100).map(slow, num_parallel_calls=4))
print(next(iterator), flush=True)  # calls still running as the interpreter exits
"""


def test_an_iterator_left_open_mid_call_lets_the_interpreter_exit() -> None:
    # The map's threads are daemons: exit neither waits for the queued calls nor hangs.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LEFT_OPEN], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
