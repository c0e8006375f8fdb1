"""Sharding across workers: FILE splits the file list, DATA splits elements; env detection."""

from __future__ import annotations

import json

import numpy as np
import pytest

import headrace as hr


def write_files(directory, count: int) -> list[str]:
    paths = []
    for i in range(count):
        path = directory / f"shard-{i:03d}.txt"
        path.write_bytes("".join(f"{i}:{j}\n" for j in range(3)).encode())
        paths.append(str(path))
    return paths


def lines(ds: hr.Dataset) -> list[str]:
    return [line.decode() for line in ds]


def test_file_policy_splits_the_file_list_of_a_reader(tmp_path) -> None:
    files = write_files(tmp_path, 5)
    ds = hr.TextLineDataset(files)
    parts = [lines(hr.auto_shard(ds, num_shards=2, index=i)) for i in range(2)]
    assert parts[0] == [f"{i}:{j}" for i in (0, 2, 4) for j in range(3)]
    assert parts[1] == [f"{i}:{j}" for i in (1, 3) for j in range(3)]


def test_file_policy_shards_names_before_an_interleave_even_if_shuffled(tmp_path) -> None:
    write_files(tmp_path, 6)
    ds = hr.Dataset.list_files(str(tmp_path / "*.txt"), seed=3).interleave(
        lambda f: hr.TextLineDataset(f), cycle_length=2
    )
    parts = [set(lines(hr.auto_shard(ds, num_shards=3, index=i))) for i in range(3)]
    assert set.union(*parts) == set(lines(ds))
    assert sum(len(p) for p in parts) == 18  # disjoint: no file read twice
    for part in parts:  # each worker reads whole files, only its own
        assert len({line.split(":")[0] for line in part}) == 2


def test_fewer_files_than_shards_is_a_clear_error(tmp_path) -> None:
    files = write_files(tmp_path, 2)
    with pytest.raises(hr.InvalidArgumentError, match="only 2 file"):
        hr.auto_shard(hr.TextLineDataset(files), num_shards=3, index=0)
    data = hr.auto_shard(hr.TextLineDataset(files), "DATA", num_shards=3, index=1)
    assert lines(data) == lines(hr.TextLineDataset(files))[1::3]


def test_file_policy_without_files_says_to_use_data() -> None:
    with pytest.raises(hr.InvalidArgumentError, match="DATA"):
        hr.auto_shard(hr.Dataset.range(10), num_shards=2, index=0)


def test_shard_info_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    assert hr.shard_info() == hr.ShardInfo(4, 2, "WORLD_SIZE/RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    config = {"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
              "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert hr.shard_info() == hr.ShardInfo(3, 2, "TF_CONFIG")
    assert hr.shard_info(5, 1).source == "given"
    with pytest.raises(hr.InvalidArgumentError, match="invalid shard 5 of 5"):
        hr.shard_info(5, 5)


def test_auto_shard_reads_the_environment(monkeypatch, tmp_path) -> None:
    files = write_files(tmp_path, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert lines(hr.auto_shard(hr.TextLineDataset(files))) == [
        f"{i}:{j}" for i in (1, 3) for j in range(3)
    ]


def test_indexed_tfrecord_file_sharding(tmp_path) -> None:
    from headrace.io.tfrecord import write_tfrecord

    files = []
    for i in range(4):
        path = str(tmp_path / f"{i}.tfrecord")
        write_tfrecord(path, [f"{i}-{j}".encode() for j in range(3)])
        files.append(path)
    ds = hr.TFRecordDataset(files, indexed=True)
    part = hr.auto_shard(ds, num_shards=2, index=0)
    assert [r.decode() for r in part] == [f"{i}-{j}" for i in (0, 2) for j in range(3)]
    assert part.cardinality() == 6
    assert np.all(np.isin([r.decode() for r in part], [r.decode() for r in ds]))
