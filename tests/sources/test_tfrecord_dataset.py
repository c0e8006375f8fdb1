"""TFRecordDataset: streaming and indexed reading, errors with file and offset, resume."""

from __future__ import annotations

import os

import numpy as np
import pytest

import headrace as hr
from headrace.core.state import seal
from headrace.io.example import FixedLenFeature, serialize_example
from headrace.io.tfrecord import write_tfrecord
from headrace.io.tfrecord_index import build_index
from headrace.testing import assert_checkpoint_roundtrip

SPEC = {"x": FixedLenFeature((4,), np.float32), "y": FixedLenFeature((), np.int64)}


def make_shards(directory, shards=3, records=7, compression=None) -> list[str]:
    paths = []
    for shard in range(shards):
        path = os.path.join(directory, f"part-{shard}.tfrecord")
        examples = [
            serialize_example({"x": np.full(4, i, np.float32), "y": np.int64(shard * 100 + i)})
            for i in range(records)
        ]
        write_tfrecord(path, examples, compression_type=compression)
        paths.append(path)
    return paths


def ys(dataset: hr.Dataset) -> list[int]:
    return [int(y) for batch in dataset.batch(5).parse_examples(SPEC) for y in batch["y"]]


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_reads_every_record_in_file_order(tmp_path, compression) -> None:
    files = make_shards(tmp_path, compression=compression)
    expected = [s * 100 + i for s in range(3) for i in range(7)]
    assert ys(hr.TFRecordDataset(files, compression_type=compression)) == expected
    assert len(list(hr.TFRecordDataset(files, compression_type=compression))) == 21


def test_num_parallel_reads_interleaves_round_robin(tmp_path) -> None:
    files = make_shards(tmp_path, records=2)
    assert ys(hr.TFRecordDataset(files, num_parallel_reads=2)) == [0, 100, 1, 101, 200, 201]


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_checkpoint_roundtrip_streaming(tmp_path, compression) -> None:
    files = make_shards(tmp_path, compression=compression)
    assert_checkpoint_roundtrip(hr.TFRecordDataset(files, compression_type=compression))
    assert_checkpoint_roundtrip(hr.TFRecordDataset(files, compression_type=compression).batch(4))


def test_parse_examples_fingerprint_holds_once_batches_are_parsed(tmp_path) -> None:
    """A checkpoint taken after parse_examples has parsed batches restores into a pipeline
    built afresh: the parse's fingerprint is the same before and after it has run (its
    plan, made once, was set on the first batch and changed the fingerprint)."""
    files = make_shards(tmp_path)

    def make() -> hr.Dataset:
        return hr.TFRecordDataset(files).batch(4).parse_examples(SPEC)

    used = make()
    with iter(used) as iterator:
        next(iterator)
        assert used.fingerprint() == make().fingerprint()
    assert_checkpoint_roundtrip(make())
    with pytest.raises(hr.InvalidArgumentError, match="unsupported spec"):
        hr.TFRecordDataset(files).batch(4).parse_examples({"x": "not a spec"})


def corrupt(path: str, at: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_record_names_file_and_offset(tmp_path) -> None:
    files = make_shards(tmp_path, records=5)
    record_bytes = os.path.getsize(files[1]) // 5
    corrupt(files[1], 2 * record_bytes + 20)  # inside record 2's data
    with pytest.raises(hr.DataLossError, match=rf"offset {2 * record_bytes} in file .*part-1"):
        list(hr.TFRecordDataset(files))


def test_skip_corrupt_is_opt_in_and_counted(tmp_path) -> None:
    files = make_shards(tmp_path, records=5)
    record_bytes = os.path.getsize(files[1]) // 5
    corrupt(files[1], 2 * record_bytes + 20)
    with iter(hr.TFRecordDataset(files, skip_corrupt=True)) as iterator:
        assert len(list(iterator)) == 14  # one record lost, and said so
        stats = iterator.stats()
    assert stats.skipped_records == 1


def test_truncated_file_is_an_error(tmp_path) -> None:
    (path,) = make_shards(tmp_path, shards=1, records=3)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 3)
    with pytest.raises(hr.DataLossError, match="truncated record at offset"):
        list(hr.TFRecordDataset(path))


def test_huge_declared_length_is_refused_before_allocating(tmp_path) -> None:
    path = tmp_path / "huge.tfrecord"
    path.write_bytes((1 << 40).to_bytes(8, "little") + b"\0" * 12)
    with pytest.raises(hr.RecordTooLargeError):
        list(hr.TFRecordDataset(str(path), verify_crc=False, max_record_bytes=1 << 20))


def test_indexed_dataset_is_random_access(tmp_path) -> None:
    files = make_shards(tmp_path)
    indexed = hr.TFRecordDataset(files, indexed=True)
    assert indexed.cardinality() == 21
    assert all(os.path.exists(f + ".hrx") for f in files)
    assert ys(indexed) == ys(hr.TFRecordDataset(files))
    assert ys(indexed.shard(3, 1)) == ys(hr.TFRecordDataset(files))[1::3]
    order = ys(indexed.global_shuffle(seed=3))
    assert sorted(order) == sorted(ys(indexed)) and order != ys(indexed)
    assert_checkpoint_roundtrip(indexed.global_shuffle(seed=3).batch(4))


def test_indexed_reads_return_requested_records_in_order(tmp_path, monkeypatch) -> None:
    import headrace._sources.tfrecord as source_module

    files = make_shards(tmp_path, shards=2, records=40)
    streamed = list(hr.TFRecordDataset(files))
    access = hr.TFRecordDataset(files, indexed=True)._node.random_access()
    wanted = np.array([79, 3, 4, 5, 41, 40, 3, 0, 39, 6, 7, 8, 9, 79])  # runs, repeats
    for run_bytes in (1 << 20, 150, 10):  # a read per run, per 2 records (57 B each), per 1
        monkeypatch.setattr(source_module, "_MAX_RUN_BYTES", run_bytes)
        assert list(access.get_many(wanted)) == [streamed[i] for i in wanted]
        assert access.get(41) == streamed[41]
    with pytest.raises(IndexError, match="record 80 of 80"):
        access.get_many(np.array([1, 80]))
    access.close()


def test_indexed_corrupt_record_names_file_and_offset(tmp_path) -> None:
    files = make_shards(tmp_path, records=5)
    record_bytes = os.path.getsize(files[1]) // 5
    corrupt(files[1], 3 * record_bytes + 20)  # a payload byte: indexing reads only framing
    ds = hr.TFRecordDataset(files, indexed=True)
    with pytest.raises(hr.DataLossError, match=rf"offset {3 * record_bytes} in file .*part-1.*data"):
        list(ds.global_shuffle(seed=1).batch(8))


def test_stale_index_is_refused(tmp_path) -> None:
    files = make_shards(tmp_path, shards=1)
    build_index(files[0])
    with open(files[0], "ab") as handle:  # the shard changed after it was indexed
        handle.write(b"x")
    with pytest.raises(hr.DataLossError, match=r"stale|changed"):
        hr.TFRecordDataset(files, indexed=True)


def test_indexed_requires_uncompressed(tmp_path) -> None:
    files = make_shards(tmp_path, compression="GZIP")
    with pytest.raises(hr.InvalidArgumentError, match="uncompressed"):
        hr.TFRecordDataset(files, compression_type="GZIP", indexed=True)


def test_global_shuffle_is_a_full_permutation_reshuffled_each_epoch() -> None:
    ds = hr.Dataset.range(1000).global_shuffle(seed=1)
    first, second = [int(v) for v in ds], [int(v) for v in ds]
    assert sorted(first) == list(range(1000)) and sorted(second) == list(range(1000))
    assert first != second and first != list(range(1000))
    fixed = hr.Dataset.range(1000).global_shuffle(seed=1, reshuffle_each_iteration=False)
    assert [int(v) for v in fixed] == [int(v) for v in fixed]
    workers = [
        [int(v) for v in hr.Dataset.range(1000).global_shuffle(seed=5).shard(4, rank)]
        for rank in range(4)
    ]
    assert sorted(v for worker in workers for v in worker) == list(range(1000))
    with pytest.raises(hr.InvalidArgumentError, match="filter does not support random access"):
        hr.Dataset.range(5).filter(lambda x: True).global_shuffle()


def test_global_shuffle_resumes_in_constant_time() -> None:
    import time

    ds = hr.Dataset.range(10**9).global_shuffle(seed=2).batch(1000)
    with iter(ds) as iterator:
        next(iterator)
        state = iterator.get_state()
        expected = next(iterator)

    def resume_at(position: int) -> tuple[float, list[np.ndarray]]:
        state["state"]["inputs"][0]["indices"]["position"] = position
        seal(state)  # a position far ahead, as if taken there (the state's own checksum)
        with iter(ds) as resumed:
            started = time.perf_counter()
            resumed.set_state(state)
            elapsed = time.perf_counter() - started
            return elapsed, [next(resumed), next(resumed)]

    _, (first, _) = resume_at(1000)
    far, (batch, following) = resume_at(900_000_000)
    np.testing.assert_array_equal(first, expected)  # the same permutation, resumed
    assert far < 1.0  # ~1 ms: no replay of the 900 million before it (that takes minutes)
    assert batch.shape == (1000,) and batch.min() >= 0 and batch.max() < 10**9
    assert len(np.unique(np.concatenate([batch, following]))) == 2000  # a permutation
    _, (again, _) = resume_at(900_001_000)
    np.testing.assert_array_equal(again, following)
