"""CSV as TensorFlow parses it: ``tf.io.decode_csv`` and ``CsvDataset``, columnar.

Two parsers, because TensorFlow has two with different rules:

* :func:`decode_csv` parses *records* (lines already split) exactly as
  ``tf.io.decode_csv`` does (``decode_csv_op.cc``): a ``\\n``/``\\r`` at the
  start of a field is skipped, a ``\\r`` inside an unquoted field is an error,
  a quoted field must end with a quote followed by the delimiter or the end.
* :func:`scan_records` splits a *byte stream* into records as
  ``CsvDataset`` does (``csv_dataset_op.cc``): a record ends at ``\\n``,
  ``\\r`` or ``\\r\\n`` outside quotes, quoted fields may hold newlines, an
  empty line is a record of one empty field, and a bad record's error is the
  first one in field order, after the whole record was consumed (so the next
  record is still read).

Values follow TensorFlow's number grammar (absl ``SimpleAtoi``/``SimpleAtof``):
surrounding ASCII whitespace is allowed, ints are decimal only, floats may be
decimal, hexadecimal (``0x1p3``), ``inf``/``infinity``/``nan`` in any case;
float32 values are rounded once, from the decimal text (never via float64
first, which rounds twice). An empty field, or one equal to ``na_value``,
takes the column's default, or is an error if the column has none.

:func:`parse_columns` turns the records of one block into one NumPy array
per column — a vectorised path for the common case (checked against the
grammar with one regular expression per column) and a field-by-field path
that is the reference, used to find the exact error of a bad block. With
the ``[arrow]`` extra installed, :func:`arrow_parse_block` parses a whole
block in C++ (pyarrow's CSV reader); anything pyarrow and TensorFlow could
read differently (quotes, hexadecimal, missing required values, ragged rows)
goes to the pure path, so both paths give the same arrays and errors.

Strings are ``bytes`` in ``object`` arrays (never fixed-width ``S``, which
drops trailing NULs). Nothing here knows about datasets.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, ParseError

__all__ = [
    "KINDS",
    "BlockRecords",
    "CsvColumn",
    "CsvError",
    "CsvFormat",
    "DeferredCsvColumn",
    "DeferredLine",
    "arrow_available",
    "arrow_parse_block",
    "columns_from_defaults",
    "convert_field",
    "decode_csv",
    "decode_lines",
    "decode_records",
    "parse_columns",
    "quoted_block_end",
    "scan_records",
    "split_record",
]

#: Column types TensorFlow's CSV ops support, by NumPy name ("string": bytes objects).
KINDS = ("int32", "int64", "float32", "float64", "string")
_NUMPY: dict[str, np.dtype[Any]] = {
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "string": np.dtype(object),
}
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


class CsvError(ParseError):
    """A CSV record that cannot be parsed: TensorFlow's message, then where it is.

    ``message`` is TensorFlow's own text (``"Field 1 in record 0 is not a valid
    int32: x"``); ``str(error)`` adds the file, the record (counted from 0 in its
    file, header excluded), the line, the column and the byte offset where known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        record: int | None = None,
        line: int | None = None,
        column: int | None = None,
        column_name: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.message = message
        self.path, self.record, self.line = path, record, line
        self.column, self.column_name, self.offset = column, column_name, offset
        super().__init__(self._text())

    def _text(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"file {self.path}")
        if self.record is not None:
            where.append(f"record {self.record}")
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.column is not None:
            name = f" ({self.column_name!r})" if self.column_name else ""
            where.append(f"column {self.column}{name}")
        if self.offset is not None:
            where.append(f"byte offset {self.offset}")
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    def located(self, **where: Any) -> CsvError:
        """A copy with more of the *where* filled in (the parser knows less than the reader)."""
        fields: dict[str, Any] = {
            "path": self.path,
            "record": self.record,
            "line": self.line,
            "column": self.column,
            "column_name": self.column_name,
            "offset": self.offset,
        }
        fields.update({key: value for key, value in where.items() if value is not None})
        return CsvError(self.message, **fields)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_csv_error, (self.message, self.path, self.record, self.line,
                                     self.column, self.column_name, self.offset))


def _rebuild_csv_error(message: str, *where: Any) -> CsvError:
    keys = ("path", "record", "line", "column", "column_name", "offset")
    return CsvError(message, **dict(zip(keys, where, strict=True)))


# -- columns and their defaults ----------------------------------------------------------
@dataclass(frozen=True)
class CsvColumn:
    """One output column: its type (one of :data:`KINDS`) and default (None: required)."""

    kind: str
    default: Any = None
    name: str | None = None

    @property
    def dtype(self) -> np.dtype[Any]:
        return _NUMPY[self.kind]

    @property
    def required(self) -> bool:
        return self.default is None


def _kind_of_dtype(dtype: Any, index: int) -> str:
    as_numpy = getattr(dtype, "as_numpy_dtype", None)  # a tf.DType, when TF is around
    if as_numpy is not None:
        dtype = as_numpy
    if dtype in (str, bytes, "string", "str", "bytes", object):
        return "string"
    if dtype is int:
        return "int32"  # tf.constant(0) is int32
    if dtype is float:
        return "float32"
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(
            f"record_defaults[{index}]: {dtype!r} is not a dtype or a default value"
        ) from None
    if resolved.kind in "SUO":
        return "string"
    if resolved.name not in _NUMPY:
        raise InvalidArgumentError(
            f"csv: data type {resolved.name} not supported in field {index} "
            f"(supported: {', '.join(KINDS)})"
        )
    return str(resolved.name)


def _default_value(value: Any, kind: str, index: int) -> Any:
    if kind == "string":
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, (bytes, np.bytes_)):
            return bytes(value)
        raise InvalidArgumentError(f"record_defaults[{index}]: {value!r} is not a string")
    try:
        converted = _NUMPY[kind].type(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(
            f"record_defaults[{index}]: {value!r} is not a valid {kind}"
        ) from None
    if kind.startswith("int") and converted != value:
        raise InvalidArgumentError(f"record_defaults[{index}]: {value!r} does not fit {kind}")
    return converted


def _scalar_kind(value: Any, index: int) -> str:
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"csv: data type bool not supported in field {index} (supported: {', '.join(KINDS)})"
        )
    if isinstance(value, np.generic):
        return _kind_of_dtype(value.dtype, index)
    if isinstance(value, int):
        low, high = _INT_RANGE["int32"]
        return "int32" if low <= value <= high else "int64"  # tf.constant's choice
    if isinstance(value, float):
        return "float32"
    if isinstance(value, (str, bytes)):
        return "string"
    raise InvalidArgumentError(f"record_defaults[{index}]: unsupported default {value!r}")


def columns_from_defaults(
    record_defaults: Sequence[Any], names: Sequence[str] | None = None
) -> list[CsvColumn]:
    """Columns from TensorFlow-style ``record_defaults``.

    Each entry is a default value (``0`` → int32, ``0.0`` → float32, ``""`` →
    string, a NumPy scalar → its dtype), a one-element list of one, an empty
    list or array (required; an array's dtype, a plain ``[]`` is float32 as
    ``tf.constant([])``), or a dtype (required), as ``CsvDataset`` accepts.
    """
    if isinstance(record_defaults, (str, bytes)) or not isinstance(
        record_defaults, (Sequence, np.ndarray)
    ):
        raise InvalidArgumentError(
            f"record_defaults must be a list (one entry per column), got {record_defaults!r:.80}"
        )
    columns = []
    for index, entry in enumerate(record_defaults):
        name = names[index] if names is not None else None
        if (isinstance(entry, np.ndarray) and entry.ndim > 0) or isinstance(entry, (list, tuple)):
            array = entry if isinstance(entry, np.ndarray) else None
            items = list(array.reshape(-1)) if array is not None else list(entry)
            if len(items) > 1:
                raise InvalidArgumentError(
                    f"There should only be 1 default per field but field {index} has {len(items)}"
                )
            if not items:
                kind = _kind_of_dtype(array.dtype, index) if array is not None else "float32"
                columns.append(CsvColumn(kind, None, name))
                continue
            value = items[0]
            kind = _kind_of_dtype(array.dtype, index) if array is not None else _scalar_kind(
                value, index
            )
            columns.append(CsvColumn(kind, _default_value(value, kind, index), name))
        elif isinstance(entry, (int, float, str, bytes, np.generic)) and not isinstance(
            entry, type
        ):
            kind = _scalar_kind(entry, index)
            columns.append(CsvColumn(kind, _default_value(entry, kind, index), name))
        else:
            columns.append(CsvColumn(_kind_of_dtype(entry, index), None, name))
    if not columns:
        raise InvalidArgumentError("record_defaults must not be empty")
    return columns


# -- format options --------------------------------------------------------------------------
@dataclass(frozen=True)
class CsvFormat:
    """How fields are delimited: TensorFlow's ``field_delim``, ``use_quote_delim``, ``na_value``."""

    field_delim: bytes = b","
    use_quote_delim: bool = True
    na_value: bytes = b""

    @staticmethod
    def make(field_delim: str | bytes = ",", use_quote_delim: bool = True,
             na_value: str | bytes = "") -> CsvFormat:
        delim = field_delim.encode() if isinstance(field_delim, str) else bytes(field_delim)
        if len(delim) != 1:
            raise InvalidArgumentError("field_delim should be only 1 char")
        if delim in (b"\n", b"\r") or (use_quote_delim and delim == b'"'):
            raise InvalidArgumentError(f"field_delim {delim!r} cannot delimit fields")
        na = na_value.encode() if isinstance(na_value, str) else bytes(na_value)
        return CsvFormat(delim, bool(use_quote_delim), na)


def check_select_cols(select_cols: Sequence[int] | None, name: str = "select_cols") -> list[int]:
    """TensorFlow's checks: strictly increasing, non-negative."""
    if select_cols is None:
        return []
    cols = [int(c) for c in select_cols]
    for before, after in itertools.pairwise(cols):
        if before >= after:
            raise InvalidArgumentError(f"{name} should be strictly increasing indices")
    if cols and cols[0] < 0:
        raise InvalidArgumentError(f"{name} should be non-negative indices")
    return cols


# -- numbers, as absl parses them --------------------------------------------------------------
_WS = rb"[ \t\n\v\f\r]*"
_INT = rb"[+-]?[0-9]+"
_DEC = rb"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_HEX = rb"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
_SPECIAL = rb"(?:[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?)"
_INT_RE = re.compile(_WS + rb"(" + _INT + rb")" + _WS)
_FLOAT_RE = re.compile(_WS + rb"([+-]?)(" + _DEC + rb"|" + _HEX + rb"|" + _SPECIAL + rb")" + _WS)
#: Bytes of values NumPy's own string-to-number casts read exactly as absl does. A column
#: made of these only (checked with one ``bytes.translate``) is cast at once; NumPy then
#: refuses what absl refuses (``1-2``, ``e5``, ``.``), which sends it field by field.
_WS_BYTES = b" \t\n\x0b\x0c\r"
_INT_BYTES = b"0123456789+-" + _WS_BYTES
_FLOAT_BYTES = _INT_BYTES + b".eE" + b"infatyINFATY"


def _exact_float32(text: bytes) -> Any:
    """The float32 nearest to the decimal ``text`` (ties to even), rounded once."""
    with np.errstate(over="ignore"):
        guess = np.float32(float(text))
    if not np.isfinite(guess):
        return guess
    try:
        exact = Fraction(Decimal(text.strip().decode()))
    except (InvalidOperation, ValueError):
        return guess
    candidates = [guess, np.nextafter(guess, np.float32(-np.inf)),
                  np.nextafter(guess, np.float32(np.inf))]

    def distance(candidate: np.float32) -> tuple[Fraction, int]:
        odd = int(np.array(candidate).view(np.uint32)) & 1
        return abs(Fraction(float(candidate)) - exact), odd

    return min((c for c in candidates if np.isfinite(c)), key=distance)


def _twice_rounded(f64: np.ndarray[Any, Any], f32: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Where casting the float64 to float32 may have rounded twice (it sits on a midpoint)."""
    with np.errstate(over="ignore", invalid="ignore"):
        diff = np.abs(f64 - f32.astype(np.float64))
        spacing = np.abs(np.spacing(f32).astype(np.float64))
        mask: np.ndarray[Any, Any] = (diff != 0) & np.isfinite(f32) & (
            (diff * 2 == spacing) | (diff * 4 == spacing)
        )
        return mask


def _parse_number(text: bytes, kind: str) -> Any:
    """One field's value, or None if TensorFlow would refuse it."""
    if kind.startswith("int"):
        match = _INT_RE.fullmatch(text)
        if match is None:
            return None
        value = int(match.group(1))
        low, high = _INT_RANGE[kind]
        return _NUMPY[kind].type(value) if low <= value <= high else None
    match = _FLOAT_RE.fullmatch(text)
    if match is None:
        return None
    sign, body = match.group(1), match.group(2)
    lowered = body.lower()
    if lowered.startswith(b"nan"):
        return _NUMPY[kind].type(np.copysign(np.nan, -1.0 if sign == b"-" else 1.0))
    if lowered.startswith(b"0x"):
        number = float.fromhex((sign + body).decode())
        with np.errstate(over="ignore"):
            return _NUMPY[kind].type(number)
    if kind == "float32" and not lowered.startswith(b"inf"):
        return _exact_float32(sign + body)
    return np.float64(float(sign + body)) if kind == "float64" else np.float32(float(sign + body))


def convert_field(field: bytes, column: CsvColumn, na_value: bytes) -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, problem)``; ``problem`` is ``"missing"`` or ``"invalid"``."""
    if not field or field == na_value:
        if column.default is None:
            return None, "missing"
        return column.default, None
    if column.kind == "string":
        return field, None
    value = _parse_number(field, column.kind)
    return (value, None) if value is not None else (None, "invalid")


def _number_name(kind: str) -> str:
    return {"float64": "double", "float32": "float"}.get(kind, kind)


# -- decode_csv: one record at a time, as decode_csv_op.cc --------------------------------------
def split_record(record: bytes, fmt: CsvFormat, select_cols: Sequence[int] = ()) -> list[bytes]:
    """The fields of one record as ``tf.io.decode_csv`` extracts them (raises CsvError)."""
    delim = fmt.field_delim
    quoting = fmt.use_quote_delim
    if not record:
        return []
    if not (quoting and b'"' in record) and b"\n" not in record and b"\r" not in record:
        fields = record.split(delim)
        if select_cols:
            return [fields[c] for c in select_cols if c < len(fields)]
        return fields
    return _extract_fields(record, delim[0], quoting, list(select_cols))


def _extract_fields(data: bytes, delim: int, quoting: bool, select: list[int]) -> list[bytes]:  # noqa: C901
    quote, newline, carriage = 0x22, 0x0A, 0x0D
    size = len(data)
    index = 0
    parsed = 0
    selector = 0
    result: list[bytes] = []
    while index < size:
        if data[index] in (newline, carriage):
            index += 1
            continue
        include = not select or select[selector] == parsed
        field = bytearray()
        if quoting and data[index] == quote:
            index += 1
            while index < size - 1 and (data[index] != quote or data[index + 1] != delim):
                if data[index] != quote:
                    field.append(data[index])
                    index += 1
                else:
                    if data[index + 1] != quote:
                        raise CsvError("Quote inside a string has to be escaped by another quote")
                    field.append(quote)
                    index += 2
            if not (index < size and data[index] == quote and (
                index == size - 1 or data[index + 1] == delim
            )):
                raise CsvError("Quoted field has to end with quote followed by delim or end")
            index += 2
        else:
            while index < size and data[index] != delim:
                char = data[index]
                if (quoting and char == quote) or char in (newline, carriage):
                    raise CsvError("Unquoted fields cannot have quotes/CRLFs inside")
                field.append(char)
                index += 1
            index += 1
        parsed += 1
        if include:
            result.append(bytes(field))
            selector += 1
            if select and selector == len(select):
                return result
    include = not select or select[selector] == parsed
    if include and data[size - 1] == delim:
        result.append(b"")
    return result


def as_records(records: Any) -> np.ndarray[Any, Any]:
    array = np.asarray(records, dtype=object) if not isinstance(records, np.ndarray) else records
    if array.dtype.kind in "SU":
        array = array.astype(object)
    flat = array.reshape(-1)
    out = np.empty(flat.shape, dtype=object)
    for i, item in enumerate(flat):
        if isinstance(item, str):
            out[i] = item.encode()
        elif isinstance(item, (bytes, np.bytes_)):
            out[i] = bytes(item)
        else:
            raise InvalidArgumentError(
                f"decode_csv: records must be strings or bytes, got {type(item).__name__} "
                f"at index {i}"
            )
    return out.reshape(array.shape)


def decode_csv(
    records: Any,
    record_defaults: Sequence[Any],
    field_delim: str = ",",
    use_quote_delim: bool = True,
    name: str | None = None,
    na_value: str = "",
    select_cols: Sequence[int] | None = None,
) -> list[np.ndarray[Any, Any]]:
    """``tf.io.decode_csv``: one array per column, shaped like ``records``.

    Same arguments, semantics and error messages as TensorFlow (raised as
    :class:`CsvError`, a ``ValueError``): ``"Expect 3 fields but have 2 in record
    0"``, ``"Field 1 is required but missing in record 4!"``, ``"Field 0 in record
    2 is not a valid int32: x"``. Strings come back as ``bytes`` in ``object``
    arrays; int/float columns in their NumPy dtype. ``name`` is accepted for
    compatibility and ignored.
    """
    del name
    columns = columns_from_defaults(record_defaults)
    fmt = CsvFormat.make(field_delim, use_quote_delim, na_value)
    select = check_select_cols(select_cols)
    if select and len(select) != len(columns):
        raise InvalidArgumentError("Length of select_cols and record_defaults do not match.")
    if isinstance(records, DeferredLine):  # a map function being traced for fusion
        return records.decode(columns, fmt, select)
    return decode_records(as_records(records), columns, fmt, select)


def decode_records(array: np.ndarray[Any, Any], columns: Sequence[CsvColumn], fmt: CsvFormat,
                   select: Sequence[int]) -> list[np.ndarray[Any, Any]]:
    """:func:`decode_csv` of ``array`` (an ``object`` array of ``bytes``), its arguments
    already checked."""
    flat = array.reshape(-1)
    rows: list[list[bytes]] = []
    problem: CsvError | None = None  # TensorFlow goes record by record: the first one wins
    for index, record in enumerate(flat):
        try:
            fields = split_record(record, fmt, select)
        except CsvError as error:
            problem = error.located(record=index)
            break
        if len(fields) != len(columns):
            problem = CsvError(
                f"Expect {len(columns)} fields but have {len(fields)} in record {index}"
            )
            break
        rows.append(fields)
    outputs = parse_columns(rows, columns, fmt, message_style="decode_csv")
    if problem is not None:
        raise problem
    return [column.reshape(array.shape) for column in outputs]


class DeferredLine:
    """Internal: a text line that is not there yet, given to a map function once to see
    whether it only decodes its line (:mod:`headrace._csv.fusion`); records the
    :func:`decode_csv` calls made on it."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        #: (columns, format, select_cols) of each decode_csv call, in call order.
        self.calls: list[tuple[list[CsvColumn], CsvFormat, list[int]]] = []

    def decode(self, columns: list[CsvColumn], fmt: CsvFormat,
               select: list[int]) -> list[Any]:
        """Record a decode of this line; stand-ins for its columns."""
        call = len(self.calls)
        self.calls.append((columns, fmt, select))
        return [DeferredCsvColumn(self, call, index) for index in range(len(columns))]

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a deferred line can only be decoded")

    __array__ = __bool__ = __len__ = __iter__ = __getitem__ = _refuse


class DeferredCsvColumn:
    """Internal: column ``index`` of decode call ``call`` on ``line``, not computed yet.
    Any use but arranging it in a nest fails, so such a function runs per record."""

    __slots__ = ("call", "index", "line")

    def __init__(self, line: DeferredLine, call: int, index: int) -> None:
        self.line, self.call, self.index = line, call, index

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"column {self.index} of a deferred line has no value yet")

    __array__ = __bool__ = __len__ = __iter__ = __float__ = __int__ = __index__ = _refuse
    __getitem__ = __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = _refuse
    __truediv__ = __rtruediv__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


def decode_lines(
    records: list[bytes], columns: Sequence[CsvColumn], fmt: CsvFormat, select: Sequence[int]
) -> list[np.ndarray[Any, Any]] | None:
    """``decode_csv`` of a batch of lines in one conversion, or None where
    :func:`decode_csv` must decide (it then gives the same arrays, or the error).

    The common shape of a fused ``map(decode_csv).batch(n)``: every column of one
    numeric type, no quote, no line break inside a record, every record as wide as
    the first. The fields of all records are then one column of ``n * width`` values,
    converted at once (one NumPy cast instead of one per column), and cut into
    columns. Anything else (strings, mixed types, ragged or empty records, defaults
    that differ where a value is missing) returns None.
    """
    count = len(records)
    kinds = {column.kind for column in columns}
    if not count or len(kinds) != 1 or "string" in kinds:
        return None
    try:
        joined = b"\n".join(records)
    except TypeError:  # not all bytes
        return None
    if b"\r" in joined or (fmt.use_quote_delim and b'"' in joined) or not all(records):
        return None  # (an empty record is decode_csv's error)
    delim = fmt.field_delim
    gaps = records[0].count(delim)
    width = gaps + 1
    if (select and select[-1] >= width) or (not select and width != len(columns)):
        return None
    if joined.count(delim) != count * gaps or any(r.count(delim) != gaps for r in records):
        return None
    defaults = {repr(column.default) for column in columns}
    # One default for all: a missing value takes it; else missing values go the long way.
    common = CsvColumn(columns[0].kind, columns[0].default if len(defaults) == 1 else None)
    flat = _vector_column(joined.replace(b"\n", delim).split(delim), common, fmt.na_value)
    if flat is None:
        return None
    matrix = flat.reshape(count, width)
    picked = list(select) if select else range(width)
    return [np.ascontiguousarray(matrix[:, j]) for j in picked]


# -- columns from many records ------------------------------------------------------------------
def _field_error(style: str, output: int, record: int, kind: str, field: bytes, problem: str,
                 column: CsvColumn) -> CsvError:
    at = f" in record {record}" if style == "decode_csv" else " in record"
    if problem == "missing":
        where = f" in record {record}!" if style == "decode_csv" else " in record!"
        message = f"Field {output} is required but missing{where}"
    else:
        shown = field.decode("utf-8", "backslashreplace")
        message = f"Field {output}{at} is not a valid {_number_name(column.kind)}: {shown}"
    return CsvError(message, column=output, column_name=column.name,
                    record=record if style != "decode_csv" else None)


def _vector_column(values: Sequence[bytes], column: CsvColumn, na_value: bytes) -> Any:  # noqa: C901
    """A column converted at once, or None where the field-by-field path must decide."""
    count = len(values)
    if column.kind == "string":
        out = np.empty(count, dtype=object)
        out[:] = values
        if column.default is not None:
            missing = [i for i, v in enumerate(values) if not v or v == na_value]
            if missing:
                out[missing] = column.default
            return out
        if any(not v or v == na_value for v in values):
            return None
        return out
    allowed = _INT_BYTES if column.kind.startswith("int") else _FLOAT_BYTES
    joined = b"".join(values)
    if joined.translate(None, allowed) and (
        not na_value or joined.replace(na_value, b"").translate(None, allowed)
    ):
        return None
    text = np.array(values, dtype="S") if count else np.empty(0, dtype="S1")
    missing = text == b""
    if na_value:
        missing |= text == na_value
    if missing.any():
        if column.default is None:
            return None
        text = np.where(missing, b"0", text)
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            if column.kind.startswith("int"):
                wide = text.astype(np.int64)
                if column.kind == "int32":
                    low, high = _INT_RANGE["int32"]
                    if count and (wide.min() < low or wide.max() > high):
                        return None
                out = wide.astype(column.dtype)
            else:
                f64 = text.astype(np.float64)
                if column.kind == "float64":
                    out = f64
                else:
                    out = f64.astype(np.float32)
                    for i in np.flatnonzero(_twice_rounded(f64, out)):
                        out[i] = _exact_float32(values[int(i)])
    except (ValueError, OverflowError):
        return None  # an int64 out of range, say: the reference path names it
    if missing.any():
        out[missing] = column.default
    return out


def parse_columns(
    rows: Sequence[Sequence[bytes]],
    columns: Sequence[CsvColumn],
    fmt: CsvFormat,
    *,
    message_style: str = "decode_csv",
    record_base: int = 0,
) -> list[np.ndarray[Any, Any]]:
    """One array per column from rows of raw fields (each row exactly ``len(columns)`` long).

    ``message_style`` picks TensorFlow's wording: ``"decode_csv"`` names the record
    index in the message, ``"dataset"`` (CsvDataset) does not — the error's
    ``record`` attribute and its location say it instead (counted from
    ``record_base``).
    """
    width = len(columns)
    by_column = list(zip(*rows, strict=True)) if rows else [() for _ in columns]
    outputs = []
    for index, column in enumerate(columns):
        converted = _vector_column(by_column[index], column, fmt.na_value)
        if converted is None:
            return _reference_columns(rows, columns, fmt, message_style, record_base)
        outputs.append(converted)
    assert len(outputs) == width
    return outputs


def _reference_columns(
    rows: Sequence[Sequence[bytes]],
    columns: Sequence[CsvColumn],
    fmt: CsvFormat,
    style: str,
    record_base: int,
) -> list[np.ndarray[Any, Any]]:
    """Field by field, record by record: the first bad field of the first bad record raises."""
    outputs = [np.empty(len(rows), dtype=column.dtype) for column in columns]
    for row_index, row in enumerate(rows):
        for index, (field, column) in enumerate(zip(row, columns, strict=True)):
            value, problem = convert_field(field, column, fmt.na_value)
            if problem is not None:
                raise _field_error(style, index, record_base + row_index, column.kind, field,
                                   problem, column)
            outputs[index][row_index] = value
    return outputs


# -- CsvDataset: records of a byte stream -------------------------------------------------------
@dataclass
class BlockRecords:
    """The records :func:`scan_records` found: raw fields, or an error, and where each ends.

    ``ends[i]`` is the offset (in the scanned buffer) just past record ``i``,
    its line break included; ``errors[i]`` is TensorFlow's message for a record
    whose quotes are malformed (None otherwise); ``consumed`` is where the next
    record starts.
    """

    fields: list[list[bytes]]
    ends: list[int]
    errors: list[tuple[int, str] | None]
    consumed: int


_UNCLOSED = "Reached end of file without closing quoted field in record"


def scan_records(  # noqa: C901
    data: bytes, fmt: CsvFormat, *, start: int = 0, final: bool, max_records: int | None = None
) -> BlockRecords:
    """Split ``data[start:]`` into CsvDataset records; stop before an incomplete one.

    With ``final=False`` the last record is kept back unless a line break ends
    it (more bytes may follow). An error in a record (a stray quote) is recorded
    with the index of the field it is in, and the record is consumed, as
    TensorFlow does so that the next record can still be read.
    """
    delim = fmt.field_delim
    quoting = fmt.use_quote_delim
    out = BlockRecords([], [], [], start)
    size = len(data)
    if not (quoting and b'"' in data[start:]) and b"\r" not in data[start:]:
        return _scan_simple(data, delim, start, final, max_records, out)
    stops = re.compile(b"[" + re.escape(delim) + rb"\n\r]")
    position = start
    while position < size and (max_records is None or len(out.ends) < max_records):
        fields: list[bytes] = []
        error: tuple[int, str] | None = None
        cursor = position
        complete = False
        while True:  # one field per turn
            if cursor >= size:
                if not final:
                    break
                fields.append(b"")  # the record ended with a delimiter at the end of the file
                complete = True
                break
            if quoting and data[cursor] == 0x22:
                result = _scan_quoted(data, cursor, delim[0], final)
                if result is None:
                    break
                field, cursor, ended, problem = result
                if problem is not None and error is None:
                    error = (len(fields), problem)
                fields.append(field)
                if ended:
                    complete = True
                    break
                continue
            match = stops.search(data, cursor)
            if match is None:
                if not final:
                    break
                field_end = size
            else:
                field_end = match.start()
            field = data[cursor:field_end]
            if quoting and b'"' in field and error is None:
                error = (len(fields), "Unquoted fields cannot have quotes inside")
            fields.append(field)
            if match is None:
                cursor = size
                complete = True
                break
            cursor = field_end + 1
            if data[field_end] != delim[0]:
                if data[field_end] == 0x0D:
                    if cursor >= size and not final:
                        break  # a \n may follow in the next block
                    if cursor < size and data[cursor] == 0x0A:
                        cursor += 1
                complete = True
                break
        if not complete:
            break
        out.fields.append(fields)
        out.errors.append(error)
        out.ends.append(cursor)
        position = cursor
    out.consumed = position
    return out


def _scan_simple(
    data: bytes, delim: bytes, start: int, final: bool, max_records: int | None,
    out: BlockRecords,
) -> BlockRecords:
    """No quotes, no ``\\r``: records are the lines, fields the pieces between delimiters."""
    end = len(data) if final else data.rfind(b"\n", start) + 1
    if max_records is not None:  # split only as far as needed (a header: one line)
        cut = start
        for _ in range(max_records):
            newline = data.find(b"\n", cut, end)
            if newline < 0:
                break
            cut = newline + 1
        else:
            end = cut
    if end <= start:
        return out
    body = data[start:end]
    lines = body.split(b"\n")
    if body.endswith(b"\n"):
        lines.pop()
    if max_records is not None and len(lines) > max_records:
        lines = lines[:max_records]
    offset = start
    ends = out.ends
    for line in lines:
        offset += len(line) + 1
        ends.append(offset)
    if ends and ends[-1] > len(data):
        ends[-1] = len(data)  # the last line of the file has no newline
    out.fields = [line.split(delim) for line in lines]
    out.errors = [None] * len(lines)
    out.consumed = ends[-1] if ends else start
    return out


def _scan_quoted(  # noqa: C901
    data: bytes, start: int, delim: int, final: bool
) -> tuple[bytes, int, bool, str | None] | None:
    """A quoted field from ``start`` (its opening quote): (value, next cursor, record ended,
    error), or None when the block ends first and more bytes may follow."""
    size = len(data)
    cursor = start + 1
    problem: str | None = None
    while True:
        quote = data.find(b'"', cursor)
        if quote < 0:
            if not final:
                return None
            return b"", size, True, _UNCLOSED  # TensorFlow returns this one, not an earlier one
        after = quote + 1
        if after >= size:
            if not final:
                return None
            return _unquote(data[start:size]) if problem is None else b"", size, True, problem
        following = data[after]
        if following == delim:
            value = _unquote(data[start:after]) if problem is None else b""
            return value, after + 1, False, problem
        if following in (0x0A, 0x0D):
            value = _unquote(data[start:after]) if problem is None else b""
            cursor = after + 1
            if following == 0x0D:
                if cursor >= size and not final:
                    return None
                if cursor < size and data[cursor] == 0x0A:
                    cursor += 1
            return value, cursor, True, problem
        if following != 0x22 and problem is None:
            problem = "Quote inside a string has to be escaped by another quote"
        cursor = after + 1


def _unquote(framed: bytes) -> bytes:
    return framed[1:-1].replace(b'""', b'"')


def select_fields(
    fields: list[bytes], select_cols: Sequence[int], exclude_cols: Sequence[int]
) -> list[bytes]:
    """The fields CsvDataset keeps from one record."""
    if select_cols:
        return [fields[c] for c in select_cols if c < len(fields)]
    if exclude_cols:
        excluded = set(exclude_cols)
        return [field for i, field in enumerate(fields) if i not in excluded]
    return fields


def record_error(
    fields: list[bytes],
    quote_error: tuple[int, str] | None,
    columns: Sequence[CsvColumn],
    fmt: CsvFormat,
    select_cols: Sequence[int],
    exclude_cols: Sequence[int],
) -> tuple[str, int | None] | None:
    """CsvDataset's error for one record (the first in field order), with the output
    column it concerns; None if the record is good."""
    width = len(columns)
    output = 0
    selected = set(select_cols)
    excluded = set(exclude_cols)
    for index, field in enumerate(fields):
        if quote_error is not None and quote_error[0] == index:
            return quote_error[1], (output if output < width else None)
        include = (not selected and not excluded) or index in selected or (
            bool(excluded) and index not in excluded
        )
        if not include:
            continue
        if output >= width:
            return f"Expect {width} fields but have more in record", None
        _, problem = convert_field(field, columns[output], fmt.na_value)
        if problem is not None:
            error = _field_error("dataset", output, 0, columns[output].kind, field, problem,
                                 columns[output])
            return error.message, output
        output += 1
    if output != width:
        return f"Expect {width} fields but have {output} in record", None
    return None


# -- pyarrow, when installed --------------------------------------------------------------------
def arrow_available() -> bool:
    """Whether the ``[arrow]`` extra (pyarrow) can be imported."""
    try:
        import pyarrow.csv  # noqa: F401
    except ImportError:
        return False
    return True


def _has_hex_prefix(block: bytes | bytearray, start: int = 0, end: int | None = None) -> bool:
    """Whether ``0x``/``0X`` occurs in ``block[start:end]``: a one-byte search first
    (memchr, tens of GB/s), as a two-byte search runs at a few hundred MB/s and would
    cost more than the parse."""
    return any(block.find(one, start, end) >= 0 and block.find(two, start, end) >= 0
               for one, two in ((b"x", b"0x"), (b"X", b"0X")))


def quoted_block_end(data: bytes | bytearray, start: int, stop: int, final: bool,
                     fmt: CsvFormat) -> int | None:
    """Where the whole records in ``data[start:stop]`` end, for text with quotes and no
    ``\r``, when pyarrow reads their quoting as ``CsvDataset`` does; None when it may
    not (a quote inside an unquoted field, text after a closing quote, an unclosed quote
    at the end of the file) or no record ends there: the pure scanner then decides.

    Vectorised over the quotes (a few ms per 4 MiB): quotes come in runs of adjacent
    quote characters, and where the quoting is TensorFlow's, a run of odd length opens
    or closes a quoted field in turn (``""`` pairs inside are escaped quotes). So an
    opening run must start a field, a closing run must end one, a run of even length
    outside a quoted field must be a whole field (``""``, an empty value); a record
    ends at a newline outside quotes.
    """
    size = stop - start
    view = np.frombuffer(data, dtype=np.uint8, count=size, offset=start)
    quotes = np.flatnonzero(view == 0x22)
    if not quotes.size:
        return None
    first = np.empty(quotes.size, dtype=bool)  # where a run of adjacent quotes starts
    first[0] = True
    np.not_equal(np.diff(quotes), 1, out=first[1:])
    starts = np.flatnonzero(first)
    run_start = quotes[starts]
    run_end = quotes[np.append(starts[1:] - 1, quotes.size - 1)] + 1
    odd = ((run_end - run_start) & 1).astype(bool)
    quoting = np.logical_xor.accumulate(odd)  # inside a quoted field after each run
    if final and not quoting[-1]:
        end = size
    else:
        # the last newline outside quotes: an even count of odd runs before it
        end = -1
        cursor = size
        while True:
            newline = data.rfind(b"\n", start, start + cursor)
            if newline < 0:
                return None
            cursor = newline - start
            before = int(np.searchsorted(run_start, cursor))
            if not before or not quoting[before - 1]:
                end = cursor + 1
                break
    runs = int(np.searchsorted(run_start, end))
    run_start, run_end, odd = run_start[:runs], run_end[:runs], odd[:runs]
    inside = quoting[:runs] ^ odd  # within a quoted field before the run
    delim = fmt.field_delim[0]
    previous = view[np.maximum(run_start - 1, 0)]
    starts_field = (run_start == 0) | (previous == delim) | (previous == 0x0A)
    following = view[np.minimum(run_end, size - 1)]
    ends_field = (run_end >= end) | (following == delim) | (following == 0x0A)
    opening, closing = odd & ~inside, odd & inside
    whole = ~odd & ~inside
    if (opening & ~starts_field).any() or (closing & ~ends_field).any() or (
            whole & ~(starts_field & ends_field)).any():
        return None
    return start + end


_ARROW_TYPES = {"int32": "int32", "int64": "int64", "float32": "float32",
                "float64": "float64", "string": "binary"}


def arrow_parse_block(  # noqa: C901
    block: bytes | bytearray,
    columns: Sequence[CsvColumn],
    fmt: CsvFormat,
    select_cols: Sequence[int],
    exclude_cols: Sequence[int],
    expected_rows: int | None = None,
    *,
    start: int = 0,
    end: int | None = None,
    quoted: bool = False,
) -> list[np.ndarray[Any, Any]] | None:
    """The block's columns parsed by pyarrow, or None where the pure path must decide.

    ``start``/``end``: parse ``block[start:end]`` only, in place (pyarrow reads a
    zero-copy view; the records end there). ``expected_rows``: the caller's count of
    records, or None when the block's lines are its records (no quote, no ``\\r``:
    then pyarrow's rows are the lines, a ragged or empty line being an error or, in a
    one-column file, an empty value).

    Only blocks where pyarrow and TensorFlow read every value alike get here:
    ``block`` holds whole records with no quote character, and no ``0x`` where an
    int column is read (pyarrow reads hexadecimal ints, TensorFlow does not; it
    refuses hexadecimal floats, which TensorFlow reads); pyarrow refuses what TensorFlow
    refuses on such input (ragged rows, bad numbers); a required column with a
    missing value, or a row count that differs from the scanner's, returns None.
    """
    import pyarrow as pa
    import pyarrow.csv as pacsv

    stop = len(block) if end is None else end
    if fmt.field_delim[0] >= 0x80:
        return None
    # pyarrow reads `0x10` as 16 in an int column (TensorFlow refuses it) and refuses any
    # hexadecimal in a float column (then the pure path decides): only ints need the scan.
    if any(c.kind.startswith("int") for c in columns) and _has_hex_prefix(block, start, stop):
        return None
    try:
        nulls = [fmt.na_value.decode()] if fmt.na_value else []
    except UnicodeDecodeError:
        return None
    if quoted:  # the first record's fields, counted as the scanner splits them
        first = scan_records(bytes(block[start:min(stop, start + (1 << 16))]), fmt,
                             final=stop - start <= 1 << 16, max_records=1)
        if not first.fields or first.errors[0] is not None:
            return None
        total = len(first.fields[0])
    else:
        newline = block.find(b"\n", start, stop)
        first_line = block[start: newline if newline >= 0 else stop]
        total = first_line.count(fmt.field_delim) + 1
    if select_cols:
        wanted = list(select_cols)
    elif exclude_cols:
        excluded = set(exclude_cols)
        wanted = [i for i in range(total) if i not in excluded]
    else:
        wanted = list(range(total))
    if len(wanted) != len(columns) or (wanted and wanted[-1] >= total):
        return None
    names = [f"f{i}" for i in range(total)]
    types = {names[c]: getattr(pa, _ARROW_TYPES[col.kind])()
             for c, col in zip(wanted, columns, strict=True)}
    try:
        table = pacsv.read_csv(
            pa.py_buffer(block if start == 0 and stop == len(block)
                         else memoryview(block)[start:stop]),
            # One Arrow block (it is already cut at a record boundary), its columns
            # converted in parallel by Arrow's thread pool: the conversion of text to
            # numbers is most of the work, and it runs without the GIL.
            read_options=pacsv.ReadOptions(column_names=names, use_threads=True,
                                           block_size=max(stop - start + 1, 1 << 16)),
            # Quoted text comes here only once quoted_block_end found its quoting to be
            # TensorFlow's: a doubled quote is an escaped one, and newlines may be quoted.
            parse_options=pacsv.ParseOptions(delimiter=fmt.field_delim.decode(),
                                             quote_char='"' if quoted else False,
                                             double_quote=True, escape_char=False,
                                             newlines_in_values=quoted,
                                             ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                column_types=types, include_columns=[names[c] for c in wanted],
                null_values=["", *nulls], strings_can_be_null=True,
                quoted_strings_can_be_null=True, check_utf8=False,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError):
        return None
    if expected_rows is not None and table.num_rows != expected_rows:
        return None
    if total > 1 and any(table.column(i).null_count for i in range(table.num_columns)) and (
            block.startswith(b"\n", start, stop) or block.find(b"\n\n", start, stop) >= 0):
        # pyarrow reads an empty line as a row of nulls; to TensorFlow it is a record of
        # one field, an error in a wider file. Only a block with nulls can hold one.
        return None
    outputs = []
    for index, column in enumerate(columns):
        chunked = table.column(index)
        nulls_here = chunked.null_count
        if nulls_here and column.default is None:
            return None
        if column.kind == "string":
            if nulls_here:  # (filled in Arrow: no Python loop over the nulls)
                chunked = chunked.fill_null(pa.scalar(column.default, pa.binary()))
            # one object array of bytes, made in C (to_pylist, then a copy, took longer)
            out = chunked.to_numpy(zero_copy_only=False)
            outputs.append(out if out.dtype == object else out.astype(object))
            continue
        if nulls_here:
            chunked = chunked.fill_null(pa.scalar(column.default.item(), chunked.type))
        array = chunked.to_numpy()
        outputs.append(np.ascontiguousarray(array, dtype=column.dtype))
    return outputs
