"""Sharding across workers: FILE splits the file list, DATA splits elements; env detection."""

from __future__ import annotations

import collections
import json
import random
import re
from typing import Any

import numpy as np
import pytest
import shard_cases as sc

import headrace as hr
from headrace.adapters._sharding import shard_for_worker


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


# -- sharding never splits an element: the unsharded pipeline is the oracle ---------------

#: Every way a pipeline is split among workers: auto_shard's two policies (hosts) and the
#: three worker_sharding policies of DataLoader workers (run here in-process: the same code).
POLICIES = ("data", "file", "auto", "source", "output")


def _part(ds: hr.Dataset, policy: str, num_shards: int, index: int) -> hr.Dataset:
    if policy in ("data", "file"):
        return hr.auto_shard(ds, policy, num_shards=num_shards, index=index)
    return shard_for_worker(ds, policy, num_shards, index, split_budget=False)


def _check_refusal(error: Exception, policy: str, ds: hr.Dataset) -> None:
    """A refusal is allowed only where the policy promises one, and names a stage present."""
    assert policy in ("file", "source"), f"{policy} refused: {error}"
    named = re.search(r"the '([^']+)' (?:stage|source)", str(error))
    assert named is not None, f"the refusal names no stage: {error}"
    assert named.group(1) in sc.stages(ds.node), f"names a stage not in the pipeline: {error}"


@pytest.mark.parametrize("seed", range(10))
def test_every_policy_delivers_the_unsharded_tuples_whole(tmp_path, seed: int) -> None:
    """Random pipelines (zips of file readers, arrays and generators, nested zips, filter,
    batch with and without drop_remainder, concatenate, interleave over files, take/skip,
    enumerate), random worker counts, every policy: over all workers, exactly the unsharded
    pipeline's rows, each tuple paired as unsharded; each worker's part the same twice."""
    env = sc.make_env(str(tmp_path), seed)
    rng = random.Random(seed)
    for case_number in range(4):
        case = sc.random_case(rng, env)
        expected = sc.multiset(sc.rows(case.dataset, case.batched))
        for policy in POLICIES:
            workers = rng.randint(1, 4)
            where = f"case {case_number} {sc.describe(case.dataset.node)}, {policy}, {workers} workers"
            try:
                parts = [_part(case.dataset, policy, workers, i) for i in range(workers)]
            except hr.InvalidArgumentError as error:
                _check_refusal(error, policy, case.dataset)
                continue
            got = [sc.rows(part, case.batched) for part in parts]
            union = sum((sc.multiset(part) for part in got), collections.Counter())
            assert union == expected, (
                f"{where}: missing {list((expected - union).elements())[:5]}, "
                f"extra {list((union - expected).elements())[:5]}"
            )
            for part, first in zip(parts, got, strict=True):
                assert sc.rows(part, case.batched) == first, f"{where}: not deterministic"


def _int_files(directory, counts: list[int]) -> list[str]:
    from headrace.io.tfrecord import write_tfrecord

    paths, value = [], 0
    for i, count in enumerate(counts):
        path = str(directory / f"ints-{i}.tfrecord")
        write_tfrecord(path, [str(value + j).encode() for j in range(count)])
        value += count
        paths.append(path)
    return paths


def test_file_policy_refusals_name_the_stage(tmp_path) -> None:
    """Where splitting by file would pair, drop or count elements differently than the
    unsharded pipeline, FILE refuses and says which stage and what to do instead."""
    files = _int_files(tmp_path, [3, 5, 2, 4])
    records = hr.TFRecordDataset(files).map(sc.to_int, output_signature=sc.INT)
    labels = hr.Dataset.from_tensor_slices(np.arange(14) * 10)
    refused = {
        "'zip' stage pairs its inputs by position": hr.Dataset.zip(records, labels),
        "'batch' stage counts elements by position (drop_remainder=True": records.batch(
            4, drop_remainder=True
        ),
        "'take' stage counts elements by position": records.take(5),
        "'from_tensor_slices' source reads no list of files": records.concatenate(labels),
    }
    for message, ds in refused.items():
        with pytest.raises(hr.InvalidArgumentError, match=re.escape(message)) as caught:
            hr.auto_shard(ds, "file", num_shards=2, index=0)
        assert "AutoShardPolicy.DATA" in str(caught.value)
        # ... and DATA shards them whole: the same rows, each once, pairs kept
        parts = [hr.auto_shard(ds, "data", num_shards=2, index=i) for i in range(2)]
        batched = "batch" in message
        union = sc.multiset(sc.rows(parts[0], batched) + sc.rows(parts[1], batched))
        assert union == sc.multiset(sc.rows(ds, batched))
    # over an endless input nothing is ever dropped: FILE shards below such a batch
    endless = hr.auto_shard(records.repeat().batch(4, drop_remainder=True), num_shards=2,
                            index=1)
    seen = {row[0] for row in sc.rows(endless.take(10), batched=True)}
    assert seen == set(range(3, 8)) | set(range(10, 14))  # files 1 and 3 only


def test_file_policy_shards_a_zip_of_the_same_files_alike(tmp_path) -> None:
    """Inputs reading the same files through one-to-one stages: each worker opens only its
    own files, in every input, and the pairs stay aligned; a remainder batch is kept."""
    files = _int_files(tmp_path, [3, 0, 5, 2, 4])
    records = hr.TFRecordDataset(files).map(sc.to_int, output_signature=sc.INT)
    ds = hr.Dataset.zip(records, records.map(sc.plus_one)).filter(sc.keep).batch(3)
    expected = sc.multiset(sc.rows(ds, batched=True))
    parts = [hr.auto_shard(ds, num_shards=2, index=i) for i in range(2)]
    got = [sc.rows(part, batched=True) for part in parts]
    assert sc.multiset(got[0] + got[1]) == expected
    assert all(b == a + 1 for a, b in got[0] + got[1])
    assert {a for a, _ in got[0]} <= set(range(8)) | set(range(10, 14))  # files 0, 2, 4
    assert {a for a, _ in got[1]} <= {8, 9}  # files 1 (empty) and 3
    # one stream zipped with itself (here an interleave over the names): its files split once
    mixed = hr.TFRecordDataset(files, num_parallel_reads=2).map(sc.to_int, output_signature=sc.INT)
    twice = hr.Dataset.zip(mixed, mixed.map(sc.plus_one))
    parts = [hr.auto_shard(twice, num_shards=2, index=i) for i in range(2)]
    got = [sc.rows(part, batched=False) for part in parts]
    assert sc.multiset(got[0] + got[1]) == sc.multiset(sc.rows(twice, batched=False))
    assert {a for a, _ in got[1]} == {8, 9}


def test_dropping_the_remainder_keeps_the_unsharded_count() -> None:
    """1000 rows in batches of 64 dropping the remainder are 960 rows: so they stay over
    two workers (the issue saw 896: each worker dropped a partial batch of its own)."""
    ds = hr.Dataset.zip(
        hr.Dataset.range(1000), hr.Dataset.from_tensor_slices(np.arange(1000) * 2)
    ).batch(64, drop_remainder=True)
    for policy in ("auto", "output", "data"):
        parts = [_part(ds, policy, 2, i) for i in range(2)]
        pairs = [pair for part in parts for pair in sc.rows(part, batched=True)]
        assert len(pairs) == 960 and all(b == 2 * a for a, b in pairs), policy
    with pytest.raises(hr.InvalidArgumentError, match="'batch' stage counts elements"):
        _part(ds, "source", 2, 0)


@pytest.mark.parametrize("seed", range(3))
def test_data_policy_pushes_a_sql_key_only_through_stages_that_allow_it(tmp_path, seed) -> None:
    """DATA over ``from_sql(key=...)`` becomes a WHERE on the key, which splits rows by
    content: under take/skip/enumerate that would change what they select (each worker
    taking its own first rows), so the shard stays above them there."""
    import sqlite3

    path = tmp_path / "t.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER)")
    db.executemany("INSERT INTO t VALUES (?, ?)", [(i, 3 * i) for i in range(60)])
    db.commit()
    db.close()
    rng = random.Random(seed)
    base = hr.Dataset.from_sql("SELECT id, v FROM t", connection=f"sqlite:///{path}", key="id",
                               batch_size=rng.randint(1, 9)).unbatch()
    for _ in range(3):
        ds = base
        for step in rng.sample(["take", "skip", "filter", "enumerate", "shuffle"], 2):
            if step == "take":
                ds = ds.take(rng.randint(0, 40))
            elif step == "skip":
                ds = ds.skip(rng.randint(0, 20))
            elif step == "filter":
                ds = ds.filter(sc.keep)
            elif step == "enumerate":
                ds = ds.enumerate()
            else:
                ds = ds.shuffle(8, seed=1, reshuffle_each_iteration=False)
        workers = rng.randint(2, 4)
        parts = [hr.auto_shard(ds, "data", num_shards=workers, index=i) for i in range(workers)]
        union = sum((sc.multiset(sc.rows(part, False)) for part in parts), collections.Counter())
        assert union == sc.multiset(sc.rows(ds, False)), sc.describe(ds.node)


@pytest.mark.parametrize("make", [
    lambda: hr.Dataset.range(100).shuffle(100),
    lambda: hr.Dataset.range(100).map(lambda x: x).shuffle(10).batch(5),
    lambda: hr.Dataset.range(100).shuffle(10, seed=1).shuffle(5).prefetch(2),
])
def test_data_sharding_refuses_a_random_stage_without_a_seed(make: Any) -> None:
    """Each worker runs the whole pipeline: unseeded, each draws another order, and the
    workers together repeated and lost about a quarter of the elements, silently."""
    with pytest.raises(hr.InvalidArgumentError, match="has no seed"):
        hr.auto_shard(make(), "data", num_shards=2, index=0)
    seeded = hr.Dataset.range(100).shuffle(100, seed=3)
    parts = [list(hr.auto_shard(seeded, "data", num_shards=2, index=i)) for i in range(2)]
    assert sorted(int(x) for part in parts for x in part) == list(range(100))
