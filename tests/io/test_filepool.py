"""The file pool: a hard cap on descriptors, exact bytes through suspension, clean release."""

from __future__ import annotations

import dataclasses
import errno
import gc
import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import weakref
import zlib
from pathlib import Path
from typing import Any

import pytest
from descriptors import open_descriptors
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace.io.filepool as filepool_module
import headrace.io.streams as streams_module
from headrace._errors import InvalidArgumentError
from headrace.io.filepool import FilePool, PooledStream, default_max_open_files

SRC_DIR = Path(filepool_module.__file__).resolve().parents[2]
KINDS = ["", "GZIP", "ZLIB"] * 3  # nine streams
CONTENTS = [random.Random(index).randbytes(3_000) * 2 + b"a" * 500 * index for index in range(9)]


def write_sample(directory: Path, kind: str, content: bytes, name: str) -> Path:
    """Write ``content`` plain, as two concatenated GZIP members, or as ZLIB."""
    half = len(content) // 2
    encoded = {
        "": content,
        "GZIP": gzip.compress(content[:half]) + gzip.compress(content[half:]),
        "ZLIB": zlib.compress(content),
    }[kind]
    path = directory / f"{name}.{kind or 'raw'}"
    path.write_bytes(encoded)
    return path


@pytest.fixture(scope="module")
def sample_files(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    directory = tmp_path_factory.mktemp("pool")
    return [
        (write_sample(directory, kind, content, name=f"f{index}"), kind)
        for index, (kind, content) in enumerate(zip(KINDS, CONTENTS, strict=True))
    ]


def read_round_robin(
    handles: list[PooledStream], size: int, after_each_read: object = None
) -> list[bytes]:
    """Read every handle ``size`` bytes at a time, in turn, until all are exhausted."""
    received: list[list[bytes]] = [[] for _ in handles]
    live = list(range(len(handles)))
    while live:
        still_live = []
        for index in live:
            piece = handles[index].read(size)
            if callable(after_each_read):
                after_each_read()
            if piece:
                received[index].append(piece)
                still_live.append(index)
        live = still_live
    return [b"".join(pieces) for pieces in received]


class RecordingAccount:
    """A MemoryAccount that checks it never goes negative."""

    def __init__(self) -> None:
        self.balance = 0
        self.charges = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> None:
        with self._lock:
            assert nbytes > 0
            self.balance += nbytes
            self.charges += 1

    def discharge(self, nbytes: int) -> None:
        with self._lock:
            self.balance -= nbytes
            assert self.balance >= 0


# --------------------------------------------------------------------------- the cap


@pytest.mark.parametrize("max_open_files", [1, 2, 3])
def test_interleaved_streams_give_exact_bytes_under_the_cap(
    sample_files: list[tuple[Path, str]], max_open_files: int, stream_descriptors: Any
) -> None:
    pool = FilePool(max_open_files)
    baseline = open_descriptors(sample_files[0][0].parent)
    handles = [pool.open(path, kind, buffer_size=300) for path, kind in sample_files]
    assert read_round_robin(handles, 777) == CONTENTS
    assert stream_descriptors.peak == max_open_files
    stats = pool.stats()
    assert stats.peak_open_files == max_open_files
    assert stats.suspensions > 0 and stats.resumptions > 0
    for handle in handles:
        handle.close()
    assert open_descriptors(sample_files[0][0].parent) == baseline
    assert pool.stats().open_files == 0


def test_a_sample_of_headraces_own_counts_against_every_pipelines_share(
    sample_files: list[tuple[Path, str]],
) -> None:
    """The heap watcher's /proc read (``transient(wait=False)``, no share) beside a
    pipeline capped at 2: skipped while the pipeline holds its 2, and while it reads, the
    pipeline's next open waits for it or suspends one of its own, never a third beside it
    (the benchmark's cap-8 interleave showed 9 open at once before)."""
    pool = FilePool(10)
    share = pool.limiter(2)
    handles = [pool.open(path, kind, limiter=share) for path, kind in sample_files[:3]]
    for handle in handles[:2]:
        handle.read(10)
    assert share.open_files == 2
    with pool.transient(wait=False) as got:
        assert not got  # the pipeline is at its cap: the sample waits for the next look
    handles[1].close()
    with pool.transient(wait=False) as got:
        assert got and share.open_files == 2  # its one file and the sample
        handles[2].read(10)  # suspends the pipeline's idle reader to open
        assert share.open_files == 2 and pool.stats().open_files == 2
    assert share.open_files == 1 and pool.stats().peak_open_files == 2
    with pool.transient(wait=False, limiter=pool.limiter(1)) as got:
        assert got  # a read on a pipeline's own share counts against that one only
    for handle in handles:
        handle.close()


def test_compressed_readers_suspended_under_the_cap_while_the_heap_is_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GZIP shards, more in the cycle than the cap: closing or resuming a suspended reader
    gives back its saved state's booking while the pool's lock is held, and that release
    looked at the heap, whose /proc read waited for the same lock. It hung for good on the
    14th pass (once 16 MiB had been released); here the heap is looked at on every release."""
    import headrace as hr
    from headrace._memory import allocator
    from headrace.io.tfrecord import write_tfrecord

    monkeypatch.setattr(allocator, "CHECK_EVERY", 1)
    paths = [str(tmp_path / f"{i:02d}.tfrecord") for i in range(20)]
    for i, path in enumerate(paths):
        write_tfrecord(path, [bytes([i]) * 2_000] * 30, compression_type="GZIP")
    ds = (hr.Dataset.from_tensor_slices(paths)
          .interleave(lambda p: hr.TFRecordDataset(p, compression_type="GZIP"), cycle_length=16)
          .with_options(hr.Options(max_open_files=9)))
    counts: list[int] = []
    reader = threading.Thread(
        target=lambda: counts.extend(sum(1 for _ in ds) for _ in range(3)), daemon=True)
    reader.start()
    reader.join(60)
    assert counts == [600, 600, 600]


def test_cap_of_two_with_eight_streams(sample_files: list[tuple[Path, str]]) -> None:
    pool = FilePool(2)
    handles = [pool.open(path, kind) for path, kind in sample_files[:8]]
    assert read_round_robin(handles, 1_000) == CONTENTS[:8]
    assert pool.stats().peak_open_files == 2


def test_cap_holds_across_threads(
    sample_files: list[tuple[Path, str]], stream_descriptors: Any
) -> None:
    pool = FilePool(4)
    baseline = open_descriptors(sample_files[0][0].parent)
    results: dict[int, list[bytes]] = {}

    def worker(worker_index: int) -> None:
        handles = [pool.open(path, kind, buffer_size=256) for path, kind in sample_files]
        results[worker_index] = read_round_robin(handles, 333)
        for handle in handles:
            handle.close()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[index] == CONTENTS for index in range(8))
    assert stream_descriptors.peak <= 4
    assert pool.stats().peak_open_files <= 4
    assert open_descriptors(sample_files[0][0].parent) == baseline


@settings(max_examples=30, deadline=None)
@given(
    max_open_files=st.integers(min_value=1, max_value=3),
    reads=st.lists(
        st.tuples(st.integers(0, len(KINDS) - 1), st.integers(1, 3_000), st.booleans()),
        max_size=60,
    ),
)
def test_random_interleavings_and_suspensions_give_exact_bytes(
    sample_files: list[tuple[Path, str]],
    max_open_files: int,
    reads: list[tuple[int, int, bool]],
) -> None:
    pool = FilePool(max_open_files)
    handles = [pool.open(path, kind, buffer_size=512) for path, kind in sample_files]
    received: list[list[bytes]] = [[] for _ in handles]
    for index, size, suspend_first in reads:
        if suspend_first:
            handles[index].suspend()
        received[index].append(handles[index].read(size))
    for index, rest in enumerate(read_round_robin(handles, 4_096)):
        assert b"".join(received[index]) + rest == CONTENTS[index]
    assert pool.stats().peak_open_files <= max_open_files
    for handle in handles:
        handle.close()


def test_the_least_recently_used_idle_stream_is_suspended(
    sample_files: list[tuple[Path, str]],
) -> None:
    pool = FilePool(2)
    first, second = (pool.open(path, kind) for path, kind in sample_files[:2])
    first.read(1)  # now ``second`` is the least recently used
    third = pool.open(*sample_files[2])
    assert first.holds_descriptor and third.holds_descriptor
    assert not second.holds_descriptor
    assert second.read(5) == CONTENTS[1][:5]


def test_a_stream_busy_in_a_read_is_never_suspended(
    sample_files: list[tuple[Path, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = FilePool(1)
    busy = pool.open(*sample_files[0])
    in_read, may_finish, opened = threading.Event(), threading.Event(), threading.Event()
    original_read_chunk = streams_module.PlainStream._read_chunk

    def blocking_read_chunk(
        stream: streams_module.PlainStream, descriptor: int, wanted: int
    ) -> bytes:
        if threading.current_thread().name == "busy-reader":
            in_read.set()
            may_finish.wait()
        return original_read_chunk(stream, descriptor, wanted)

    monkeypatch.setattr(streams_module.PlainStream, "_read_chunk", blocking_read_chunk)
    results: dict[str, object] = {}
    reader = threading.Thread(
        target=lambda: results.update(read=busy.read(100)), name="busy-reader"
    )
    reader.start()
    in_read.wait()

    def open_other() -> None:
        results["other"] = pool.open(*sample_files[1])
        opened.set()

    opener = threading.Thread(target=open_other)
    opener.start()
    assert not opened.wait(0.3), "the open must wait for the busy slot, not steal it"
    assert busy.holds_descriptor
    may_finish.set()
    reader.join()
    opener.join()
    assert results["read"] == CONTENTS[0][:100]
    other = results["other"]
    assert isinstance(other, PooledStream) and other.read(10) == CONTENTS[1][:10]


# --------------------------------------------------------------------------- limiters


def test_limiter_caps_its_streams_and_suspends_only_its_own(
    sample_files: list[tuple[Path, str]],
) -> None:
    pool = FilePool(10)
    outside = [pool.open(path, kind) for path, kind in sample_files[:2]]
    limiter = pool.limiter(2)
    limited = [pool.open(path, kind, limiter=limiter) for path, kind in sample_files[2:8]]

    def check() -> None:
        assert limiter.open_files <= 2
        assert all(handle.holds_descriptor for handle in outside)

    assert read_round_robin(limited, 500, check) == CONTENTS[2:8]
    assert pool.stats().peak_open_files == 4


def test_pool_cap_binds_a_larger_limiter(sample_files: list[tuple[Path, str]]) -> None:
    pool = FilePool(2)
    limiter = pool.limiter(5)
    handles = [pool.open(path, kind, limiter=limiter) for path, kind in sample_files]
    assert read_round_robin(handles, 900) == CONTENTS
    assert pool.stats().peak_open_files == 2


def test_limiter_must_belong_to_the_pool(sample_files: list[tuple[Path, str]]) -> None:
    with pytest.raises(InvalidArgumentError, match="different FilePool"):
        FilePool(2).open(*sample_files[0], limiter=FilePool(2).limiter(1))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_max_open_files_is_validated(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="max_open_files"):
        FilePool(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="max_open_files"):
        FilePool(4).limiter(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- changing the cap


def test_lowering_the_cap_with_streams_open(sample_files: list[tuple[Path, str]]) -> None:
    pool = FilePool(6)
    baseline = open_descriptors(sample_files[0][0].parent)
    handles = [pool.open(path, kind) for path, kind in sample_files[:6]]
    prefixes = [handle.read(100) for handle in handles]
    assert open_descriptors(sample_files[0][0].parent) == baseline + 6
    pool.set_max_open_files(2)
    assert open_descriptors(sample_files[0][0].parent) == baseline + 2
    assert pool.stats().open_files == 2
    rests = read_round_robin(handles, 700)
    assert [a + b for a, b in zip(prefixes, rests, strict=True)] == CONTENTS[:6]
    assert pool.stats().max_open_files == 2


def test_default_cap_is_a_quarter_of_the_soft_rlimit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_open_files() == max(1, soft // 4)
    for fake_soft, expected in [(64, 16), (3, 1), (resource.RLIM_INFINITY, 1024)]:
        monkeypatch.setattr(resource, "getrlimit", lambda _, fake=fake_soft: (fake, fake))
        assert default_max_open_files() == expected


def test_set_max_open_files_sets_the_default_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filepool_module, "_default_pool", None)
    filepool_module.set_max_open_files(5)
    assert filepool_module.get_default_pool().max_open_files == 5
    filepool_module.set_max_open_files(7)  # an existing pool is changed in place
    assert filepool_module.get_default_pool().max_open_files == 7


# --------------------------------------------------------------------------- release


def test_close_and_context_manager_free_the_slot(sample_files: list[tuple[Path, str]]) -> None:
    pool = FilePool(1)
    baseline = open_descriptors(sample_files[0][0].parent)
    with pool.open(*sample_files[0]) as handle:
        assert handle.read(10) == CONTENTS[0][:10]
    assert handle.closed
    handle.close()  # idempotent
    assert open_descriptors(sample_files[0][0].parent) == baseline
    assert pool.stats().open_files == 0 and pool.stats().streams == 0
    with pytest.raises(ValueError, match="closed"):
        handle.read(1)


def test_garbage_collected_streams_release_their_slots(
    sample_files: list[tuple[Path, str]],
) -> None:
    pool = FilePool(2)
    baseline = open_descriptors(sample_files[0][0].parent)
    handle = pool.open(*sample_files[1])
    handle.read(10)
    collected = weakref.ref(handle)
    del handle  # no cycle: the pool must hold no reference that keeps the handle alive
    assert collected() is None
    assert pool.stats().open_files == 0 and pool.stats().streams == 0

    cyclic: list[object] = [pool.open(*sample_files[2])]
    cyclic.append(cyclic)
    del cyclic
    gc.collect()
    assert pool.stats().streams == 0
    assert open_descriptors(sample_files[0][0].parent) == baseline


def test_streams_collected_while_the_pool_lock_is_held_are_closed_on_release(
    sample_files: list[tuple[Path, str]],
) -> None:
    """A finalizer may run inside any allocation of a thread holding the lock: it must queue
    the stream instead of deadlocking, and the lock holder must close it on release."""
    pool = FilePool(2)
    handle = pool.open(*sample_files[0])
    with pool._locked:
        del handle
        assert len(pool._abandoned) == 1
    assert pool.stats().streams == 0 and pool.stats().open_files == 0


def test_missing_file_fails_at_open_and_frees_the_slot(tmp_path: Path) -> None:
    pool = FilePool(1)
    with pytest.raises(FileNotFoundError):
        pool.open(tmp_path / "missing")
    stats = pool.stats()
    assert stats.open_files == 0 and stats.streams == 0


def test_memory_account_balances_to_zero(sample_files: list[tuple[Path, str]]) -> None:
    pool = FilePool(1)
    account = RecordingAccount()
    handles = [
        pool.open(path, kind, memory_account=account, buffer_size=1_024)
        for path, kind in sample_files
    ]

    def check() -> None:
        assert account.balance == pool.stats().suspended_nbytes

    assert read_round_robin(handles, 500, check) == CONTENTS
    assert account.charges > 0
    compressed_suspended = sum(
        1 for handle in handles if handle.compression_type and not handle.holds_descriptor
    )
    assert account.balance >= compressed_suspended * streams_module.ZLIB_STATE_NBYTES
    for handle in handles:
        handle.close()
    assert account.balance == 0
    assert pool.stats().suspended_nbytes == 0


def test_stats_are_a_frozen_snapshot(sample_files: list[tuple[Path, str]]) -> None:
    pool = FilePool(3)
    stats = pool.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.open_files = 1  # type: ignore[misc]
    pool.open(*sample_files[0])
    assert stats.open_files == 0


# --------------------------------------------------------------------------- child processes


def run_child(script: str, *args: str) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter (its own RLIMIT_NOFILE) and return its JSON."""
    environment = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    result: dict[str, object] = json.loads(completed.stdout)
    return result


def expected_small_file(index: int) -> bytes:
    return (f"<{index}>" * (1 + index % 13)).encode()


TEN_THOUSAND_FILES_CHILD = """
    import gzip, json, os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    from headrace.io.filepool import get_default_pool

    def open_descriptors():
        return len(os.listdir("/proc/self/fd"))

    def expected(index):
        return ("<%d>" % index * (1 + index % 13)).encode()

    directory = sys.argv[1]
    names = sorted(os.listdir(directory))
    pool = get_default_pool()
    baseline = open_descriptors()
    peak_extra = 0
    wrong = []
    for start in range(0, len(names), 100):
        group = names[start : start + 100]
        handles = [
            pool.open(os.path.join(directory, name), "GZIP" if name.endswith(".gz") else None)
            for name in group
        ]
        received = [[] for _ in group]
        live = list(range(len(group)))
        while live:
            still_live = []
            for index in live:
                piece = handles[index].read(16)
                peak_extra = max(peak_extra, open_descriptors() - baseline)
                if piece:
                    received[index].append(piece)
                    still_live.append(index)
            live = still_live
        for name, handle, pieces in zip(group, handles, received):
            handle.close()
            if b"".join(pieces) != expected(int(name.split(".")[0])):
                wrong.append(name)
    stats = pool.stats()
    print(json.dumps({
        "cap": pool.max_open_files, "peak_extra": peak_extra, "wrong": wrong,
        "files": len(names), "peak_open_files": stats.peak_open_files,
        "open_after": open_descriptors() - baseline, "suspensions": stats.suspensions,
    }))
"""


@pytest.mark.slow
def test_ten_thousand_files_under_rlimit_64(tmp_path: Path) -> None:
    for index in range(10_000):
        content = expected_small_file(index)
        if index % 3 == 0:
            (tmp_path / f"{index:05d}.gz").write_bytes(gzip.compress(content))
        else:
            (tmp_path / f"{index:05d}.raw").write_bytes(content)
    result = run_child(TEN_THOUSAND_FILES_CHILD, str(tmp_path))
    assert result["files"] == 10_000
    assert result["wrong"] == []
    assert result["cap"] == 16  # a quarter of the soft RLIMIT_NOFILE of 64
    assert result["peak_open_files"] == 16
    assert isinstance(result["peak_extra"], int) and result["peak_extra"] <= 16
    assert result["open_after"] == 0


EXHAUSTED_DESCRIPTORS_CHILD = """
    import json, os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, hard))
    from headrace._errors import FileLimitError
    from headrace.io.filepool import FilePool

    def hog_all_descriptors():
        hogged = []
        try:
            while True:
                hogged.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return hogged

    paths = sys.argv[1:]
    pool = FilePool(20)
    result = {}

    # 1. The process runs out below the pool's cap, but the pool has idle streams: it
    #    gives its own back and carries on.
    handles = [pool.open(path) for path in paths[:3]]
    prefixes = [handle.read(3) for handle in handles]
    hogged = hog_all_descriptors()
    handles.append(pool.open(paths[3]))
    prefixes.append(b"")
    contents = [prefix + handle.read() for prefix, handle in zip(prefixes, handles)]
    result["recovered"] = [content.decode() for content in contents]
    result["suspensions"] = pool.stats().suspensions
    for handle in handles:
        handle.close()

    # 2. Nothing idle to give back: a FileLimitError that explains the fix.
    hogged += hog_all_descriptors()
    try:
        pool.open(paths[4])
    except FileLimitError as error:
        result["error"] = str(error)
        result["errno"] = error.errno
        result["is_oserror"] = isinstance(error, OSError)
    result["open_files_after"] = pool.stats().open_files
    print(json.dumps(result))
"""


def test_process_out_of_descriptors(tmp_path: Path) -> None:
    paths = []
    for index in range(5):
        path = tmp_path / f"small{index}"
        path.write_bytes(f"content of file {index}".encode())
        paths.append(str(path))
    result = run_child(EXHAUSTED_DESCRIPTORS_CHILD, *paths)
    assert result["recovered"] == [f"content of file {index}" for index in range(4)]
    assert isinstance(result["suspensions"], int) and result["suspensions"] >= 1
    assert result["is_oserror"] is True
    assert result["errno"] == errno.EMFILE
    message = result["error"]
    assert isinstance(message, str)
    for expected in ["RLIMIT_NOFILE", "32", "max_open_files=20", "ulimit -n", "set_max_open_files"]:
        assert expected in message
    assert paths[4] in message
    assert result["open_files_after"] == 0


def test_positioned_reads_leave_the_stream_where_it_was(
    sample_files: list[tuple[Path, str]],
) -> None:
    pool = FilePool(1)
    plain = pool.open(*sample_files[0])
    assert plain.read(10) == CONTENTS[0][:10]
    assert plain.pread_many([100, 0, len(CONTENTS[0]) - 5], [7, 3, 50]) == [
        CONTENTS[0][100:107], CONTENTS[0][:3], CONTENTS[0][-5:],  # short only at the end
    ]
    assert plain.read(5) == CONTENTS[0][10:15]
    compressed = pool.open(*sample_files[1])  # takes the only slot: plain is suspended
    with pytest.raises(InvalidArgumentError, match="positioned reads need an uncompressed"):
        compressed.pread_many([0], [1])
    assert plain.pread_many([3], [2]) == [CONTENTS[0][3:5]]  # resumed for the read
    scratch = bytearray(b"#" * 64)
    assert plain.pread_into(100, memoryview(scratch)[:7]) == 7  # into a reused buffer
    assert bytes(scratch[:7]) == CONTENTS[0][100:107] and scratch[7:] == b"#" * 57
    end = len(CONTENTS[0]) - 5
    assert plain.pread_into(end, memoryview(scratch)) == 5  # short only at the end
    assert bytes(scratch[:5]) == CONTENTS[0][-5:]
    assert plain.read(5) == CONTENTS[0][15:20]  # the stream's position did not move
    with pytest.raises(InvalidArgumentError, match="positioned reads need an uncompressed"):
        compressed.pread_into(0, memoryview(scratch))
    plain.close()
    compressed.close()
    assert pool.stats().open_files == 0
