"""``headrace convert images.npy --feature image``: byte arrays as raw bytes features with
their shape, read back by TensorFlow itself (decode_raw + reshape) and by headrace."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from headrace import tf_compat
from headrace.cli import main


def convert(tmp_path: Path, array: np.ndarray, shards: int = 3) -> list[str]:
    np.save(tmp_path / "images.npy", array)
    assert main(["convert", str(tmp_path / "images.npy"), str(tmp_path / "shards"), "--shards",
                 str(shards), "--feature", "image", "--batch-size", "7",
                 "--progress", "never"]) == 0
    return sorted(glob.glob(str(tmp_path / "shards" / "*.tfrecord")))


CASES = [
    (np.uint8, (40, 5, 6, 3)),
    (np.int8, (25, 17)),
    (np.uint8, (9, 2, 3, 4, 1)),
]


@pytest.mark.tf
@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_tensorflow_reads_raw_rows_back(tmp_path: Path, dtype: type, shape: tuple[int, ...],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import tensorflow as tf

    array = np.random.default_rng(1).integers(-128 if dtype is np.int8 else 0,
                                              128 if dtype is np.int8 else 256, shape,
                                              dtype=dtype)
    files = convert(tmp_path, array)
    out = capsys.readouterr().out
    assert f"image: {np.dtype(dtype)} rows of shape {shape[1:]} -> bytes_list (raw)" in out
    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "image_shape": tf.io.FixedLenFeature([len(shape) - 1], tf.int64)}

    def decode(record: tf.Tensor) -> tf.Tensor:
        example = tf.io.parse_single_example(record, features)
        return tf.reshape(tf.io.decode_raw(example["image"], tf.as_dtype(dtype)),
                          example["image_shape"])

    rows = [row.numpy() for row in tf.data.TFRecordDataset(files).map(decode)]
    np.testing.assert_array_equal(np.stack(rows), array)
    assert rows[0].dtype == dtype


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_headrace_reads_raw_rows_back(tmp_path: Path, dtype: type,
                                      shape: tuple[int, ...]) -> None:
    tf = tf_compat
    array = np.random.default_rng(2).integers(0, 100, shape, dtype=dtype)
    files = convert(tmp_path, array)
    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "image_shape": tf.io.FixedLenFeature([len(shape) - 1], tf.int64)}

    def decode(record: bytes) -> np.ndarray:
        example = tf.io.parse_single_example(record, features)
        return tf.io.decode_raw(example["image"], dtype).reshape(example["image_shape"])

    rows = list(tf.data.TFRecordDataset(files).map(decode))
    np.testing.assert_array_equal(np.stack(rows), array)


def test_other_arrays_keep_their_numeric_lists(tmp_path: Path) -> None:
    # a 1-D byte array (one value per row) and wider integers stay int64_list values
    from headrace.io.example import decode_example
    from headrace.io.tfrecord import open_tfrecord

    for array in (np.arange(10, dtype=np.uint8), np.arange(12, dtype=np.int16).reshape(6, 2)):
        files = convert(tmp_path, array, shards=1)
        with open_tfrecord(files[0]) as reader:
            record = reader.read_batch(1)[0]
        decoded = decode_example(record)
        assert set(decoded) == {"image"} and decoded["image"][0] == "int64_list"
        np.testing.assert_array_equal(decoded["image"][1], np.atleast_1d(array[0]))
