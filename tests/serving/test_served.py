"""One producer serving several consumers (headrace.serve / headrace.connect), issue 10.

Consumers run in real processes (forkserver, as the process stages) where what is
tested is about processes: death, descriptors, segments; the property test of which
elements each consumer gets drives the same protocol from threads, to try many
random pipelines quickly.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import served_fns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
from headrace._workers import shm
from headrace._workers.processes import start_method
from headrace.io.tfrecord import write_tfrecord

KEY = b"served-tests"
CONTEXT = multiprocessing.get_context(start_method())
MiB = 1 << 20


def our_segments(pid: int | None = None) -> list[str]:
    owner = os.getpid() if pid is None else pid
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"headrace-{owner}-")]


def read_lines(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(condition: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def read_all(read: Any, consumers: int, seconds: float = 30) -> None:
    """``read(i)`` for every consumer index, each on a thread of its own, all at once."""
    threads = [threading.Thread(target=read, args=(i,)) for i in range(consumers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds)


# -- which elements each consumer gets ----------------------------------------------------


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[hr.Dataset, int]:
    n = draw(st.integers(0, 40))
    dataset = served_fns.ranged(n)
    if draw(st.booleans()):
        dataset = hr.Dataset.range(n).shuffle(draw(st.integers(1, 16)), seed=draw(st.integers(0, 9)))
        dataset = dataset.map(served_fns.as_array)
    if draw(st.booleans()):
        dataset = dataset.prefetch(draw(st.integers(1, 4)))
    return dataset, draw(st.integers(1, 3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pipelines())
def test_consumers_get_disjoint_deterministic_parts_whose_union_is_the_stream(
    case: tuple[hr.Dataset, int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    dataset, k = case
    stream = [served_fns.value(e) for e in dataset]
    address = str(tmp_path_factory.mktemp("served") / "s.sock")
    parts: dict[int, list[int]] = {}

    def read(index: int) -> None:
        with hr.connect(address, index, authkey=KEY) as part:
            parts[index] = [served_fns.value(e) for e in part]

    with hr.serve(dataset, k, address, authkey=KEY):
        read_all(read, k)
    for index in range(k):  # in the stream's order: every k-th element from the index-th
        assert parts[index] == stream[index::k]
    assert Counter(v for part in parts.values() for v in part) == Counter(stream)
    assert our_segments() == []


def test_three_consumer_processes_share_one_reader_under_its_descriptor_cap(
    tmp_path: Path,
) -> None:
    """The producer's sockets and its readers' files together within ``max_open_files``;
    a cap that cannot hold the sockets and a reader is refused at once."""
    with pytest.raises(hr.InvalidArgumentError, match="consumer connection"):
        hr.serve(hr.Dataset.range(3), 8, str(tmp_path / "small.sock"), authkey=KEY,
                 max_open_files=6)
    files = []
    for f in range(6):
        path = tmp_path / f"part-{f}.tfrecord"
        write_tfrecord(path, [f"{f}:{r}".encode() for r in range(30)])
        files.append(str(path))
    dataset = hr.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False).interleave(
        hr.TFRecordDataset, cycle_length=4
    )
    stream = [bytes(e).decode() for e in dataset]
    address = str(tmp_path / "reader.sock")
    open_now: list[int] = []
    stop = threading.Event()

    def count_descriptors() -> None:  # the producer's (this process's) open files of ours
        while not stop.is_set():
            fds = 0
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    fds += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
            open_now.append(fds)
            time.sleep(0.002)

    watcher = threading.Thread(target=count_descriptors, daemon=True)
    watcher.start()
    outs = [tmp_path / f"out-{i}.json" for i in range(3)]
    # 6: the listening socket and 3 connections hold 4 (counted too), the readers share 2
    with hr.serve(dataset.map(served_fns.record_array), 3, address, authkey=KEY,
                  max_open_files=6) as server:
        procs = [CONTEXT.Process(target=served_fns.consume_records,
                                 args=(address, i, KEY, str(outs[i]))) for i in range(3)]
        for proc in procs:
            proc.start()
        assert all(served_fns.exit_code(proc) in (0, None) for proc in procs)
        assert [server.finished(i) for i in range(3)] == [1, 1, 1]
        assert wait_until(lambda: server.connected == [])
    stop.set()
    watcher.join()
    parts = [json.loads(out.read_text()) for out in outs]
    for index, part in enumerate(parts):
        assert part == stream[index::3]
    assert sorted(v for part in parts for v in part) == sorted(stream)
    assert max(open_now) <= 2 and max(open_now) >= 1  # what the three parts share
    assert our_segments() == []


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(files=st.integers(1, 7), records=st.lists(st.integers(0, 6), min_size=7, max_size=7),
       k=st.integers(1, 3), cycle=st.integers(1, 3), listed=st.booleans())
def test_file_sharding_gives_each_consumer_only_its_own_files(
    files: int, records: list[int], k: int, cycle: int, listed: bool,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``shard_policy="file"``: consumer i reads files i, i+k, ... only (each file read once
    for all consumers, not k times), in that sub-pipeline's order; fewer files than
    consumers is a clear error, as for auto_shard."""
    directory = tmp_path_factory.mktemp("files")
    paths = []
    for f in range(files):
        paths.append(str(directory / f"part-{f}.tfrecord"))
        write_tfrecord(paths[-1], [f"{f}:{r}".encode() for r in range(records[f])])
    if listed:
        dataset = hr.Dataset.list_files(str(directory / "*.tfrecord"), shuffle=False).interleave(
            hr.TFRecordDataset, cycle_length=cycle)
    else:
        dataset = hr.TFRecordDataset(paths)
    address = str(directory / "s.sock")
    if files < k:
        with pytest.raises(hr.InvalidArgumentError, match=f"only {files} file.s., fewer than the {k}"):
            hr.serve(dataset, k, address, authkey=KEY, shard_policy="file")
        return
    parts: dict[int, list[str]] = {}

    def read(index: int) -> None:
        with hr.connect(address, index, authkey=KEY) as part:
            parts[index] = [bytes(e).decode() for e in part]

    with hr.serve(dataset, k, address, authkey=KEY, shard_policy="file"):
        read_all(read, k)
    stream = [bytes(e).decode() for e in dataset]
    for index in range(k):
        expected = [bytes(e).decode() for e in hr.auto_shard(dataset, "file", num_shards=k,
                                                             index=index)]
        assert parts[index] == expected
        assert {int(v.split(":")[0]) % k for v in parts[index]} <= {index}  # its files only
    assert Counter(v for part in parts.values() for v in part) == Counter(stream)
    assert our_segments() == []


def test_a_shard_policy_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(hr.InvalidArgumentError, match="shard_policy must be 'data' or 'file'"):
        hr.serve(hr.Dataset.range(4), 2, str(tmp_path / "s.sock"), shard_policy="rows")


# -- independence: a consumer dies, the others go on --------------------------------------


def test_a_killed_consumer_never_stalls_the_others_and_its_index_can_reconnect(
    tmp_path: Path,
) -> None:
    n = 60
    address = str(tmp_path / "s.sock")
    outs = [tmp_path / "victim.json", tmp_path / "other.json", tmp_path / "again.json"]
    with hr.serve(served_fns.ranged(n), 2, address, authkey=KEY) as server:
        victim = CONTEXT.Process(target=served_fns.consume, args=(address, 0, KEY, str(outs[0]), 3))
        victim.start()
        assert served_fns.exit_code(victim, 30) in (-signal.SIGKILL, None)
        assert read_lines(outs[0]) == [0, 2, 4]
        other = CONTEXT.Process(target=served_fns.consume, args=(address, 1, KEY, str(outs[1])))
        other.start()
        assert served_fns.exit_code(other, 30) in (0, None)
        assert read_lines(outs[1]) == list(range(1, n, 2))
        assert wait_until(lambda: 0 not in server.connected, 5)
        again = CONTEXT.Process(target=served_fns.consume, args=(address, 0, KEY, str(outs[2])))
        again.start()
        assert served_fns.exit_code(again, 30) in (0, None)
        assert read_lines(outs[2]) == list(range(0, n, 2))
    assert our_segments() == []


def test_a_consumer_that_stops_reading_does_not_stall_another(tmp_path: Path) -> None:
    address = str(tmp_path / "s.sock")
    with hr.serve(served_fns.ranged(40).prefetch(2), 2, address, authkey=KEY):
        idle = hr.connect(address, 0, authkey=KEY)
        assert served_fns.value(next(idle)) == 0  # then reads nothing more
        with hr.connect(address, 1, authkey=KEY) as busy:
            assert [served_fns.value(e) for e in busy] == list(range(1, 40, 2))
        idle.close()


# -- checkpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [3, None])
def test_a_consumer_resumes_exactly_from_its_checkpoint_on_a_new_producer(
    tmp_path: Path, seed: int | None
) -> None:
    dataset = hr.Dataset.range(50).shuffle(20, seed=seed).map(served_fns.as_array)
    first = str(tmp_path / "first.sock")
    with hr.serve(dataset, 3, first, authkey=KEY), hr.connect(first, 2, authkey=KEY) as part:
        head = [served_fns.value(next(part)) for _ in range(5)]
        state = json.loads(json.dumps(part.get_state()))  # JSON-able
        rest_here = [served_fns.value(e) for e in part]
    second = str(tmp_path / "second.sock")
    with hr.serve(dataset, 3, second, authkey=KEY):
        for _ in range(2):  # a new producer, whatever it served before
            with hr.connect(second, 0, authkey=KEY) as other:
                list(other)
        with hr.connect(second, 2, authkey=KEY, state=state) as resumed:
            assert [served_fns.value(e) for e in resumed] == rest_here
        with hr.connect(second, 1, authkey=KEY) as wrong, pytest.raises(
            hr.CheckpointError, match="consumer 2 of 3's; this is consumer 1 of 3"
        ):
            wrong.set_state(state)
    if seed is not None:
        assert head + rest_here == [served_fns.value(e) for e in dataset][2::3]


# -- the producer dies -------------------------------------------------------------------


def test_a_dead_producer_is_a_clear_error_within_seconds_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    address = str(tmp_path / "s.sock")
    producer = CONTEXT.Process(target=served_fns.produce, args=(address, 2, 100, KEY, 3))
    producer.start()
    try:
        part = hr.connect(address, 1, authkey=KEY, timeout=30)
        assert served_fns.value(next(part)) == 1
        assert served_fns.value(next(part)) == 3
        # Element 5 is stuck in the producer: kill it while this consumer waits.
        assert producer.pid is not None
        threading.Timer(0.5, os.kill, (producer.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(hr.ProducerError, match=rf"producer \(pid {producer.pid}\).*is gone"):
            next(part)
        assert time.monotonic() - started < 5
        with pytest.raises(hr.IteratorClosedError):
            next(part)
        part.close()
    finally:
        producer.kill()
        producer.join(10)
    shm.sweep_stale()
    assert our_segments(producer.pid) == []
    # A new producer takes over the stale socket.
    with hr.serve(served_fns.ranged(4), 2, address, authkey=KEY), hr.connect(
        address, 1, authkey=KEY
    ) as part:
        assert [served_fns.value(e) for e in part] == [1, 3]


# -- refusals and errors -----------------------------------------------------------------


def test_refusals_say_why(tmp_path: Path) -> None:
    address = str(tmp_path / "s.sock")
    with pytest.raises(hr.ProducerError, match=r"no headrace producer listens on .* 0\.2 s"):
        hr.connect(address, 0, authkey=KEY, timeout=0.2)
    with hr.serve(served_fns.ranged(6), 2, address, authkey=KEY):
        with pytest.raises(hr.ProducerError, match=r"refused consumer 2: consumer index 2 is not in 0\.\.1"):
            hr.connect(address, 2, authkey=KEY)
        with pytest.raises(hr.ProducerError, match="refused the connection"):
            hr.connect(address, 0, authkey=b"wrong")
        with hr.connect(address, 0, authkey=KEY), pytest.raises(
            hr.ProducerError, match="consumer 0 is already connected"
        ):
            hr.connect(address, 0, authkey=KEY, timeout=0.3)
    with pytest.raises(hr.InvalidArgumentError, match="consumers must be an integer >= 1"):
        hr.serve(served_fns.ranged(6), 0, address)


@pytest.mark.parametrize("seed", [0, 1])
def test_connects_timeout_bounds_the_wait_for_the_first_element_only(
    seed: int, tmp_path: Path
) -> None:
    """Random first-element delays on either side of ``timeout`` (with margins): a
    ProducerError within the timeout iff the delay exceeds it, never a hang; otherwise
    the consumer's exact part, a later element slower than ``timeout`` included."""
    rng = random.Random(seed)
    for case in range(2):
        timeout = rng.uniform(0.4, 0.7)
        late = case == seed  # one case of each kind per seed, in a random order
        first_delay = timeout * (rng.uniform(1.6, 3.0) if late else rng.uniform(0.0, 0.3))
        later_delay = timeout * rng.uniform(1.2, 1.5)  # (not waited for when late)
        n, k = rng.randint(3, 7), rng.randint(1, 3)
        index = rng.randrange(k)
        slow_later = rng.randrange(index + k, n) if index + k < n else None
        release = threading.Event()  # frees a producer the consumer gave up on at once

        def delayed(x: Any, index: int = index, slow_later: int | None = slow_later,
                    first_delay: float = first_delay, later_delay: float = later_delay,
                    release: threading.Event = release) -> Any:
            if int(x) == index:
                release.wait(first_delay)
            elif int(x) == slow_later:
                release.wait(later_delay)
            return served_fns.as_array(x)

        address = str(tmp_path / f"s{case}.sock")
        with hr.serve(hr.Dataset.range(n).map(delayed), k, address, authkey=KEY):
            part = hr.connect(address, index, authkey=KEY, timeout=timeout)
            start = time.monotonic()
            try:
                if late:
                    with pytest.raises(hr.ProducerError, match=(
                            rf"consumer {index} of {k}'s first element did not arrive .* "
                            rf"within {timeout:g} s .* larger connect\(\.\.\., timeout=")):
                        next(part)
                    took = time.monotonic() - start
                    assert timeout - 0.05 <= took < timeout + 1.0, (timeout, took)
                    with pytest.raises(hr.IteratorClosedError):
                        next(part)
                else:
                    assert [served_fns.value(e) for e in part] == list(range(n))[index::k]
            finally:
                release.set()
                part.close()


def test_a_pipeline_error_reaches_its_consumer_which_can_go_on(tmp_path: Path) -> None:
    def check(x: Any) -> Any:
        if int(x) == 4:
            raise ValueError("element four is bad")
        return served_fns.as_array(x)

    address = str(tmp_path / "s.sock")
    with hr.serve(hr.Dataset.range(8).map(check), 2, address, authkey=KEY), hr.connect(
        address, 0, authkey=KEY
    ) as part:
        got = [served_fns.value(next(part)), served_fns.value(next(part))]
        with pytest.raises(ValueError, match="element four is bad"):
            next(part)
        got += [served_fns.value(e) for e in part]
    assert got == [0, 2, 6]


def test_all_consumers_draw_from_one_budget_which_books_their_segments(tmp_path: Path) -> None:
    budget = 4 << 20
    dataset = served_fns.ranged(150).prefetch(8).with_options(hr.Options(memory_budget=budget))
    address = str(tmp_path / "s.sock")
    with hr.serve(dataset, 3, address, authkey=KEY) as server:
        parts = [hr.connect(address, i, authkey=KEY) for i in range(3)]
        kept = [[next(part) for _ in range(5)] for part in parts]  # 15 segments held
        segment_bytes = 15 * served_fns.WIDTH * 8
        assert server.segments.held >= segment_bytes
        assert server.budget.used >= segment_bytes
        assert server.budget.total == budget
        # A consumer that keeps everything it got takes its part past the budget: the
        # segments are booked as an overdraft, and nobody hangs.
        hoard = [list(part) for part in parts]
        assert [len(h) for h in hoard] == [45, 45, 45]
        assert server.segments.overdrawn_peak > 0
        del kept, hoard
        for part in parts:
            part.close()
        assert wait_until(lambda: server.connected == [])
        assert server.segments.held == 0 and server.budget.used == 0


@pytest.mark.parametrize("workers", ["sequential", "threads"])
def test_consumers_runs_and_segments_together_stay_within_the_one_budget(
    tmp_path: Path, workers: str
) -> None:
    """Found by the served fuzz case (tests/serving/test_served_fuzz.py): every consumer's run
    drew on the whole budget, so 3 runs plus the segments booked up to 27 MB under
    16 MiB, with no overdraft counted. The budget is now split in k + 1 parts: one per
    run (its stages' shares add up to it) and one for the segments."""
    import functools

    budget = 16 * MiB
    element = functools.partial(served_fns.sized, nbytes=128 << 10, grow_at=10)  # 1 MiB from 10
    ds = hr.Dataset.range(60)
    ds = ds.map(element) if workers == "sequential" else ds.map(element, num_parallel_calls=2)
    ds = ds.prefetch(-1).with_options(hr.Options(memory_budget=budget))
    address = str(tmp_path / "s.sock")
    excess: list[int] = []
    done = threading.Event()
    with hr.serve(ds, 3, address, authkey=KEY) as server:
        assert server.part == budget // 4 and server.segments.limit == budget - 3 * server.part

        def sample() -> None:
            while not done.is_set():
                before = server.overdrawn()  # on either side of the use (see served fuzz)
                used = server.budget.used
                excess.append(used - budget - max(before, server.overdrawn()))
                time.sleep(0.001)

        def read(index: int) -> None:
            with hr.connect(address, index, authkey=KEY) as part:
                for _ in part:
                    time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        read_all(read, 3, seconds=60)
        done.set()
        sampler.join()
    assert len(excess) > 10 and max(excess) <= 0, max(excess)


def test_a_refused_run_returns_every_byte_it_booked(tmp_path: Path) -> None:
    """Found by the served fuzz case: a prefetch refused (MemoryBudgetError) an element
    a parallel map had booked, and dropped it without returning its booking: 1 MiB per
    consumer stayed booked on the producer's budget after every run closed. A refused
    element's booking now comes back (in prefetch, and in any refused move)."""
    import functools

    element = functools.partial(served_fns.sized, nbytes=128 << 10, grow_at=0)  # 1 MiB
    ds = hr.Dataset.range(1).map(element, num_parallel_calls=2).prefetch(1)
    address = str(tmp_path / "s.sock")
    with hr.serve(ds.with_options(hr.Options(memory_budget=8 * MiB)), 3, address,
                  authkey=KEY) as server:  # parts of 2 MiB: map + prefetch need more
        for index in range(3):
            with hr.connect(address, index, authkey=KEY) as part, pytest.raises(
                hr.MemoryBudgetError, match=r"stage 'prefetch' needs 1\.0 MiB at once"
            ):
                list(part)
        assert wait_until(lambda: server.connected == [])
        assert server.budget.used == 0 and server.segments.held == 0


def test_a_file_sharded_consumer_resumes_from_its_checkpoint_and_refuses_a_data_one(
    tmp_path: Path,
) -> None:
    """A part under ``shard_policy="file"`` is its own pipeline (its files only): its
    checkpoint resumes on a new producer with the same policy, and a state taken under
    the other policy is refused by its fingerprint, not replayed into the wrong part."""
    for f in range(4):
        write_tfrecord(tmp_path / f"part-{f}.tfrecord", [f"{f}:{r}".encode() for r in range(9)])
    dataset = hr.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False).interleave(
        hr.TFRecordDataset, cycle_length=2)
    first, second = str(tmp_path / "first.sock"), str(tmp_path / "second.sock")
    with hr.serve(dataset, 2, first, authkey=KEY, shard_policy="file"), hr.connect(
        first, 1, authkey=KEY
    ) as part:
        head = [bytes(next(part)) for _ in range(4)]
        state = json.loads(json.dumps(part.get_state()))
        rest_here = [bytes(e) for e in part]
    assert {v.split(b":")[0] for v in head + rest_here} == {b"1", b"3"}  # its files only
    with hr.serve(dataset, 2, second, authkey=KEY, shard_policy="file"), hr.connect(
        second, 1, authkey=KEY, state=state
    ) as resumed:
        assert [bytes(e) for e in resumed] == rest_here
    third = str(tmp_path / "third.sock")
    with hr.serve(dataset, 2, third, authkey=KEY), hr.connect(third, 1, authkey=KEY) as other, \
            pytest.raises(hr.CheckpointError):
        other.set_state(state)


def test_a_refused_checkpoint_reaches_the_consumer_and_serving_goes_on(tmp_path: Path) -> None:
    """A producer whose checkpoint is refused (an unbatch half-way through rows a map gave
    out of order) sends the CheckpointError to the consumer that asked, and serves on."""
    dataset = hr.Dataset.range(40).map(
        served_fns.as_array, num_parallel_calls=3, deterministic=False).batch(4).unbatch()
    address = str(tmp_path / "s.sock")
    with hr.serve(dataset, 1, address, authkey=KEY), hr.connect(address, 0, authkey=KEY) as part:
        got = [served_fns.value(next(part)) for _ in range(2)]
        with pytest.raises(hr.CheckpointError, match="runs out of order"):
            part.get_state()
        got += [served_fns.value(e) for e in part]
    assert sorted(got) == list(range(40))
