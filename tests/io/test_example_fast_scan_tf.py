"""Records TensorFlow serializes take the pure-Python scan's fast paths (the layout they
assume is TensorFlow's), with the C extension's values."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from test_example_fast_scan import refused, vector_threshold

from headrace.io import _example_wire as wire
from headrace.io import _native

pytestmark = pytest.mark.tf


def tf_record(index: int) -> bytes:
    rng = np.random.default_rng(index)
    feature = {
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[index - 3, -(2**62)])),
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=rng.random(40))),
        "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"", b"n" * 200])),
        "empty": tf.train.Feature(float_list=tf.train.FloatList(value=[])),
        "": tf.train.Feature(int64_list=tf.train.Int64List(value=[index])),
        "none": tf.train.Feature(),
    }
    if index % 3:
        del feature["x"]
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=bool(index % 2))


def test_tensorflow_records_take_the_fast_paths() -> None:
    native = _native._loaded_extension
    assert native is not None
    records = [tf_record(index) for index in range(20)]
    keys = [b"label", b"x", b"name", b"empty", b"", b"none", b"absent"]
    kinds = [wire.KIND_INT64, wire.KIND_FLOAT, wire.KIND_BYTES, wire.KIND_FLOAT,
             wire.KIND_INT64, wire.KIND_BYTES, wire.KIND_FLOAT]  # fmt: skip
    expected = native.parse_example_columns(records, keys, kinds)
    with refused("_general_record"), vector_threshold(10**9):
        assert wire.scan_columns(records, keys, kinds) == expected
    with refused("_scan_canonical"), vector_threshold(1):
        assert wire.scan_columns(records, keys, kinds) == expected
