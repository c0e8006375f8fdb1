"""headrace: tf.data-style input pipelines for data larger than RAM, under a hard byte budget.

Everything public is listed in ``__all__`` below (and tested against it); ``dir(headrace)``
shows only those names. The other public namespaces are ``headrace.core`` (custom stages),
``headrace.image``, ``headrace.io.example``, ``headrace.io.tfrecord``, ``headrace.io.objstore``,
``headrace.adapters.*``, ``headrace.ray``, ``headrace.profiling``, ``headrace.keras`` and
``headrace.tf_compat``; every other module is internal and can change in any release.
"""

from headrace._csv import CsvDataset, CsvError, decode_csv, make_csv_dataset, read_csv
from headrace._dataset import Dataset, TextLineDataset, TFRecordDataset
from headrace._distribute import AutoShardPolicy, ShardInfo, auto_shard, shard_info
from headrace._errors import (
    CheckpointError,
    DataLossError,
    ElementSpecError,
    EmptyInputError,
    FileLimitError,
    HeadraceError,
    HeadraceWarning,
    InvalidArgumentError,
    IteratorClosedError,
    MemoryBudgetError,
    Origin,
    ParseError,
    RecordTooLargeError,
    WorkerError,
    WorkerPoolError,
    element_origin,
    mark_batch_row,
)
from headrace._memory.sizeof import register_sizer
from headrace._memory.units import parse_bytes
from headrace._options import AUTOTUNE, Options
from headrace._served import ProducerError, ServedIterator, Server, connect, serve
from headrace._sources.sql import SqlError
from headrace._structure import TensorSpec
from headrace.core.node import INFINITE, UNKNOWN
from headrace.core.run import DatasetIterator

__version__ = "0.1.0"
"""This release's version (PEP 440), the same as the installed package's metadata."""

__all__ = [
    "AUTOTUNE",
    "INFINITE",
    "UNKNOWN",
    "AutoShardPolicy",
    "CheckpointError",
    "CsvDataset",
    "CsvError",
    "DataLossError",
    "Dataset",
    "DatasetIterator",
    "ElementSpecError",
    "EmptyInputError",
    "FileLimitError",
    "HeadraceError",
    "HeadraceWarning",
    "InvalidArgumentError",
    "IteratorClosedError",
    "MemoryBudgetError",
    "Options",
    "Origin",
    "ParseError",
    "ProducerError",
    "RecordTooLargeError",
    "ServedIterator",
    "Server",
    "ShardInfo",
    "SqlError",
    "TFRecordDataset",
    "TensorSpec",
    "TextLineDataset",
    "WorkerError",
    "WorkerPoolError",
    "__version__",
    "auto_shard",
    "connect",
    "decode_csv",
    "element_origin",
    "make_csv_dataset",
    "mark_batch_row",
    "parse_bytes",
    "read_csv",
    "register_sizer",
    "serve",
    "shard_info",
]


def __dir__() -> list[str]:
    """The public names (and the module's dunders), not the internal subpackages that
    importing headrace binds as attributes: what ``dir()`` and tab completion offer is
    what is supported."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


# the old import paths of the internal modules still work, with a DeprecationWarning
from headrace import _moved  # noqa: E402

_moved.install()
__getattr__ = _moved.moved_attribute
