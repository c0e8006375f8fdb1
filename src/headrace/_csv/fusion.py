"""``map(decode_csv of a line).batch(n)`` run as one columnar decode per batch.

The recipe ``TextLineDataset(f).skip(1).map(lambda line: decode_csv(line, defaults))
.batch(n)`` decodes each line in its own call: per record, the fixed cost of a call
(the line split, one NumPy conversion per column) is paid again, and it dwarfs the
work. tf.data fuses ``map`` with the ``batch`` after it; headrace does the same, as for
``parse_single_example`` (:mod:`headrace._transforms.parse_fusion`, whose iterator runs
this too):

* **Seeing the function.** A map function qualifies when it mentions ``decode_csv``
  (in its code, or a function it calls by name, a few levels deep). It is called once,
  on a :class:`~headrace._csv.reader.DeferredLine`: if it only decodes its line (once or
  more) and returns columns arranged in a dict/tuple/list nest, the map is fused;
  anything else it does to a column makes the trace fail, and it runs per record.
* **Results.** A batch is ``decode_csv`` of the batch's lines, arranged as the function
  arranges one line's columns: the values, dtypes and structure that batching the
  per-record results gives (:func:`~headrace._csv.reader.decode_lines` converts all
  the fields of a batch at once where it can, else :func:`decode_csv` of the lines).
* **Errors.** When a batch holds a bad record, the function runs on its lines one by
  one and the first error it raises is raised, with the map's note: the element index,
  and the file, record and byte offset of the line where the input knows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._csv.reader import (
    DeferredCsvColumn,
    DeferredLine,
    as_records,
    decode_lines,
    decode_records,
)
from headrace._structure import flatten, pack_as
from headrace._transforms.parse_fusion import FUSION_RULES, FusedParse, trace
from headrace._transforms.parse_fusion import mentions_parse as _mentions_parse

__all__ = ["FusedDecodeCsv", "fused_decode_csv"]

_DECODE_NAME = "decode_csv"


class FusedDecodeCsv(FusedParse):
    """The batched form of a per-line ``decode_csv`` function: its decode calls and the
    arrangement of their columns."""

    def __init__(self, line: DeferredLine, structure: Any) -> None:
        super().__init__([], structure)
        self.calls = line.calls
        self.columns: list[DeferredCsvColumn] = flatten(structure)

    def __call__(self, records: list[bytes]) -> Any:
        decoded = []
        for columns, fmt, select in self.calls:
            fast = decode_lines(records, columns, fmt, select)
            if fast is None:  # the general decode: same arrays, or the record's error
                lines = np.empty(len(records), dtype=object)
                lines[:] = records
                fast = decode_records(as_records(lines), columns, fmt, select)
            decoded.append(fast)
        return pack_as(self.structure, [decoded[leaf.call][leaf.index] for leaf in self.columns])


def fused_decode_csv(fn: Callable[..., Any]) -> FusedDecodeCsv | None:
    """The batched form of ``fn`` if it only decodes its line (see the module doc)."""
    # (a wrapper, such as tf_compat's dtype rule, is looked through, and traced as is)
    if not _mentions_parse(getattr(fn, "__wrapped__", fn), name=_DECODE_NAME):
        return None
    line = DeferredLine()
    traced = trace(fn, line,
                   lambda leaf: isinstance(leaf, DeferredCsvColumn) and leaf.line is line)
    return None if traced is None else FusedDecodeCsv(line, traced[0])


FUSION_RULES.append(fused_decode_csv)  # map's batch fusion asks it (see parse_fusion)
