"""interleave / flat_map: tf.data's order, budget, file cap, resume."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
import time
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._transforms import _wait_watch
from headrace._transforms._wait_watch import WaitWatch
from headrace.core.state import seal
from headrace.testing import assert_checkpoint_roundtrip


def lists_dataset(lists: list[list[int]]):
    """map_func for an interleave over range(len(lists)): element i -> lists[i]."""

    def inner(i):
        values = lists[int(i)]
        return hr.Dataset.from_tensor_slices(np.array(values, dtype=np.int64).reshape(-1))

    return inner


def sequential_reference(lists, cycle_length, block_length):
    """tf.data's interleave_dataset_op.cc, transcribed."""
    slots = [None] * cycle_length
    cycle = block = 0
    end = False
    open_count = 0
    next_input = 0
    out = []
    while not end or open_count:
        slot = slots[cycle]
        if slot is not None:
            if slot:
                out.append(slot.pop(0))
                block += 1
                if block == block_length:
                    block, cycle = 0, (cycle + 1) % cycle_length
                continue
            slots[cycle] = None
            open_count -= 1
            block, cycle = 0, (cycle + 1) % cycle_length
        elif not end:
            if next_input < len(lists):
                slots[cycle] = list(lists[next_input])
                next_input += 1
                open_count += 1
            else:
                end = True
        else:
            block, cycle = 0, (cycle + 1) % cycle_length
    return out


def run(lists, **kwargs) -> list[int]:
    ds = hr.Dataset.range(len(lists)).interleave(lists_dataset(lists), **kwargs)
    return [int(v) for v in ds]


def test_documented_examples() -> None:
    ds = hr.Dataset.range(1, 6).interleave(
        lambda x: hr.Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4
    )
    assert "".join(str(int(v)) for v in ds) == "111122221122333344443344555555"
    # an inner dataset that ends on a block boundary is noticed one visit later
    assert run([[1, 2], [11, 12, 13, 14], [21, 22]], cycle_length=2, block_length=2) == [
        1, 2, 11, 12, 13, 14, 21, 22,
    ]
    # an empty inner dataset costs a visit
    assert run([[], [11, 12, 13], [21], [31, 32]], cycle_length=2, block_length=1) == [
        11, 21, 12, 13, 31, 32,
    ]


@settings(max_examples=60, deadline=None)
@given(
    lists=st.lists(st.lists(st.integers(0, 99), max_size=5), max_size=7),
    cycle_length=st.integers(1, 4),
    block_length=st.integers(1, 3),
    parallel=st.sampled_from([None, 1, 2, "cycle"]),
)
def test_order_matches_tf_data_sequential_and_parallel(lists, cycle_length, block_length, parallel):
    calls = cycle_length if parallel == "cycle" else parallel
    if calls is not None and calls > cycle_length:
        calls = cycle_length
    expected = sequential_reference([list(x) for x in lists], cycle_length, block_length)
    got = run(lists, cycle_length=cycle_length, block_length=block_length, num_parallel_calls=calls)
    assert got == expected


def test_nondeterministic_yields_each_element_once() -> None:
    lists = [list(range(i * 10, i * 10 + i)) for i in range(8)]
    got = run(lists, cycle_length=3, num_parallel_calls=3, deterministic=False)
    assert sorted(got) == sorted(v for values in lists for v in values)


def test_flat_map_concatenates() -> None:
    assert run([[1, 2], [], [3]], cycle_length=1) == [1, 2, 3]
    ds = hr.Dataset.range(3).flat_map(lambda i: hr.Dataset.range(int(i)))
    assert [int(v) for v in ds] == [0, 0, 1]


def test_invalid_arguments() -> None:
    with pytest.raises(hr.InvalidArgumentError, match=r"num_parallel_calls \(3\) must be <="):
        hr.Dataset.range(3).interleave(lambda x: hr.Dataset.range(1), cycle_length=2,
                                       num_parallel_calls=3)
    with pytest.raises(hr.InvalidArgumentError, match="block_length must be > 0"):
        hr.Dataset.range(3).interleave(lambda x: hr.Dataset.range(1), cycle_length=2,
                                       block_length=0)
    with pytest.warns(UserWarning, match="depends on the CPU count"):
        hr.Dataset.range(3).interleave(lambda x: hr.Dataset.range(1))
    with pytest.raises(hr.InvalidArgumentError, match="must return a Dataset"):
        list(hr.Dataset.range(3).interleave(lambda x: [1], cycle_length=1))


@pytest.mark.parametrize("parallel", [None, 2, hr.AUTOTUNE])
def test_checkpoint_roundtrip(parallel) -> None:
    lists = [list(range(i * 10, i * 10 + (i % 4))) for i in range(9)]
    ds = hr.Dataset.range(len(lists)).interleave(
        lists_dataset(lists), cycle_length=3, block_length=2, num_parallel_calls=parallel
    )
    assert_checkpoint_roundtrip(ds)


@pytest.fixture
def quiet_machine(monkeypatch):
    """For tests of AUTOTUNE's windows and of what happens after it starts threads: the
    waits the inner pipelines make (sleeps) decide, not how busy the machine running the
    suite is (preempted time and a contended GIL rightly keep it sequential, see WaitWatch;
    the compute-bound test below runs on the real clocks)."""
    monkeypatch.setattr(_wait_watch, "_run_queue_seconds", lambda limiter: 0.0)
    monkeypatch.setattr(_wait_watch, "_gil_is_free", lambda within, probes=3: True)


def waiting_inner(i):
    """An inner pipeline that waits 1 ms per element, as a slow disk or network would."""
    return hr.Dataset.range(i * 1000, i * 1000 + 300).map(lambda x: (time.sleep(0.001), x)[1])


@pytest.mark.usefixtures("no_thread_leak", "quiet_machine")
def test_autotune_starts_threads_when_the_inner_pipelines_wait(monkeypatch) -> None:
    monkeypatch.setattr(WaitWatch, "WINDOW_SECONDS", 0.05)
    ds = hr.Dataset.range(4).interleave(
        waiting_inner, cycle_length=4, num_parallel_calls=hr.AUTOTUNE
    )
    expected = [i * 1000 + j for j in range(300) for i in range(4)]  # round-robin, as tf
    with iter(ds) as iterator:
        interleave = iterator._tree
        head = [int(next(iterator)) for _ in range(10)]
        assert not interleave.threaded  # two windows of 50 ms of pulls come first
        early_state = iterator.get_state()
        rest = [int(x) for x in iterator]
        assert interleave.threaded
        assert head + rest == expected  # the switch changes timing, never the order
        # a state saved before the switch restores into the switched iterator...
        iterator.set_state(early_state)
        assert [int(x) for x in iterator] == expected[10:]
    with iter(ds) as iterator:
        head = [int(next(iterator)) for _ in range(700)]
        assert iterator._tree.threaded
        late_state = iterator.get_state()
    with iter(ds) as resumed:  # ...and one saved after it restores switched, mid-slot
        resumed.set_state(late_state)
        assert resumed._tree.threaded
        assert head + [int(x) for x in resumed] == expected


@pytest.mark.usefixtures("no_thread_leak", "quiet_machine")
def test_checkpoints_across_the_autotune_switch(monkeypatch) -> None:
    monkeypatch.setattr(WaitWatch, "WINDOW_SECONDS", 0.002)  # switch after a few pulls

    def inner(i):
        return hr.Dataset.range(i * 10, i * 10 + 4).map(lambda x: (time.sleep(0.001), x)[1])

    ds = hr.Dataset.range(5).interleave(
        inner, cycle_length=3, block_length=2, num_parallel_calls=hr.AUTOTUNE
    )
    with iter(ds) as iterator:
        expected = [int(x) for x in iterator]
        assert len(expected) == 20 and iterator._tree.threaded
    assert_checkpoint_roundtrip(ds)  # every step; fresh iterators switch again
    with iter(ds) as iterator:  # a state without "threaded" (written before AUTOTUNE
        head = [int(next(iterator)) for _ in range(12)]  # could stay sequential) is
        state = iterator.get_state()  # a read-ahead state, as it was then
        assert state["state"].pop("threaded") is True
        seal(state)
    with iter(ds) as resumed:
        resumed.set_state(state)
        assert head + [int(x) for x in resumed] == expected


@pytest.mark.usefixtures("no_thread_leak", "quiet_machine")
def test_autotune_switch_with_deterministic_false_yields_each_element_once() -> None:
    ds = hr.Dataset.range(6).interleave(
        waiting_inner, cycle_length=3, num_parallel_calls=hr.AUTOTUNE, deterministic=False
    )
    with iter(ds) as iterator:
        got = sorted(int(x) for x in iterator)
        assert iterator._tree.threaded
    assert got == sorted(i * 1000 + j for i in range(6) for j in range(300))


@pytest.mark.usefixtures("quiet_machine")
def test_autotune_threads_keep_the_file_cap_and_the_order(tmp_path, stream_descriptors) -> None:
    files = [
        write(tmp_path / f"{i}.txt", "".join(f"{i}:{j}\n" for j in range(40)).encode(),
              "GZIP" if i % 2 else None)
        for i in range(8)
    ]

    def slow_lines(f):  # a slow file system: every line waits
        lines = hr.TextLineDataset(f, compression_type="GZIP" if int(f[-5]) % 2 else None,
                                   buffer_size=16)
        return lines.map(lambda line: (time.sleep(0.001), line)[1])

    def build(parallel):
        names = hr.Dataset.from_tensor_slices(np.array(files, dtype=object))
        return names.interleave(slow_lines, cycle_length=6, num_parallel_calls=parallel)

    expected = list(build(None))
    stream_descriptors.peak = 0
    ds = build(hr.AUTOTUNE).with_options(hr.Options(max_open_files=2))
    with iter(ds) as iterator:
        assert list(iterator) == expected
        assert iterator._tree.threaded  # six slots reading ahead, two files open at most
    assert stream_descriptors.peak <= 2


@pytest.mark.usefixtures("no_thread_leak", "quiet_machine")
def test_autotune_notices_reads_that_turn_slow_after_it_rested(monkeypatch) -> None:
    monkeypatch.setattr(WaitWatch, "REST_SECONDS", 0.2)

    def inner(i):  # 50,000 quick elements (well over five windows), then 150 that wait
        quick = hr.Dataset.range(i * 100_000, i * 100_000 + 50_000)
        slow = hr.Dataset.range(i * 100_000 + 50_000, i * 100_000 + 50_150)
        return quick.concatenate(slow.map(lambda x: (time.sleep(0.001), x)[1]))

    ds = hr.Dataset.range(4).interleave(inner, cycle_length=4, num_parallel_calls=hr.AUTOTUNE)
    with iter(ds) as iterator:
        interleave = iterator._tree
        quick = [int(next(iterator)) for _ in range(200_000)]
        assert not interleave.threaded
        assert interleave.watch.rest_until > 0  # it had stopped watching for a while
        rest = [int(x) for x in iterator]
        assert interleave.threaded
    expected = [i * 100_000 + j for j in range(50_150) for i in range(4)]
    assert quick + rest == expected


def test_autotune_stays_sequential_when_the_inner_pipelines_compute() -> None:
    ds = hr.Dataset.range(40).interleave(  # ~0.2 s of pulls: about ten windows
        lambda i: hr.Dataset.range(i * 1000, i * 1000 + 1000), cycle_length=4,
        num_parallel_calls=hr.AUTOTUNE,
    )
    with iter(ds) as iterator:
        assert sum(1 for _ in iterator) == 40_000
        assert not iterator._tree.threaded  # threads would only add hand-offs here


def test_inner_pipelines_draw_from_the_interleave_share() -> None:
    def inner(i):
        return hr.Dataset.from_generator(
            lambda: (np.full(1 << 20, int(i), np.uint8) for _ in range(20)),
            output_signature=hr.TensorSpec((1 << 20,), np.uint8),
        ).prefetch(100)

    ds = hr.Dataset.range(6).interleave(inner, cycle_length=3, num_parallel_calls=3)
    ds = ds.with_options(hr.Options(memory_budget="24MiB"))
    with iter(ds) as iterator:
        assert sum(1 for _ in iterator) == 120
        budget = iterator.context.budget
        assert budget.peak <= budget.total


# -- text files ---------------------------------------------------------------------


def write(path, data: bytes, compression: str | None = None) -> str:
    if compression == "GZIP":
        data = gzip.compress(data)
    elif compression == "ZLIB":
        data = zlib.compress(data)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_text_lines_split_like_tf_data(tmp_path, compression) -> None:
    path = write(tmp_path / "a.txt", b"a\r\nb\n\nc", compression)
    assert list(hr.TextLineDataset(path, compression_type=compression)) == [b"a", b"b", b"", b"c"]
    path = write(tmp_path / "b.txt", b"x\ny\n", compression)
    assert list(hr.TextLineDataset(path, compression_type=compression)) == [b"x", b"y"]


def test_num_parallel_reads_is_round_robin(tmp_path) -> None:
    files = [
        write(tmp_path / f"{i}.txt", "".join(f"{i}-{j}\n" for j in range(n)).encode())
        for i, n in enumerate([3, 1, 2])
    ]
    got = [line.decode() for line in hr.TextLineDataset(files, num_parallel_reads=2)]
    assert got == ["0-0", "1-0", "0-1", "0-2", "2-0", "2-1"]


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_text_lines_resume_at_byte_offsets(tmp_path, compression) -> None:
    files = [
        write(tmp_path / f"{i}.txt", "".join(f"{i}:{j}\n" for j in range(7)).encode(), compression)
        for i in range(3)
    ]
    assert_checkpoint_roundtrip(hr.TextLineDataset(files, compression_type=compression))
    assert_checkpoint_roundtrip(
        hr.TextLineDataset(files, compression_type=compression, num_parallel_reads=2)
    )


def test_a_cap_of_two_files_with_cycle_eight_gives_the_uncapped_order(
    tmp_path, stream_descriptors
) -> None:
    files = [
        write(tmp_path / f"{i}.txt", "".join(f"{i}:{j}\n" for j in range(5 + i)).encode(),
              "GZIP" if i % 2 else None)
        for i in range(12)
    ]

    def by_suffix(f):  # file names come as bytes, as from tf.data
        return "GZIP" if int(os.path.basename(os.fsdecode(f)).split(".")[0]) % 2 else None

    def build(options):
        names = hr.Dataset.from_tensor_slices(np.array(files, dtype=object))
        return names.interleave(
            lambda f: hr.TextLineDataset(f, compression_type=by_suffix(f)), cycle_length=8
        ).with_options(options)

    uncapped = list(build(hr.Options()))
    assert stream_descriptors.peak > 2  # uncapped, the cycle holds more files open
    stream_descriptors.peak = 0
    capped = list(build(hr.Options(max_open_files=2)))
    assert capped == uncapped
    assert len(uncapped) == sum(5 + i for i in range(12))
    assert stream_descriptors.peak == 2


@pytest.mark.slow
def test_ten_thousand_shards_under_rlimit_64(tmp_path) -> None:
    directory = tmp_path / "shards"
    directory.mkdir()
    for i in range(10_000):
        (directory / f"{i:05d}.txt").write_bytes(f"{i}\n{i}\n{i}\n".encode())
    script = textwrap.dedent(
        f"""
        import os, resource, threading, numpy as np, headrace as hr
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        import headrace.io.streams
        from headrace.io.filepool import get_default_pool
        lock = threading.Lock(); held = [0]; peak = [0]
        class CountingOS:  # every open and close of the streams; never under-counts
            def add(self, delta):
                with lock:
                    held[0] += delta; peak[0] = max(peak[0], held[0])
            def open(self, *args):
                self.add(1)
                try:
                    return os.open(*args)
                except BaseException:
                    self.add(-1)
                    raise
            def close(self, descriptor):
                try:
                    os.close(descriptor)
                finally:
                    self.add(-1)
            def __getattr__(self, name):
                return getattr(os, name)
        headrace.io.streams.os = CountingOS()
        before = len(os.listdir("/proc/self/fd"))  # and what the process as a whole shows
        proc_peak = [0]; stop = threading.Event()
        def watch():
            while not stop.is_set():
                proc_peak[0] = max(proc_peak[0], len(os.listdir("/proc/self/fd")) - before)
        watcher = threading.Thread(target=watch, daemon=True); watcher.start()
        files = hr.Dataset.list_files({str(directory)!r} + "/*.txt", shuffle=False)
        peaks = []
        # sequential: each of the 100 slots keeps its file open between its lines (a
        # 4-byte read buffer), so the cycle wants 100 files; then 4 threads reading ahead
        for parallel in (None, 4):
            peak[0] = 0
            lines = files.interleave(lambda f: hr.TextLineDataset(f, buffer_size=4),
                                     cycle_length=100, num_parallel_calls=parallel)
            seen = sorted(int(line) for line in lines)
            assert seen == sorted(list(range(10_000)) * 3), "records lost or duplicated"
            peaks.append(peak[0])
        stop.set(); watcher.join()
        cap = get_default_pool().max_open_files
        print(cap, *peaks, proc_peak[0])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cap, sequential_peak, threaded_peak, proc_peak = map(int, out.stdout.split())
    assert cap == 16
    assert sequential_peak == cap  # 100 slots want a file each: they get the cap, no more
    assert 1 <= threaded_peak <= cap
    # /proc/self/fd, minus the count before: a listing is not atomic while threads open
    # and close files (see tests/conftest.py), so it may read one over the exact count
    assert proc_peak <= cap + 1


def test_suspended_compressed_streams_are_booked_on_the_budget(tmp_path) -> None:
    files = [write(tmp_path / f"{i}.gz", "".join(f"{i}:{j}\n" for j in range(50)).encode(),
                   "GZIP") for i in range(6)]
    names = hr.Dataset.from_tensor_slices(np.array(files, dtype=object))
    ds = names.interleave(
        lambda f: hr.TextLineDataset(f, compression_type="GZIP"), cycle_length=6
    ).with_options(hr.Options(max_open_files=2, memory_budget="64MiB"))
    with iter(ds) as iterator:
        assert len(list(iterator)) == 300
        held = {s.name: s for s in iterator.stats().stages}
        budget = iterator.context.budget
    assert budget.used == 0  # every suspension's decompressor state was given back
    # interleave slots draw from the interleave's share: the pipeline saw the bookings
    assert budget.peak >= 40 << 10  # at least one suspended zlib state (~40 KiB)
    assert "interleave" in held


def test_sizes_one_sample_fixed_stay_unknown_so_padded_batch_pads_each_batch() -> None:
    """Budget fuzzer seeds 400019/400042/400085 (``newer_spec``): decoded images of
    varying sizes through an interleave, then ``padded_batch``, raised "Attempted to pad
    to a smaller size": the interleave's spec came from the first image's inner dataset
    ((2, 2, 3) here) where tf.data, tracing over the input's spec, has (None, None, 3)."""
    def images() -> Any:
        for side in (2, 5, 3):
            yield np.full((side, side, 3), side, np.uint8)

    ds = hr.Dataset.from_generator(
        images, output_signature=hr.TensorSpec((None, None, 3), np.uint8)
    ).interleave(hr.Dataset.from_tensors, cycle_length=1)
    assert ds.element_spec == hr.TensorSpec((None, None, 3), np.uint8)
    (batch,) = list(ds.padded_batch(3))
    assert batch.shape == (3, 5, 5, 3)
    assert [int(batch[i, 0, 0, 0]) for i in range(3)] == [2, 5, 3]
    # a size every input has is kept: rows of 4 stay rows of 4
    rows = hr.Dataset.from_tensor_slices(np.zeros((3, 4), np.float32)).interleave(
        hr.Dataset.from_tensors, cycle_length=2)
    assert rows.element_spec == hr.TensorSpec((4,), np.float32)
