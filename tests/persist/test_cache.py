"""cache(): in memory within its share, spilling to disk past it; cache(filename) with
tf.data's persistent-cache semantics; checkpoints at every step; disk full; corruption."""

from __future__ import annotations

import array
import contextlib
import errno
import gc
import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._transforms.cache import PARTIAL_CACHE_ADVICE
from headrace.core.state import seal
from headrace.io import tfrecord as tfrecord_module
from headrace.testing import assert_checkpoint_roundtrip, assert_elements_equal

MiB = 1 << 20


class Counted:
    """A generator source that counts the elements it produced (the 'source touched' probe)."""

    def __init__(self, count: int, nbytes: int = 32) -> None:
        # the count lives where a pipeline's fingerprint does not look (an array.array counts
        # by type): equal pipelines over it keep equal fingerprints as it changes
        self.count, self.nbytes, self.tally = count, nbytes, array.array("q", [0])

    @property
    def produced(self) -> int:
        return self.tally[0]

    @produced.setter
    def produced(self, value: int) -> None:
        self.tally[0] = value

    def __call__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.count):
            self.produced += 1
            yield {"x": np.full(self.nbytes // 8, i, np.float64), "i": np.int64(i)}

    def dataset(self) -> hr.Dataset:
        return hr.Dataset.from_generator(
            self,
            output_signature={
                "x": hr.TensorSpec((self.nbytes // 8,), np.float64),
                "i": hr.TensorSpec((), np.int64),
            },
        )


def ids(elements: Any) -> list[int]:
    return [int(e["i"]) for e in elements]


def spill_dirs() -> set[str]:
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"headrace-cache-{os.getpid()}-*")))


# --------------------------------------------------------------------------- in memory


def test_later_epochs_read_only_the_cache() -> None:
    source = Counted(20)
    ds = source.dataset().cache().repeat(3).with_options(hr.Options(memory_budget="16MiB"))
    assert ids(ds) == list(range(20)) * 3
    assert source.produced == 20


def test_cached_arrays_are_read_only_so_an_edit_cannot_change_the_next_epoch() -> None:
    ds = hr.Dataset.range(4).map(lambda i: np.full(3, i)).cache().repeat(2)
    with iter(ds) as iterator:
        first = next(iterator)
        with pytest.raises(ValueError):
            first[0] = 99
        rest = [int(e[0]) for e in iterator]
    assert rest == [1, 2, 3, 0, 1, 2, 3]


def test_a_dataset_three_times_the_budget_spills_once_stays_within_its_share() -> None:
    budget = 8 * MiB
    source = Counted(3 * budget // (64 << 10), nbytes=64 << 10)  # 3x the budget in rows
    ds = source.dataset().cache().repeat(2).with_options(hr.Options(memory_budget=budget))
    before = spill_dirs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with iter(ds) as iterator:
            seen = ids(iterator)
            made = spill_dirs() - before
            account = next(a for a in iterator.context.budget.accounts if a.name == "cache")
            assert account.breaches == 0 and account.peak <= account.limit
            assert iterator.context.budget.peak <= budget
    assert seen == list(range(source.count)) * 2
    assert source.produced == source.count  # the second epoch read only the cache
    spills = [str(w.message) for w in caught if "spill" in str(w.message)]
    assert len(spills) == 1, spills
    (directory,) = made
    assert directory in spills[0] and "MiB" in spills[0] and "elements" in spills[0]
    assert os.path.exists(directory)  # complete: kept with the dataset, for its next iterator
    del ds, iterator
    gc.collect()
    assert not os.path.exists(directory)  # removed with the dataset


def test_spill_directory_is_removed_after_an_exception_and_for_an_abandoned_iterator() -> None:
    def boom(e: Any) -> Any:
        if int(e["i"]) == 150:
            raise KeyError("boom")
        return e

    source = Counted(200, nbytes=64 << 10)
    ds = source.dataset().cache().map(boom).with_options(hr.Options(memory_budget="4MiB"))
    before = spill_dirs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyError), iter(ds) as iterator:
            for _ in iterator:
                pass
        assert spill_dirs() == before
        iterator = iter(ds)
        for _ in range(120):
            next(iterator)
        assert spill_dirs() - before
        del iterator
        gc.collect()
        hr.DatasetIterator  # noqa: B018 - (keeps the import used)
        from headrace.core.run import join_abandoned

        assert join_abandoned()
    assert spill_dirs() == before


def test_partial_cache_is_discarded_with_tf_datas_advice() -> None:
    source = Counted(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ids(source.dataset().cache().take(3).repeat(2))
    assert got == [0, 1, 2, 0, 1, 2]
    assert source.produced == 6  # nothing partial was served: the input was read again
    advice = [str(w.message) for w in caught if PARTIAL_CACHE_ADVICE in str(w.message)]
    assert len(advice) == 2
    assert "dataset.take(k).cache().repeat()" in advice[0]


def test_take_of_the_whole_cardinality_completes_the_cache_as_in_tf_data() -> None:
    calls: list[int] = []

    def note(i: Any) -> Any:
        calls.append(int(i))
        return i

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no partial-cache warning
        got = [int(x) for x in hr.Dataset.range(5).map(note).cache().take(5).repeat(2)]
    assert got == [0, 1, 2, 3, 4] * 2 and calls == [0, 1, 2, 3, 4]


def test_elements_the_format_cannot_store_fail_when_they_spill_naming_the_component() -> None:
    ds = hr.Dataset.range(100).map(lambda i: {"s": {int(i)}, "pad": np.zeros(8192)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(hr.ElementSpecError, match="'/s' of type set"):
            list(ds.cache().with_options(hr.Options(memory_budget="2MiB")))


# --------------------------------------------------------------------------- checkpoints


STEPS = {
    "memory": lambda ds: ds.cache().repeat(2),
    "memory_mapped": lambda ds: ds.map(lambda e: e).cache().shuffle(4, seed=3).repeat(2),
    "spill": lambda ds: ds.cache().repeat(2),
    "inside_repeat": lambda ds: ds.shuffle(5, seed=1).cache().repeat(3).take(40),
}


@pytest.mark.parametrize("pipeline", list(STEPS))
def test_checkpoint_round_trip_at_every_step(pipeline: str) -> None:
    nbytes = (96 << 10) if pipeline == "spill" else 32
    ds = STEPS[pipeline](Counted(16, nbytes).dataset())
    ds = ds.with_options(hr.Options(memory_budget="1MiB" if pipeline == "spill" else "16MiB"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_checkpoint_roundtrip(ds, max_checkpoints=40)


def test_restored_reading_phase_reads_the_kept_cache_or_rebuilds_it() -> None:
    source = Counted(10)
    ds = source.dataset().cache().repeat(3)
    with iter(ds) as iterator:
        for _ in range(14):  # into the second epoch: reading the cache
            next(iterator)
        state = iterator.get_state()
    assert state["state"]["inner"]["mode"] == "read"
    source.produced = 0
    with iter(ds) as restored:  # the same dataset: its cache is kept
        restored.set_state(json.loads(json.dumps(state)))
        assert ids(restored) == list(range(4, 10)) + list(range(10))
    assert source.produced == 0
    with iter(source.dataset().cache().repeat(3)) as restored:  # as in a new process
        restored.set_state(json.loads(json.dumps(state)))
        assert ids(restored) == list(range(4, 10)) + list(range(10))
    assert source.produced == 10  # rebuilt once by replay, then only the cache


def test_tampered_cache_state_is_refused_naming_the_field() -> None:
    ds = hr.Dataset.range(5).cache()
    with iter(ds) as iterator:
        next(iterator)
        state = iterator.get_state()
    bad = json.loads(json.dumps(state))
    bad["state"]["mode"] = "sideways"
    with iter(ds) as other, pytest.raises(hr.CheckpointError, match="checksum"):
        other.set_state(bad)  # edited: refused as a whole
    seal(bad)  # as a buggy producer would have made it: the field's own check
    with iter(ds) as other, pytest.raises(hr.CheckpointError, match="cache: state field 'mode'"):
        other.set_state(bad)
    bad = seal(json.loads(json.dumps(state)) | {"state": {**state["state"], "position": 50}})
    with iter(ds) as other, pytest.raises(hr.CheckpointError, match="past the end"):
        other.set_state(bad)


# --------------------------------------------------------------------------- cache(filename)


def cache_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_file_cache_is_complete_only_at_the_end_and_reused_by_the_next_run(
    tmp_path: Path,
) -> None:
    prefix = str(tmp_path / "c")
    source = Counted(12)
    ds = source.dataset().cache(prefix)
    with iter(ds) as iterator:
        for _ in range(5):
            next(iterator)
        assert not os.path.exists(prefix + ".hrcache.json")  # not complete yet
        assert os.path.exists(prefix + ".lockfile")
        assert ids(iterator) == list(range(5, 12))
    assert cache_files(tmp_path) == ["c.hrcache", "c.hrcache.crc", "c.hrcache.hrx", "c.hrcache.json"]
    source.produced = 0
    assert ids(ds.repeat(2)) == list(range(12)) * 2
    assert source.produced == 0  # a later run reads only the files


def test_partial_file_cache_leaves_nothing_behind(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [int(x) for x in hr.Dataset.range(10).cache(prefix).take(2)] == [0, 1]
    assert cache_files(tmp_path) == []  # as tf.data: no files remain after take(2)
    assert any(PARTIAL_CACHE_ADVICE in str(w.message) for w in caught)


def test_a_second_concurrent_writer_gets_an_error_naming_the_lock(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    ds = hr.Dataset.range(10).cache(prefix)
    with iter(ds) as first:
        next(first)
        with pytest.raises(FileExistsError, match="concurrent caching iterator") as raised:
            iter(ds)
        assert prefix + ".lockfile" in str(raised.value)
        assert f"pid {os.getpid()}" in str(raised.value)
        assert [int(x) for x in first] == list(range(1, 10))
    assert [int(x) for x in ds] == list(range(10))


def test_a_crashed_writers_leftovers_never_count_as_complete(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    script = textwrap.dedent(
        f"""
        import os, numpy as np, headrace as hr
        it = iter(hr.Dataset.range(100000).map(lambda i: np.full(64, i)).cache({prefix!r}))
        for _ in range(50000):
            next(it)
        os._exit(3)  # killed mid-write: no close, no cleanup
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script], env=env, check=False)
    assert done.returncode == 3
    left = cache_files(tmp_path)
    assert "c.hrcache.json" not in left and any(name.endswith(".tmp") for name in left)
    source = Counted(6)
    assert ids(source.dataset().cache(prefix)) == list(range(6))  # rebuilt, not read
    assert source.produced == 6
    assert cache_files(tmp_path) == ["c.hrcache", "c.hrcache.crc", "c.hrcache.hrx", "c.hrcache.json"]  # leftovers removed


def test_a_cache_from_another_pipeline_is_rebuilt_with_a_message(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prefix = str(tmp_path / "c")
    assert [int(x) for x in hr.Dataset.range(5).map(lambda i: i * 2).cache(prefix)] == [
        0, 2, 4, 6, 8,
    ]
    # what headrace does, not a hazard: logged (headrace.cache, INFO), not a warning
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", "headrace"):
        warnings.simplefilter("always")
        got = [int(x) for x in hr.Dataset.range(5).map(lambda i: i * 3).cache(prefix)]
    assert got == [0, 3, 6, 9, 12]
    assert not [w for w in caught if "different pipeline" in str(w.message)]
    (record,) = [r for r in caplog.records if "different pipeline" in r.getMessage()]
    assert record.name == "headrace.cache" and record.levelname == "INFO"
    assert "rebuilding" in record.getMessage()
    assert [int(x) for x in hr.Dataset.range(5).map(lambda i: i * 3).cache(prefix)] == got


def test_corrupt_file_cache_names_the_file_and_offset(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    ds = hr.Dataset.range(50).map(lambda i: np.full(10, i)).cache(prefix)
    list(ds)
    data = prefix + ".hrcache"
    raw = bytearray(Path(data).read_bytes())
    record = len(raw) // 50
    raw[record * 20 + 30] ^= 0xFF  # inside the 21st record's payload
    stat = os.stat(data)
    Path(data).write_bytes(bytes(raw))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot: the mtime stays
    with pytest.raises(hr.DataLossError, match=f"offset {record * 20} in file {data}") as raised:
        list(ds)
    assert raised.value.path == data and raised.value.offset == record * 20
    Path(data).write_bytes(bytes(raw[:-7]))  # truncated after it was complete: refused
    with pytest.raises(hr.DataLossError, match=f"{data} holds {len(raw) - 7} bytes"):
        list(ds)


def test_a_corrupt_index_is_refused_where_records_differ_in_size(tmp_path: Path) -> None:
    prefix = str(tmp_path / "c")
    ds = hr.Dataset.range(50).map(lambda i: np.full(i % 7 + 1, i)).cache(prefix)
    list(ds)
    data = prefix + ".hrcache"
    index = Path(data + ".hrx")
    raw_index = bytearray(index.read_bytes())
    raw_index[-3] ^= 0xFF  # an offset of the index
    index.write_bytes(bytes(raw_index))
    with pytest.raises(hr.DataLossError, match=f"index file {data}.hrx is corrupt"):
        list(ds)


def test_records_of_one_size_are_read_without_their_index(tmp_path: Path) -> None:
    """The manifest records the one size (its fields sealed): each record's offset is
    computed, so the index is not read (not even a corrupt one); every record is
    still checked, and a file of another length is refused naming it."""
    prefix = str(tmp_path / "c")
    ds = hr.Dataset.range(50).map(lambda i: np.full(10, i)).cache(prefix)
    first = [x.tolist() for x in ds]
    data = prefix + ".hrcache"
    manifest = json.loads(Path(data + ".json").read_text())
    assert manifest["record_bytes"] * 50 == os.path.getsize(data)
    Path(data + ".hrx").write_bytes(b"\0" * 64)  # (same name: find_complete wants it)
    assert [x.tolist() for x in ds] == first == [[i] * 10 for i in range(50)]
    assert [b.tolist() for b in ds.batch(16)] == [first[i : i + 16] for i in range(0, 50, 16)]


@pytest.mark.parametrize("leave_files", [False, True])
def test_file_cache_checkpoint_round_trip_in_the_writing_phase(
    tmp_path: Path, leave_files: bool
) -> None:
    prefix = str(tmp_path / "c")
    ds = Counted(9).dataset().cache(prefix).repeat(2)

    def wipe() -> None:
        for name in glob.glob(prefix + ".*"):
            os.unlink(name)

    for step in range(0, 19):
        wipe()
        with iter(ds) as original:
            for _ in range(step):
                next(original)
            state = json.loads(json.dumps(original.get_state()))
            expected = list(original)
        if not leave_files:
            wipe()
        with iter(ds) as restored:
            restored.set_state(state)
            actual = list(restored)
        assert len(actual) == len(expected), step
        for a, e in zip(actual, expected, strict=True):
            assert_elements_equal(a, e, where=f"step {step}")


def test_file_cache_checkpoint_round_trip_in_the_reading_phase(tmp_path: Path) -> None:
    ds = Counted(9).dataset().cache(str(tmp_path / "c")).repeat(2)
    list(ds)  # complete on disk: every run reads it
    assert_checkpoint_roundtrip(ds)


# --------------------------------------------------------------------------- disk full


class FullDisk:
    """TFRecordWriter.write_framed (how the cache writes its framed records) failing with
    ENOSPC after ``allowed`` calls (the file layer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allowed: int) -> None:
        original = tfrecord_module.TFRecordWriter.write_framed
        calls = [0]

        def write_framed(writer: Any, pieces: Any, records: int) -> int:
            calls[0] += 1
            if calls[0] > allowed:
                raise OSError(errno.ENOSPC, "No space left on device")
            return original(writer, pieces, records)

        monkeypatch.setattr(tfrecord_module.TFRecordWriter, "write_framed", write_framed)


def test_full_disk_while_spilling_is_a_clear_error_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FullDisk(monkeypatch, allowed=2)
    before = spill_dirs()
    ds = Counted(300, nbytes=64 << 10).dataset().cache()

    def spill() -> int | None:
        with pytest.raises(OSError, match="no space left on the device writing") as raised:
            list(ds.with_options(hr.Options(memory_budget="4MiB")))
        return raised.value.errno  # (the error's frames hold the run: dropped here)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = spill()
        gc.collect()  # the run closes now
    assert code == errno.ENOSPC
    assert spill_dirs() == before
    # the spill failed, the pass was not stopped early: no advice about take(k)
    assert not [w for w in caught if "take(k)" in str(w.message)]


@pytest.mark.parametrize("where", ["spill", "file"])
def test_after_a_full_disk_the_pass_goes_on_uncached_and_the_next_pass_reads_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # Every later element of the pass used to fail on the closed store (AssertionError).
    FullDisk(monkeypatch, allowed=2)
    source = Counted(300, nbytes=64 << 10)
    ds = source.dataset().cache(str(tmp_path / "c") if where == "file" else "")
    seen: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with iter(ds.with_options(hr.Options(memory_budget="4MiB"))) as iterator:
            for _ in range(400):
                try:
                    seen.append(int(next(iterator)["i"]))
                except StopIteration:
                    break
                except OSError:
                    seen.append("full")
    assert seen.count("full") == 1
    failed = seen.index("full")
    assert seen[:failed] + seen[failed + 1:] == [i for i in range(300) if i != failed]
    assert source.produced == 300
    monkeypatch.undo()  # room on the disk again: the next pass caches it
    with iter(ds.with_options(hr.Options(memory_budget="4MiB"))) as iterator:
        assert [int(e["i"]) for e in iterator] == list(range(300))
    assert source.produced == 600


def test_full_disk_writing_a_file_cache_leaves_no_complete_looking_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FullDisk(monkeypatch, allowed=1)
    prefix = str(tmp_path / "c")
    ds = Counted(400, nbytes=4096).dataset().cache(prefix)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError,
                           match=f"no space left on the device writing {prefix}.hrcache"):
            list(ds)
        gc.collect()  # (the run the error's frames held is closed now)
    assert cache_files(tmp_path) == []
    # the write failed, the pass was not stopped early: no advice about take(k)
    assert not [w for w in caught if "take(k)" in str(w.message)]


# --------------------------------------------------------------------------- read path


@pytest.mark.parametrize("sizes", [[100_000] * 60, [50, 100_000, 70, 40_000, 3, 200_000] * 10])
def test_large_records_are_read_in_runs_each_into_a_buffer_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int]
) -> None:
    from headrace.io.streams import SuspendableStream

    def make(i: Any) -> Any:
        return np.full(sizes[int(i)], int(i) % 251, np.uint8)

    ds = hr.Dataset.range(len(sizes)).map(make).cache(str(tmp_path / "c")).with_options(
        hr.Options(memory_budget="64MiB")
    )
    list(ds)  # writes the file
    calls: list[int] = []
    original = SuspendableStream.pread_many

    def counted(self: Any, offsets: list[int], lengths: list[int]) -> list[bytes]:
        calls.append(len(offsets))
        return original(self, offsets, lengths)

    monkeypatch.setattr(SuspendableStream, "pread_many", counted)
    elements = list(ds)
    assert [int(e[0]) if len(e) else None for e in elements] == [
        i % 251 if sizes[i] else None for i in range(len(sizes))
    ]
    for element, size in zip(elements, sizes, strict=True):
        assert element.shape == (size,) and not element.flags.writeable
        if size >= 32 << 10:  # decoded where it was read: its own buffer, no neighbour's
            owner = element.base
            while getattr(owner, "base", None) is not None:
                owner = owner.base
            assert isinstance(owner, (bytes, memoryview)) or hasattr(owner, "obj")
            assert len(bytes(memoryview(owner))) < size + 1024
    # the chunk follows the stage's share (1 MiB here): runs of records, not one each
    assert len(calls) <= len(sizes) // 4, calls


class OpenFilesUnder:
    """The peak number of descriptors this process has open on files under ``directory``,
    sampled by a thread and wherever the test calls :meth:`sample` (what the kernel
    sees, not what the pool believes)."""

    def __init__(self, directory: str) -> None:
        import threading

        self.directory, self.peak, self.names = directory, 0, [""]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> list[str]:
        found = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target == self.directory or target.startswith(self.directory + os.sep):
                    found.append(os.path.relpath(target, self.directory))
        return found

    def sample(self) -> None:
        now = self.now()
        if len(now) > self.peak:
            self.peak, self.names = len(now), sorted(now)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sample()

    def __enter__(self) -> OpenFilesUnder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _cached_interleave(
    files: list[str], cycle: int, *, snapshot: bool
) -> Callable[[Path], hr.Dataset]:
    """Files interleaved, then cached (or snapshotted) at the path given."""

    def pipeline(out: Path) -> hr.Dataset:
        src = hr.Dataset.from_tensor_slices(files).interleave(
            hr.TFRecordDataset, cycle_length=cycle
        )
        return src.snapshot(str(out)) if snapshot else src.cache(str(out))

    return pipeline


def test_cache_and_snapshot_writers_and_locks_count_against_max_open_files(
    tmp_path: Path,
) -> None:
    """G2 (issue 22): a cache(filename)/snapshot writer's file and its lock are descriptors
    headrace opens, so they count against Options(max_open_files): readers of the
    interleaved input are suspended to make room, and a cap below writer + lock + one
    reader is refused naming the stage. Random pipelines and caps; oracle: the elements of
    the same pipeline without a cap, and the descriptors the kernel shows open."""
    from headrace.io.tfrecord import write_tfrecord

    rng = np.random.default_rng(22)
    for case in range(6):
        directory = tmp_path / f"case{case}"
        directory.mkdir()
        files = []
        for shard in range(int(rng.integers(2, 7))):
            path = str(directory / f"f{shard}.tfrecord")
            write_tfrecord(path, [bytes([shard, i]) * 5 for i in range(int(rng.integers(1, 9)))])
            files.append(path)
        cycle = int(rng.integers(1, 5))
        cap = int(rng.integers(1, cycle + 3))  # up to readers + writer + lock
        snapshot = case % 2 == 1

        pipeline = _cached_interleave(files, cycle, snapshot=snapshot)
        expected = list(pipeline(tmp_path / f"uncapped{case}").as_numpy_iterator())
        capped = pipeline(directory / "out").with_options(hr.Options(max_open_files=cap))
        stage = "snapshot(" if snapshot else "cache("
        with OpenFilesUnder(str(directory)) as seen:
            if cap < 3:  # writer + lock + one reader
                with pytest.raises(hr.InvalidArgumentError, match=r"max_open_files") as e:
                    list(capped.as_numpy_iterator())
                assert stage in str(e.value) and f"max_open_files={cap}" in str(e.value)
            else:
                for _ in range(2):  # writing, then reading the complete cache
                    got = []
                    for element in capped.as_numpy_iterator():
                        seen.sample()
                        got.append(element)
                    assert got == expected, (case, cap, snapshot)
        assert seen.peak <= cap, (case, cap, snapshot, seen.names)
        assert seen.now() == [], seen.now()  # nothing left open, error or not


@pytest.mark.parametrize("seed", range(6))
def test_an_edited_cache_or_snapshot_manifest_is_refused_naming_it(
    tmp_path: Path, seed: int
) -> None:
    """Random file caches and snapshots (size, compression) whose manifest gets one field
    changed to a random value: a DataLossError naming the manifest, never the cache
    believed (or silently rebuilt) with edited counts, sizes or formats."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    snapshot = bool(rng.integers(2))
    compression = None if not snapshot else [None, "GZIP"][int(rng.integers(2))]

    def pipeline() -> hr.Dataset:
        ds = hr.Dataset.range(n).map(lambda i: np.float64(i) * 2)
        if snapshot:
            return ds.snapshot(str(tmp_path / "s"), compression=compression)
        return ds.cache(str(tmp_path / "c"))

    oracle = [float(x) for x in pipeline()]
    assert oracle == [2.0 * i for i in range(n)]
    (manifest_path,) = glob.glob(str(tmp_path / "**" / "*.hrcache.json"), recursive=True)
    with open(manifest_path, encoding="utf-8") as file:
        manifest = json.load(file)
    fields = sorted(set(manifest) - {"format", "version"})  # those two: another's, rebuilt
    field = fields[int(rng.integers(len(fields)))]
    old = manifest[field]
    new: Any = [old + int(rng.integers(1, 9)), -1, "x", None][int(rng.integers(4))] if isinstance(
        old, int
    ) else ["headrace.elements/9", "0" * 20, 1, None][int(rng.integers(4))]
    manifest[field] = new
    with open(manifest_path, "w", encoding="utf-8") as file:
        json.dump(manifest, file)
    with pytest.raises(hr.DataLossError, match="manifest") as raised:
        list(pipeline())
    assert manifest_path in str(raised.value), (field, new, str(raised.value))


def _drain_with_errors(iterator: Any, limit: int | None = None) -> list[Any]:
    """What an iterator hands out: values, and "E" where an element raised."""
    out: list[Any] = []
    while limit is None or len(out) < limit:
        try:
            out.append(int(next(iterator)))
        except StopIteration:
            break
        except ValueError:
            out.append("E")
    return out


@pytest.mark.parametrize("seed", range(4))
def test_a_state_taken_after_errors_while_the_cache_fills_resumes_after_them(
    seed: int, tmp_path: Path
) -> None:
    """``map(f).cache()`` where ``f`` raises on some elements: errors are not cached,
    but a state taken while the cache fills resumes exactly where the uninterrupted
    run goes on (the oracle), after the errors already handed out. It resumed *at* the
    last error, which then came out twice."""
    rng = np.random.default_rng(seed)
    count, modulus = int(rng.integers(20, 60)), int(rng.integers(3, 9))
    filename = str(tmp_path / "c") if seed % 2 else ""
    repeats = int(rng.integers(1, 3))

    def boom(i: Any) -> Any:
        if int(i) % modulus == 1:
            raise ValueError(f"bad {int(i)}")
        return np.int64(i)

    def make() -> hr.Dataset:
        return hr.Dataset.range(count).map(boom).cache(filename).repeat(repeats)

    with iter(make()) as plain:
        oracle = _drain_with_errors(plain)
    for cut in sorted({int(k) for k in rng.integers(1, len(oracle), 6)}):
        for leftover in glob.glob(filename + "*") if filename else ():
            os.remove(leftover)
        with iter(make()) as it:
            assert _drain_with_errors(it, cut) == oracle[:cut]
            state = json.loads(json.dumps(it.get_state()))
        for leftover in glob.glob(filename + "*") if filename else ():
            os.remove(leftover)  # (a crash: the half-written cache is gone)
        with iter(make()) as resumed:
            resumed.set_state(state)
            assert _drain_with_errors(resumed) == oracle[cut:], (seed, cut)


@pytest.mark.parametrize("seed", range(4))
def test_a_pass_whose_input_raised_is_not_kept_as_the_cache(seed: int, tmp_path: Path) -> None:
    """An element whose map fails once (a transient error) while the cache fills: that
    pass raises it in its place and is not kept, with a warning; the next pass reads
    the input again and every later epoch has every element (the oracle: the input as
    it is now). Kept, the cache lacked the element in every later epoch, silently, and
    in every other process reading the file. Elements that fail every time still fail
    in their place each epoch; dropped before the cache, the cache is kept."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(8, 30))
    flaky = {int(i) for i in rng.choice(count, size=int(rng.integers(1, 4)), replace=False)}
    kind = ("memory", "file", "snapshot")[seed % 3]
    failed: set[int] = set()

    def once(i: Any) -> Any:
        if int(i) in flaky and int(i) not in failed:
            failed.add(int(i))
            raise OSError(f"flaky {int(i)}")
        return np.int64(i)

    def cached(ds: hr.Dataset, name: str) -> hr.Dataset:
        if kind == "snapshot":
            return ds.snapshot(str(tmp_path / name))
        return ds.cache(str(tmp_path / name) if kind == "file" else "")

    ds = cached(hr.Dataset.range(count).map(once), "a")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [_drain_errors_as(iter(ds), OSError) for _ in range(3)]
    assert epochs[0] == ["E" if i in flaky else i for i in range(count)], (seed, kind)
    assert epochs[1] == epochs[2] == list(range(count)), (seed, kind, epochs)
    assert any("not kept" in str(w.message) for w in caught), [str(w.message) for w in caught]
    # failing every time and dropped before the cache: kept after one pass
    always = cached(hr.Dataset.range(count).map(
        lambda i: np.int64(i) if int(i) not in flaky else np.int64(1 // 0)
    ).ignore_errors(), "b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        passes = [_drain_errors_as(iter(always), ZeroDivisionError) for _ in range(2)]
    assert passes == [[i for i in range(count) if i not in flaky]] * 2, (seed, kind)
    assert not any("not kept" in str(w.message) for w in caught), (seed, kind)


def _drain_errors_as(iterator: Any, kind: type[Exception]) -> list[Any]:
    out: list[Any] = []
    with iterator:
        while True:
            try:
                out.append(int(next(iterator)))
            except StopIteration:
                return out
            except kind:
                out.append("E")


@pytest.mark.parametrize("damage", ["truncate-data", "append-data", "truncate-manifest",
                                    "not-a-manifest", "unsealed-edit"])
def test_a_damaged_complete_cache_is_refused_not_rebuilt(tmp_path: Path, damage: str) -> None:
    """A complete cache whose data file lost or gained bytes, or whose manifest no longer
    parses or is not one, is refused with DataLossError naming the file; it was rebuilt
    from the input in silence, which the guide says never happens (the outsider's a4)."""
    import json as json_module

    calls: list[int] = []

    def f(x: Any) -> Any:
        calls.append(1)
        return np.full(100, int(x), np.int64)

    prefix = str(tmp_path / "c")
    ds = hr.Dataset.range(50).map(f).cache(prefix)
    assert len(list(ds)) == 50
    data = next(p for p in tmp_path.iterdir() if p.name.endswith(".hrcache"))
    manifest = next(p for p in tmp_path.iterdir() if p.name.endswith(".json"))
    if damage == "truncate-data":
        data.write_bytes(data.read_bytes()[:-10])
    elif damage == "append-data":
        data.write_bytes(data.read_bytes() + b"x" * 10)
    elif damage == "truncate-manifest":
        manifest.write_bytes(manifest.read_bytes()[:-5])
    elif damage == "not-a-manifest":
        content = json_module.loads(manifest.read_text())
        content["format"] = "something-else"
        manifest.write_text(json_module.dumps(content))
    else:
        content = json_module.loads(manifest.read_text())
        content["elements"] = 49
        manifest.write_text(json_module.dumps(content))
    calls.clear()
    named = data if "data" in damage else manifest
    with pytest.raises(hr.DataLossError, match=re.escape(str(named))):
        list(ds)
    assert calls == []  # refused before a rebuild began


@pytest.mark.parametrize("seed", range(4))
def test_a_cache_or_snapshot_manifest_missing_a_field_is_refused_naming_it(
    tmp_path: Path, seed: int
) -> None:
    """Each field removed in turn, the checksum that seals the others included: a
    manifest of this version without its checksum was believed whole, so any other
    edit made with it went unnoticed."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    snapshot = seed % 2 == 1
    compression = [None, "GZIP"][seed // 2] if snapshot else None

    def pipeline() -> hr.Dataset:
        ds = hr.Dataset.range(n).map(lambda i: np.float64(i) * 2)
        if snapshot:
            return ds.snapshot(str(tmp_path / "s"), compression=compression)
        return ds.cache(str(tmp_path / "c"))

    assert [float(x) for x in pipeline()] == [2.0 * i for i in range(n)]
    (manifest_path,) = glob.glob(str(tmp_path / "**" / "*.hrcache.json"), recursive=True)
    with open(manifest_path, encoding="utf-8") as file:
        manifest = json.load(file)
    assert "checksum" in manifest
    for field in sorted(manifest):
        edited = {key: value for key, value in manifest.items() if key != field}
        if field == "checksum":  # and a count changed with it
            edited["elements"] = n + 1
        with open(manifest_path, "w", encoding="utf-8") as file:
            json.dump(edited, file)
        with pytest.raises(hr.DataLossError, match="manifest") as raised:
            list(pipeline())
        assert manifest_path in str(raised.value), (field, str(raised.value))
