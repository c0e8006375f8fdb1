"""interleave(..., workers="processes"): inner pipelines in worker processes.

Order, errors and checkpoints are checked against the sequential interleave
(itself checked against tf.data in test_interleave_tf.py) over generated
shapes; faults (an error in an inner pipeline, a killed worker) and shutdown
against what a user relies on: the element's place, a killed worker replaced
with nothing lost, no worker and no segment left.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import process_fns
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from segments import own_segments
from transform_cases import positions

import headrace as hr
from headrace._workers.memory import worker_memory
from headrace.core.run import join_abandoned
from headrace.io.tfrecord.writer import write_tfrecord

MiB = 1 << 20


def outputs(iterator: Any, limit: int = 10_000) -> list[Any]:
    """Every position: the element, or the error's message, in order."""
    return positions(iterator, process_fns.Failing, limit)


def interleaved(
    inputs: int, sizes: tuple[int, ...], bad: int, cycle: int, block: int, workers: int | None
) -> hr.Dataset:
    fn = functools.partial(process_fns.shard_dataset, sizes=sizes, bad=bad)
    extra: dict[str, Any] = {}
    if workers is not None:
        extra = {"num_parallel_calls": workers, "workers": "processes"}
    return hr.Dataset.range(inputs).interleave(fn, cycle_length=cycle, block_length=block, **extra)


shapes = {
    "inputs": st.integers(0, 9),
    "sizes": st.lists(st.integers(0, 90), min_size=1, max_size=4).map(tuple),
    "bad": st.integers(-1, 400),
    "cycle": st.integers(1, 4),
    "block": st.integers(1, 3),
    "workers": st.integers(1, 2),
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 elements: slots cross many chunks, and chunks move between workers."""
    from headrace._transforms import process_interleave

    monkeypatch.setattr(process_interleave, "CHUNK_ELEMENTS", 3)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(**shapes)
def test_same_elements_errors_and_order_as_the_sequential_interleave(
    inputs: int, sizes: tuple[int, ...], bad: int, cycle: int, block: int, workers: int
) -> None:
    with iter(interleaved(inputs, sizes, bad, cycle, block, None)) as sequential:
        expected = outputs(sequential)
    with iter(interleaved(inputs, sizes, bad, cycle, block, workers)) as remote:
        assert outputs(remote) == expected
    assert own_segments() == []


@settings(max_examples=3, deadline=None, derandomize=True)
@given(**shapes, at=st.floats(0, 1))
def test_checkpoints_resume_exactly(
    inputs: int, sizes: tuple[int, ...], bad: int, cycle: int, block: int, workers: int,
    at: float,
) -> None:
    ds = interleaved(inputs, sizes, bad, cycle, block, workers)
    with iter(ds) as reference:
        everything = outputs(reference)
    step = int(at * len(everything))
    with iter(ds) as original:
        assert outputs(original, step) == everything[:step]
        state = json.loads(json.dumps(original.get_state()))
    with iter(ds) as restored:
        restored.set_state(state)
        assert outputs(restored) == everything[step:]


@pytest.mark.parametrize("seed", range(4))
def test_a_dataset_that_cannot_be_built_takes_no_visit_as_in_the_sequential_interleave(
    seed: int,
) -> None:
    """The interleave function raising for some inputs (their datasets are built in the
    worker): the error in its place, then the sequential order exactly (the failed open
    takes no visit of the cycle), with ignore_errors too, and resumed from anywhere.
    Before, a failed build took its slot's visit: same elements, another order."""
    rng = random.Random(seed)
    inputs, cycle, block, workers = rng.randint(4, 10), rng.randint(2, 4), rng.randint(1, 3), 2
    # unequal inner sizes: slots end at different visits (equal ones hid the order)
    sizes = tuple(rng.randint(1, 12) for _ in range(rng.randint(2, 4)))
    unbuilt = tuple(rng.sample(range(inputs), rng.randint(1, 3)))
    bad = rng.choice([-1, rng.randrange(inputs) * 100 + rng.randint(0, 5)])
    at = [rng.random(), rng.random()]

    def build(parallel: int | None) -> hr.Dataset:
        fn = functools.partial(process_fns.shard_or_no_dataset, sizes=sizes, bad=bad,
                               unbuilt=unbuilt)
        extra: dict[str, Any] = {}
        if parallel is not None:
            extra = {"num_parallel_calls": parallel, "workers": "processes"}
        return hr.Dataset.range(inputs).interleave(fn, cycle_length=cycle, block_length=block,
                                                   **extra)

    with iter(build(None)) as sequential:
        expected = outputs(sequential)
    with iter(build(None).ignore_errors()) as sequential:
        kept = [int(x) for x in sequential]
    with iter(build(workers)) as remote:
        assert outputs(remote) == expected
    with iter(build(workers).ignore_errors()) as remote:
        assert [int(x) for x in remote] == kept
    for where in at:
        step = int(where * len(expected))
        with iter(build(workers)) as original:
            assert outputs(original, step) == expected[:step]
            state = json.loads(json.dumps(original.get_state()))
        with iter(build(workers)) as restored:
            restored.set_state(state)
            assert outputs(restored) == expected[step:]
    assert own_segments() == []


def test_an_error_in_an_inner_pipeline_has_the_workers_traceback_and_iteration_goes_on() -> None:
    ds = interleaved(2, (4,), 101, 2, 1, 2)  # element 101 of input 1 fails
    with iter(ds) as iterator:
        assert [int(next(iterator)) for _ in range(3)] == [0, 100, 1]
        with pytest.raises(process_fns.Failing, match="bad element 101") as caught:
            next(iterator)
        assert caught.value.__cause__ is None  # the user's chain, as on threads
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "its traceback there" in notes and "fail_on_value" in notes
        # as in tf.data's sequential interleave, the error is not an element of the block:
        # the same slot goes on
        assert [int(x) for x in iterator] == [102, 2, 103, 3]


def test_a_checkpoint_of_a_threaded_interleave_is_refused_clearly() -> None:
    threaded = interleaved(3, (4,), -1, 2, 1, None)
    with iter(threaded) as iterator:
        next(iterator)
        state = iterator.get_state()
    with iter(interleaved(3, (4,), -1, 2, 1, 2)) as remote, pytest.raises(hr.CheckpointError):
        remote.set_state(state)


def test_arrays_come_back_booked_and_everything_is_returned_at_close() -> None:
    ds = (
        hr.Dataset.range(6)
        .interleave(process_fns.shard_arrays, cycle_length=3, num_parallel_calls=2,
                    workers="processes")
        .with_options(hr.Options(memory_budget="32MiB"))
    )
    with iter(ds) as iterator:
        got = [row.copy() for row in iterator]
        stats = iterator.stats()
        budget = iterator.context.budget
    assert len(got) == 120 and stats.budget_peak <= 32 * MiB
    # shard i's rows, in the interleave's order: 0, 1, 2 alternate, then 3, 4, 5
    assert got[0][0] == 0 and got[1][0] == 1e6 and got[2][0] == 2e6 and got[60][0] == 3e6
    (choice,) = stats.workers
    assert choice.kind == "processes" and len(choice.processes) == 2
    assert budget.used == 0
    gc.collect()
    assert join_abandoned()  # also an earlier test's iterator that this collection closed
    assert own_segments() == []


def test_a_killed_worker_is_replaced_and_its_slots_go_on() -> None:
    """A worker killed from outside: its successor is sent the slots' requests again
    (a follow request finds no iterator there and the slot asks again with its state),
    so the stream is the sequential interleave's, whole and in order."""
    fn = functools.partial(process_fns.shard_dataset, sizes=(600,))
    ds = hr.Dataset.range(4).interleave(fn, cycle_length=2, num_parallel_calls=2,
                                        workers="processes")
    expected = [int(x) for x in hr.Dataset.range(4).interleave(fn, cycle_length=2)]
    iterator = iter(ds)
    got = [int(next(iterator))]
    (choice,) = iterator.stats().workers
    pids = [p.pid for p in choice.processes]
    with pytest.warns(hr.HeadraceWarning, match=rf"worker process {pids[0]} killed by SIGKILL"):
        os.kill(pids[0], signal.SIGKILL)
        got += [int(x) for x in iterator]
    assert got == expected
    (choice,) = iterator.stats().workers
    pids += [p.pid for p in choice.processes]
    iterator.close()
    deadline = time.monotonic() + 5
    while any(worker_memory(pid) is not None for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(worker_memory(pid) is None for pid in pids)
    gc.collect()
    assert join_abandoned()  # also an earlier test's iterator that this collection closed
    assert own_segments() == []


def test_the_function_must_pickle_and_auto_is_refused() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="cannot be sent to worker processes"):
        hr.Dataset.range(2).interleave(
            lambda i: hr.Dataset.range(3), cycle_length=1, num_parallel_calls=1,
            workers="processes",
        )
    with pytest.raises(hr.InvalidArgumentError, match="'threads' or 'processes'"):
        hr.Dataset.range(2).interleave(
            process_fns.shard_dataset, cycle_length=1, num_parallel_calls=1, workers="auto"
        )
    with pytest.raises(hr.InvalidArgumentError, match="needs num_parallel_calls"):
        hr.Dataset.range(2).interleave(process_fns.shard_dataset, cycle_length=1,
                                       workers="processes")


def test_shards_on_disk_read_in_workers_match_threads(tmp_path: Path) -> None:
    """TFRecord shards opened and parsed in the workers (the case the stage is for)."""
    paths = []
    for shard in range(4):
        path = tmp_path / f"part-{shard}.tfrecord"
        write_tfrecord(path, [f"{shard}:{i}".encode() for i in range(50)])
        paths.append(str(path))
    files = hr.Dataset.from_tensor_slices(np.array(paths, dtype=object))
    expected = [bytes(r) for r in files.interleave(hr.TFRecordDataset, cycle_length=3)]
    got = [
        bytes(r)
        for r in files.interleave(
            hr.TFRecordDataset, cycle_length=3, num_parallel_calls=2, workers="processes"
        )
    ]
    assert got == expected and len(got) == 200


# -- batches of parsed Examples read in the workers (benchmark 2's pipeline) -------------


def example_shards(directory: Path, counts: list[int]) -> list[str]:
    """TFRecord shards of Examples; record j of shard i has y = i * 1000 + j."""
    from headrace.io.example import serialize_example

    paths = []
    for shard, count in enumerate(counts):
        path = directory / f"ex-{shard}.tfrecord"
        write_tfrecord(path, [
            serialize_example({
                "x": np.full(4, shard + j / 100, np.float32),
                "y": shard * 1000 + j,
                "id": b"r-%d-%d\x00" % (shard, j) * (j % 3),  # empty, NULs, varied lengths
            })
            for j in range(count)
        ])
        paths.append(str(path))
    return paths


def parsed(paths: list[str], cycle: int, block: int, batch: int, workers: int | None) -> hr.Dataset:
    extra: dict[str, Any] = {}
    if workers is not None:
        extra = {"num_parallel_calls": workers, "workers": "processes"}
    files = hr.Dataset.from_tensor_slices(np.array(paths, dtype=object))
    fn = functools.partial(process_fns.example_batches, batch=batch)
    return files.interleave(fn, cycle_length=cycle, block_length=block, **extra)


def batches(iterator: Any, limit: int = 10_000) -> list[tuple[list[float], list[int], list[bytes]]]:
    got = []
    for batch in iterator:
        assert batch["id"].dtype == object and all(type(b) is bytes for b in batch["id"])
        got.append((batch["x"].tolist(), batch["y"].tolist(), batch["id"].tolist()))
        if len(got) == limit:
            break
    return got


example_shapes = {
    "counts": st.lists(st.integers(0, 40), min_size=1, max_size=6),
    "cycle": st.integers(1, 3),
    "block": st.integers(1, 2),
    "batch": st.integers(1, 9),
    "workers": st.integers(1, 2),
}


@settings(max_examples=6, deadline=None, derandomize=True)
@given(**example_shapes, at=st.floats(0, 1))
def test_parsed_example_batches_from_workers_equal_the_in_process_pipeline_and_resume(
    tmp_path_factory: pytest.TempPathFactory, counts: list[int], cycle: int, block: int,
    batch: int, workers: int, at: float,
) -> None:
    paths = example_shards(tmp_path_factory.mktemp("ex"), counts)
    with iter(parsed(paths, cycle, block, batch, None)) as local:
        expected = batches(local)
    remote = parsed(paths, cycle, block, batch, min(workers, cycle))
    with iter(remote) as iterator:
        assert batches(iterator) == expected
    step = int(at * len(expected))
    with iter(remote) as original:
        assert batches(original, step) == expected[:step] if step else True
        state = json.loads(json.dumps(original.get_state()))
    with iter(remote) as restored:
        restored.set_state(state)
        assert batches(restored) == expected[step:]
    assert own_segments() == []


def test_follow_requests_that_find_no_iterator_are_asked_again_with_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker keeping one iterator for three slots loses its place for every queued
    request: each is answered 'lost' and asked again from its state — same batches."""
    from headrace._transforms import process_interleave

    monkeypatch.setattr(process_interleave, "kept_iterators", lambda node: 1)
    paths = example_shards(tmp_path, [30, 25, 0, 31, 12])
    with iter(parsed(paths, 3, 1, 4, None)) as local:
        expected = batches(local)
    with iter(parsed(paths, 3, 1, 4, 1)) as remote:
        assert batches(remote) == expected


def test_slot_reader_continues_only_at_the_exact_position() -> None:
    from headrace._options import Options
    from headrace._transforms.process_interleave import SlotReader

    node = interleaved(1, (7,), -1, 1, 1, 1).node
    reader = SlotReader(node, Options(), 1 << 20, 2)

    def ask(position: tuple[int, int], state: Any, follow: bool) -> Any:
        out: list[Any] = []
        count, after, ended, error, lost, _ = reader(
            (1, position, 0, state, 0, 3, 1 << 20, 0, [], follow, False),
            lambda element, left: out.append(element))
        assert count == len(out)
        return out, after, ended, error, lost

    first, state, ended, error, lost = ask((0, 0), None, False)
    assert [int(x) for x in first] == [0, 1, 2] and not ended and error is None and not lost
    assert ask((0, 2), None, True) == ([], None, False, None, True)  # not where it stands
    second, _, _, _, lost = ask((0, 1), None, True)  # exactly where it stands
    assert [int(x) for x in second] == [3, 4, 5] and not lost
    third, after, ended, _, _ = ask((1, 0), state, False)  # a restore: rebuilt from state
    assert [int(x) for x in third] == [3, 4, 5] and after is not None and not ended
    last, _, ended, _, _ = ask((1, 1), None, True)
    assert [int(x) for x in last] == [6] and ended
    assert ask((1, 2), None, True)[4]  # ended: nothing kept


def test_slot_reader_releases_what_it_skips_on_a_restore() -> None:
    """A restore rebuilds the slot's iterator and skips the elements handed out since
    its state: their bookings go back to the worker's budget. Kept, a prefetch inside
    the slot (1 MiB elements, a 4 MiB share) held the skipped elements' bytes, and past
    the share it waited for room for good: a hang, not an error."""
    from headrace._options import Options
    from headrace._transforms.process_interleave import SlotReader

    def inner(k: Any) -> hr.Dataset:
        return hr.Dataset.range(12).map(lambda j: np.full(1 << 17, j, np.int64)).prefetch(1)

    node = hr.Dataset.range(1).interleave(inner, cycle_length=1).node
    reader = SlotReader(node, Options(), 4 << 20, 2)
    out: list[Any] = []
    answer = reader((1, (0, 0), 0, None, 8, 2, 8 << 20, 0, [], False, True),
                    lambda element, left: out.append(int(element[0])))
    assert out == [8, 9] and not answer[4]
    (_, budget, _), = reader.kept.values()
    assert budget.used <= 2 << 20  # the prefetched element at most, not 8 skipped ones


def test_slot_reader_stops_before_an_element_its_booking_cannot_hold() -> None:
    """Elements of 1 KiB then 64 KiB: once the worker has read a 64 KiB one, a chunk
    stops before the element that would take it past its booking, and a chunk booked
    below 64 KiB is answered 'lost' unread unless the consumer waits for it (forced)."""
    from headrace._options import Options
    from headrace._transforms.process_interleave import SlotReader

    def inner(k: Any) -> hr.Dataset:
        return hr.Dataset.range(8).map(
            lambda j: np.zeros(128 if int(j) < 2 else 8192, np.int64))

    node = hr.Dataset.range(1).interleave(inner, cycle_length=1).node
    reader = SlotReader(node, Options(), 1 << 20, 2)
    out: list[Any] = []

    def ask(position: tuple[int, int], state: Any, max_bytes: int, forced: bool) -> Any:
        out.clear()
        answer = reader((1, position, 0, state, 0, 64, max_bytes, 0, [], False, forced),
                        lambda element, left: out.append(element.nbytes))
        return answer, list(out)

    # nothing large read yet: the 1 KiB elements, then one 64 KiB past the 8 KiB booking
    (count, state, _, _, lost, largest), sizes = ask((0, 0), None, 8 << 10, False)
    assert sizes == [1024, 1024, 65536] and not lost and largest >= 65536
    # booked at 8 KiB again: answered lost, nothing read
    (count, _, _, _, lost, _), sizes = ask((0, 1), state, 8 << 10, False)
    assert lost and count == 0 and sizes == []
    # forced at 8 KiB: one element, no more
    (count, state, _, _, lost, _), sizes = ask((0, 1), state, 8 << 10, True)
    assert not lost and sizes == [65536]
    # booked for two large elements: exactly two, none past the booking
    (count, _, _, _, lost, _), sizes = ask((0, 2), state, 2 * largest + 100, False)
    assert not lost and sizes == [65536, 65536]


def test_parsed_batches_stay_in_the_budget_and_reuse_their_segments(tmp_path: Path) -> None:
    """Many chunks through a 16 MiB budget: the peak booked stays inside it, a handful of
    result segments per worker serve the whole stream, and close returns everything."""
    from headrace._transforms import process_interleave

    paths = example_shards(tmp_path, [2000] * 6)  # batches' id columns go by segment
    ds = parsed(paths, 2, 1, 300, 2).with_options(hr.Options(memory_budget="16MiB"))
    with iter(ds) as iterator:
        got = batches(iterator)
        stats = iterator.stats()
        budget = iterator.context.budget
        (pool,) = [s.processes for s in iterator.stages() if getattr(s, "processes", None)]
        chunks = pool.traffic.chunks
        opened = [maps.opened for maps in pool.maps.values()]
    assert sum(len(b[1]) for b in got) == 12_000
    assert stats.budget_peak <= 16 * MiB
    # every chunk came back in a segment, but few segments were ever made (a chunk's
    # elements are packed as they are read, so one may end in a second segment)
    assert chunks >= 20 and all(0 < n <= 3 + process_interleave.READ_AHEAD * 3 for n in opened), (
        chunks, opened)
    assert budget.used == 0
    gc.collect()
    assert join_abandoned()  # also an earlier test's iterator that this collection closed
    assert own_segments() == []


def test_slots_one_after_another_reuse_the_same_few_segments() -> None:
    """Eight inner datasets of 40 KB rows, two slots on two workers: each worker's slots
    pass their chunks through one set of segments, READ_AHEAD + 3 of them (the chunks
    asked for, the one handed out, the one whose last row is still held). With two kept
    idle, each worker made a fresh segment for one chunk in ten (67-113 per worker here,
    and ~40% of benchmark 2's chunks)."""
    from headrace._transforms import process_interleave

    fn = functools.partial(process_fns.shard_arrays, rows=120)
    ds = hr.Dataset.range(8).interleave(fn, cycle_length=2, num_parallel_calls=2, workers="processes")
    with iter(ds.with_options(hr.Options(memory_budget="32MiB"))) as iterator:
        rows = [float(row[0]) for row in iterator]
        stats = iterator.stats()
        (pool,) = [s.processes for s in iterator.stages() if getattr(s, "processes", None)]
        chunks, opened = pool.traffic.chunks, [maps.opened for maps in pool.maps.values()]
    assert rows[:4] == [0.0, 1e6, 5000.0, 1e6 + 5000.0] and len(rows) == 960
    assert stats.budget_peak <= 32 * MiB
    assert chunks >= 100 and all(0 < n <= process_interleave.READ_AHEAD + 3 for n in opened), (
        chunks, opened)
    gc.collect()
    assert join_abandoned()  # also an earlier test's iterator that this collection closed
    assert own_segments() == []


@pytest.mark.parametrize("cycle", [1, 3])
def test_autotune_starts_a_worker_per_cpu_but_no_more_than_the_slots(cycle: int) -> None:
    from headrace._transforms.process_map import cpu_count

    ds = hr.Dataset.range(4).interleave(
        process_fns.shard_dataset, cycle_length=cycle, num_parallel_calls=hr.AUTOTUNE,
        workers="processes",
    )
    with iter(ds) as iterator:
        got = [int(x) for x in iterator]
        (choice,) = iterator.stats().workers
    with iter(hr.Dataset.range(4).interleave(process_fns.shard_dataset, cycle_length=cycle)) as local:
        assert got == [int(x) for x in local]
    assert choice.count == min(cpu_count(), cycle)


def _interleave_stage(iterator: Any) -> Any:
    (stage,) = [s for s in iterator.stages() if hasattr(s, "ahead")]
    return stage


def test_the_next_inputs_slot_opens_ahead_and_a_checkpoint_then_reopens_it() -> None:
    ds = interleaved(4, (6,), -1, 1, 1, 1)  # one slot: inputs strictly one after another
    with iter(ds) as reference:
        everything = outputs(reference)
    with iter(ds) as iterator:
        stage = _interleave_stage(iterator)
        got = []
        while not stage.ahead:  # until the first slot's last chunk is in
            got.append(int(next(iterator)))
        assert len(got) < 6 and stage.ahead[0].slot is not None  # opened before its turn
        taken = len(got)
        state = json.loads(json.dumps(iterator.get_state()))
        got += outputs(iterator)
    assert got == everything
    with iter(ds) as restored:
        restored.set_state(state)
        assert outputs(restored) == everything[taken:]


def test_an_input_error_met_while_opening_ahead_is_raised_in_its_turn() -> None:
    def build(workers: int | None) -> hr.Dataset:
        inputs = hr.Dataset.range(6).map(functools.partial(process_fns.fail_on_value, 2))
        fn = functools.partial(process_fns.shard_dataset, sizes=(4, 1, 6))
        extra: dict[str, Any] = {}
        if workers is not None:
            extra = {"num_parallel_calls": workers, "workers": "processes"}
        return inputs.interleave(fn, cycle_length=2, **extra)

    with iter(build(None)) as sequential:
        expected = outputs(sequential)
    assert ("error", "bad element 2") in expected
    with iter(build(2)) as remote:
        assert outputs(remote) == expected


def test_a_process_map_inside_a_slots_pipeline_runs_in_the_worker() -> None:
    """Found by the served-consumer fuzz case: a slot's inner pipeline holding a map on
    processes, unpickled in a worker that had never imported the process map's module,
    failed there ("headrace._transforms.process_map not imported"). The node now pickles
    as a call into that module, so unpickling it registers the process map; and since a
    worker (daemonic) may not start processes, the map runs its calls on threads there."""
    inner = hr.Dataset.range(12).map(process_fns.square, num_parallel_calls=2,
                                      workers="processes")
    halves = functools.partial(process_fns.half_of, inner)
    sequential = hr.Dataset.range(2).interleave(halves, cycle_length=2)
    remote = hr.Dataset.range(2).interleave(halves, cycle_length=2, num_parallel_calls=2,
                                            workers="processes")
    expected = [int(x) for x in sequential]
    assert expected == [0, 1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 121]
    with iter(remote) as iterator:
        assert [int(x) for x in iterator] == expected


def test_the_recipe_before_a_process_interleave_need_not_pickle() -> None:
    """Budget fuzzer seeds 200003, 200008, 200037, ... (an interleave on processes after a
    from_generator of a local generator, or a map of a lambda): the workers were sent the
    whole interleave node, its input recipe included, which they never read, so a recipe
    that could not pickle was refused. Only the interleave function travels now."""

    def numbers() -> Any:
        yield from range(6)

    upstream = hr.Dataset.from_generator(
        numbers, output_signature=hr.TensorSpec((), np.int64)
    ).map(lambda x: x * 2)
    ds = upstream.interleave(
        functools.partial(process_fns.shard_dataset, sizes=(2,)), cycle_length=2,
        num_parallel_calls=2, workers="processes",
    )
    expected = [int(x) for x in upstream.interleave(
        functools.partial(process_fns.shard_dataset, sizes=(2,)), cycle_length=2)]
    assert expected[:4] == [0, 200, 1, 201]
    with iter(ds) as iterator:
        assert [int(x) for x in iterator] == expected


@pytest.mark.parametrize("bad", [100, 103, 106])
def test_an_element_that_cannot_be_sent_is_its_error_in_place(bad: int) -> None:
    """An inner element that cannot be pickled is a WorkerError at its position; the
    slot goes on after it. Oracle: the in-process interleave whose inner pipeline
    raises at that element."""

    def drain(ds: hr.Dataset) -> list[Any]:
        got: list[Any] = []
        with iter(ds) as iterator:
            while True:
                try:
                    got.append(int(next(iterator)))
                except StopIteration:
                    return got
                except Exception as error:
                    got.append(type(error).__name__)

    remote = hr.Dataset.range(3).interleave(
        functools.partial(process_fns.shard_unpicklable_at, bad), cycle_length=2,
        block_length=2, num_parallel_calls=2, workers="processes")
    local = hr.Dataset.range(3).interleave(
        functools.partial(process_fns.shard_dataset, sizes=(7,), bad=bad), cycle_length=2,
        block_length=2)
    expected = drain(local)
    assert "Failing" in expected and len(expected) == 21
    assert drain(remote) == ["WorkerError" if x == "Failing" else x for x in expected]


def test_a_refusal_in_a_worker_says_whose_budget_it_names(tmp_path: Path) -> None:
    # The inner pipeline's refusal names its own budget (half a slot's part), not the
    # user's 16 MiB: the note says so and what to change.
    paths = [str(tmp_path / f"{shard}.tfrecord") for shard in range(4)]
    for path in paths:
        write_tfrecord(path, [b"x" * ((3 << 20) if row == 2 else 100) for row in range(4)])
    files = hr.Dataset.from_tensor_slices(paths)
    ds = files.interleave(hr.TFRecordDataset, cycle_length=4, num_parallel_calls=2,
                          workers="processes").with_options(hr.Options(memory_budget="16MiB"))
    with iter(ds) as iterator:
        assert [len(next(iterator)) for _ in range(8)] == [100] * 8
        with pytest.raises(hr.MemoryBudgetError, match=r"memory budget of 2\.0 MiB") as info:
            next(iterator)
    note = info.value.__notes__[-1]
    assert "the budget above is a worker's" in note and "under 2.0 MiB" in note
    assert "lower cycle_length" in note
