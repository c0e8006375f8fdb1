"""Work in flight on worker processes is bounded by design (issue 23).

A worker packs each output into shared memory as it is made and stops a call
right after the output that passes the call's allowance (what the consumer
booked for it), handing the inputs it did not run back. The generators here
draw adversarial size sequences (regime jumps after many small outputs,
giants among dwarfs, heavy tails, outputs larger than the budget) with faults
(the function raises, an output cannot be sent back, a worker is killed in the
middle of a chunk), and compare against an oracle: the same function run
sequentially, and the stop rule computed from the outputs' costs.

Growth of the process tree (PSS, children included: shared-memory segments
count once, wherever they are mapped) is held to the issue's bound: budget +
10% + 64 MiB, plus one element where the user's own function made it.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import numpy as np
import process_fns
import pytest
from segments import own_segments

import headrace as hr
from headrace._memory.sizeof import sizeof
from headrace._workers import shm
from headrace._workers.memory import _descendants, worker_memory
from headrace._workers.processes import ProcessPool

MiB = 1 << 20


def _sizes(rng: random.Random, count: int) -> list[int]:
    """Output sizes in bytes, from one of the adversarial shapes."""
    shape = rng.choice(["jump", "giant_dwarf", "heavy_tail", "steady"])
    if shape == "jump":  # many small outputs, then x1000
        at, small = rng.randrange(count + 1), rng.randrange(1, 2000)
        return [small if i < at else small * 1000 for i in range(count)]
    if shape == "giant_dwarf":
        giant, dwarf = rng.randrange(200_000, 3 * MiB), rng.randrange(1, 500)
        return [giant if i % 2 else dwarf for i in range(count)]
    if shape == "heavy_tail":
        return [min(int(rng.paretovariate(1.1) * 2000), 4 * MiB) for _ in range(count)]
    size = rng.randrange(1, 200_000)
    return [size] * count


def _pool_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    count = rng.randrange(1, 60)
    sizes = _sizes(rng, count)
    faults = ["ok"] * count
    for _ in range(rng.randrange(3)):
        faults[rng.randrange(count)] = rng.choice(["raise", "unsendable"])
    total = sum(sizes)
    allowance = rng.choice([None, 0, rng.randrange(1, max(total, 2)), total // 3, 10 * total])
    return {"sizes": sizes, "faults": faults, "allowance": allowance,
            "kill": rng.random() < 0.25 and count > 1, "kill_at": rng.randrange(count)}


def _expected_length(sizes: list[int], faults: list[str], allowance: int | None) -> int:
    """The stop rule: right after the output whose cost passes the allowance, if
    elements remain (a failed element costs nothing)."""
    spent = 0
    for position, (nbytes, fault) in enumerate(zip(sizes, faults, strict=True)):
        if fault == "ok":
            spent += sizeof(np.empty(nbytes, np.uint8))
        if allowance is not None and spent > allowance and position + 1 < len(sizes):
            return position + 1
    return len(sizes)


def check_pool_case(case: dict[str, Any], markers: str, seed: int) -> None:
    sizes, faults = case["sizes"], list(case["faults"])
    if case["kill"] and faults[case["kill_at"]] == "ok":  # killed in the middle of the
        # chunk, after outputs were packed: it runs again (the kill is once)
        faults[case["kill_at"]] = "kill:" + os.path.join(markers, f"killed-{seed}")
    plan = dict(enumerate(zip(sizes, faults, strict=True)))
    pool = ProcessPool(functools.partial(process_fns.sized_output, plan), 1, f"case {seed}")
    try:
        outputs, failed, _, slack = pool.submit(
            list(range(len(sizes))), allowance=case["allowance"]).result(timeout=120)
    finally:
        pool.shutdown()
    failed = failed or {}
    assert slack >= 0
    assert 1 <= len(outputs) <= len(sizes)
    if not case["kill"]:
        assert len(outputs) == _expected_length(sizes, case["faults"], case["allowance"]), case
    for position, output in enumerate(outputs):  # a prefix of the sequential outcomes
        fault = case["faults"][position]
        if fault == "raise":
            assert isinstance(failed[position], process_fns.Failing)
        elif fault == "unsendable":
            assert isinstance(failed[position], hr.WorkerError)
            assert "cannot be sent back" in str(failed[position])
        else:
            assert position not in failed
            assert output.shape == (sizes[position],) and output.dtype == np.uint8
            assert output.size == 0 or (output[0] == output[-1] == position % 251)
    assert not set(failed) - set(range(len(outputs)))


@pytest.mark.parametrize("seeds", [range(12)])
def test_a_worker_stops_at_its_allowance_and_hands_the_rest_back(seeds: range) -> None:
    _run_pool_cases(seeds)


@pytest.mark.slow
def test_a_worker_stops_at_its_allowance_many() -> None:
    _run_pool_cases(range(12, 120))


def _run_pool_cases(seeds: range) -> None:
    with tempfile.TemporaryDirectory() as markers, warnings.catch_warnings():
        warnings.simplefilter("ignore", hr.HeadraceWarning)  # "worker ... replaced"
        for seed in seeds:
            check_pool_case(_pool_case(seed), markers, seed)
    assert own_segments() == []


# -- pipelines --------------------------------------------------------------------------


def _status(pid: int, *keys: str) -> list[int]:
    """Fields of ``/proc/<pid>/status`` in bytes (0 where the process is gone)."""
    found = dict.fromkeys(keys, 0)
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key = line.split(":", 1)[0]
                if key in found:
                    found[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return [found[key] for key in keys]


def _tree_charged(floors: dict[int, int]) -> int:
    """The process tree's memory, pages shared among its processes counted once (PSS):
    this process's Pss_Anon + Pss_Shmem, and each descendant's Pss_Shmem plus its
    Pss_Anon above the least it was seen to hold (its interpreter is its start, not
    the pipeline's growth)."""
    total = 0
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        memory = worker_memory(pid)
        if memory is None:
            continue
        if pid == os.getpid():
            total += memory.pss_anon + memory.pss_shmem
            continue
        floor = floors[pid] = min(floors.get(pid, memory.pss_anon), memory.pss_anon)
        total += memory.pss_anon - floor + memory.pss_shmem
    return total


class Growth:
    """The peak growth of the process tree while a pipeline runs: a sampler thread, a
    sample after each few elements the consumer takes, and each worker's own peak
    (its VmHWM above the least VmRSS it was seen at: a copy that lived between two
    samples still shows there)."""

    def __init__(self) -> None:
        self.floors: dict[int, int] = {}
        self.rss_floors: dict[int, int] = {}
        self.start = _tree_charged(self.floors)
        self.peak = self.start
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            began = time.perf_counter()
            self.sample()
            time.sleep(max(0.002, 2 * (time.perf_counter() - began)))

    def sample(self) -> None:
        self.peak = max(self.peak, _tree_charged(self.floors))
        for pid in _descendants(os.getpid()):
            (rss,) = _status(pid, "VmRSS")
            if rss:
                self.rss_floors[pid] = min(self.rss_floors.get(pid, rss), rss)

    def worker_peak(self) -> int:
        """The largest growth of one worker process over its least seen (call it before
        the pipeline closes: its workers are gone after)."""
        peaks = [_status(pid, "VmHWM")[0] - floor for pid, floor in self.rss_floors.items()]
        return max([0, *peaks])

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        self.sample()
        return self.peak - self.start


def _jump_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "at": rng.randrange(500, 3000),
        "small": rng.choice([8, 128, 2000]),
        "large": rng.choice([512 << 10, 2 * MiB, 4 * MiB]),
        "workers": rng.randrange(1, 4),
        "seconds": rng.choice([0.0, 50e-6, 300e-6]),
        "deterministic": rng.random() < 0.7,
        "budget_mib": rng.choice([32, 64]),
    }


def check_jump_case(case: dict[str, Any]) -> None:
    """Outputs jump from small to large after ``at`` quick elements: the process tree's
    growth stays within the bound, and the outputs are the sequential map's."""
    n = case["at"] + max(40, (400 * MiB) // case["large"])
    fn = functools.partial(process_fns.jump_output, case["at"], case["small"], case["large"],
                           case["seconds"])
    ds = (hr.Dataset.range(n)
          .map(fn, num_parallel_calls=case["workers"], workers="processes",
               deterministic=case["deterministic"])
          .with_options(hr.Options(memory_budget=f"{case['budget_mib']}MiB")))
    got: list[tuple[int, int]] = []
    growth = Growth()
    try:
        with iter(ds) as iterator:
            for element in iterator:  # (read whole, as a consumer does: its pages count)
                got.append((element.size, int(element.min()) if element.size else -1))
                del element
                if len(got) % 16 == 0:
                    growth.sample()
            worker_peak = growth.worker_peak()
    finally:
        grown = growth.stop()
    expected = [(case["small"] if x < case["at"] else case["large"], x % 251)
                for x in range(n)]
    if case["deterministic"]:
        assert got == expected
    else:
        assert sorted(got) == sorted(expected)
    budget = case["budget_mib"] * MiB
    bound = budget + budget // 10 + 64 * MiB + case["workers"] * case["large"]
    assert grown <= bound, f"grew {grown / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB: {case}"
    assert worker_peak <= bound, f"a worker grew {worker_peak / MiB:.0f} MiB: {case}"
    assert own_segments() == []


#: The issue's case: 128 B outputs jump to 2 MB after 3,000 quick elements, 64 MiB.
ISSUE_CASE = {"at": 3000, "small": 128, "large": 2 * MiB, "workers": 2, "seconds": 0.0,
              "deterministic": True, "budget_mib": 64}


@pytest.mark.parametrize("seed", ["issue", 1])
def test_a_process_map_whose_outputs_jump_stays_within_the_budget(seed: Any) -> None:
    check_jump_case(ISSUE_CASE if seed == "issue" else _jump_case(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 14))
def test_a_process_map_whose_outputs_jump_many(seed: int) -> None:
    check_jump_case(_jump_case(seed))


def test_an_output_larger_than_the_budget_is_refused_in_the_worker() -> None:
    """A 256 MiB output under a 64 MiB budget: MemoryBudgetError naming the stage and
    the sizes, in the element's place; the tree grows by at most the bound plus that
    element (the worker's own array, never copied into shared memory); the pipeline
    goes on and closes with no segment and no worker left."""
    giant, budget = 256 * MiB, 64 * MiB
    fn = functools.partial(process_fns.giant_at, 5, giant)
    ds = (hr.Dataset.range(12)
          .map(fn, num_parallel_calls=2, workers="processes")
          .with_options(hr.Options(memory_budget=budget)))
    growth = Growth()
    got: list[Any] = []
    try:
        with iter(ds) as iterator:
            while True:
                try:
                    got.append(int(next(iterator)[0]))
                except StopIteration:
                    break
                except hr.MemoryBudgetError as error:
                    text = str(error)
                    assert "map(functools.partial)" in text  # the stage, and the sizes
                    assert "256.0 MiB" in text and "64.0 MiB" in text
                    got.append("refused")
                growth.sample()
            pids = iterator.stats().workers[0].processes
            worker_peak = growth.worker_peak()
    finally:
        grown = growth.stop()
    assert got == [0, 1, 2, 3, 4, "refused", 6, 7, 8, 9, 10, 11]
    bound = budget + budget // 10 + 64 * MiB + giant
    assert grown <= bound, f"grew {grown / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
    # the worker's array and a copy of it in shared memory never coexist
    assert worker_peak <= bound, f"a worker grew {worker_peak / MiB:.0f} MiB"
    assert own_segments() == []
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{p.pid}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p.pid for p in pids if os.path.exists(f"/proc/{p.pid}")]


# -- the writer itself ---------------------------------------------------------------------


def _object(rng: random.Random, nbytes: int) -> Any:
    """An output of about ``nbytes``: an array, large bytes (sent as a copy), a bytes
    column met twice, a dict of them, one that cannot be pickled, or small objects met
    more than once in one output (pickle memo references, which differ output to
    output: an output's references must resolve within that output)."""
    kind = rng.choice(["array", "bytes", "column", "dict", "unsendable", "none", "repeats"])
    if kind == "repeats":
        word = f"w{rng.randrange(1 << 30)}"
        small = np.arange(rng.randrange(1, 9), dtype=rng.choice(["u1", "i4", "f8"]))
        return (word, [word, small.dtype], small, {word: small.dtype.str}, small.dtype.str)
    if kind == "array":
        return np.full(nbytes, nbytes % 251, np.uint8)
    if kind == "bytes":
        return bytes([nbytes % 251]) * nbytes
    if kind == "column":
        column = np.array([b"x" * (nbytes // 4 + i) for i in range(4)], dtype=object)
        return (column, column)  # one array, sent once
    if kind == "dict":
        return {"a": np.arange(nbytes // 8 + 1), "b": b"y" * nbytes, "n": nbytes}
    if kind == "unsendable":
        return process_fns.Unsendable()
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("seeds", [range(20), pytest.param(range(20, 300), marks=pytest.mark.slow)])
def test_outputs_packed_one_by_one_come_back_whole(seeds: range) -> None:
    """The oracle is the objects themselves: each comes back equal, in its place; one
    that cannot be pickled leaves nothing behind; no segment is larger than the bound
    the writer is given (or than one output that needs more); none is left over."""
    for seed in seeds:
        rng = random.Random(seed)
        pool, maps = shm.SegmentPool(os.getpid(), tag="t-"), shm.SegmentMaps()
        sizes = _sizes(rng, rng.randrange(1, 30))
        objects = [_object(rng, nbytes) for nbytes in sizes]
        most = rng.choice([64 << 10, 1 << 20, 4 << 20])
        made: list[tuple[int, int]] = []

        def allocate(nbytes: int, capacity: int, pool: Any = pool, made: Any = made) -> Any:
            key, name, size, mapping = pool.allocate(nbytes, capacity)
            made.append((nbytes, size))
            return key, name, size, mapping

        writer = shm.OutputWriter(allocate, rng.choice([0, sum(sizes)]),
                                  rng.choice([None, sum(sizes) // 2]), most)
        expected = []
        for position, obj in enumerate(objects):
            try:
                writer.add(obj, len(objects) - position)
            except Exception:
                assert isinstance(obj, process_fns.Unsendable)
                writer.add(None)
                obj = None
            expected.append(obj)
        got, unreadable = maps.unpack_outputs(writer.finish())
        assert not unreadable
        assert len(got) == len(expected)
        assert all(_same(a, b) for a, b in zip(expected, got, strict=True)), seed
        page = shm.SegmentPool.capacity_for
        assert all(size <= page(max(nbytes, most)) for nbytes, size in made), (seed, made)
        del got
        maps.released()
        maps.close()
        pool.close()
    assert own_segments() == []


def test_outputs_that_need_a_class_this_process_lacks_fail_alone_in_their_run() -> None:
    """Small outputs share a pickle memo (a run): an output whose class cannot be imported
    here fails with the import error, and so does each later output of the run that
    refers to that class or to an instance of it through the memo; the outputs between
    and after them, memo references included, come back whole."""
    import types

    module = types.ModuleType("headrace_test_gone_after_packing")
    exec("class Thing:\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        thing = module.Thing()
        word = "shared-" + "w" * 20
        outputs = [word, thing, (word, module.Thing), [module.Thing()], {"k": thing},
                   word, np.arange(5), (word, np.arange(5))]
        writer = shm.OutputWriter(lambda nbytes, capacity: pytest.fail("no segment needed"))
        for position, obj in enumerate(outputs):
            writer.add(obj, len(outputs) - position)
        packed = writer.finish()
    finally:
        del sys.modules[module.__name__]
    assert all(not fresh for _, _, fresh in packed.ends[1:])  # one run
    got, unreadable = shm.SegmentMaps().unpack_outputs(packed)
    assert sorted(unreadable) == [1, 2, 3, 4]
    for error in unreadable.values():
        assert isinstance(error, ModuleNotFoundError)
        assert module.__name__ in str(error)
    assert got[0] == word and got[5] == word and got[7][0] == word
    assert np.array_equal(got[6], np.arange(5)) and np.array_equal(got[7][1], np.arange(5))
