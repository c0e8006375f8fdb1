"""The in-memory cache outlives its iterator, as tf.data's does: every later iterator of
the dataset (Keras makes one per epoch) reads it, never the source; its bytes stay booked
(on the default budget, and on each run with its own budget that reads it) until the
dataset is collected; restored states read it only when their iterator wrote it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.persist.test_cache import Counted, ids, spill_dirs

import headrace as hr
from headrace._memory.budget import MemoryBudget
from headrace.core import run as run_module
from headrace.core.state import seal

MiB = 1 << 20


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def small_default_budget(monkeypatch: pytest.MonkeyPatch) -> MemoryBudget:
    budget = MemoryBudget(16 * MiB)
    monkeypatch.setattr(run_module, "_default_budget", budget)
    return budget


def test_each_new_iterator_reads_the_kept_cache_never_the_source() -> None:
    source = Counted(20)
    ds = source.dataset().cache()
    for _ in range(3):
        assert ids(iter(ds)) == list(range(20))
    assert source.produced == 20
    # datasets built on it share it (tf.data: the cache belongs to the cache dataset)
    assert ids(ds.map(lambda e: e).take(5)) == list(range(5))
    assert ids(ds.with_options(hr.Options(memory_budget="8MiB"))) == list(range(20))
    assert source.produced == 20


def test_a_partial_iterator_keeps_nothing_the_next_full_one_writes_it() -> None:
    source = Counted(10)
    ds = source.dataset().cache()
    with iter(ds) as iterator:
        next(iterator)
        next(iterator)
    assert source.produced == 2
    assert ids(ds) == list(range(10)) and source.produced == 12
    assert ids(ds) == list(range(10)) and source.produced == 12


def test_concurrent_writers_each_read_the_source_the_first_complete_cache_is_kept() -> None:
    source = Counted(6)
    ds = source.dataset().cache()
    first, second = iter(ds), iter(ds)
    assert ids(first) == list(range(6)) and ids(second) == list(range(6))
    assert source.produced == 12  # as tf.data: both wrote (see test_cache_tf)
    assert ids(ds) == list(range(6)) and source.produced == 12


def test_kept_cache_is_booked_on_the_default_budget_until_the_dataset_is_collected(
    small_default_budget: MemoryBudget,
) -> None:
    source = Counted(40, nbytes=1024)
    ds = source.dataset().cache()
    assert small_default_budget.used == 0
    with iter(ds) as iterator:
        assert len(ids(iterator)) == 40
        run_cache = next(a for a in iterator.context.budget.accounts if a.name == "cache")
        assert run_cache.held == 0  # moved to the default budget's "kept" booking
    kept = small_default_budget.used
    assert 40 * 1024 < kept < 40 * 1024 * 2
    with iter(ds) as iterator:  # a run drawing from the default budget: booked once
        assert len(ids(iterator)) == 40
        assert small_default_budget.used == kept
    del ds, iterator
    gc.collect()
    assert run_module.join_abandoned()
    assert small_default_budget.used == 0


def test_a_run_with_its_own_budget_books_the_kept_cache_on_its_share() -> None:
    source = Counted(40, nbytes=1024)
    ds = source.dataset().cache().repeat(3).with_options(hr.Options(memory_budget="4MiB"))
    for _ in range(2):
        with iter(ds) as iterator:
            assert ids(iterator) == list(range(40)) * 3
            account = next(a for a in iterator.context.budget.accounts if a.name == "cache")
            assert 40 * 1024 < account.held <= account.limit  # the kept cache, once
            assert account.breaches == 0
            assert iterator.context.budget.peak <= 4 * MiB
    assert source.produced == 40
    assert account.held == 0  # returned with the run


def test_a_kept_cache_larger_than_a_later_runs_share_resplits_or_names_the_stage() -> None:
    source = Counted(200, nbytes=8192)  # ~1.7 MB in memory under a 16 MiB budget
    ds = source.dataset().cache()
    assert len(ids(ds.with_options(hr.Options(memory_budget="16MiB")))) == 200
    with pytest.raises(hr.MemoryBudgetError, match="kept in-memory cache"):
        ids(ds.with_options(hr.Options(memory_budget="1MiB")))
    assert len(ids(ds.map(lambda e: e).with_options(hr.Options(memory_budget="4MiB")))) == 200
    assert source.produced == 200


def test_the_spill_file_is_kept_with_the_dataset_and_removed_with_it() -> None:
    source = Counted(100, nbytes=64 << 10)  # ~6.4 MB under a 2 MiB budget: spills
    ds = source.dataset().cache().with_options(hr.Options(memory_budget="2MiB"))
    before = spill_dirs()
    assert ids(ds) == list(range(100))
    (directory,) = spill_dirs() - before
    for _ in range(2):
        assert ids(ds) == list(range(100))
    assert source.produced == 100
    del ds
    gc.collect()
    assert run_module.join_abandoned()
    assert not os.path.exists(directory)


def test_restoring_reads_the_kept_cache_only_if_its_iterator_wrote_it() -> None:
    """A reshuffling shuffle above the cache: what the cache holds depends on which
    iterator wrote it, and a restored state must read exactly what it was reading."""

    def pipeline(source: Counted) -> hr.Dataset:
        return source.dataset().shuffle(8, seed=5).cache()

    source = Counted(12)
    ds = pipeline(source)
    first = ids(ds)  # iterator 0 writes the kept cache
    with iter(ds) as iterator:  # iterator 1 reads it
        head = ids(next(iterator) for _ in range(5))
        state = iterator.get_state()
        rest = ids(iterator)
    assert head + rest == first and source.produced == 12
    assert state["state"]["writer_iteration"] == 0 and state["iteration"] == 1
    source.produced = 0
    with iter(pipeline(source)) as restored:  # a new process: rebuilt as iterator 0 read it
        restored.set_state(json.loads(json.dumps(state)))
        assert ids(restored) == rest
    assert source.produced == 12
    other_ds = pipeline(source)
    assert ids(other_ds) == first  # seeded: the same data and order
    # a cache kept from another iterator is not what this state read: rebuild instead
    with iter(other_ds) as mismatched:
        bad = json.loads(json.dumps(state))
        bad["state"]["writer_iteration"] = 3
        mismatched.set_state(seal(bad))  # (sealed again: the field's meaning is tested)
        assert len(ids(mismatched)) == 7
    assert source.produced == 36


def _two_at_once(ds: hr.Dataset) -> list[list[int]]:
    """Two iterators of ``ds`` read in lockstep."""
    got: list[list[int]] = [[], []]
    with iter(ds) as first, iter(ds) as second:
        for one, other in zip(first, second, strict=True):
            got[0].append(int(one["i"]))
            got[1].append(int(other["i"]))
    return got


def _partial(ds: hr.Dataset, count: int) -> list[int]:
    """The first ``count`` elements of a new iterator, which is then closed."""
    with iter(ds) as iterator:
        return ids(next(iterator) for _ in range(count))


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(0, 30),
    nbytes=st.sampled_from([16, 4096, 96 << 10]),
    operations=st.lists(
        st.one_of(st.just("full"), st.integers(0, 35), st.just("two_at_once")),
        min_size=1,
        max_size=6,
    ),
)
def test_random_sequences_of_iterators_follow_tf_datas_rules(
    count: int, nbytes: int, operations: list[Any]
) -> None:
    """Full runs, partial runs (k elements, then closed) and two concurrent runs, in any
    order: the values are always the source's; the source is read only while no
    complete cache is kept; nothing stays booked and no file stays once it is collected."""
    source = Counted(count, nbytes)
    budget = hr.Options(memory_budget="1MiB")
    ds = source.dataset().cache().with_options(budget)
    before = spill_dirs()
    kept, expected_reads = False, 0
    for operation in operations:
        if operation == "full":
            assert ids(ds) == list(range(count))
            expected_reads += 0 if kept else count
            kept = True
        elif operation == "two_at_once":
            assert _two_at_once(ds) == [list(range(count))] * 2
            expected_reads += 0 if kept else 2 * count
            kept = True
        else:
            taken = min(operation, count)
            assert _partial(ds, taken) == list(range(taken))
            expected_reads += 0 if kept else taken
            # never completes: the end was not read (a generator's cardinality is unknown)
        assert source.produced == expected_reads, operations
    del ds
    gc.collect()
    assert run_module.join_abandoned()
    assert spill_dirs() == before


def test_kept_cache_thread_safety_many_readers_at_once() -> None:
    source = Counted(50, nbytes=4096)
    ds = source.dataset().cache().with_options(hr.Options(memory_budget="1MiB"))
    assert ids(ds) == list(range(50))
    results: list[list[int]] = []

    def read() -> None:
        results.append(ids(ds))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [list(range(50))] * 4 and source.produced == 50


@pytest.mark.slow
def test_g1_three_times_the_budget_iterated_by_three_iterators_reads_the_source_once() -> None:
    """Measured in a fresh process: growth of RssAnon + RssShmem from before the first
    iterator, across three separate iter() calls (the first writes, spilling past its
    share; the next two read the kept cache), within budget + 10% + 64 MiB; the source
    is read once. Without the spill (tf.data's cache) it would hold the 192 MiB."""
    script = textwrap.dedent(
        """
        import json, threading, time, warnings
        import numpy as np
        import headrace as hr

        MiB = 1 << 20
        budget = 64 * MiB
        rows = 3 * budget // (256 << 10)
        produced = [0]

        def gen():
            for i in range(rows):
                produced[0] += 1
                yield np.full(32 << 10, i, np.float64)  # 256 KiB, fresh each time

        def charged():
            total = 0
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        total += int(line.split()[1]) * 1024
            return total

        ds = hr.Dataset.from_generator(
            gen, output_signature=hr.TensorSpec((32 << 10,), np.float64)
        ).cache().with_options(hr.Options(memory_budget=budget))
        warnings.simplefilter("ignore")
        peak, done = [0], threading.Event()
        base = charged()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], charged() - base)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        sums = []
        for _ in range(3):
            with iter(ds) as iterator:
                sums.append(sum(float(e[0]) for e in iterator))
        done.set()
        sampler.join()
        peak[0] = max(peak[0], charged() - base)
        print(json.dumps({"peak": peak[0], "produced": produced[0], "rows": rows,
                          "sums": sums, "bound": int(budget * 1.1) + 64 * MiB}))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    assert result["produced"] == rows
    assert result["sums"] == [float(rows * (rows - 1) // 2)] * 3
    assert result["peak"] <= result["bound"], result


# --------------------------------------------------------------------------- stats (G7)


def test_stats_name_the_kept_cache_and_the_default_budget_that_carries_it(
    small_default_budget: MemoryBudget,
) -> None:
    source = Counted(40, nbytes=1024)
    ds = source.dataset().cache()
    with iter(ds) as writer:
        assert len(ids(writer)) == 40
        (written,) = writer.stats().kept  # the run that wrote it shows it too
    with iter(ds) as reader:
        assert len(ids(reader)) == 40
        stats = reader.stats()
    (kept,) = stats.kept
    assert kept == written
    assert kept.name == "cache (kept)"
    assert kept.booked_on == "the default budget"
    assert kept.held == small_default_budget.used  # every byte the default budget holds
    assert (kept.elements, kept.spilled_elements, kept.spilled_bytes) == (40, 0, 0)
    assert "cache (kept): " in stats.format() and "booked on the default budget" in stats.format()


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    count=st.integers(1, 120),
    nbytes=st.sampled_from((256, 4096, 32 << 10)),
    budget_kib=st.sampled_from((512, 1024, 4096)),
)
def test_stats_of_a_run_with_its_own_budget_account_for_every_cached_element(
    count: int, nbytes: int, budget_kib: int
) -> None:
    source = Counted(count, nbytes=nbytes)
    ds = source.dataset().cache().with_options(hr.Options(memory_budget=budget_kib << 10))
    for _ in range(2):
        with iter(ds) as iterator:
            assert ids(iterator) == list(range(count))
            (kept,) = iterator.stats().kept
            account = next(a for a in iterator.context.budget.accounts if a.name == "cache")
            # what the cache stage holds at the end: the kept cache, and in a run that
            # read the spill file, its index while the reader is open (8 bytes a record)
            assert account.held - kept.held in (0, 8 * kept.spilled_elements)
            assert account.held <= account.limit
            assert kept.booked_on == "this run's 'cache' share"
            assert kept.elements + kept.spilled_elements == count
            if kept.spilled_elements:
                assert kept.spill_path is not None
                assert os.path.getsize(kept.spill_path) == kept.spilled_bytes
                assert f"{kept.spilled_elements} elements" in kept.format()
            else:
                assert kept.spilled_bytes == 0 and kept.spill_path is None
    assert source.produced == count


def test_a_partial_cache_is_not_reported_kept_and_a_profile_shows_the_kept_one() -> None:
    source = Counted(30, nbytes=1024)
    ds = source.dataset().cache()
    with iter(ds) as iterator:
        next(iterator)
        assert iterator.stats().kept == ()  # not complete: nothing outlives the run
    profile = ds.profile(epochs=2)
    (kept,) = profile.kept
    assert kept.elements == 30 and kept.held > 30 * 1024
    assert "kept beyond the run (belongs to the dataset):" in profile.format()
    assert "cache (kept): " in profile.format()


def test_a_damaged_spill_index_is_data_loss_with_no_advice_to_rebuild_it() -> None:
    # The spill file is headrace's own temporary: there is nothing for the user to rebuild.
    source = Counted(120, nbytes=32 << 10)
    ds = source.dataset().cache().with_options(hr.Options(memory_budget=1 << 20))
    with iter(ds) as iterator:
        assert ids(iterator) == list(range(120))
        (kept,) = iterator.stats().kept
        assert kept.spill_path is not None and kept.spilled_elements
        index = kept.spill_path + ".hrx"
        with open(index, "r+b") as file:
            file.seek(4)
            byte = file.read(1)
            file.seek(4)
            file.write(bytes([byte[0] ^ 0xFF]))
        with iter(ds) as again, pytest.raises(hr.DataLossError) as raised:
            ids(again)
    assert "temporary file headrace wrote" in str(raised.value)
    assert "rebuild" not in str(raised.value)
