"""Index files: O(1) random access, and refusal of indexes that no longer fit their shard."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from headrace._errors import DataLossError
from headrace.io.tfrecord import write_tfrecord
from headrace.io.tfrecord_index import (
    StaleIndexError,
    build_index,
    index_path_for,
    load_index,
    load_or_build_index,
)

RECORDS = [b"record-%d" % i * (i % 5 + 1) for i in range(500)]


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    path = tmp_path / "shard.tfrecord"
    write_tfrecord(path, RECORDS)
    return path


def test_build_then_load_gives_random_access(shard: Path) -> None:
    built = build_index(shard)
    assert os.path.exists(index_path_for(shard))
    loaded = load_index(shard)
    assert len(loaded) == len(RECORDS)
    np.testing.assert_array_equal(loaded.offsets, built.offsets)
    assert not loaded.offsets.flags.writeable
    with open(shard, "rb") as file:
        for i in [0, 1, 250, 499]:
            assert loaded.read(file, i) == RECORDS[i]
            assert loaded.payload_length(i) == len(RECORDS[i])


def test_missing_index_names_files(shard: Path) -> None:
    with pytest.raises(StaleIndexError, match=r"no index file .*shard\.tfrecord\.hrx"):
        load_index(shard)


def test_appended_shard_makes_index_stale(shard: Path) -> None:
    build_index(shard)
    with open(shard, "ab") as file:
        file.write(b"\x00")
    with pytest.raises(StaleIndexError, match=r"is stale: .*shard\.tfrecord changed"):
        load_index(shard)


def test_same_size_rewrite_with_preserved_mtime_is_detected(shard: Path) -> None:
    build_index(shard)
    stat = os.stat(shard)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1  # last record's payload, inside the fingerprint's tail window
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(StaleIndexError, match="is stale"):
        load_index(shard)


def test_corrupt_index_file_is_refused(shard: Path) -> None:
    build_index(shard)
    index_file = Path(index_path_for(shard))
    data = bytearray(index_file.read_bytes())
    data[-1] ^= 1
    index_file.write_bytes(bytes(data))
    with pytest.raises(StaleIndexError, match="corrupt"):
        load_index(shard)
    index_file.write_bytes(bytes(data[:-3]))
    with pytest.raises(StaleIndexError, match="truncated"):
        load_index(shard)


def test_load_or_build_rebuilds(shard: Path) -> None:
    assert len(load_or_build_index(shard)) == len(RECORDS)
    assert len(load_index(shard)) == len(RECORDS)


def test_empty_shard(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    write_tfrecord(path, [])
    build_index(path)
    assert len(load_index(path)) == 0


def test_truncated_shard_cannot_be_indexed(shard: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataLossError, match="truncated record at offset"):
        build_index(shard)
    assert not os.path.exists(index_path_for(shard))
