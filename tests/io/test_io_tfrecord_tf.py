"""TFRecord files round-trip between headrace and TensorFlow, for every compression."""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf

from headrace.io.tfrecord import TFRecordWriter, open_tfrecord

pytestmark = pytest.mark.tf

COMPRESSIONS = [None, "GZIP", "ZLIB"]
RECORDS = [b"", b"a", b"\x00" * 7, bytes(range(256)) * 40, b"tail\x00"] + [
    b"r%d" % i for i in range(2000)
]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_reads_files_written_by_tensorflow(tmp_path: Path, compression: str | None) -> None:
    path = str(tmp_path / "tf.tfrecord")
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    with tf.io.TFRecordWriter(path, options) as writer:
        for record in RECORDS:
            writer.write(record)
    with open_tfrecord(path, compression_type=compression, buffer_size=4096) as reader:
        assert list(reader) == RECORDS


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_tensorflow_reads_files_written_by_headrace(
    tmp_path: Path, compression: str | None
) -> None:
    path = str(tmp_path / "hr.tfrecord")
    with TFRecordWriter(path, compression_type=compression) as writer:
        writer.write(RECORDS[0])
        writer.write_many(RECORDS[1:])
    dataset = tf.data.TFRecordDataset(path, compression_type=compression or "")
    assert [record.numpy() for record in dataset] == RECORDS


def test_same_bytes_as_tensorflow_uncompressed(tmp_path: Path) -> None:
    with tf.io.TFRecordWriter(str(tmp_path / "tf")) as writer:
        for record in RECORDS:
            writer.write(record)
    with TFRecordWriter(tmp_path / "hr") as writer:
        writer.write_many(RECORDS)
    assert (tmp_path / "tf").read_bytes() == (tmp_path / "hr").read_bytes()


def test_tensorflow_rejects_what_headrace_calls_corrupt(tmp_path: Path) -> None:
    """Both readers agree that a flipped payload bit is data loss."""
    path = tmp_path / "bad.tfrecord"
    with TFRecordWriter(path) as writer:
        writer.write_many([b"hello world"])
    data = bytearray(path.read_bytes())
    data[14] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(str(path)))
    with pytest.raises(OSError, match="corrupted record at offset 0"):
        list(open_tfrecord(path))
