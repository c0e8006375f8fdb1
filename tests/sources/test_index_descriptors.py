"""Indexed TFRecord reads and ``Dataset.load`` keep the file cap (G2), ``.hrx`` included.

An indexed shard's index is read whole and its shard fingerprinted when first used.
Those two descriptors are brief, but each is one more file while the pool's streams
are open: they must take a pool slot, or a pipeline holds cap + 1 files.
"""

from __future__ import annotations

import builtins
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import headrace as hr
import headrace.io.tfrecord_index as tfrecord_index
from headrace.io.filepool import FilePool
from headrace.io.tfrecord import write_tfrecord


def open_under(directory: Path) -> int:
    """Descriptors of this process open on files under ``directory``."""
    prefix, count = str(directory), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(prefix)
    return count


@pytest.fixture
def peak_at_index_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], int]]:
    """The most files open under a folder at the moment an index or shard is opened
    to load its index (counted right after each such open: exact, not sampled)."""
    folder: list[Path] = []
    peak = [0]
    real_open = builtins.open

    def counting_open(*args: Any, **kwargs: Any) -> Any:
        file = real_open(*args, **kwargs)
        if folder:
            peak[0] = max(peak[0], open_under(folder[0]))
        return file

    monkeypatch.setattr(tfrecord_index, "open", counting_open, raising=False)

    def watch(directory: Path) -> int:
        folder[:] = [directory]
        return peak[0]

    yield watch


def shards(directory: Path, rng: random.Random) -> list[str]:
    names = []
    for shard in range(rng.randint(6, 24)):
        name = directory / f"s{shard:03d}.tfrecord"
        write_tfrecord(name, [b"%d:%d" % (shard, i) for i in range(rng.randint(1, 6))])
        names.append(str(name))
    return names


def pipeline(kind: str, names: list[str], rng: random.Random) -> hr.Dataset:
    if kind == "global_shuffle":
        return hr.TFRecordDataset(names, indexed=True).global_shuffle(seed=rng.randrange(99))
    if kind == "shuffle":
        return hr.TFRecordDataset(names, indexed=True).shuffle(500, seed=rng.randrange(99))
    parts = rng.randint(2, 5)
    return hr.Dataset.zip(
        tuple(hr.TFRecordDataset(names[i::parts], indexed=True) for i in range(parts))
    )


@pytest.mark.parametrize("seed", range(6))
def test_indexed_reads_never_hold_more_files_than_the_cap(
    tmp_path: Path, seed: int, peak_at_index_opens: Callable[[Path], int]
) -> None:
    rng = random.Random(seed)
    names = shards(tmp_path, rng)
    kind = rng.choice(["global_shuffle", "shuffle", "zip"])
    cap = rng.randint(1, 5)
    oracle = [repr(x) for x in pipeline(kind, names, random.Random(seed))]
    peak_at_index_opens(tmp_path)  # watch from here: the oracle ran uncapped
    got = [
        repr(x)
        for x in pipeline(kind, names, random.Random(seed)).with_options(
            hr.Options(max_open_files=cap)
        )
    ]
    assert got == oracle, (kind, cap)  # same values, same order
    assert 0 < peak_at_index_opens(tmp_path) <= cap, (kind, cap)
    assert open_under(tmp_path) == 0


@pytest.mark.parametrize("seed", range(3))
def test_load_of_many_shards_never_holds_more_files_than_the_cap(
    tmp_path: Path, seed: int, peak_at_index_opens: Callable[[Path], int]
) -> None:
    rng = random.Random(seed)
    count, num_shards, cap = rng.randint(50, 300), rng.randint(20, 60), rng.randint(1, 6)
    hr.Dataset.from_tensor_slices(np.arange(count)).save(str(tmp_path), num_shards=num_shards)
    # As a save made before record sizes were recorded (or of records of mixed sizes):
    # each part's offsets come from its index.
    manifest_path = tmp_path / "headrace-dataset.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["record_bytes"]
    manifest_path.write_text(json.dumps(manifest))
    order_seed = rng.randrange(99)
    oracle = [int(x) for x in hr.Dataset.load(str(tmp_path)).global_shuffle(seed=order_seed)]
    assert sorted(oracle) == list(range(count))
    peak_at_index_opens(tmp_path)
    got = [
        int(x)
        for x in hr.Dataset.load(str(tmp_path))
        .global_shuffle(seed=order_seed)
        .with_options(hr.Options(max_open_files=cap))
    ]
    assert got == oracle
    assert 0 < peak_at_index_opens(tmp_path) <= cap, (num_shards, cap)


def test_load_of_one_size_records_opens_no_index(
    tmp_path: Path, peak_at_index_opens: Callable[[Path], int]
) -> None:
    """Parts whose records all have one size (the manifest says so) are read at computed
    offsets: their indexes are never opened, so they cost no file slot and no memory."""
    hr.Dataset.from_tensor_slices(np.arange(90)).save(str(tmp_path), num_shards=7)
    peak_at_index_opens(tmp_path)
    got = [
        int(x)
        for x in hr.Dataset.load(str(tmp_path))
        .global_shuffle(seed=5)
        .with_options(hr.Options(max_open_files=2))
    ]
    assert sorted(got) == list(range(90)) and got != list(range(90))
    assert peak_at_index_opens(tmp_path) == 0
    assert open_under(tmp_path) == 0


def test_a_borrowed_slot_suspends_an_idle_stream_and_waits_for_none(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 100)
    pool = FilePool(1)
    with pool.open(str(path)) as stream:
        assert stream.read(10) == b"x" * 10
        with pool.borrow():
            assert pool.stats().open_files == 1
            assert not stream.holds_descriptor  # suspended to make room
        assert stream.read(5) == b"x" * 5  # and resumed at the same byte
        assert stream.tell() == 15
    assert pool.stats().open_files == 0
