"""Datasets an interleave's function builds keep the pipeline's file cap (G2).

Two ways past ``Options(max_open_files=n)`` that these cases caught:

* ``from_npy`` mapped its file through ``np.memmap``, whose ``mmap.mmap`` keeps a
  duplicate descriptor as long as the mapping lives: an interleave over ``.npy`` files
  held one per slot, outside every cap (40 slots, cap 6: 42 open; 100 slots under
  ``ulimit -n 64``: EMFILE). The mapping now keeps no descriptor at all.
* ``Dataset.load`` called by the function read its manifest and digested its part files
  without a pool slot, and the index reads took one from the process-wide pool but
  not from the pipeline's share: one file past the pipeline's cap while its slots
  held their shards. The interleave now charges the function's opens to its pipeline.

The oracle is the promise itself: the peak of ``/proc/self/fd`` (sampled by a thread)
above the baseline never passes the cap, and the elements are those of tf.data's
interleave order over each inner dataset read on its own, uncapped.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr


class FdPeak:
    """The most descriptors this process held while the block ran, above its start."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def count() -> int:
        return len(os.listdir("/proc/self/fd"))

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.count())

    def __enter__(self) -> FdPeak:
        self.base = self.peak = self.count()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def interleave_order(inner: list[list[Any]], cycle_length: int) -> list[Any]:
    """tf.data's interleave (block_length 1): a slot emptied is refilled with the next
    input when the cycle comes back to it."""
    inputs: Iterator[list[Any]] = iter(inner)
    slots: list[Iterator[Any] | None] = [None] * cycle_length
    out: list[Any] = []
    index, open_count, end_of_input = 0, 0, False
    while not end_of_input or open_count:
        slot = slots[index]
        if slot is not None:
            try:
                out.append(next(slot))
            except StopIteration:
                slots[index] = None
                open_count -= 1
            index = (index + 1) % cycle_length
        elif not end_of_input:
            nxt = next(inputs, None)
            if nxt is None:
                end_of_input = True
            else:
                slots[index] = iter(nxt)
                open_count += 1
        else:
            index = (index + 1) % cycle_length
    return out


def as_list(dataset: hr.Dataset) -> list[Any]:
    return [np.asarray(x).tolist() for x in dataset]


def run_capped(
    inputs: hr.Dataset, make: Callable[[Any], hr.Dataset], cycle: int, cap: int, parallel: bool
) -> tuple[list[Any], int]:
    dataset = inputs.interleave(
        make, cycle_length=cycle, num_parallel_calls=hr.AUTOTUNE if parallel else None
    ).with_options(hr.Options(memory_budget="64MiB", max_open_files=cap))
    with FdPeak() as fds:
        elements = as_list(dataset)
    return elements, fds.growth


class _Npy:
    def __call__(self, path: Any) -> hr.Dataset:
        return hr.Dataset.from_npy(path.decode() if isinstance(path, bytes) else str(path))


@pytest.mark.parametrize("seed", range(6))
def test_an_interleave_over_npy_files_keeps_the_cap(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    count = rng.randint(3, 40)
    cycle, cap = rng.randint(1, count + 3), rng.randint(1, 6)
    paths = []
    for s in range(count):
        rows = rng.randint(0, 12)
        path = tmp_path / f"f{s}.npy"
        array = np.arange(rows * 3, dtype=np.int64).reshape(rows, 3) + 1000 * s
        np.save(path, np.asfortranarray(array) if s % 2 else array)
        paths.append(str(path))
    oracle = interleave_order([as_list(hr.Dataset.from_npy(p)) for p in paths], cycle)
    elements, growth = run_capped(
        hr.Dataset.from_tensor_slices(paths), _Npy(), cycle, cap, parallel=bool(seed % 2)
    )
    assert growth <= cap, f"{count} files, cycle {cycle}: {growth} descriptors, cap {cap}"
    assert elements == oracle


def test_a_hundred_npy_slots_run_under_ulimit_64(tmp_path: Path) -> None:
    """The finding's second half: 100 slots, RLIMIT_NOFILE 64 (default cap 16), in a
    child process so the limit stays there."""
    script = textwrap.dedent(
        f"""
        import os, resource
        import numpy as np, headrace as hr
        paths = []
        for s in range(100):
            p = os.path.join({str(tmp_path)!r}, f"n{{s}}.npy")
            np.save(p, np.full((20, 4), s, np.float32))
            paths.append(p)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        ds = hr.Dataset.from_tensor_slices(paths).interleave(
            lambda p: hr.Dataset.from_npy(p.decode() if isinstance(p, bytes) else p),
            cycle_length=100)
        got = [float(x[0]) for x in ds]
        assert got == [float(s) for _ in range(20) for s in range(100)], got[:10]
        print("ok", len(got))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok 2000" in done.stdout


class _Load:
    def __init__(self, directories: list[str]) -> None:
        self.directories = directories

    def __call__(self, k: Any) -> hr.Dataset:
        return hr.Dataset.load(self.directories[int(k) % len(self.directories)])


@pytest.mark.parametrize("seed", range(8))
def test_an_interleave_of_loads_keeps_the_cap(tmp_path: Path, seed: int) -> None:
    rng = random.Random(100 + seed)
    directories = []
    for d in range(rng.randint(1, 3)):
        directory = str(tmp_path / f"saved{d}")
        size = rng.randint(1, 60)
        hr.Dataset.range(size).map(lambda i, d=d: np.full(4, i + 1000 * d)).save(
            directory, num_shards=rng.randint(1, 5)
        )
        directories.append(directory)
    cap = rng.randint(2, 6)
    cycle = rng.randint(1, cap + 6)  # (mostly past the cap: the slots' shards fill it)
    inputs = rng.randint(1, cycle + 8)
    make = _Load(directories)
    oracle = interleave_order([as_list(make(k)) for k in range(inputs)], cycle)
    elements, growth = run_capped(
        hr.Dataset.range(inputs), make, cycle, cap, parallel=bool(seed % 2)
    )
    assert growth <= cap, f"{inputs} loads, cycle {cycle}: {growth} descriptors, cap {cap}"
    assert elements == oracle


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (workers are the forkserver's children: grandchildren)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                pending += [int(c) for c in
                            Path(f"/proc/{current}/task/{task}/children").read_text().split()]
            except OSError:
                continue
    return found


def _data_descriptors(pid: int, root: str) -> int:
    count = 0
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in names:
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root)
        except OSError:
            continue
    return count


@pytest.mark.parametrize("seed", range(3))
def test_a_process_interleaves_workers_read_within_the_cap_together(
    tmp_path: Path, seed: int,
) -> None:
    """The workers open the data files themselves: together (and with the consumer)
    they hold at most ``max_open_files`` of them (each worker had the whole cap for
    each of its slots: 40 against 12). Elements as the threaded interleave's."""
    from headrace.io.tfrecord import write_tfrecord

    rng = random.Random(seed)
    files = rng.randint(24, 40)
    cap = rng.randint(9, 16)  # (below 9 a worker's pipes do not fit: FileLimitError)
    paths = []
    for index in range(files):
        path = str(tmp_path / f"p{index}.tfrecord")
        write_tfrecord(path, [b"%d-%d;" % (index, j) + bytes(16_000)
                              for j in range(rng.randint(40, 64))])
        paths.append(path)

    def pipeline(workers: str) -> hr.Dataset:
        ds = hr.Dataset.from_tensor_slices(paths).interleave(
            hr.TFRecordDataset, cycle_length=files, num_parallel_calls=2, workers=workers)
        # (a small budget: each slot reads in several chunks, its file open between them)
        return ds.with_options(hr.Options(memory_budget="32MiB", max_open_files=cap))

    expected = list(pipeline("threads"))
    root, peak, stop = str(tmp_path), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            total = sum(_data_descriptors(pid, root) for pid in _process_tree(os.getpid()))
            peak[0] = max(peak[0], total)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        got = list(pipeline("processes"))
    finally:
        stop.set()
        watcher.join()
    assert got == expected
    assert peak[0] <= cap, f"{peak[0]} data files open against max_open_files={cap}"
