"""`headrace index` and `headrace inspect`, run in-process on TensorFlow- and headrace-written
files: exit codes, what they print, stale and corrupt files named with offsets."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import headrace as hr
from headrace.cli import main
from headrace.io.tfrecord import write_tfrecord
from headrace.io.tfrecord_index import index_path_for, load_index

Capture = pytest.CaptureFixture[str]


def tf_example(i: int) -> bytes:
    feature = {
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
        "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=[0.5] * (i % 3 + 1))),
        "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"n" * (60 + i)])),
    }
    if i % 2:
        feature["odd"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[]))
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString()


def write_with_tf(path: Path, records: int = 10, compression: str = "") -> str:
    options = tf.io.TFRecordOptions(compression_type=compression)
    with tf.io.TFRecordWriter(str(path), options) as writer:
        for i in range(records):
            writer.write(tf_example(i))
    return str(path)


def headrace_shards(directory: Path, shards: int = 2) -> list[str]:
    data = {"x": np.arange(40, dtype=np.float32).reshape(20, 2), "id": np.arange(20)}
    return hr.Dataset.from_tensor_slices(data).save_tfrecords(
        directory, num_shards=shards, progress=False
    )


# --------------------------------------------------------------------------- index


@pytest.mark.tf
def test_index_builds_indexes_for_tensorflow_files(tmp_path: Path, capsys: Capture) -> None:
    first = write_with_tf(tmp_path / "a.tfrecord", 10)
    second = write_with_tf(tmp_path / "b.tfrecord", 3)
    assert main(["index", first, second]) == 0
    out = capsys.readouterr().out
    assert f"{first}: 10 records, index {index_path_for(first)}" in out
    assert f"{second}: 3 records" in out
    index = load_index(first)
    with open(first, "rb") as file:
        assert index.read(file, 7) == tf_example(7)
    assert main(["index", "--check", first, second]) == 0
    assert "2 of 2 indexes ok" in capsys.readouterr().out


def test_index_check_reports_stale_and_missing(tmp_path: Path, capsys: Capture) -> None:
    paths = headrace_shards(tmp_path, 3)
    assert main(["index", "--check", *paths]) == 0
    capsys.readouterr()
    with open(paths[0], "ab") as file:  # appended to after it was indexed
        file.write(Path(paths[1]).read_bytes())
    os.remove(index_path_for(paths[2]))
    assert main(["index", "--check", *paths]) == 1
    captured = capsys.readouterr()
    assert re.search(
        rf"{re.escape(paths[0])}: STALE: .*changed since it was indexed.*size", captured.err
    )
    assert f"headrace index {paths[0]}" in captured.err
    assert f"{paths[2]}: STALE: no index file {index_path_for(paths[2])}" in captured.err
    assert f"{paths[1]}: index ok, 7 records" in captured.out
    assert "1 of 3 indexes ok" in captured.out
    assert main(["index", paths[0], paths[2]]) == 0  # rebuilding fixes both
    assert main(["index", "--check", *paths]) == 0


def test_index_check_catches_a_rewrite_of_the_same_size(tmp_path: Path, capsys: Capture) -> None:
    (path,) = headrace_shards(tmp_path, 1)
    stat = os.stat(path)
    data = bytearray(Path(path).read_bytes())
    data[20] ^= 0xFF  # same size, mtime restored: only the content fingerprint differs
    Path(path).write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert main(["index", "--check", path]) == 1
    assert "STALE" in capsys.readouterr().err


@pytest.mark.tf
def test_index_refuses_compressed_and_corrupt_files(tmp_path: Path, capsys: Capture) -> None:
    gzipped = write_with_tf(tmp_path / "c.tfrecord.gz", 5, "GZIP")
    assert main(["index", gzipped]) == 1
    err = capsys.readouterr().err
    assert f"{gzipped}: ERROR:" in err
    assert "GZIP-compressed: compressed TFRecord files cannot be indexed" in err
    assert not os.path.exists(index_path_for(gzipped))
    missing = str(tmp_path / "nope.tfrecord")
    assert main(["index", "--check", missing]) == 1
    assert "no such file" in capsys.readouterr().err


# --------------------------------------------------------------------------- inspect


@pytest.mark.tf
def test_inspect_tensorflow_file(tmp_path: Path, capsys: Capture) -> None:
    path = write_with_tf(tmp_path / "tf.tfrecord", 10)
    assert main(["inspect", path, "--records", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{path} (uncompressed," in out
    assert "records: 10\n" in out
    assert "check: ok" in out
    assert re.search(r"label\s+int64_list\s+1\s+10 \(100%\)", out)
    assert re.search(r"pixels\s+float_list\s+1\.\.3\s+10 \(100%\)", out)
    assert re.search(r"odd\s+int64_list\s+0\s+5 \(50%\)", out)
    assert re.search(r"name\s+bytes_list\s+1\s+10 \(100%\)", out)
    assert "record 0 (" in out and "record 1 (" in out and "record 2 (" not in out
    assert "name: bytes_list[1] [b'" + "n" * 40 + "'...(60 bytes)]" in out  # truncated
    assert "pixels: float_list[1] [0.5]" in out


@pytest.mark.tf
@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_inspect_compressed_tensorflow_file(
    tmp_path: Path, capsys: Capture, compression: str
) -> None:
    path = write_with_tf(tmp_path / "tf.tfrecord", 6, compression)
    assert main(["inspect", path, "--compression-type", compression.lower()]) == 0
    out = capsys.readouterr().out
    assert f"({compression}," in out and "records: 6\n" in out
    assert main(["inspect", path]) == 1  # read as uncompressed: garbage framing
    out = capsys.readouterr().out
    assert f"pass --compression-type {compression}" in out


def test_inspect_headrace_files(tmp_path: Path, capsys: Capture) -> None:
    paths = headrace_shards(tmp_path, 2)
    assert main(["inspect", *paths, "--records", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("records: 10\n") == 2
    assert re.search(r"x\s+float_list\s+2\s+10 \(100%\)", out)
    assert "x: float_list[2] [0, 1]" in out
    assert "id: int64_list[1] [0]" in out
    assert "2 files, 20 records, 0 corrupt" in out


def test_inspect_corrupt_file_names_the_offset(tmp_path: Path, capsys: Capture) -> None:
    (path,) = headrace_shards(tmp_path, 1)
    bad_offset = int(load_index(path).offsets[4])
    data = bytearray(Path(path).read_bytes())
    data[bad_offset + 14] ^= 0x01  # a payload byte of record 4: its data CRC fails
    Path(path).write_bytes(bytes(data))
    assert main(["inspect", path, "--records", "0"]) == 1
    out = capsys.readouterr().out
    assert "records: 4 before the corruption" in out
    assert (
        f"check: CORRUPT at offset {bad_offset}: corrupted record at offset {bad_offset} "
        f"in file {path} (bad data checksum)"
    ) in out
    assert main(["inspect", path, "--no-crc", "--records", "0"]) == 0
    assert "CRCs not checked" in capsys.readouterr().out


def test_inspect_truncated_and_missing_files(tmp_path: Path, capsys: Capture) -> None:
    (path,) = headrace_shards(tmp_path, 1)
    size = os.path.getsize(path)
    os.truncate(path, size - 3)
    missing = str(tmp_path / "missing.tfrecord")
    assert main(["inspect", path, missing]) == 1
    out, err = capsys.readouterr()
    assert "records: 19 before the corruption" in out
    assert "truncated record at offset" in out
    assert missing not in out  # nothing to report of a file that is not there ...
    assert "2 files, 19 records, 1 corrupt, 1 unreadable" in out  # missing is not corrupt
    # ... and one line on stderr for each bad file
    first, second = err.splitlines()
    assert first.startswith("headrace inspect: truncated record at offset") and path in first
    assert second == f"headrace inspect: {missing}: no such file"


def test_inspect_records_that_are_not_examples(tmp_path: Path, capsys: Capture) -> None:
    path = str(tmp_path / "raw.tfrecord")
    write_tfrecord(path, [b"\xff\xff", b""])
    assert main(["inspect", path]) == 0  # valid TFRecord framing, just not Examples
    out = capsys.readouterr().out
    assert "not tf.train.Example: 1 records (first: record 0: malformed Example" in out
    assert "record 1 (0 bytes):\n    (no features)" in out
