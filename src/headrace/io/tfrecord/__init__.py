"""TFRecord files: framing (:mod:`.framing`), reading (:mod:`.reader`), writing (:mod:`.writer`).

A TFRecord file (``tensorflow/core/lib/io/record_writer.h``) is a sequence of::

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

Compression (``"GZIP"`` / ``"ZLIB"``) applies to the *whole file stream*, as in TensorFlow.
This package's namespace is the public API of the format; headrace's own modules import
from the submodule that defines a name.
"""

from headrace.io.streams import DEFAULT_BUFFER_SIZE, normalize_compression_type
from headrace.io.tfrecord.framing import (
    DEFAULT_MAX_RECORD_BYTES,
    RECORD_OVERHEAD_BYTES,
    encode_records,
)
from headrace.io.tfrecord.reader import (
    SkippedSpan,
    TFRecordReader,
    open_tfrecord,
    read_record_at,
)
from headrace.io.tfrecord.writer import TFRecordWriter, write_tfrecord

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_MAX_RECORD_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "SkippedSpan",
    "TFRecordReader",
    "TFRecordWriter",
    "encode_records",
    "normalize_compression_type",
    "open_tfrecord",
    "read_record_at",
    "write_tfrecord",
]
