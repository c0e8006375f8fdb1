"""``headrace inspect``: what a TFRecord file holds, and whether it is intact.

For each file: the record count; the ``tf.train.Example`` schema inferred from *every*
record (feature names, list kinds, min/max value counts, how many records have each
feature - the facts needed to write a ``parse_example`` spec); record sizes; the CRC
check (the first corrupt offset and the reader's error message, G5); and the first
records pretty-printed with long values truncated. Works on files TensorFlow wrote.

Reading stops at the first corrupt or truncated record: after a bad length the framing
cannot be trusted, so counts are "up to the corruption" and say so.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from headrace._errors import DataLossError, InvalidArgumentError, ParseError
from headrace._tools.index import sniff_compression
from headrace.io.example.parsing import DecodedFeature, decode_example
from headrace.io.files import require_regular_file
from headrace.io.tfrecord.framing import RECORD_OVERHEAD_BYTES
from headrace.io.tfrecord.reader import open_tfrecord

__all__ = ["FeatureStats", "FileReport", "format_report", "inspect_tfrecord"]

_BATCH_RECORDS = 1024
_SHOWN_VALUES = 8
_SHOWN_BYTES = 40


@dataclass
class FeatureStats:
    """One feature name across the Examples of a file."""

    name: str
    kinds: Counter[str] = field(default_factory=Counter)  # list kind -> records with it
    records: int = 0
    min_values: int = 0
    max_values: int = 0

    def add(self, kind: str, count: int) -> None:
        if self.records == 0:
            self.min_values = self.max_values = count
        else:
            self.min_values = min(self.min_values, count)
            self.max_values = max(self.max_values, count)
        self.records += 1
        self.kinds[kind] += 1


@dataclass
class FileReport:
    """Everything :func:`inspect_tfrecord` found in one file."""

    path: str
    compression_type: str
    verify_crc: bool
    file_bytes: int = 0
    records: int = 0
    payload_bytes: int = 0
    min_record_bytes: int | None = None
    max_record_bytes: int | None = None
    examples: int = 0
    features: dict[str, FeatureStats] = field(default_factory=dict)
    not_examples: int = 0
    first_not_example: tuple[int, str] | None = None
    corruption: tuple[int | None, str] | None = None  # (offset, message)
    #: False when the file could not be read at all (missing, a directory, a device,
    #: a FIFO): ``corruption`` then says why, and there is nothing else to report
    readable: bool = True
    samples: list[tuple[int, int, dict[str, DecodedFeature] | str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """False when the file is corrupt, truncated or unreadable."""
        return self.corruption is None


def _add_records(report: FileReport, batch: list[bytes], sample_records: int) -> None:
    for record in batch:
        index = report.records
        report.records += 1
        size = len(record)
        report.payload_bytes += size
        report.min_record_bytes = size if index == 0 else min(report.min_record_bytes or 0, size)
        report.max_record_bytes = max(report.max_record_bytes or 0, size)
        try:
            decoded = decode_example(record)
        except ParseError as error:
            report.not_examples += 1
            if report.first_not_example is None:
                report.first_not_example = (index, str(error))
            if index < sample_records:
                report.samples.append((index, size, f"not a tf.train.Example: {error}"))
            continue
        report.examples += 1
        for name, (kind, values) in decoded.items():
            stats = report.features.get(name)
            if stats is None:
                stats = report.features[name] = FeatureStats(name)
            stats.add(kind, len(values))
        if index < sample_records:
            report.samples.append((index, size, decoded))


def inspect_tfrecord(
    path: str | os.PathLike[str],
    *,
    compression_type: str | None = None,
    verify_crc: bool = True,
    sample_records: int = 3,
) -> FileReport:
    """Read a whole TFRecord file and return its :class:`FileReport` (never raises for bad
    data: corruption and unreadable files are recorded in ``report.corruption``; a path
    that is not a regular file is not opened, and ``report.readable`` is False)."""
    path_str = os.fspath(path)
    report = FileReport(path_str, (compression_type or "").upper(), verify_crc)
    try:
        # Only a regular file has an end: /dev/zero with checksums off is endless empty
        # records, and opening a FIFO blocks until someone writes to it.
        report.file_bytes = require_regular_file(path_str, "inspect").st_size
    except FileNotFoundError:
        report.corruption, report.readable = (None, f"{path_str}: no such file"), False
        return report
    except (InvalidArgumentError, OSError) as error:
        report.corruption, report.readable = (None, str(error)), False
        return report
    try:
        with open_tfrecord(
            path_str, compression_type=compression_type, verify_crc=verify_crc
        ) as reader:
            while True:
                try:
                    batch = reader.read_batch(_BATCH_RECORDS)
                except DataLossError as error:
                    report.corruption = (error.offset, str(error))
                    break
                if not batch:
                    break
                _add_records(report, batch, sample_records)
    except OSError as error:  # missing file, permissions (DataLossError is caught above)
        report.corruption = (None, f"cannot read {path_str}: {error}")
    if report.corruption is not None and report.records == 0 and not compression_type:
        kind = sniff_compression(path_str)
        if kind:
            offset, message = report.corruption
            hint = f" (the file looks {kind}-compressed: pass --compression-type {kind})"
            report.corruption = (offset, message + hint)
    return report


# --------------------------------------------------------------------------- formatting


def _format_bytes(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:,.0f} B" if float(nbytes).is_integer() else f"{nbytes:,.1f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:,.1f} {unit}"


def _format_value(value: Any) -> str:
    if isinstance(value, bytes):
        text = repr(value[:_SHOWN_BYTES])
        return text + (f"...({len(value)} bytes)" if len(value) > _SHOWN_BYTES else "")
    if isinstance(value, np.floating):
        return f"{float(value):.6g}"
    return str(value)


def format_feature(kind: str, values: Any) -> str:
    """``kind[count] [v0, v1, ...]`` with at most 8 values and 40 bytes of each bytes value."""
    shown = ", ".join(_format_value(value) for value in values[:_SHOWN_VALUES])
    more = f", ... ({len(values) - _SHOWN_VALUES} more)" if len(values) > _SHOWN_VALUES else ""
    return f"{kind}[{len(values)}] [{shown}{more}]"


def _schema_lines(report: FileReport) -> list[str]:
    if not report.features:
        return []
    rows = [("feature", "kind", "values/record", "in records")]
    for name in sorted(report.features):
        stats = report.features[name]
        kinds = (
            next(iter(stats.kinds))
            if len(stats.kinds) == 1
            else " + ".join(f"{kind} ({n:,})" for kind, n in sorted(stats.kinds.items()))
        )
        counts = (
            f"{stats.min_values}"
            if stats.min_values == stats.max_values
            else f"{stats.min_values}..{stats.max_values}"
        )
        share = stats.records / report.examples
        rows.append((name, kinds, counts, f"{stats.records:,} ({share:.0%})"))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    return [
        "    "
        + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        + "  "
        + row[3]
        for row in rows
    ]


def format_report(report: FileReport) -> str:
    """The text ``headrace inspect`` prints for one file."""
    compression = report.compression_type or "uncompressed"
    lines = [f"{report.path} ({compression}, {_format_bytes(report.file_bytes)})"]
    upto = " before the corruption" if report.corruption else ""
    lines.append(f"  records: {report.records:,}{upto}")
    if report.corruption is not None:
        offset, message = report.corruption
        where = f"at offset {offset}" if offset is not None else ""
        lines.append(f"  check: CORRUPT {where}: {message}".replace("  :", ":"))
    elif report.verify_crc:
        lines.append("  check: ok (every record's length and data CRC32C verified)")
    else:
        lines.append("  check: framing ok; CRCs not checked (--no-crc)")
    if report.records:
        mean = report.payload_bytes / report.records
        lines.append(
            f"  record sizes: total {_format_bytes(report.payload_bytes)} "
            f"(+{RECORD_OVERHEAD_BYTES} B framing each), min {report.min_record_bytes:,} B, "
            f"mean {mean:,.1f} B, max {report.max_record_bytes:,} B"
        )
    if report.examples:
        lines.append(f"  schema ({report.examples:,} tf.train.Example records):")
        lines.extend(_schema_lines(report))
    if report.first_not_example is not None:
        index, message = report.first_not_example
        lines.append(
            f"  not tf.train.Example: {report.not_examples:,} records "
            f"(first: record {index}: {message})"
        )
    for index, size, decoded in report.samples:
        lines.append(f"  record {index} ({size:,} bytes):")
        if isinstance(decoded, str):
            lines.append(f"    {decoded}")
            continue
        if not decoded:
            lines.append("    (no features)")
        for name in sorted(decoded):
            kind, values = decoded[name]
            lines.append(f"    {name}: {format_feature(kind, values)}")
    return "\n".join(lines)
