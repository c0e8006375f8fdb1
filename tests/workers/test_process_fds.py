"""G2 for worker processes: the pipes of a process map's workers count against the cap.

Each worker keeps descriptors open in the consumer (its task and result pipes, the
ends its ``Process`` object keeps). They are counted here in ``/proc/self/fd``, in a
subprocess under a low RLIMIT_NOFILE, against the caps a generator picks.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd"
)

_SCRIPT = textwrap.dedent(
    """
    import json, os, random, resource, sys, threading, time, warnings
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import numpy as np
    import headrace as hr
    from headrace._errors import FileLimitError, HeadraceWarning
    from headrace.io.filepool import _count_process_descriptors, set_max_open_files
    from process_fns import square

    def fds():
        return _count_process_descriptors()

    def run(count, cap, process_cap, rows):
        set_max_open_files(process_cap)
        ds = (hr.Dataset.range(rows).map(square, num_parallel_calls=count,
                                        workers="processes").prefetch(8))
        if cap is not None:
            ds = ds.with_options(hr.Options(max_open_files=cap))
        peak, done = [fds()], threading.Event()
        base = peak[0]

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], fds())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        got, error, warned = [], None, False
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with iter(ds) as it:
                    for x in it:
                        got.append(int(x))
                warned = any(issubclass(w.category, HeadraceWarning) for w in caught)
        except FileLimitError as e:
            error = str(e)
        finally:
            done.set()
            sampler.join()
        return dict(count=count, cap=cap, process_cap=process_cap, got=got, error=error,
                    warned=warned, extra=peak[0] - base, after=fds() - base)

    # Start the process-wide helpers (the forkserver, the resource tracker) first:
    # their descriptors live as long as the process, whichever pipeline started them.
    list(hr.Dataset.range(2).map(square, num_parallel_calls=1, workers="processes"))
    rng = random.Random(int(sys.argv[1]))
    results = []
    for _ in range(int(sys.argv[2])):
        count = rng.randint(1, 6)
        process_cap = rng.choice([16, 16, 13, 9, 6])
        cap = rng.choice([None, rng.randint(4, 24)])
        results.append(run(count, cap, process_cap, rng.randint(10, 60)))
    print(json.dumps(results))
    """
)


def _run_cases(seed: int, cases: int) -> list[dict]:
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [tests, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(seed), str(cases)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tests,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_worker_pipes_stay_within_the_cap(seed: int) -> None:
    from headrace._workers.processes import DESCRIPTORS_PER_WORKER, SPAWN_DESCRIPTORS

    for case in _run_cases(seed, 4):
        cap = case["process_cap"] if case["cap"] is None else min(case["cap"], case["process_cap"])
        # what headrace opens never passes the cap, and all of it is closed afterwards
        assert case["extra"] <= cap, case
        assert case["after"] <= 0, case
        # (one slot stays free for a reader, and some for a worker being started)
        room = (cap - 1 - SPAWN_DESCRIPTORS) // DESCRIPTORS_PER_WORKER
        if room <= 0:  # not even one worker fits: a clear error, nothing computed
            assert case["error"] is not None and "max_open_files" in case["error"], case
            assert case["got"] == [], case
            continue
        assert case["error"] is None, case
        rows = len(case["got"])
        assert case["got"] == [i * i for i in range(rows)], case  # values and order
        assert case["warned"] == (case["count"] > room), case  # fewer workers, told


def test_descriptors_per_worker_measured() -> None:
    """The count the pool holds per worker is what a worker keeps open, measured."""
    script = textwrap.dedent(
        """
        import json
        from headrace.io.filepool import _count_process_descriptors, get_default_pool
        from headrace._workers.processes import ProcessPool
        from process_fns import square

        def run(count):
            pool = ProcessPool(square, count, "test")
            pool.submit([1]).result()
            return pool

        run(1).shutdown()  # the forkserver and resource tracker: once per process
        out = []
        for count in (1, 3, 5):
            base = _count_process_descriptors()
            pool = run(count)
            for index in range(count):  # every worker started
                pool.submit([1], worker=index).result()
            held = get_default_pool().stats().open_files
            out.append((count, _count_process_descriptors() - base, held))
            pool.shutdown()
            out.append((0, _count_process_descriptors() - base, get_default_pool().stats().open_files))
        print(json.dumps(out))
        """
    )
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [tests, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tests)
    assert done.returncode == 0, done.stderr[-3000:]
    from headrace._workers.processes import DESCRIPTORS_PER_WORKER, SPAWN_DESCRIPTORS

    for count, opened, held in json.loads(done.stdout.strip().splitlines()[-1]):
        assert opened == count * DESCRIPTORS_PER_WORKER  # started: what each keeps open
        assert held == (count * DESCRIPTORS_PER_WORKER + SPAWN_DESCRIPTORS if count else 0)


def test_auto_takes_threads_when_no_worker_pipes_fit() -> None:
    """``workers="auto"`` under a cap too low for one worker's pipes picks threads (and
    says why), so a pipeline that ran before the pipes were counted still runs."""
    import headrace as hr

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
    import process_fns

    rng = random.Random(7)
    reasons = []
    for _ in range(6):  # (the GIL probe is noisy on a busy machine: some runs say threads)
        rows, cap = rng.randint(80, 140), rng.randint(1, 8)
        ds = (hr.Dataset.range(rows)
              .map(process_fns.python_work, num_parallel_calls=2, workers="auto")
              .with_options(hr.Options(max_open_files=cap)))
        with iter(ds) as iterator:
            assert list(iterator) == list(range(rows))
            (choice,) = iterator.stats().workers
        assert choice.kind == "threads", choice.reason  # a cap of 8 fits no worker
        reasons.append(choice.reason)
        if "no descriptors for worker pipes" in choice.reason:
            assert f"max_open_files={cap}" in choice.reason
            break
    else:
        pytest.fail(f"the GIL-bound function was never sampled as such: {reasons}")


@pytest.mark.slow
def test_process_interleave_workers_fit_the_cap() -> None:
    """A process interleave's pool holds its pipes on the pipeline's cap too: fewer
    workers (told) or a FileLimitError, and the elements of the threaded run."""
    import warnings

    import headrace as hr
    from headrace._errors import FileLimitError, HeadraceWarning
    from headrace._workers.processes import DESCRIPTORS_PER_WORKER, SPAWN_DESCRIPTORS

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
    import process_fns

    rng = random.Random(1)  # (a case for each way: all fit, fewer, none)
    for _ in range(3):
        inputs, cycle = rng.randint(3, 12), rng.randint(1, 4)
        calls, cap = rng.randint(1, cycle), rng.randint(4, 14)

        def build(workers: str, inputs: int = inputs, cycle: int = cycle,
                  calls: int = calls) -> hr.Dataset:
            return hr.Dataset.range(inputs).interleave(
                process_fns.shard_dataset, cycle_length=cycle, num_parallel_calls=calls,
                workers=workers)

        expected = [int(x) for x in build("threads")]
        room = min(calls, (cap - 1 - SPAWN_DESCRIPTORS) // DESCRIPTORS_PER_WORKER)
        ds = build("processes").with_options(hr.Options(max_open_files=cap))
        if room <= 0:
            with pytest.raises(FileLimitError, match=f"max_open_files={cap}"):
                list(ds)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with iter(ds) as iterator:
                assert [int(x) for x in iterator] == expected
                (stats,) = iterator.stats().workers
        assert stats.count == room
        told = [w for w in caught if issubclass(w.category, HeadraceWarning)]
        assert bool(told) == (room < calls)
