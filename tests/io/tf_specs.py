"""TensorFlow's twin of a generated feature spec, shared by the tests that compare with it."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

TF_DTYPE = {"float_list": tf.float32, "int64_list": tf.int64, "bytes_list": tf.string}


def tf_spec(spec_type: str, kind: str, shape: tuple[int, ...], default: Any) -> Any:
    """The tf.io feature spec of a ``(spec_type, kind, shape, default)`` drawn spec."""
    dtype = TF_DTYPE[kind]
    if spec_type == "fixed":
        return tf.io.FixedLenFeature(shape, dtype, default_value=default)
    if spec_type == "varlen":
        return tf.io.VarLenFeature(dtype)
    if spec_type == "sequence":
        return tf.io.FixedLenSequenceFeature(
            shape, dtype, allow_missing=True, default_value=default
        )
    return tf.io.RaggedFeature(dtype)
