"""save_tfrecords: byte-exact Examples, deterministic shards, atomicity, indexes, progress."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import headrace as hr
from headrace._errors import InvalidArgumentError
from headrace._persist.writers import ProgressBar, save_tfrecords, shard_paths
from headrace.io import filepool
from headrace.io.example import decode_example, serialize_example
from headrace.io.example.encoding import encode_example_columns
from headrace.io.tfrecord import TFRecordReader, open_tfrecord
from headrace.io.tfrecord_index import index_path_for, load_index

ROWS = 2500  # more than two encoding chunks of 1024


def columns(rows: int = ROWS) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    ids = np.empty(rows, dtype=object)
    ids[:] = [b"id-%06d\x00" % i for i in range(rows)]  # trailing NUL must survive (G5)
    return {
        "x": rng.standard_normal((rows, 4), dtype=np.float32),
        "y": rng.integers(-(1 << 40), 1 << 40, rows),
        "id": ids,
    }


def read_all(paths: list[str], compression_type: str | None = None) -> list[bytes]:
    records: list[bytes] = []
    for path in paths:
        with open_tfrecord(path, compression_type=compression_type) as reader:
            records.extend(reader)
    return records


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------- encoding


def _irregular_rows(count: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    return [
        {
            "f32": rng.random(3, dtype=np.float32),
            "f64": rng.random((2, 2)),
            "pyfloat": 0.1 * i,
            "pyint": i - 5,
            "big": (1 << 62) + i,
            "negative": np.int64(-i),
            "flag": bool(i % 2),
            "u8": np.arange(i % 4, dtype=np.uint8),  # ragged across rows: slow path
            "text": "é" * (i % 300),  # head length changes past 127 bytes
            "raw": b"\x00" * (i % 3),
            "empty": np.zeros(0, np.float32),
            "empty_int": np.zeros(0, np.int64),
            "pylist": [1, 2.5],
            "objects": np.array([b"a\x00", "bc"], dtype=object),
            "unicode": np.array(["x", "yz"]),
            "fixed": np.array([b"ab", b"c"], dtype="S2"),
        }
        for i in range(count)
    ]


def test_column_encoding_is_byte_identical_to_serialize_example() -> None:
    rows = _irregular_rows(300)
    expected = [serialize_example(row) for row in rows]
    got = encode_example_columns({key: [row[key] for row in rows] for key in rows[0]})
    assert got == expected


def test_batched_columns_are_byte_identical_to_rows() -> None:
    data = columns(50)
    rows = [{key: value[i] for key, value in data.items()} for i in range(50)]
    assert encode_example_columns(data) == [serialize_example(row) for row in rows]


def test_mixed_types_in_one_column_keep_their_own_kind() -> None:
    rows = [{"v": 1}, {"v": 2.5}, {"v": b"z"}, {"v": np.float32(1)}, {"v": [1, 2]}]
    got = encode_example_columns({"v": [row["v"] for row in rows]})
    assert got == [serialize_example(row) for row in rows]
    assert decode_example(got[0])["v"][0] == "int64_list"
    assert decode_example(got[1])["v"][0] == "float_list"


# --------------------------------------------------------------------------- paths


def test_shard_paths_directory_and_pattern(tmp_path: Path) -> None:
    assert shard_paths(tmp_path, 2) == [
        str(tmp_path / "part-00000-of-00002.tfrecord"),
        str(tmp_path / "part-00001-of-00002.tfrecord"),
    ]
    pattern = str(tmp_path / "train-{shard:03d}-{num_shards}.rec")
    assert shard_paths(pattern, 2)[1] == str(tmp_path / "train-001-2.rec")
    with pytest.raises(InvalidArgumentError, match="same name"):
        shard_paths(str(tmp_path / "x-{num_shards}-{shard!s:.0}"), 3)
    with pytest.raises(InvalidArgumentError, match="shard"):
        shard_paths(str(tmp_path / "x-{num_shards}"), 2)
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        shard_paths(tmp_path, 0)


# --------------------------------------------------------------------------- writing


def test_contiguous_shards_when_cardinality_is_known(tmp_path: Path) -> None:
    data = columns()
    dataset = hr.Dataset.from_tensor_slices(data)
    paths = dataset.save_tfrecords(tmp_path, num_shards=3, progress=False)
    assert paths == shard_paths(tmp_path, 3)
    sizes = [len(read_all([path])) for path in paths]
    assert sizes == [834, 833, 833]  # the first n % num_shards shards get one more
    expected = [serialize_example(element) for element in dataset]
    assert read_all(paths) == expected  # shards in order = the dataset in order
    ids = [decode_example(record)["id"][1][0] for record in read_all(paths)]
    assert ids[:2] == [b"id-000000\x00", b"id-000001\x00"]


def test_round_robin_when_cardinality_is_unknown(tmp_path: Path) -> None:
    data = columns(100)

    def rows() -> Iterator[dict[str, Any]]:
        for i in range(100):
            yield {key: value[i] for key, value in data.items()}

    paths = save_tfrecords(rows(), tmp_path, num_shards=3, progress=False)
    expected = [serialize_example(row) for row in rows()]
    for shard, path in enumerate(paths):
        assert read_all([path]) == expected[shard::3]


def test_batched_elements_split_into_rows(tmp_path: Path) -> None:
    data = columns()
    dataset = hr.Dataset.from_tensor_slices(data).batch(300)
    paths = save_tfrecords(dataset, tmp_path, num_shards=4, progress=False, batched=True)
    expected = [serialize_example(element) for element in hr.Dataset.from_tensor_slices(data)]
    for shard, path in enumerate(paths):
        assert read_all([path]) == expected[shard::4]


def test_batched_needs_one_leading_dimension(tmp_path: Path) -> None:
    bad = [{"a": np.zeros((3, 2)), "b": np.zeros(2)}]
    with pytest.raises(InvalidArgumentError, match="same leading dimension"):
        save_tfrecords(bad, tmp_path, progress=False, batched=True)
    with pytest.raises(InvalidArgumentError, match="batched=False"):
        save_tfrecords([{"a": 1}], tmp_path, progress=False, batched=True)
    assert listing(tmp_path) == []


def test_indexes_are_written_and_valid(tmp_path: Path) -> None:
    paths = hr.Dataset.from_tensor_slices(columns()).save_tfrecords(
        tmp_path, num_shards=2, progress=False
    )
    for path in paths:
        index = load_index(path)
        with open(path, "rb") as file:
            assert [index.read(file, i) for i in (0, len(index) - 1)] == [
                read_all([path])[0],
                read_all([path])[-1],
            ]
    expected = sorted(paths + [index_path_for(p) for p in paths])
    assert listing(tmp_path) == [os.path.basename(p) for p in expected]  # no leftovers


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_shards_have_no_index(tmp_path: Path, compression: str) -> None:
    stale = tmp_path / "part-00000-of-00002.tfrecord.hrx"
    stale.write_bytes(b"from an older uncompressed run")
    data = columns(100)
    paths = hr.Dataset.from_tensor_slices(data).save_tfrecords(
        tmp_path, num_shards=2, compression_type=compression, progress=False
    )
    assert listing(tmp_path) == sorted(os.path.basename(p) for p in paths)
    rows = [{key: value[i] for key, value in data.items()} for i in range(100)]
    assert read_all(paths, compression) == [serialize_example(row) for row in rows]


def test_empty_shards_still_exist(tmp_path: Path) -> None:
    paths = hr.Dataset.from_tensor_slices({"a": np.arange(2)}).save_tfrecords(
        tmp_path, num_shards=4, progress=False
    )
    assert [len(read_all([p])) for p in paths] == [1, 1, 0, 0]
    assert [len(load_index(p)) for p in paths] == [1, 1, 0, 0]


# --------------------------------------------------------------------------- failures


def test_element_that_cannot_be_serialized_leaves_nothing(tmp_path: Path) -> None:
    previous = tmp_path / "part-00001-of-00002.tfrecord"
    previous.write_bytes(b"an older run's shard")

    def rows() -> Iterator[dict[str, Any]]:
        for i in range(3000):
            yield {"a": np.float32(i), "b": object() if i == 2049 else b"ok"}

    with pytest.raises(InvalidArgumentError, match=r"element 2049 .*feature 'b'.*object"):
        save_tfrecords(rows(), tmp_path, num_shards=2, progress=False)
    assert listing(tmp_path) == ["part-00001-of-00002.tfrecord"]
    assert previous.read_bytes() == b"an older run's shard"  # untouched, not half-replaced


def test_dataset_raising_midway_leaves_nothing(tmp_path: Path) -> None:
    def row(i: Any) -> dict[str, Any]:
        if int(i) == 1500:
            raise RuntimeError("source failed at 1500")
        return {"i": i}

    dataset = hr.Dataset.range(3000).map(row)
    assert dataset.cardinality() == 3000  # contiguous: shard 0 was complete when it failed
    with pytest.raises(Exception, match="source failed at 1500"):
        dataset.save_tfrecords(tmp_path, num_shards=4, progress=False)
    assert listing(tmp_path) == []


def test_non_dict_elements_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"element 0.*dicts"):
        hr.Dataset.range(3).save_tfrecords(tmp_path, progress=False)
    assert listing(tmp_path) == []


def test_round_robin_over_the_file_cap_is_refused(tmp_path: Path) -> None:
    pool = filepool.get_default_pool()
    cap = pool.max_open_files
    pool.set_max_open_files(4)
    try:
        with pytest.raises(InvalidArgumentError, match=r"num_shards=5.*cap of 4"):
            save_tfrecords(iter([{"a": 1}]), tmp_path, num_shards=5, progress=False)
        # Known cardinality: one shard open at a time, so any number of shards is fine.
        hr.Dataset.from_tensor_slices({"a": np.arange(5)}).save_tfrecords(
            tmp_path, num_shards=5, progress=False
        )
    finally:
        pool.set_max_open_files(cap)


def test_infinite_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="infinite"):
        hr.Dataset.from_tensor_slices({"a": np.arange(2)}).repeat().save_tfrecords(
            tmp_path, progress=False
        )


# --------------------------------------------------------------------------- progress


def test_progress_bar_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tfrecords(
        hr.Dataset.from_tensor_slices(columns()), tmp_path, num_shards=2, progress="always"
    )
    err = capsys.readouterr().err
    assert "2,500/2,500 records (100%)" in err
    assert "records/s" in err
    assert "KiB" in err
    assert err.endswith("-> 2 shards\n")


def test_progress_bar_hidden_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hr.Dataset.from_tensor_slices(columns(10)).save_tfrecords(tmp_path)  # progress=True
    save_tfrecords(iter([{"a": 1}]), tmp_path / "b", progress=False)
    assert capsys.readouterr().err == ""


def test_progress_bar_is_throttled() -> None:
    stream = io.StringIO()
    bar = ProgressBar(total=None, enabled="always", stream=stream, min_interval=3600)
    for _ in range(1000):
        bar.update(1, 100)
    bar.close()
    assert stream.getvalue().count("\r") == 2  # first update, then only the final line
    assert "1,000 records" in stream.getvalue()


# --------------------------------------------------------------------------- TensorFlow


@pytest.mark.tf
@pytest.mark.parametrize(("compression", "batched"), [(None, False), ("GZIP", True)])
def test_tensorflow_reads_the_shards(
    tmp_path: Path, compression: str | None, batched: bool
) -> None:
    data = columns()
    dataset = hr.Dataset.from_tensor_slices(data)
    if batched:
        dataset = dataset.batch(512)
    paths = save_tfrecords(
        dataset,
        tmp_path,
        num_shards=3,
        compression_type=compression,
        progress=False,
        batched=batched,
    )
    spec = {
        "x": tf.io.FixedLenFeature([4], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
        "id": tf.io.FixedLenFeature([], tf.string),
    }
    parsed: dict[str, list[Any]] = {"x": [], "y": [], "id": []}
    for path in paths:  # one file at a time: shard order is part of what is checked
        records = tf.data.TFRecordDataset(path, compression_type=compression or "")
        for batch in records.batch(1000):
            for key, value in tf.io.parse_example(batch, spec).items():
                parsed[key].extend(value.numpy())
    order = np.arange(ROWS)
    if batched:  # round-robin: shard s holds rows s, s + 3, ...
        order = np.concatenate([order[shard::3] for shard in range(3)])
    np.testing.assert_array_equal(np.array(parsed["x"]), data["x"][order])
    np.testing.assert_array_equal(np.array(parsed["y"]), data["y"][order])
    assert parsed["id"] == list(data["id"][order])


@pytest.mark.tf
def test_records_match_tensorflows_deterministic_serialization(tmp_path: Path) -> None:
    data = columns(20)
    (path,) = hr.Dataset.from_tensor_slices(data).save_tfrecords(tmp_path, progress=False)
    with TFRecordReader(open(path, "rb"), close_stream=True) as reader:
        records = list(reader)
    for i, record in enumerate(records):
        example = tf.train.Example(
            features=tf.train.Features(
                feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=data["x"][i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[data["y"][i]])),
                    "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data["id"][i]])),
                }
            )
        )
        assert record == example.SerializeToString(deterministic=True)
