"""``headrace convert``: CSV files, SQL queries and ``.npy`` arrays to TFRecord shards of
``tf.train.Example``; TFRecord shards back to CSV, for inspection.

Why it exists: a table is read once, written as shards that any TFRecord reader
(TensorFlow included) takes, with ``.hrx`` indexes for random access and O(1) resume.
Decisions, and why:

* **Every source is read as a headrace dataset** (``read_csv``, ``Dataset.from_sql``,
  ``Dataset.from_npy``) in batches, under a memory budget, so a table larger than RAM
  converts in flat memory, and its values, types and errors are the readers' own: a bad
  CSV field names its file, record, line and column; a NULL names its column, row and key.
* **Writing is** :func:`headrace._persist.writers.save_tfrecords` with ``batched=True``: one
  Example per row, encoded column by column, all shards published atomically (an error
  leaves no file under a final name) and indexed. Rows go round-robin over the shards
  (row ``i`` to shard ``i % N``) when their count is not known up front (CSV, SQL); an
  array's length is known, so its shards hold contiguous blocks.
* **Missing values.** A SQL NULL, or an empty field in a numeric CSV column, is an error
  naming the column and row (file, record and line for CSV) unless ``--null-default``
  gives it a value: ``COLUMN=VALUE`` for one column, a bare ``VALUE`` (or ``*=VALUE``)
  for every column without its own, written as text and parsed as each column's type (a
  value that is not, e.g. ``NA`` for an integer column, is refused up front for CSV, at
  the first NULL it would fill for SQL). Writing zeros for what was absent - what
  ``make_csv_dataset``'s inferred defaults do - would make a missing value look like a
  measured one. An empty field in a CSV *text* column is the empty string, a value;
  only that column's own default replaces it.
* **Types.** An Example holds three kinds of list: integers (and booleans) become
  ``int64_list``, floats ``float_list`` - float32, so float64 columns lose precision,
  and the summary says which did - and strings or bytes ``bytes_list`` (UTF-8).
* **TFRecord to CSV** reads the files twice: once for the feature names (the header must
  come first and an Example may lack features others have), once to write the rows.
  A feature with one value is written as that value, an empty or missing one as an empty
  field, a longer list as ``[v1, v2, ...]`` (strings quoted as JSON). Floats are written
  in the shortest form that reads back as the same float32. The CSV is written to a
  hidden file and renamed when complete.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from headrace._errors import InvalidArgumentError, ParseError
from headrace._memory.units import format_bytes
from headrace._persist.writers import ProgressBar, ProgressSetting
from headrace.io import objstore
from headrace.io.filepool import borrowed_slot
from headrace.io.files import describe_file_type, require_regular_file
from headrace.io.tfrecord import normalize_compression_type, open_tfrecord
from headrace.io.tfrecord_index import load_index

__all__ = [
    "ConvertSummary",
    "ShardSummary",
    "parse_null_defaults",
    "source_kind",
    "tfrecords_to_csv",
    "to_tfrecords",
]

_SQL_SCHEMES = ("sqlite:///", "postgresql://", "postgres://")
_CSV_SUFFIXES = {".csv": None, ".csv.gz": "GZIP", ".csv.zz": "ZLIB"}
_TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfr")
_BATCH_RECORDS = 1024


def source_kind(source: str) -> str:
    """``"sql"``, ``"csv"``, ``"npy"`` or ``"tfrecord"``, from a URL scheme or a file suffix."""
    if source.startswith(_SQL_SCHEMES):
        return "sql"
    lower = source.lower()
    if lower.endswith(tuple(_CSV_SUFFIXES)):
        return "csv"
    if lower.endswith(".npy"):
        return "npy"
    if lower.endswith(_TFRECORD_SUFFIXES) or any(
        lower.endswith(suffix + ext) for suffix in _TFRECORD_SUFFIXES for ext in (".gz", ".zz")
    ):
        return "tfrecord"
    raise InvalidArgumentError(
        f"convert: cannot tell what {source!r} is: give a .csv (or .csv.gz) file, a .npy "
        "file, a 'sqlite:///path.db' or 'postgresql://...' URL with --query, or .tfrecord "
        "files (to convert to CSV)"
    )


@dataclass(frozen=True)
class ShardSummary:
    """One written file: its path, records (None where no index counts them) and bytes."""

    path: str
    records: int | None
    nbytes: int


@dataclass
class ConvertSummary:
    """What a conversion read and wrote, for the closing lines of ``headrace convert``."""

    source: str
    kind: str
    records: int = 0
    #: column name -> "dtype -> list kind" (or the CSV header for TFRecord -> CSV)
    columns: dict[str, str] = field(default_factory=dict)
    files: list[ShardSummary] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        total = sum(f.nbytes for f in self.files)
        rate = self.records / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"converted {self.kind} {self.source}: {self.records:,} records in "
            f"{self.seconds:.2f} s ({rate:,.0f} records/s) -> {len(self.files)} "
            f"file{'s' if len(self.files) != 1 else ''}, {format_bytes(total)}"
        ]
        if self.columns:
            lines.append("columns:")
            lines.extend(f"  {name}: {what}" for name, what in self.columns.items())
        lines.append("files:")
        for shard in self.files:
            count = f"{shard.records:,} records, " if shard.records is not None else ""
            lines.append(f"  {shard.path}: {count}{format_bytes(shard.nbytes)}")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


# --------------------------------------------------------------------------- to TFRecord


def _as_counts(value: Any) -> Any:
    """A ``datetime64`` / ``timedelta64`` column as int64 counts of its unit (an Example
    has no time type; the summary names the unit)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "mM":
        return value.view(np.int64)
    return value


def _list_kind(dtype: np.dtype[Any]) -> str:
    if dtype.kind in "mM":
        unit = np.datetime_data(dtype)[0]
        since = " since 1970-01-01" if dtype.kind == "M" else ""
        return f"int64_list (count of {unit}{since})"
    if dtype.kind == "f":
        return "float_list"
    if dtype.kind in "iub":
        return "int64_list"
    return "bytes_list"


class _Counted:
    """The batches of a dataset, counting rows and noting each column's dtype on the way."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.rows = 0
        self.dtypes: dict[str, np.dtype[Any]] = {}

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        iterator = iter(self.dataset)
        try:
            for batch in iterator:
                if not self.dtypes:
                    self.dtypes = {name: np.asarray(value).dtype for name, value in batch.items()}
                self.rows += len(next(iter(batch.values())))
                yield {name: _as_counts(value) for name, value in batch.items()}
        finally:
            iterator.close()


class _StructuredFields:
    """A batch of a structured array as ``{field: column}`` (a picklable map function)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def __call__(self, batch: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {name: batch[name] for name in self.names}


#: Byte arrays whose rows are written as their raw bytes (one ``bytes_list`` value per
#: row) rather than one int64 per element: images, mostly (8 to 10 times smaller, and
#: what ``tf.io.decode_raw`` reads).
RAW_DTYPES = (np.dtype(np.uint8), np.dtype(np.int8))


def shape_feature(feature: str) -> str:
    """The feature that records the shape of each row of a raw-bytes ``feature``."""
    return f"{feature}_shape"


class _Named:
    """A batch of a plain array as ``{feature: batch}`` (a picklable map function).

    Rows of uint8/int8 with more than one element each go as their raw bytes, with their
    shape in :func:`shape_feature` (every row of an array has the same one).
    """

    def __init__(self, feature: str) -> None:
        self.feature = feature

    def __call__(self, batch: np.ndarray[Any, Any]) -> dict[str, Any]:
        if batch.dtype not in RAW_DTYPES or batch.ndim < 2:
            return {self.feature: batch}
        rows = np.ascontiguousarray(batch).reshape(len(batch), -1).view(np.uint8)
        raw = np.empty(len(batch), dtype=object)
        for index, row in enumerate(rows):
            raw[index] = row.data  # (a view: the row is copied once, into its record)
        shape = np.broadcast_to(np.asarray(batch.shape[1:], dtype=np.int64),
                                (len(batch), batch.ndim - 1))
        return {self.feature: raw, shape_feature(self.feature): shape}


def _npy_dataset(path: str, feature: str, batch_size: int) -> tuple[Any, int]:
    import headrace as hr
    from headrace._sources.arrays import load_npy

    header = load_npy(path)  # a corrupt or truncated file is refused here, naming it
    rows = int(header.shape[0])
    names = header.dtype.names
    del header
    batches = hr.Dataset.from_npy(path).batch(batch_size)
    if names:
        return batches.map(_StructuredFields(names)), rows
    return batches.map(_Named(feature)), rows


def parse_null_defaults(specs: Sequence[str]) -> dict[str, str]:
    """``--null-default`` arguments as ``{column: text}`` (``"*"``: every other column).

    ``COLUMN=VALUE`` is one column's; a bare ``VALUE`` (or ``*=VALUE``, for a value
    holding ``=``) every column's. A column given twice is an error.
    """
    from headrace._sources.sql import ALL_COLUMNS

    defaults: dict[str, str] = {}
    for spec in specs:
        column, equals, value = spec.partition("=")
        if not equals:
            column, value = ALL_COLUMNS, spec
        if not column:
            raise InvalidArgumentError(
                f"convert: --null-default {spec!r} names no column: use COLUMN=VALUE, or "
                "VALUE alone for every column"
            )
        if column in defaults:
            raise InvalidArgumentError(f"convert: --null-default given twice for {column!r}")
        defaults[column] = value
    return defaults


def _csv_column_defaults(dataset: Any, defaults: Mapping[str, str],
                         source: str) -> list[Any]:
    """``record_defaults`` for ``read_csv`` from the inferred column types: numeric
    columns required unless a default applies (parsed here, so a bad one fails before
    anything is read), text columns ``""`` unless they have their own default."""
    from headrace._sources.sql import ALL_COLUMNS

    spec = dataset.element_spec
    unknown = sorted(set(defaults) - set(spec) - {ALL_COLUMNS})
    if unknown:
        raise InvalidArgumentError(
            f"convert: --null-default for {unknown}, which {source} has no column of; its "
            f"columns are {list(spec)}"
        )
    record_defaults: list[Any] = []
    for name, column in spec.items():
        if column.kind != "numeric":
            record_defaults.append(defaults.get(name, "").encode())
            continue
        text = defaults.get(name, defaults.get(ALL_COLUMNS))
        if text is None:
            record_defaults.append(np.array([], column.dtype))  # required: empty is an error
            continue
        try:
            value = column.dtype.type(int(text) if column.dtype.kind in "iu" else float(text))
        except (ValueError, OverflowError):
            raise InvalidArgumentError(
                f"convert: the --null-default {text!r} for column {name!r} of {source} is not "
                f"a {column.dtype} value; give that column its own ({name}=...)"
            ) from None
        record_defaults.append(value)
    return record_defaults


class _MissingHint:
    """The batches of a CSV read, with a missing numeric field's error saying what to do."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        iterator = iter(self.dataset)
        try:
            yield from iterator
        except ParseError as error:
            if "is required but missing" not in str(error):
                raise
            raise type(error)(
                f"{error}; an empty field is a missing value: give it one with "
                "--null-default COLUMN=VALUE (or VALUE for every column)"
            ) from error
        finally:
            iterator.close()


def _source_dataset(
    source: str, kind: str, *, query: str | None, table: str | None, key: str | None,
    params: Sequence[Any], feature: str, batch_size: int, field_delim: str,
    infer_rows: int | None, null_defaults: Mapping[str, str],
) -> tuple[Any, int | None]:
    """The source as batches of ``{column: array}``, and its row count when known."""
    import headrace as hr

    if kind == "csv":
        suffix = next(s for s in _CSV_SUFFIXES if source.lower().endswith(s))
        options: dict[str, Any] = {"field_delim": field_delim,
                                   "compression_type": _CSV_SUFFIXES[suffix]}
        inferred = hr.read_csv(source, batch_size, num_rows_for_inference=infer_rows, **options)
        column_defaults = _csv_column_defaults(inferred, null_defaults, source)
        return hr.read_csv(source, batch_size, column_defaults=column_defaults,
                           **options), None
    if kind == "sql":
        if (query is None) == (table is None):
            raise InvalidArgumentError(
                "convert: a SQL source needs --query 'SELECT ...' or --table NAME (one of them)"
            )
        if table is not None:
            from headrace._sources.sql import quote_identifier

            query = f"SELECT * FROM {quote_identifier(table)}"
        assert query is not None
        from headrace._sources.sql import TextDefault

        return hr.Dataset.from_sql(
            query, params, connection=source, key=key, batch_size=batch_size,
            null_defaults={name: TextDefault(text) for name, text in null_defaults.items()},
        ), None
    if kind == "npy":
        return _npy_dataset(source, feature, batch_size)
    raise InvalidArgumentError(
        f"convert: {source} is already TFRecord; its destination must be a .csv file"
    )


def _check_source(source: str) -> None:
    """Refuse a source file that is missing or not a regular file (a FIFO would block the
    read, /dev/zero never end), before anything is read or created."""
    if objstore.is_remote(source):
        if source.lower().endswith(".npy"):
            raise InvalidArgumentError(
                f"convert: {source}: a .npy source is mapped into memory, so it must be a "
                "local file (copy it down first)")
        try:
            objstore.object_info(source)
        except FileNotFoundError:
            raise InvalidArgumentError(f"convert: {source} does not exist") from None
        return
    try:
        require_regular_file(source, "convert")
    except FileNotFoundError:
        raise InvalidArgumentError(f"convert: {source} does not exist") from None


def _check_dest(dest: str, expected: str, fits: Any) -> None:
    """Refuse a destination that exists and is not what is written there (a device, a
    FIFO): nothing is ever written into or beside it."""
    if dest == "-" or objstore.is_remote(dest) or not os.path.exists(dest) or fits(dest):
        return
    kind = describe_file_type(os.stat(dest).st_mode)
    raise InvalidArgumentError(
        f"convert: the destination {dest} is {kind}; it must be {expected}"
    )


def _shard_summaries(paths: Sequence[str], compressed: bool) -> list[ShardSummary]:
    return [
        ShardSummary(path, None if compressed else len(load_index(path)), _size(path))
        for path in paths
    ]


def _size(path: str) -> int:
    return objstore.object_info(path).size if objstore.is_remote(path) else os.path.getsize(path)


def to_tfrecords(
    source: str,
    dest: str,
    *,
    num_shards: int = 1,
    query: str | None = None,
    table: str | None = None,
    key: str | None = None,
    params: Sequence[Any] = (),
    feature: str = "x",
    batch_size: int = 4096,
    field_delim: str = ",",
    infer_rows: int | None = 1000,
    compression_type: str | None = None,
    memory_budget: int | str | None = None,
    progress: ProgressSetting = True,
    null_defaults: Sequence[str] = (),
) -> ConvertSummary:
    """Convert a CSV file, a SQL query or a ``.npy`` file to ``num_shards`` TFRecord shards
    of Examples (one per row) under ``dest`` (a directory or a ``{shard}`` pattern).

    CSV: the header names the columns; types come from the first ``infer_rows`` rows
    (None: all of them) as ``make_csv_dataset`` infers them. SQL: ``source`` is the
    connection URL, with ``query`` (values in ``params``, never in the text) or ``table``;
    ``key`` pages the read by that column. ``.npy``: a structured array gives one feature
    per field, any other array one feature named ``feature`` (rows of several values as
    lists). ``null_defaults``: ``--null-default`` specs (``COLUMN=VALUE``, or ``VALUE``
    for every column) for SQL NULLs and empty numeric CSV fields, which are errors
    without one (see the module doc). Nothing is written under a final name unless
    every shard is complete.
    """
    import headrace as hr
    from headrace._persist.writers import save_tfrecords

    kind = source_kind(source)
    if kind != "sql":
        _check_source(source)
    _check_dest(dest, "a directory (or a {shard} pattern)",
                lambda path: os.path.isdir(path) or os.path.isfile(path))
    defaults = parse_null_defaults(null_defaults)
    if defaults and kind == "npy":
        raise InvalidArgumentError("convert: --null-default is for CSV and SQL sources; an "
                                   "array has no missing values")
    dataset, rows = _source_dataset(
        source, kind, query=query, table=table, key=key, params=params, feature=feature,
        batch_size=batch_size, field_delim=field_delim, infer_rows=infer_rows,
        null_defaults=defaults,
    )
    if memory_budget is not None:
        dataset = dataset.with_options(hr.Options(memory_budget=memory_budget))
    counted = _Counted(_MissingHint(dataset) if kind == "csv" else dataset)
    started = time.perf_counter()
    paths = save_tfrecords(counted, dest, num_shards=num_shards,
                           compression_type=compression_type, progress=progress,
                           batched=True, num_records=rows)
    summary = ConvertSummary(source, kind, counted.rows, seconds=time.perf_counter() - started)
    summary.columns = {name: f"{dtype} -> {_list_kind(dtype)}"
                       for name, dtype in counted.dtypes.items()}
    summary.files = _shard_summaries(paths, bool(normalize_compression_type(compression_type)))
    if kind == "npy":
        from headrace._sources.arrays import load_npy

        header = load_npy(source)
        if header.dtype in RAW_DTYPES and header.ndim >= 2:
            shape = tuple(header.shape[1:])
            summary.columns[feature] = f"{header.dtype} rows of shape {shape} -> bytes_list (raw)"
            summary.notes.append(
                f"feature {feature!r} holds each row's raw {header.dtype} bytes, its shape in "
                f"{shape_feature(feature)!r}: read it back with decode_raw(..., "
                f"{header.dtype}) and reshape to {shape}")
        del header
    for name, dtype in counted.dtypes.items():
        if dtype.kind == "f" and dtype.itemsize > 4:
            summary.notes.append(
                f"column {name!r} is {dtype}: written as float32 (an Example's float_list "
                "holds float32 only)"
            )
    return summary


# --------------------------------------------------------------------------- to CSV


def _records(paths: Sequence[str], compression_type: str | None,
             limit: int | None) -> Iterator[tuple[str, int, bytes]]:
    """(path, record index in its file, record) of the files in order, ``limit`` in all."""
    left = limit
    for path in paths:
        index = 0
        with open_tfrecord(path, compression_type=compression_type) as reader:
            while left is None or left > 0:
                batch = reader.read_batch(_BATCH_RECORDS if left is None
                                          else min(left, _BATCH_RECORDS))
                if not batch:
                    break
                for record in batch:
                    yield path, index, record
                    index += 1
                if left is not None:
                    left -= len(batch)
        if left == 0:
            return


def _decode(path: str, index: int, record: bytes) -> dict[str, tuple[str, Any]]:
    from headrace.io.example import decode_example

    try:
        return decode_example(record)
    except ParseError as error:
        raise ParseError(f"{path} record {index}: not a tf.train.Example: {error}") from None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    return str(value)  # NumPy scalars: the shortest text that reads back as the same value


def _cell(kind: str, values: Any) -> str:
    if len(values) == 0:
        return ""
    if len(values) == 1:
        return _text(values[0])
    if kind == "bytes_list":
        return "[" + ", ".join(json.dumps(_text(v), ensure_ascii=False) for v in values) + "]"
    return "[" + ", ".join(map(str, values)) + "]"


@contextlib.contextmanager
def _atomic_text(dest: str) -> Iterator[IO[str]]:
    """A text file that appears under ``dest`` only when the block completes."""
    if dest == "-":
        yield sys.stdout
        return
    if objstore.is_remote(dest):  # written locally, then uploaded whole (one PUT/multipart)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="headrace-convert-") as scratch:
            local = os.path.join(scratch, "out.csv")
            with open(local, "w", newline="", encoding="utf-8") as handle:
                yield handle
            with borrowed_slot(), open(local, "rb") as file:  # (G2: see put_atomic)
                objstore.put_atomic(dest, file)
        return
    directory = os.path.dirname(os.path.abspath(dest))
    os.makedirs(directory, exist_ok=True)
    staging = os.path.join(directory, f".{os.path.basename(dest)}.{secrets.token_hex(4)}.tmp")
    try:
        with open(staging, "w", newline="", encoding="utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise


def tfrecords_to_csv(
    sources: Sequence[str],
    dest: str,
    *,
    compression_type: str | None = None,
    limit: int | None = None,
    progress: ProgressSetting = True,
) -> ConvertSummary:
    """Write the Examples of TFRecord files as CSV (``dest``, or ``"-"`` for stdout): one
    row per Example, one column per feature name (sorted), ``limit`` rows at most."""
    if not sources:
        raise InvalidArgumentError("convert: no TFRecord files given")
    if limit is not None and (isinstance(limit, bool) or limit < 0):
        raise InvalidArgumentError(f"convert: --limit must be >= 0, got {limit!r}")
    if dest != "-" and not dest.lower().endswith(".csv"):
        raise InvalidArgumentError(
            f"convert: TFRecord files convert to CSV: the destination must end with .csv "
            f"(or be '-' for stdout), got {dest!r}"
        )
    for source in sources:
        _check_source(source)
    _check_dest(dest, "a .csv file", os.path.isfile)
    started = time.perf_counter()
    kinds: dict[str, str] = {}
    for path, index, record in _records(sources, compression_type, limit):
        for name, (kind, _) in _decode(path, index, record).items():
            if kinds.setdefault(name, kind) != kind and kind != "none":
                kinds[name] = kind if kinds[name] == "none" else "mixed"
    names = sorted(kinds)
    bar = ProgressBar(enabled=progress, label="converting")
    rows = 0
    with _atomic_text(dest) as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(names)
        for path, index, record in _records(sources, compression_type, limit):
            decoded = _decode(path, index, record)
            writer.writerow([_cell(*decoded[name]) if name in decoded else "" for name in names])
            rows += 1
            bar.update(1, len(record))
    bar.close(f" -> {dest}")
    summary = ConvertSummary(", ".join(sources), "tfrecord", rows,
                             seconds=time.perf_counter() - started)
    summary.columns = dict(sorted(kinds.items()))
    if dest != "-":
        summary.files = [ShardSummary(dest, rows, _size(dest))]
    return summary
