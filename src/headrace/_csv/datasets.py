"""CSV datasets with tf.data's names and element structures, and a columnar reader.

* :func:`CsvDataset` — ``tf.data.experimental.CsvDataset``: one tuple of
  scalars per record, TensorFlow's parsing rules and error messages (each
  error also names file, record, line and column). Followed by ``batch``,
  it reads whole columns per block instead of record by record.
* :func:`make_csv_dataset` — ``tf.data.experimental.make_csv_dataset``:
  ``(features_dict, label)`` batches, column names from the header, types
  inferred from the first rows, shuffled and repeated by default, as in
  TensorFlow (the shuffle order is headrace's, not TensorFlow's).
* :func:`read_csv` — headrace's own: batches as dicts
  of NumPy arrays by column name, parsed a block at a time (pyarrow's parser
  with the ``[arrow]`` extra, the pure parser otherwise; the same values).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace._csv.reader import (
    CsvColumn,
    CsvError,
    CsvFormat,
    check_select_cols,
    columns_from_defaults,
    decode_csv,
)
from headrace._csv.shuffle import CsvShuffleNode, columnar_shuffle_fits
from headrace._csv.source import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_MAX_RECORD_BYTES,
    CsvNode,
    CsvSpec,
    read_first_record,
)
from headrace._dataset import Dataset, read_files_in_parallel
from headrace._errors import InvalidArgumentError, RecordTooLargeError
from headrace._options import AUTOTUNE
from headrace._sources.files import list_files

__all__ = ["CsvDataset", "decode_csv", "make_csv_dataset", "read_csv"]

#: Text parsed at once while inferring types: the first rows are usually few.
_PROBE_BLOCK_BYTES = 1 << 16
#: Longest record the type inference reads. It runs when the dataset is built, before the
#: pipeline's memory budget is known, so it must not read a record the budget may refuse:
#: at a longer record it stops (no number is that long), and the read that follows books
#: that record on its share of the budget, refusing it there if it cannot fit (G1).
_PROBE_MAX_RECORD_BYTES = 1 << 20


def _check_cols(cols: Sequence[int] | None, name: str) -> tuple[int, ...]:
    return tuple(check_select_cols(cols, name))


def CsvDataset(
    filenames: Any,
    record_defaults: Sequence[Any],
    compression_type: str | None = None,
    buffer_size: int | None = None,
    header: bool = False,
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    select_cols: Sequence[int] | None = None,
    exclude_cols: Sequence[int] | None = None,
    *,
    engine: str = "auto",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Dataset:
    """``tf.data.experimental.CsvDataset``: a tuple of scalars per CSV record.

    Same arguments and semantics as TensorFlow: ``record_defaults`` gives each
    output column's type and default (a dtype, or an empty list, makes it
    required); ``header=True`` skips the first record of each file;
    ``select_cols``/``exclude_cols`` pick columns by index. Errors carry
    TensorFlow's message (``"Field 1 in record is not a valid int32: x"``)
    followed by the file, record, line and column; the next element is the
    next record. ``engine`` (``"auto"``, ``"arrow"``, ``"pure"``) picks the
    parser; ``block_bytes`` how much text is parsed at once, at most: where the
    stage's share of the memory budget cannot hold such a block, it is cut
    smaller (down to one record), rather than the budget refused.

    Under ``batch``, as in tf.data, a bad record drops the rows its batch had
    gathered and raises in the batch's place; an empty file or a header that
    cannot be read raises once, and the reading goes on.
    """
    spec = CsvSpec(
        columns=tuple(columns_from_defaults(record_defaults)),
        fmt=CsvFormat.make(field_delim, use_quote_delim, na_value),
        select_cols=_check_cols(select_cols, "select_cols"),
        exclude_cols=_check_cols(exclude_cols, "exclude_cols"),
        header=bool(header),
        engine=engine,
        block_bytes=block_bytes,
    )
    return Dataset(CsvNode(filenames, compression_type, buffer_size, spec))


def _header_names(filenames: list[str], fmt: CsvFormat, compression_type: str | None,
                  encoding: str, caller: str) -> list[str]:
    """Column names from each file's first record (read as ``CsvDataset`` reads records,
    through the file pool); every file must have the same ones."""
    names: list[str] | None = None
    for path in filenames:
        fields = read_first_record(path, compression_type, fmt)
        if fields is None:
            raise InvalidArgumentError(
                f"Failed when reading the header line of {path}. Is it an empty file?"
            )
        try:
            row = [field.decode(encoding) for field in fields]
        except UnicodeDecodeError as error:
            hint = ("pass encoding=..." if caller == "make_csv_dataset"
                    else "pass column_names=... and header=True to skip it")
            raise CsvError(
                f"the header is not valid {encoding} text ({error.reason}: byte "
                f"{error.object[error.start:error.start + 1]!r}); {hint}",
                path=path, record=0, line=1,
            ) from None
        if names is None:
            names = row
        elif row != names:
            raise InvalidArgumentError(
                "All input CSV files should have the same column names in the header row. "
                f"File {path} has different column names."
            )
    assert names is not None
    return names


def _valid(text: str, kind: str) -> bool:
    """TensorFlow's type inference tests (NumPy constructors, as readers.py uses)."""
    try:
        if kind == "int32":
            return bool(np.int32(text) == np.int64(text))
        if kind == "int64":
            np.int64(text)
            return True
        return bool(np.dtype(kind).type(text) < np.inf)
    except (ValueError, OverflowError):
        return False


_INFERENCE_ORDER = ("int32", "int64", "float32", "float64", "string")


def _infer_kind(text: str, na_value: str, previous: str | None) -> str | None:
    if text in ("", na_value):
        return previous
    for position, kind in enumerate(_INFERENCE_ORDER):
        allowed = _INFERENCE_ORDER[: position + 1]
        if (kind == "string" or _valid(text, kind)) and (previous is None or previous in allowed):
            return kind
    return "string"


def _infer_defaults(filenames: list[str], width: int, fmt: CsvFormat, header: bool,
                    rows_for_inference: int | None, select: Sequence[int],
                    compression_type: str | None, encoding: str,
                    ignore_errors: bool = False) -> list[CsvColumn]:
    """Each selected column's type, from the first ``rows_for_inference`` records of the
    files (all of them with None), by TensorFlow's rules (``make_csv_dataset``).

    The records are read by a ``CsvDataset`` of ``width`` text columns: the same
    records, the same file pool, budget and errors as the read that follows (a
    malformed or ragged record is a :class:`CsvError` naming its file, record, line and
    column). This runs as the dataset is built, before its memory budget is known, so
    records of at most ``_PROBE_MAX_RECORD_BYTES`` are read: the types are those of the
    records before a longer one and of that record's fields before the one it stopped
    in, which is text (its read, later, is booked on the budget and refused there if it
    cannot fit). A field that is not ``encoding`` text cannot be a number:
    its column is text (read as bytes).
    """
    def probe(most: int) -> Dataset:
        spec = CsvSpec(columns=tuple(CsvColumn("string", b"") for _ in range(width)),
                       fmt=fmt, header=header, ignore_errors=ignore_errors,
                       block_bytes=_PROBE_BLOCK_BYTES, max_record_bytes=most)
        records = Dataset(CsvNode(filenames, compression_type, None, spec))
        return records if rows_for_inference is None else records.take(rows_for_inference)

    records = probe(_PROBE_MAX_RECORD_BYTES)
    try:
        kinds = _kinds_of(records.batch(1024), select, fmt, encoding)
    except RecordTooLargeError:
        # A record longer than the probe reads: the types are those of the records before
        # it, read again one by one (the batch it would have ended was never handed out),
        # and of its fields before the long one. Where fields follow the long one (their
        # types unknown), the record is read whole, as TensorFlow's inference does.
        stopped: list[int | None] = []
        kinds = _kinds_of(records, select, fmt, encoding, one_by_one=True, stopped=stopped)
        if stopped and (stopped[0] is None or stopped[0] < width - 1):
            kinds = _kinds_of(probe(DEFAULT_MAX_RECORD_BYTES).batch(1024), select, fmt,
                              encoding)
    columns = []
    for kind in kinds:
        resolved = kind or "string"
        default: Any = b"" if resolved == "string" else np.dtype(resolved).type(0)
        columns.append(CsvColumn(resolved, default))
    return columns


def _kinds_of(dataset: Dataset, select: Sequence[int], fmt: CsvFormat, encoding: str,
              one_by_one: bool = False, stopped: list[int | None] | None = None,
              ) -> list[str | None]:
    """Each selected column's inferred kind (None: no value seen) over ``dataset``'s
    batches, or with ``one_by_one`` over its records up to the first one longer than the
    probe reads (the field it stopped in appended to ``stopped``)."""
    kinds: list[str | None] = [None] * len(select)
    with iter(dataset) as iterator:
        while True:
            try:
                element = next(iterator)
            except StopIteration:
                break
            except RecordTooLargeError as error:
                if not one_by_one:
                    raise
                # No number is that long: the field the probe stopped in holds text; the
                # record's whole fields before it count as a row's would.
                if error.field is not None and error.field in select:
                    kinds[list(select).index(error.field)] = "string"
                _infer_fields(kinds, select, [[f] for f in error.fields_before], fmt,
                              encoding, skip=error.field)
                if stopped is not None:
                    stopped.append(error.field)
                break
            batch = [[field] for field in element] if one_by_one else element
            _infer_fields(kinds, select, batch, fmt, encoding)
    return kinds


def _infer_fields(kinds: list[str | None], select: Sequence[int], batch: Sequence[Any],
                  fmt: CsvFormat, encoding: str, skip: int | None = None) -> None:
    """Widen ``kinds`` (one per selected column) by the values of ``batch`` (per field of
    the file, a sequence of values; fields past its end are not seen)."""
    missing = (b"", fmt.na_value)
    for j, index in enumerate(select):
        if index >= len(batch) or index == skip:
            continue
        kind = kinds[j]
        for field in batch[index]:
            if field in missing:
                continue
            try:
                text = field.decode(encoding)
            except UnicodeDecodeError:
                kind = "string"
            else:
                kind = _infer_kind(text, "", kind)
            if kind == "string":
                break
        kinds[j] = kind


def _sorted_indices(select_columns: Sequence[int | str], names: list[str]) -> list[int]:
    positions = {name: i for i, name in enumerate(names)}
    results = []
    for value in select_columns:
        if isinstance(value, int):
            if value < 0 or value >= len(names):
                raise InvalidArgumentError(
                    f"Column index {value} specified in `select_columns` should be > 0  and "
                    f"<= {len(names)}, which is the number of columns."
                )
            results.append(value)
        elif value not in positions:
            raise InvalidArgumentError(
                f"Column {value} specified in `select_columns` must be of one of the "
                f"columns: {list(positions)}."
            )
        else:
            results.append(positions[value])
    unique = sorted(set(results))
    if len(unique) != len(select_columns):
        raise InvalidArgumentError("The `select_columns` argument contains duplicate columns.")
    return unique


class _CsvFile:
    """One file's ``CsvDataset`` (the per-file function of an interleave; picklable)."""

    def __init__(self, spec: CsvSpec, compression_type: str | None) -> None:
        self.spec, self.compression_type = spec, compression_type
        self.__qualname__ = "csv_file"

    def __call__(self, filename: str) -> Dataset:
        return Dataset(CsvNode(filename, self.compression_type, None, self.spec))


class _ToFeatures:
    """``map_fn`` of make_csv_dataset: a batch's columns as a dict, the label popped."""

    def __init__(self, names: list[str], label_name: str | None) -> None:
        self.names, self.label_name = names, label_name
        self.__qualname__ = "csv_features"

    def __call__(self, *columns: Any) -> Any:
        features = dict(zip(self.names, columns, strict=True))
        if self.label_name is None:
            return features
        label = features.pop(self.label_name)
        return features, label


def make_csv_dataset(  # noqa: C901
    file_pattern: str | Sequence[str],
    batch_size: int,
    column_names: Sequence[str] | None = None,
    column_defaults: Sequence[Any] | None = None,
    label_name: str | None = None,
    select_columns: Sequence[int | str] | None = None,
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    header: bool = True,
    num_epochs: int | None = None,
    shuffle: bool = True,
    shuffle_buffer_size: int = 10000,
    shuffle_seed: int | None = None,
    prefetch_buffer_size: int | None = None,
    num_parallel_reads: int | None = None,
    sloppy: bool = False,
    num_rows_for_inference: int | None = 100,
    compression_type: str | None = None,
    ignore_errors: bool = False,
    encoding: str = "utf-8",
) -> Dataset:
    """``tf.data.experimental.make_csv_dataset``: ``(features, label)`` batches.

    TensorFlow's pipeline, stage for stage: files (shuffled when ``shuffle``),
    interleaved ``num_parallel_reads`` at a time (1 by default), shuffled with
    ``shuffle_buffer_size``, repeated ``num_epochs`` times (None: forever, with
    ``drop_remainder=True`` as TensorFlow does), batched, turned into a dict by
    column name, prefetched. Names come from the header and types from the
    first ``num_rows_for_inference`` rows unless given, read as ``CsvDataset``
    reads records: a malformed or ragged row, a directory or a missing file is
    an error naming the file (and line), and a field that is not ``encoding``
    text makes its column text (``bytes``, as read). Shuffles use
    headrace's generator: same seed, same order every run, but not
    TensorFlow's order. With one reader (``num_parallel_reads=None`` or 1) and
    numeric columns, the shuffle runs on columns a batch at a time (tf.data's
    buffer semantics, without a Python step per record; see
    :mod:`headrace._csv.shuffle`). ``sloppy=True`` lets the interleave go out of
    order.
    """
    if isinstance(file_pattern, (list, tuple)) and not file_pattern:
        raise InvalidArgumentError("Argument `file_pattern` should not be empty.")
    filenames = list_files(file_pattern)
    fmt = CsvFormat.make(field_delim, use_quote_delim, na_value)
    if compression_type not in (None, "", "GZIP", "ZLIB"):
        raise InvalidArgumentError(
            f"Received unknown `compression_type` {compression_type}. Expected: GZIP, ZLIB "
            "or  (empty string)."
        )
    if column_names is None:
        if not header:
            raise InvalidArgumentError(
                "Expected `column_names` or `header` arguments. Neither is provided."
            )
        names = _header_names(filenames, fmt, compression_type or None, encoding,
                              "make_csv_dataset")
    else:
        names = list(column_names)
    if len(names) != len(set(names)):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgumentError(
            "Either `column_names` argument or CSV header row contains duplicate column "
            f"names: {set(duplicates)}."
        )
    select = _sorted_indices(select_columns, names) if select_columns is not None else None
    if column_defaults is not None:
        columns = columns_from_defaults(column_defaults)
    else:
        columns = _infer_defaults(filenames, len(names), fmt, header, num_rows_for_inference,
                                  select if select is not None else range(len(names)),
                                  compression_type or None, encoding, bool(ignore_errors))
    if select is not None and len(columns) != len(select):
        raise InvalidArgumentError(
            "If specified, `column_defaults` and `select_columns` must have the same length: "
            f"`column_defaults` has length {len(columns)}, `select_columns` has length "
            f"{len(select)}."
        )
    if select is not None and len(names) > len(select):
        names = [names[i] for i in select]
    if label_name is not None and label_name not in names:
        raise InvalidArgumentError(
            f"`label_name` provided must be one of the columns: {names}. Received: {label_name}."
        )
    spec = CsvSpec(columns=tuple(columns), fmt=fmt, select_cols=tuple(select or ()),
                   header=bool(header), ignore_errors=bool(ignore_errors))
    reads = 1 if num_parallel_reads is None else num_parallel_reads
    if not shuffle and reads == 1 and num_epochs is not None and num_epochs >= 1:
        # Files in order, each epoch after the last, and batches across their edges:
        # what interleave(cycle 1).repeat(n).batch(b) gives, read as one source that
        # batch pushes into, so batches are cut from parsed blocks (no per-record work).
        records = Dataset(CsvNode(filenames * num_epochs, compression_type or None, None,
                                  spec))
        dataset = records.batch(batch_size).map(_ToFeatures(names, label_name))
        return dataset.prefetch(AUTOTUNE if prefetch_buffer_size is None
                                else prefetch_buffer_size)
    source = CsvNode(filenames, compression_type or None, None, spec)
    if shuffle and reads == 1 and columnar_shuffle_fits(source) and num_epochs != 0:
        # files and rows shuffled, repeated and batched as columns: the same stages as
        # below, without a Python step per record (see headrace._csv.shuffle)
        shuffled = Dataset(CsvShuffleNode(source, shuffle_buffer_size, shuffle_seed,
                                          num_epochs))
        dataset = shuffled.batch(batch_size, drop_remainder=num_epochs is None)
        dataset = dataset.map(_ToFeatures(names, label_name))
        return dataset.prefetch(AUTOTUNE if prefetch_buffer_size is None
                                else prefetch_buffer_size)
    per_file = _CsvFile(spec, compression_type or None)
    dataset = Dataset.from_tensor_slices(np.array(filenames, dtype=object))
    if shuffle:
        dataset = dataset.shuffle(len(filenames), shuffle_seed)
    cycle = len(filenames) if reads == AUTOTUNE else reads
    if reads == 1:
        dataset = dataset.interleave(per_file, cycle_length=1, block_length=1)
    else:
        dataset = dataset.interleave(per_file, cycle_length=max(cycle, 1), block_length=1,
                                     num_parallel_calls=AUTOTUNE, deterministic=not sloppy)
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer_size, shuffle_seed)
    if num_epochs != 1:
        dataset = dataset.repeat(num_epochs)
    dataset = dataset.batch(batch_size, drop_remainder=num_epochs is None)
    dataset = dataset.map(_ToFeatures(names, label_name))
    return dataset.prefetch(AUTOTUNE if prefetch_buffer_size is None else prefetch_buffer_size)


def read_csv(
    filenames: Any,
    batch_size: int,
    *,
    column_names: Sequence[str] | None = None,
    column_defaults: Sequence[Any] | None = None,
    select_columns: Sequence[int | str] | None = None,
    header: bool = True,
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    compression_type: str | None = None,
    drop_remainder: bool = False,
    num_rows_for_inference: int | None = 100,
    engine: str = "auto",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    num_parallel_reads: int | None = None,
) -> Dataset:
    """Batches of CSV rows as ``{column name: NumPy array}``, parsed a block at a time.

    Names come from the header (or ``column_names``), types and defaults from
    ``column_defaults`` (as ``record_defaults``) or are inferred from the
    first rows as ``make_csv_dataset`` does. Values, missing-field rules and
    errors are ``CsvDataset``'s, for the inference too: each names the file
    and, where it has one, the line. The inference reads records of at most 1
    MiB (it runs before the memory budget is known): at a longer record it
    stops there. ``engine="auto"`` uses pyarrow's parser when the ``[arrow]``
    extra is installed, ``"pure"`` never does; both give the same arrays.
    ``filenames``: a path (``str``, ``bytes`` as an interleave hands them out,
    ``os.PathLike``) or a sequence of them.
    """
    names_given = column_names is not None
    if isinstance(filenames, np.ndarray) and filenames.ndim == 0:
        filenames = filenames.item()
    one = isinstance(filenames, (str, bytes, os.PathLike))
    try:
        filenames_list = [os.fsdecode(f) for f in ([filenames] if one else list(filenames))]
    except TypeError as error:
        raise InvalidArgumentError(
            f"read_csv: filenames must be a path (str, bytes, os.PathLike) or a sequence of "
            f"them, got {filenames!r:.80} ({error})") from None
    if not filenames_list:
        raise InvalidArgumentError("read_csv: filenames must not be empty")
    if names_given:
        names = list(column_names or ())
    elif header:
        names = _header_names(filenames_list, CsvFormat.make(field_delim, use_quote_delim,
                                                             na_value),
                              compression_type or None, "utf-8", "read_csv")
    else:
        raise InvalidArgumentError("read_csv: give column_names, or header=True")
    select = _sorted_indices(select_columns, names) if select_columns is not None else None
    if column_defaults is not None:
        columns = columns_from_defaults(column_defaults)
    else:
        columns = _infer_defaults(filenames_list, len(names),
                                  CsvFormat.make(field_delim, use_quote_delim, na_value), header,
                                  num_rows_for_inference,
                                  select if select is not None else range(len(names)),
                                  compression_type or None, "utf-8")
    if select is not None:
        names = [names[i] for i in select]
    if len(columns) != len(names):
        raise InvalidArgumentError(
            f"read_csv: {len(columns)} column_defaults for {len(names)} columns {names}"
        )
    spec = CsvSpec(columns=tuple(columns), fmt=CsvFormat.make(field_delim, use_quote_delim,
                                                              na_value),
                   select_cols=tuple(select or ()), header=bool(header), names=tuple(names),
                   engine=engine, block_bytes=block_bytes)
    parallel = read_files_in_parallel(filenames_list, num_parallel_reads,
                                      _CsvFile(spec, compression_type or None))
    records = parallel if parallel is not None else Dataset(
        CsvNode(filenames_list, compression_type, None, spec))
    return records.batch(batch_size, drop_remainder=drop_remainder)
