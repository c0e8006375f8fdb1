"""map(workers="processes" | "auto"): order, errors, checkpoints, failures, memory, shm.

The functions live in ``process_fns`` (module level), because worker processes start by
forkserver and receive them pickled.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import process_fns
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from segments import own_segments, segments_now

import headrace as hr
from headrace._workers import shm
from headrace._workers.memory import worker_memory
from headrace.core.run import join_abandoned
from headrace.testing import assert_checkpoint_roundtrip, assert_elements_equal

MiB = 1 << 20


def wait_dead(pids: list[int], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(worker_memory(pid) is None for pid in pids):
            return True
        time.sleep(0.05)
    return False


def outputs(ds: hr.Dataset) -> list[Any]:
    """Every position: the element, or the error's type and message, in order."""
    got: list[Any] = []
    with iter(ds) as iterator:
        while True:
            try:
                got.append(next(iterator))
            except StopIteration:
                return got
            except process_fns.Failing as error:
                got.append(("error", str(error)))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    count=st.integers(0, 120),
    bad=st.frozensets(st.integers(0, 119), max_size=6),
    workers=st.integers(1, 3),
    deterministic_input=st.booleans(),
)
def test_same_elements_errors_and_order_as_sequential(
    count: int, bad: frozenset[int], workers: int, deterministic_input: bool
) -> None:
    fn = functools.partial(process_fns.fail_on, bad)
    source = hr.Dataset.range(count)
    if deterministic_input:
        source = source.map(lambda x: x)  # a streaming input (not random access)
    expected = outputs(source.map(fn))
    got = outputs(source.map(fn, num_parallel_calls=workers, workers="processes"))
    assert got == expected
    assert own_segments() == []


def test_a_returned_list_is_a_tuple_of_components_on_processes_too() -> None:
    """tf.data's rule (a list a function returns is a tuple) holds wherever calls run:
    two columns, and the next map gets them as two arguments."""
    for workers in (None, "processes"):
        dataset = hr.Dataset.range(6).map(
            process_fns.as_list, num_parallel_calls=2, workers=workers)
        (batch,) = list(dataset.batch(6))
        assert isinstance(batch, tuple) and len(batch) == 2
        np.testing.assert_array_equal(batch[0], np.arange(6))
        np.testing.assert_array_equal(batch[1], np.arange(6) * 10)
        assert [int(v) for v in dataset.map(lambda a, b: a + b)] == [11 * i for i in range(6)]
    assert own_segments() == []


def _identical(a: Any, b: Any) -> bool:
    """Equal values of the same types, arrays by dtype, shape and contents."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_identical, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("seed", [0, 1, 2, pytest.param(3, marks=pytest.mark.slow),
                                  pytest.param(4, marks=pytest.mark.slow)])
def test_outputs_of_varied_structure_come_back_as_the_in_process_map_makes_them(
    seed: int,
) -> None:
    """Oracle: the same function mapped in this process. Outputs whose structure differs
    element to element, with objects met twice in one output, several to a call: each
    comes back identical (a shared unpickler once resolved an output's memo references
    into an earlier output's objects: wrong values, or a class named by a dtype)."""
    fn = functools.partial(process_fns.varied_output, seed)
    source = hr.Dataset.range(300)
    expected = list(source.map(fn))
    got = list(source.map(fn, num_parallel_calls=2, workers="processes"))
    assert len(got) == len(expected)
    wrong = [i for i, (a, b) in enumerate(zip(expected, got, strict=True))
             if not _identical(a, b)]
    assert not wrong, f"elements {wrong[:5]} differ: {got[wrong[0]]!r} != {expected[wrong[0]]!r}"
    assert own_segments() == []


def test_an_output_this_process_cannot_rebuild_fails_in_its_place_alone() -> None:
    """An output whose class exists only in the worker: its element raises the import
    error, saying where; the outputs of the same call before and after it are whole,
    and ``ignore_errors`` drops just that element."""
    fn = functools.partial(process_fns.worker_only_class_on, frozenset({5, 6, 40}))
    ds = hr.Dataset.range(60).map(fn, num_parallel_calls=2, workers="processes")
    got: list[Any] = []
    with iter(ds) as iterator:
        while True:
            try:
                got.append(int(next(iterator)))
            except StopIteration:
                break
            except ModuleNotFoundError as error:
                assert "headrace_test_only_in_worker" in str(error)
                assert any("could not be rebuilt in this process" in note
                           for note in error.__notes__)
                got.append("error")
    assert got == [x if x not in (5, 6, 40) else "error" for x in range(60)]
    assert [int(x) for x in ds.ignore_errors()] == [x for x in range(60) if x not in (5, 6, 40)]
    assert own_segments() == []


def test_worker_exception_has_its_traceback_and_iteration_goes_on() -> None:
    fn = functools.partial(process_fns.fail_on, frozenset({3}))
    ds = hr.Dataset.range(6).map(fn, num_parallel_calls=2, workers="processes")
    with iter(ds) as iterator:
        assert [next(iterator) for _ in range(3)] == [0, 10, 20]
        with pytest.raises(process_fns.Failing, match="bad element 3") as caught:
            next(iterator)
        assert caught.value.__cause__ is None  # the user's chain, as on threads
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "its traceback there" in notes and "fail_on" in notes
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "element 3" in notes and "worker process" in notes
        assert list(iterator) == [40, 50]


def test_arrays_come_back_through_shared_memory_and_are_booked() -> None:
    ds = (
        hr.Dataset.range(40)
        .map(process_fns.row_array, num_parallel_calls=2, workers="processes")
        .with_options(hr.Options(memory_budget="32MiB"))
    )
    with iter(ds) as iterator:
        got = list(iterator)
        stats = iterator.stats()
        (stage,) = [s for s in iterator.stages() if getattr(s, "processes", None)]
        # only idle segments kept, beside the workers' own memory
        assert iterator.context.budget.used <= stage.workers_booking.nbytes + 2 * 4 * MiB
    for i, element in enumerate(got):
        assert element["x"].shape == (100_000,) and element["x"][0] == i
        assert element["x"].flags.writeable and element["name"] == f"row {i}"
        base = element["x"]
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview)  # a view of the segment, not a copy
    assert stats.budget_peak <= 32 * MiB
    (stage,) = [s for s in stats.stages if s.name.startswith("map")]
    assert stage.max_element >= 400_000  # each output's array bytes are booked
    assert stats.workers[0].kind == "processes" and len(stats.workers[0].processes) == 2
    assert all(p.uss > 0 for p in stats.workers[0].processes)
    del got, element, base
    gc.collect()
    assert join_abandoned()  # also an earlier test's iterator that this collection closed
    assert own_segments() == []


@pytest.mark.parametrize("into", ["processes", "threads"])
def test_checkpoints_round_trip_and_move_between_threads_and_processes(into: str) -> None:
    fn = functools.partial(process_fns.fail_on, frozenset({7, 8, 30}))
    source = hr.Dataset.range(40).map(lambda x: x).shuffle(10, seed=3)
    saved = source.map(fn, num_parallel_calls=2, workers="processes")
    assert_checkpoint_roundtrip(
        source.map(process_fns.square, num_parallel_calls=2, workers="processes"),
        max_checkpoints=6,
    )
    restored_ds = source.map(fn, num_parallel_calls=2, workers=into)

    def drain(iterator: Any, count: int | None = None) -> list[Any]:
        got: list[Any] = []
        while count is None or len(got) < count:
            try:
                got.append(next(iterator))
            except StopIteration:
                break
            except process_fns.Failing as error:
                got.append(("error", str(error)))
        return got

    with iter(saved) as original:
        drain(original, 12)
        state = json.loads(json.dumps(original.get_state()))
        expected = drain(original)
    with iter(restored_ds) as restored:
        restored.set_state(state)
        assert drain(restored) == expected
    assert any(item[0] == "error" for item in expected if isinstance(item, tuple))


def test_unpicklable_function_is_named() -> None:
    lock = threading.Lock()
    with pytest.raises(hr.InvalidArgumentError, match=r"the map function\.args\[0\]"):
        hr.Dataset.range(3).map(
            functools.partial(process_fns.fail_on, lock), num_parallel_calls=2,
            workers="processes",
        )
    with pytest.raises(hr.InvalidArgumentError, match="lambda"):
        hr.Dataset.range(3).map(lambda x: x, num_parallel_calls=2, workers="processes")
    with pytest.raises(hr.InvalidArgumentError, match="needs num_parallel_calls"):
        hr.Dataset.range(3).map(process_fns.square, workers="processes")
    with pytest.raises(hr.InvalidArgumentError, match="workers must be one of"):
        hr.Dataset.range(3).map(process_fns.square, num_parallel_calls=2, workers="fork")


def test_a_killed_worker_is_replaced_and_its_calls_run_again() -> None:
    """A worker killed from outside (the OOM killer) is a fault of the machine, not of
    an element: its successor runs its calls again, the stream loses nothing, and the
    user is told once (issue 22: the stage broke, and a state lost 4 elements)."""
    n = 1_000
    ds = hr.Dataset.range(n).map(process_fns.sleepy, num_parallel_calls=2,
                                 workers="processes")
    iterator = iter(ds)
    got = [int(next(iterator)) for _ in range(3)]
    (stats,) = iterator.stats().workers
    pids = [p.pid for p in stats.processes]
    victim = pids[1]
    with pytest.warns(hr.HeadraceWarning, match=rf"worker process {victim} killed by SIGKILL"):
        os.kill(victim, signal.SIGKILL)
        got += [int(x) for x in iterator]
    assert got == list(range(n))
    (stats,) = iterator.stats().workers
    now = [p.pid for p in stats.processes]
    assert victim not in now and len(now) == 2
    iterator.close()
    assert wait_dead(pids + now)
    assert own_segments() == []


@pytest.mark.parametrize("then_kill_a_worker", [False, True])
def test_workers_outlive_a_failed_forkserver(then_kill_a_worker: bool) -> None:
    """A forkserver that fails (under load: CPython gh-140867, seen in CI) closes the
    status pipes of the workers it started: their sentinels fired and the stage raised
    WorkerError ("exited with status 255") while every worker still ran. The pipeline
    now goes on; a worker that really dies afterwards is still a WorkerError within
    seconds; close stops them all; the next pipeline gets a new forkserver."""
    from multiprocessing import forkserver

    n = 100_000 if then_kill_a_worker else 400
    ds = hr.Dataset.range(n).map(process_fns.sleepy, num_parallel_calls=2, workers="processes")
    iterator = iter(ds)
    got = [int(next(iterator)) for _ in range(20)]
    (stats,) = iterator.stats().workers
    pids = [p.pid for p in stats.processes]
    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)  # type: ignore[attr-defined]
    if then_kill_a_worker:
        got += [int(next(iterator)) for _ in range(50)]  # the sentinels fired meanwhile
        os.kill(pids[1], signal.SIGKILL)
        # noticed through its results pipe, and replaced (by a new forkserver)
        with pytest.warns(hr.HeadraceWarning, match=rf"worker process {pids[1]} "):
            got += [int(next(iterator)) for _ in range(500)]
        (stats,) = iterator.stats().workers
        pids += [p.pid for p in stats.processes]
    else:
        got += [int(x) for x in iterator]
    assert got == list(range(len(got)))  # nothing lost or reordered
    assert len(got) == (570 if then_kill_a_worker else n)
    iterator.close()
    assert wait_dead(pids)
    assert own_segments() == []
    again = hr.Dataset.range(10).map(process_fns.square, num_parallel_calls=2, workers="processes")
    assert [int(x) for x in again] == [x * x for x in range(10)]


def test_an_element_that_ends_two_workers_is_its_own_error() -> None:
    """``os._exit(3)`` on element 5, whichever worker runs it: once in its chunk, once
    alone, then it is that element's WorkerError (its place, its status) and the
    stream goes on; ``ignore_errors`` drops that one element and no other."""
    ds = hr.Dataset.range(20).map(process_fns.die_on, num_parallel_calls=2, workers="processes")
    got: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hr.HeadraceWarning)
        with iter(ds) as iterator:
            while True:
                try:
                    got.append(int(next(iterator)))
                except StopIteration:
                    break
                except hr.WorkerError as error:
                    assert not isinstance(error, hr.WorkerPoolError)
                    assert "exited with status 3" in str(error)
                    assert "on element 5" in "".join(error.__notes__)
                    got.append("error")
        assert got == [*range(5), "error", *range(6, 20)]
        assert [int(x) for x in ds.ignore_errors()] == [x for x in range(20) if x != 5]


def test_close_and_garbage_collection_stop_the_workers() -> None:
    ds = hr.Dataset.range(1000).map(process_fns.pid_of, num_parallel_calls=2,
                                    workers="processes")
    iterator = iter(ds)
    pids = {next(iterator) for _ in range(50)}
    iterator.close()
    assert wait_dead(list(pids))
    iterator = iter(ds)
    pids = {next(iterator) for _ in range(50)}
    del iterator
    gc.collect()
    assert join_abandoned()
    assert wait_dead(list(pids))
    assert own_segments() == []


@pytest.mark.parametrize("seed", range(4))
def test_iterators_dropped_after_an_error_are_collected_with_their_threads(seed: int) -> None:
    """G6 after an error: the error a worker sent back is the one the consumer raises, so
    its traceback reaches the iterator's frames; nothing of the pool (its collector thread
    waiting for the next message) may keep it, or a dropped iterator never closes."""
    rng = random.Random(seed)
    threads_before = set(threading.enumerate())
    iterators = []
    for _ in range(rng.randint(1, 3)):
        count = rng.randint(4, 30)
        # errors at random positions, often the last (its message is then the last one
        # the pool receives: nothing after it replaces it)
        bad = frozenset(rng.sample(range(count), rng.randint(1, 3))
                        + [count - 1] * (rng.random() < 0.5))
        ds = hr.Dataset.range(count).map(functools.partial(process_fns.fail_on, bad),
                                         num_parallel_calls=rng.randint(1, 2),
                                         workers="processes")
        if rng.random() < 0.5:
            ds = ds.prefetch(rng.randint(1, 2))
        iterator = iter(ds)
        # read past the first error, and maybe on to a random later position
        stop = rng.choice([count - 1, rng.randint(min(bad), count - 1)])
        for _ in range(stop + 1):
            with contextlib.suppress(process_fns.Failing):
                next(iterator)
        iterators.append(weakref.ref(iterator))
        del iterator  # dropped without close, as after a `break`
    gc.collect()
    assert join_abandoned()
    assert [ref for ref in iterators if ref() is not None] == []
    deadline = time.monotonic() + 5.0
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t.name for t in set(threading.enumerate()) - threads_before] == []
    assert own_segments() == []


def test_keyboard_interrupt_stops_the_workers(tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, os
        # Ctrl-C as at a terminal: a suite started in the background (``cmd &`` in a
        # script) passes SIGINT ignored to its children, and Python then keeps it so
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {str(Path(__file__).parents[1] / "support")!r})
        import headrace as hr, process_fns
        ds = hr.Dataset.range(10**6).map(process_fns.pid_of, num_parallel_calls=2,
                                         workers="processes")
        if __name__ == "__main__":  # workers start by forkserver and import this module
            try:
                with iter(ds) as iterator:
                    pids = {{next(iterator) for _ in range(100)}}
                    print(*pids, flush=True)
                    for _ in iterator:
                        pass
            except KeyboardInterrupt:
                print("interrupted", flush=True)
    """))
    child = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdout is not None
    pids = [int(p) for p in child.stdout.readline().split()]
    child.send_signal(signal.SIGINT)
    assert child.stdout.readline().strip() == "interrupted"
    assert child.wait(10) == 0
    assert wait_dead(pids)
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"headrace-{child.pid}-")]


def test_segments_of_a_dead_owner_are_swept_and_owner_only() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    name = f"headrace-{dead_pid}-{dead_pid}-7"
    mapping = shm.create_segment(name, 4096)
    mapping.close()
    path = Path(shm.SHM_DIR, name)
    assert path.stat().st_mode & 0o777 == 0o600
    mine = shm.create_segment(shm.segment_name(os.getpid()), 4096)  # owner alive: kept
    try:
        removed = shm.sweep_stale()
        assert name in removed and not path.exists()
        assert len(segments_now()) == 1
    finally:
        mine.close()
        for leftover in segments_now():
            shm.unlink_segment(leftover)


def test_consumer_killed_leaves_segments_that_the_next_start_sweeps(tmp_path: Path) -> None:
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import sys, os
        sys.path.insert(0, {str(Path(__file__).parents[1] / "support")!r})
        from headrace._workers import shm
        mapping = shm.create_segment(shm.segment_name(os.getpid()), 1 << 20)
        print(os.getpid(), flush=True)
        sys.stdin.read()
    """))
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    pid = int(child.stdout.readline())
    assert any(n.startswith(f"headrace-{pid}-") for n in os.listdir(shm.SHM_DIR))
    child.kill()
    child.wait()
    ds = hr.Dataset.range(4).map(process_fns.square, num_parallel_calls=2, workers="processes")
    assert list(ds) == [0, 1, 4, 9]  # the pool's start sweeps
    assert not any(n.startswith(f"headrace-{pid}-") for n in os.listdir(shm.SHM_DIR))


def test_auto_picks_processes_for_python_and_threads_for_gil_free_work() -> None:
    gil_bound = hr.Dataset.range(300).map(
        process_fns.python_work, num_parallel_calls=hr.AUTOTUNE, workers="auto"
    )
    with iter(gil_bound) as iterator:
        assert list(iterator) == list(range(300))
        (choice,) = iterator.stats().workers
    assert choice.kind == "processes", choice.reason
    assert "GIL" in choice.reason and choice.count == 2
    sleeping = hr.Dataset.range(60).map(process_fns.sleepy, num_parallel_calls=4, workers="auto")
    with iter(sleeping) as iterator:
        assert list(iterator) == list(range(60))
        (choice,) = iterator.stats().workers
    assert choice.kind == "threads" and "releases the GIL" in choice.reason
    # (300 calls: past 4 x the sample's 64 the choice is made whatever the GIL probe saw;
    # at 80, a loaded machine's probe had not run enough and it was still sampling)
    lambdas = hr.Dataset.range(300).map(lambda x: process_fns.python_work(x),
                                        num_parallel_calls=2, workers="auto")
    with iter(lambdas) as iterator:
        assert list(iterator) == list(range(300))
        (choice,) = iterator.stats().workers
    assert choice.kind == "threads"


def test_workers_grow_no_copy_of_a_large_in_memory_source() -> None:
    """Workers see chunks, never the source: their unique memory does not grow with it."""
    paths = [f"/data/shard-{i:07d}/image-{i:09d}.jpeg" for i in range(400_000)]
    table = np.arange(8 * MiB, dtype=np.float64).reshape(-1, 64)  # 64 MiB of rows
    for source, size in (
        (hr.Dataset.from_generator(lambda: iter(paths), output_signature=hr.TensorSpec((), str)),
         sum(map(sys.getsizeof, paths))),
        (hr.Dataset.from_tensor_slices(table), table.nbytes),
    ):
        ds = source.map(process_fns.pid_of, num_parallel_calls=2, workers="processes")
        with iter(ds) as iterator:
            for _ in range(5_000):  # both workers started and warm (imports, first chunks)
                next(iterator)
            (stats,) = iterator.stats().workers
            before = {p.pid: p.uss for p in stats.processes}
            for _ in iterator:
                pass
            (stats,) = iterator.stats().workers
            for process in stats.processes:
                assert process.uss - before[process.pid] < 0.1 * size, (process, size)


def assert_same(a: Any, b: Any) -> None:
    assert_elements_equal(a, b)


@pytest.mark.slow
def test_an_element_over_2_gib() -> None:
    nbytes = (2 << 30) + 4096
    ds = (
        hr.Dataset.range(2)
        .map(functools.partial(process_fns.huge, nbytes=nbytes), num_parallel_calls=1,
             workers="processes")
        .with_options(hr.Options(memory_budget="6GiB"))
    )
    with iter(ds) as iterator:
        first = next(iterator)
        assert first.nbytes == nbytes and first[-1] == 1 and first[0] == 0
        del first
        second = next(iterator)
        assert second[-1] == 2
        del second


# -- the breach of the process-map fuzz sweep (seed 700), one test per cause ------------


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * shm.OUT_OF_BAND_BYTES), max_size=6),
    with_array=st.booleans(),
    as_object_array=st.booleans(),
)
def test_large_bytes_travel_out_of_band_and_come_back_equal(
    sizes: list[int], with_array: bool, as_object_array: bool
) -> None:
    records = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    obj: Any = records
    if as_object_array:
        obj = np.empty(len(records), object)
        obj[:] = records
    if with_array:
        obj = {"records": obj, "x": np.arange(shm.OUT_OF_BAND_BYTES // 8 + 1)}
    mappings: list[Any] = []

    def allocate(nbytes: int) -> tuple[int, str, int, Any]:
        import mmap

        mappings.append(mmap.mmap(-1, max(nbytes, 1)))
        return 0, "", nbytes, mappings[-1]

    packet = shm.pack(obj, allocate)
    large = [size for size in sizes if size >= shm.OUT_OF_BAND_BYTES]
    # The pickle holds no large record: they lie in the segment, once each.
    assert len(packet.payload) < sum(sizes) - sum(large) + 4096
    if as_object_array:  # one bytes column: values and offsets, in the segment when large
        column = sum(sizes) + 8 * (len(sizes) + 1)
        assert len(packet.copied) == (2 if column >= shm.COLUMN_SEGMENT_BYTES else 0)
    else:
        assert len(packet.copied) == len(large)
    back = shm.unpack(packet, mappings[-1] if mappings else None, lambda view: None)
    got = back["records"] if with_array else back
    assert [bytes(r) for r in got] == records and all(type(r) is bytes for r in got)
    if with_array:
        assert np.array_equal(back["x"], obj["x"])


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 200_000), min_size=1, max_size=8))
def test_outputs_sharing_a_segment_each_cost_their_own_bytes(sizes: list[int]) -> None:
    # A chunk's outputs come back in one segment; each array must pin (and be booked
    # at) its own span: a view of the whole mapping made each cost the whole segment,
    # so a chunk of n booked n times its bytes and the map overdrew its share.
    import mmap

    from headrace._memory.sizeof import admit

    arrays = [np.full(size, i, np.uint8) for i, size in enumerate(sizes)]
    mappings: list[Any] = []

    def allocate(nbytes: int) -> tuple[int, str, int, Any]:
        mappings.append(mmap.mmap(-1, max(nbytes, 1)))
        return 0, "", nbytes, mappings[-1]

    packet = shm.pack(arrays, allocate)
    back = shm.unpack(packet, mappings[-1] if mappings else None, lambda view: None)
    for array, got in zip(arrays, back, strict=True):
        assert np.array_equal(array, got)
        kept, cost = admit(got)
        assert kept is got and array.nbytes <= cost <= array.nbytes + 512, (sizes, cost)
    del back, kept, got


def test_a_segment_of_bytes_only_is_free_again_at_once() -> None:
    maps = shm.SegmentMaps()
    pool = shm.SegmentPool(os.getpid(), tag="test-")
    try:
        packet = shm.pack([b"a" * (1 << 20)], pool.allocate)
        assert packet.segment is not None
        (record,) = maps.unpack(packet)
        # the record is a copy: nothing views the segment, so its worker may reuse it
        assert record == b"a" * (1 << 20) and maps.released() == [packet.segment[0]]
    finally:
        pool.close()
        maps.close()
    assert own_segments() == []


def test_process_map_outputs_are_freed_without_the_cyclic_gc() -> None:
    """Each call's futures formed a reference cycle that kept its chunk of outputs alive
    until the cyclic GC ran: with large outputs (few objects) that is late, and the
    measured memory passed the bound while the books showed a tenth of it."""
    import tracemalloc

    ds = (
        hr.Dataset.range(64)
        .map(process_fns.record_bytes, num_parallel_calls=1, workers="processes")
        .with_options(hr.Options(memory_budget="16MiB"))
    )
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        with iter(ds) as iterator:
            for i, record in enumerate(iterator):
                assert record[:1] == bytes([i % 251]) and len(record) == MiB
                del record
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    # 64 MiB went through; what stays is what the 16 MiB budget lets be in flight
    assert peak < 20 * MiB, f"{peak / MiB:.0f} MiB of Python objects at peak"


def test_input_segments_are_pooled_booked_and_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    from headrace._workers import processes

    events: list[str] = []  # "call" per chunk sent, "segment" per segment made here
    create, submit = shm.create_segment, processes.ProcessPool.submit

    def counted(name: str, size: int) -> Any:
        events.append("segment")
        return create(name, size)

    def counted_submit(self: Any, elements: list[Any], **options: Any) -> Any:
        events.append("call")
        return submit(self, elements, **options)

    monkeypatch.setattr(shm, "create_segment", counted)
    monkeypatch.setattr(processes, "create_segment", counted)
    monkeypatch.setattr(processes.ProcessPool, "submit", counted_submit)
    # Chunks of at most 4 rows: their sizes settle whatever the machine's load (a busy
    # box made the map's timing-driven chunks grow all run long, and each new size class
    # needs a larger segment, which is pooling working, not failing).
    from headrace._transforms import map as map_module

    monkeypatch.setattr(map_module, "_MAX_CHUNK", 4)
    rows = np.arange(1000 * 8_000, dtype=np.float64).reshape(1000, 8_000)  # 64 KB rows
    ds = (
        hr.Dataset.from_tensor_slices(rows)
        .map(process_fns.same, num_parallel_calls=2, workers="processes")
        .with_options(hr.Options(memory_budget="64MiB"))
    )
    with iter(ds) as iterator:
        for row, expected in zip(iterator, rows, strict=True):
            assert np.array_equal(row, expected)
        budget = iterator.context.budget
    # This process makes only input segments: a few per worker while the chunks grow
    # (the map learns the function's speed), then none: the pooled ones are reused.
    calls, made = events.count("call"), events.count("segment")
    # every chunk carries 64 KB rows out of band: one-shot segments would be one per call;
    # pooled, two per worker at most per size class, and none once sizes have settled
    second_half = [i for i, event in enumerate(events) if event == "call"][calls // 2]
    trace = "".join(event[0] for event in events)
    assert calls >= 250 and made <= 12 and events[second_half:].count("segment") == 0, (made, trace)
    assert budget.used == 0  # the pooled segments' bookings went back with close
    gc.collect()
    assert join_abandoned()  # also an earlier test's iterator that this collection closed
    assert own_segments() == []


def test_idle_segments_too_small_for_grown_outputs_make_room_for_larger_ones() -> None:
    """Two small chunks leave two idle segments (a worker's quota); then the outputs grow.
    The worker drops the small idle segments and the consumer unbooks them, so one larger
    segment serves the rest. Before, the small ones held the quota for good and every
    later chunk went into a fresh segment (a process map made one per chunk)."""
    from headrace._memory.budget import MemoryBudget
    from headrace._workers import processes

    budget = MemoryBudget(64 * MiB)
    account = budget.account("test", weight=1)
    budget.allot()
    pool = processes.ProcessPool(process_fns.zeros_of, 1, "test", book_idle=account.admit)
    try:
        small = [pool.submit([64 << 10]), pool.submit([64 << 10])]  # two segments at once
        assert [len(f.result(timeout=10)[0][0]) for f in small] == [64 << 10] * 2
        del small
        for _ in range(10):
            outputs = pool.submit([256 << 10]).result(timeout=10)[0]
            assert len(outputs[0]) == 256 << 10
            del outputs
            gc.collect()
        assert pool.maps[0].opened == 3, pool.maps[0].opened
        assert len(pool.workers[0].idle) <= processes.IDLE_SEGMENTS
        assert account.held == sum(256 << 10 for _ in pool.workers[0].idle)
    finally:
        pool.shutdown()
    assert account.held == 0


def test_the_collector_survives_the_segment_of_a_cancelled_call_vanishing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the process sweep (seed 200014, refused mid-run): a call cancelled by the
    pipeline's close came back in a new segment that the closing worker had unlinked
    already; opening it raised FileNotFoundError in the collector thread, which died."""
    from headrace._workers import processes

    def vanished(name: str, size: int) -> Any:
        raise FileNotFoundError(name)

    pool = processes.ProcessPool(functools.partial(process_fns.huge, nbytes=1 << 20), 1, "test")
    try:
        monkeypatch.setattr(processes, "open_segment", vanished)
        cancelled = pool.submit([1])
        assert cancelled.cancel()
        deadline = time.monotonic() + 10
        while pool.workers[0].pending and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker answers; the collector meets the missing name
        monkeypatch.undo()
        outputs, failed, _, _ = pool.submit([2]).result(timeout=10)
        assert failed is None and outputs[0][-1] == 3 and len(outputs[0]) == 1 << 20
    finally:
        pool.shutdown()


_ARRAY_DTYPES = st.sampled_from([
    "bool", "<i1", "<u2", ">i4", "<i8", "<f2", ">f4", "<f8", "<c8", "<M8[ns]", "<m8[s]",
    "S3", "<U2", [("a", "<i4"), ("b", ">f8")], "O",
])


@settings(max_examples=150, deadline=None)
@given(
    dtype=_ARRAY_DTYPES,
    shape=st.lists(st.integers(0, 12), min_size=0, max_size=3),
    view=st.sampled_from(["whole", "transposed", "strided", "read-only", "masked", "matrix"]),
    repeat=st.integers(1, 3),
)
def test_arrays_of_every_kind_travel_exactly(
    dtype: Any, shape: list[int], view: str, repeat: int
) -> None:
    """What a worker sends comes back as pickle would give it: type, dtype (byte order,
    fields, units), shape, values and, for small ones, writability; arrays of at least
    OUT_OF_BAND_BYTES through the segment. Plain arrays are sent as buffer + dtype string
    (not NumPy's reduce): every other kind must still take NumPy's path unchanged."""
    count = int(np.prod(shape)) * repeat * 60  # some past the out-of-band threshold
    flat = (np.arange(count) % 100).astype(np.int64)
    if np.dtype(dtype).kind == "O":
        base = np.array([bytes([i % 256]) * (i % 5) for i in range(count)], dtype=object)
    elif np.dtype(dtype).fields:
        base = np.zeros(count, dtype=dtype)
        base["a"] = flat
    else:
        base = flat.astype(str if np.dtype(dtype).kind in "SU" else dtype).astype(dtype)
    array: Any = base.reshape(*shape, repeat * 60) if shape else base
    if view == "transposed":
        array = array.T
    elif view == "strided":
        array = array[..., ::3]
    elif view == "read-only":
        array = array.copy()
        array.flags.writeable = False
    elif view == "masked":
        array = np.ma.masked_array(array, mask=np.zeros(array.shape, bool))
    elif view == "matrix" and array.ndim == 2 and array.dtype.kind != "O":
        with warnings.catch_warnings():  # a subclass, however deprecated
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            array = np.asmatrix(array)
    element = {"a": array, "b": [array[..., :1]]}
    pool = shm.SegmentPool(os.getpid(), tag="kinds-")
    maps = shm.SegmentMaps()
    try:
        packet = shm.pack([element], pool.allocate)
        received = maps.unpack(packet)[0]
    finally:
        pool.close()
    expected = pickle.loads(pickle.dumps(element, protocol=5))
    for got, want in ((received["a"], expected["a"]), (received["b"][0], expected["b"][0])):
        assert type(got) is type(want)
        assert got.dtype == want.dtype and got.dtype.str == want.dtype.str
        assert got.shape == want.shape
        assert np.array_equal(np.asarray(got), np.asarray(want))
        if got.nbytes < shm.OUT_OF_BAND_BYTES and got.dtype.kind != "O":
            assert got.flags.writeable == want.flags.writeable
