"""tf.train.Example without TensorFlow or protobuf: feature specs (:mod:`.specs`),
building and serializing (:mod:`.encoding`), parsing batches into NumPy columns and
decoding for inspection (:mod:`.parsing`).

This package's namespace is the public API of the format, with tf.io's names
(``FixedLenFeature``, ``parse_example``, ...); headrace's own modules import from the
submodule that defines a name.
"""

from headrace.io._ragged import RaggedColumn
from headrace.io._sparse import SparseColumn
from headrace.io.example.encoding import (
    encode_example_columns,
    serialize_example,
    serialize_sequence_example,
)
from headrace.io.example.parsing import (
    DecodedFeature,
    decode_example,
    decode_sequence_example,
    parse_example,
    parse_sequence_example,
    parse_single_example,
    parse_single_sequence_example,
)
from headrace.io.example.specs import (
    FeatureSpec,
    FixedLenFeature,
    FixedLenSequenceFeature,
    RaggedFeature,
    SparseFeature,
    VarLenFeature,
)

__all__ = [
    "DecodedFeature",
    "FeatureSpec",
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "RaggedColumn",
    "RaggedFeature",
    "SparseColumn",
    "SparseFeature",
    "VarLenFeature",
    "decode_example",
    "decode_sequence_example",
    "encode_example_columns",
    "parse_example",
    "parse_sequence_example",
    "parse_single_example",
    "parse_single_sequence_example",
    "serialize_example",
    "serialize_sequence_example",
]
