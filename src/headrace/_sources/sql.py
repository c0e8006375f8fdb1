"""SQL queries as a source: batches of ``{column: NumPy array}``, resumable by key.

``Dataset.from_sql(query, params, connection=..., key=...)`` (this module's
:class:`SqlNode`) reads a query's rows in batches. ``connection`` is a URL, or a
picklable zero-argument function returning a ``sqlite3`` or ADBC PostgreSQL
connection. URLs are ``sqlite:///path.db`` (the standard library's sqlite3:
embedded, no server) or ``postgresql://...`` (the ``[postgres]`` extra). The
recipe keeps the URL or the function, never a live connection.

PostgreSQL goes through ADBC's libpq driver (``adbc-driver-postgresql``). It
receives rows in PostgreSQL's binary COPY format and decodes them in C++ into
Arrow columns, so NumPy arrays come out without a Python object per value.
``benchmarks/bench_sql.py`` measures it against a psycopg 3 server-side cursor,
and against psycopg's binary COPY parsed with NumPy.

Pages (G1, G4). With a ``key`` column (unique, non-NULL, sortable), rows are read
in pages of ``page_rows`` by keyset pagination: ``SELECT * FROM (query) WHERE key
>= :last ORDER BY key LIMIT :page_rows + 1``, with the row of the last key
dropped. Each page is booked on the stage's share of the budget before it is
held, so a table of any size streams in flat memory. The iterator's state holds
the last key handed out; a restore asks for the rows after it.

Keyset pages are exact only over a unique key. Rows sharing a key with the last
row of a page would be skipped, and NULL keys never reached. So the key is
checked as it is read. These raise :class:`SqlError` naming the key:

- two rows with one key side by side in a page;
- a second row of the last key at the start of the next page;
- a NULL key (and, where pages could not see one, one query for ``key IS NULL``
  at the end).

The rows before it were delivered once; none is skipped in silence. A unique
index or primary key is not required, only unique values: headrace cannot tell,
from a query, which table a column comes from. Without a key, the query is read
once through a cursor (``fetchmany``). A restore then re-runs it and skips the
rows already delivered, which is exact only if the query's order is
deterministic.

The query is one statement. It may end with ``;``, whitespace and comments,
which are dropped before it is nested as ``(query)``. They are found by
tokenizing as the database does, leaving strings and quoted names alone. Values
only ever travel as query parameters: ``params``, the last key, the page size,
the shard numbers. The key column's name is quoted as an identifier.

A lost connection (an I/O error, SQLSTATE class 08, a server shutting down) is
retried from the last key, up to ``max_retries`` times. Then :class:`SqlError`
says what failed, how often, and from which key. Nothing is delivered twice or
skipped. Anything else fails at once with the database's message and the query:
no such table or column, a syntax error, a refused permission, a bad value. A
``sqlite:///`` path that is not a file is refused (sqlite3 would create an empty
database there).

Types come from the result's column types (PostgreSQL), or from the first page's
values (SQLite, whose columns have no fixed type; a page holds at least
``batch_size`` rows, ``page_rows`` being raised to it). Integers become int64, reals
float64, booleans bool; text becomes ``str`` and blobs ``bytes``, in ``object``
arrays. A SQLite column may mix storage classes: a first page that mixes kinds
(ints and text, say) makes the column ``object``, each value kept as it is. A
later value that its type
would change raises :class:`SqlError` naming the column (the key column as
such), the row and the value; it is never converted in silence. Examples: 1.5 or
'1' in an int64 column, text in a float64 one, an integer beyond 2**53 in
float64. Which values come first depends on ``page_rows``. So pass
``dtypes={column: ...}`` (float64 for integers and reals, ``object`` for
anything, kept as it is), or CAST in SQL. Pages start from the last key exactly
as the database returned it.

A NULL takes ``null_defaults[column]``, or ``null_defaults["*"]`` for every
column without an entry of its own. Without one, it raises naming the column,
the row and its key. A default given as :class:`TextDefault` (what ``headrace
convert --null-default`` passes) is parsed as each column's type where it is
used. So one value serves integer, float and text columns alike.

Parameters (``params``) are int, float, bool, str, bytes, ``datetime.date``,
``datetime.datetime``, ``decimal.Decimal`` or None. NumPy scalars count as their
Python type. Anything else is refused when the dataset is built, naming its
position. PostgreSQL binds each with its own type: bigint, double precision,
boolean, text, bytea, date, timestamp (timestamptz for an aware datetime),
numeric. A text parameter compares with text only, so a date column needs a
``date``. SQLite stores dates as text. So a date is bound as ``2024-01-31``, a
datetime as ``2024-01-31 12:00:00`` (an aware one in UTC), a Decimal as its
exact text, a bool as 1 or 0. Placeholders are the driver's: ``$1, $2``
(PostgreSQL), ``?`` (SQLite). psycopg's ``%s`` and ``%(name)s`` are refused;
the message shows the query rewritten with the right ones.

PostgreSQL column types become:

- date: ``datetime64[D]``; timestamp: ``datetime64[us]``;
- timestamptz: ``datetime64[us]`` holding the instant in UTC (NumPy has no time
  zones);
- time: ``timedelta64[us]`` since midnight;
- interval: ``timedelta64[us]``, a day being 24 h. An interval with months,
  whose length is not fixed, raises naming the column and row;
- numeric: ``float64``, or exact ``decimal.Decimal`` with
  ``dtypes={column: object}``;
- uuid: ``str`` in its canonical form; json and jsonb: ``str`` (the JSON text);
- an array: an ``object`` array holding one 1-D NumPy array per row, of its
  element's type by these rules. An element that is NULL raises. ADBC hands a
  multi-dimensional array over flattened: reshape it, or unnest it in SQL;
- types without a rule: their text.

SQLite has no date type: pass ``dtypes={"day": "datetime64[D]"}`` to parse ISO
text.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from headrace._errors import HeadraceError, InvalidArgumentError, MemoryBudgetError
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import sizeof
from headrace._memory.units import format_bytes
from headrace._structure import TensorSpec
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN, SourceNode, first_element
from headrace.core.state import StateReader

__all__ = [
    "ALL_COLUMNS",
    "PARAM_TYPES",
    "SqlError",
    "SqlNode",
    "TextDefault",
    "check_params",
    "parse_param",
    "quote_identifier",
    "refuse_pyformat",
    "sqlite_param",
]

#: The ``null_defaults`` key whose value serves every column without an entry of its own.
ALL_COLUMNS = "*"


class TextDefault(str):
    """A NULL default given as text, parsed as the type of the column it fills.

    Integer columns take ``int(text)``, float and numeric ones ``float(text)``,
    booleans ``true/false/1/0``, text columns the text and blobs its UTF-8 bytes;
    text that is not the column's type raises :class:`SqlError` naming both.
    """


class SqlError(HeadraceError, OSError):
    """The database could not be read: a connection that failed after its retries, a
    login refused, a value of the wrong type, a NULL without a default."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_IDENTIFIER = re.compile(r"[^\x00]+")


def quote_identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier (``"a""b"`` for ``a"b``): never a value."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidArgumentError(f"from_sql: key must be a column name, got {name!r}")
    return '"' + name.replace('"', '""') + '"'


# -- the query's text ------------------------------------------------------------------------
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_\x80-\U0010ffff]*)?\$")


def one_statement(query: str, postgres: bool) -> str:
    """``query`` without what may follow its last token: whitespace, comments and ``;``.

    The query is read inside ``SELECT * FROM (query) ...``, where a trailing
    ``-- comment`` would comment out the closing parenthesis and a ``;`` would end
    the statement early. The text is tokenized as the database does (strings with
    ``''``, quoted identifiers, ``--`` and ``/* */`` comments, and for PostgreSQL
    ``E'...'`` escapes, ``$tag$...$tag$`` strings and nested block comments), so a
    ``--`` or ``;`` inside a string is left alone. Text that is not one statement (a
    ``;`` followed by more code) raises :class:`SqlError`; text this cannot tokenize
    (an unterminated string) is returned as it is, for the database to report.
    """
    return _scan(query, postgres)[0]


def _scan(query: str, postgres: bool) -> tuple[str, list[int]]:
    """:func:`one_statement`'s text, and where ``%`` stands in code (outside strings,
    quoted names and comments): psycopg's placeholders are looked for there only."""
    percents: list[int] = []
    i, n = 0, len(query)
    end = 0  # just past the last token that is code, not a ';'
    semicolon: int | None = None  # the first ';' after `end`
    while i < n:
        c = query[i]
        if c.isspace():
            i += 1
            continue
        stop = _comment_end(query, i, postgres)
        if stop > i:
            i = stop
            continue
        if c == ";":
            if semicolon is None:
                semicolon = i
            i += 1
            continue
        if semicolon is not None:
            raise SqlError(
                f"from_sql: the query holds more than one statement (code after the ';' at "
                f"character {semicolon}); give one SELECT: {query!r:.200}"
            )
        stop = _quoted_end(query, i, postgres)
        if stop < 0:
            return query.strip(), percents  # unterminated: the database says where
        if stop > i:
            i = end = stop
            continue
        if c == "%":
            percents.append(i)
        i = end = i + 1
    return query[:end], percents



def _comment_end(query: str, i: int, postgres: bool) -> int:
    """Just past the comment at ``i``; ``i`` if none starts there. A ``--`` comment runs
    to the line's end; a ``/* */`` one nests in PostgreSQL, and unterminated runs to
    the end, as SQLite reads it."""
    n = len(query)
    if query.startswith("--", i):
        stop = query.find("\n", i)
        return n if stop < 0 else stop + 1
    if not query.startswith("/*", i):
        return i
    depth, j = 1, i + 2
    while j < n and depth:
        if query.startswith("*/", j):
            depth, j = depth - 1, j + 2
        elif postgres and query.startswith("/*", j):
            depth, j = depth + 1, j + 2
        else:
            j += 1
    return j


def _quoted_end(query: str, i: int, postgres: bool) -> int:
    """Just past the string or quoted name starting at ``i``; ``i`` itself if none
    starts there; -1 if it is not terminated."""
    c = query[i]
    if postgres and c == "$":
        return _dollar_end(query, i)
    if c not in ("'\"" if postgres else "'\"[`"):  # (PostgreSQL's [ is a subscript)
        return i
    close = {"[": "]"}.get(c, c)
    backslash = postgres and c == "'" and i > 0 and query[i - 1] in "eE" and (
        i < 2 or not (query[i - 2].isalnum() or query[i - 2] in "_$"))
    j, n = i + 1, len(query)
    while j < n:
        if backslash and query[j] == "\\":
            j += 2
        elif query[j] == close:
            if close != "]" and query.startswith(close * 2, j):
                j += 2  # a doubled quote is one quote character
            else:
                return j + 1
        else:
            j += 1
    return -1


def _dollar_end(query: str, i: int) -> int:
    """Just past PostgreSQL's ``$tag$...$tag$`` string at ``i``; ``i`` if the ``$`` does
    not start one (a ``$1`` parameter, part of a name); -1 if it is not terminated."""
    tag = _DOLLAR_TAG.match(query, i)
    if tag is None or (i > 0 and (query[i - 1].isalnum() or query[i - 1] == "_")):
        return i
    stop = query.find(tag.group(), tag.end())
    return -1 if stop < 0 else stop + len(tag.group())


_PYFORMAT = re.compile(r"%(?:s|\((?P<name>[^()]*)\)s)(?![A-Za-z0-9_])")


def refuse_pyformat(query: str, postgres: bool) -> None:
    """Refuse psycopg's ``%s`` / ``%(name)s`` placeholders, showing the query as the
    driver takes it (``$1, $2...`` for PostgreSQL, ``?`` for SQLite).

    The drivers receive the query as it is written: a ``%s`` would reach the server as
    text and fail there with a syntax error that does not say why. Rewriting it in
    silence would also rewrite ``%%`` and a ``%`` meant as modulo, so it is refused.
    Only ``%`` in code counts (not in strings, quoted names or comments).
    """
    if "%" not in query:
        return
    _, percents = _scan(query, postgres)
    found = [m for m in (_PYFORMAT.match(query, at) for at in percents) if m is not None]
    if not found:
        return
    numbers: dict[str, int] = {}  # a named placeholder keeps its number where it repeats
    pieces, last, order = [], 0, []
    for match in found:
        name = match.group("name")
        if not postgres or name is None or name not in numbers:
            order.append(name if name is not None else "%s")
            if name is not None:
                numbers[name] = len(order)
        number = numbers[name] if name is not None and postgres else len(order)
        pieces += [query[last:match.start()], f"${number}" if postgres else "?"]
        last = match.end()
    rewritten = ("".join(pieces) + query[last:]).replace("%%", "%")
    order_note = (f"; params=(...) in this order: {', '.join(order)}"
                  if any(name != "%s" for name in order) else "")
    style = "$1, $2, ... (PostgreSQL)" if postgres else "? (SQLite)"
    raise InvalidArgumentError(
        f"from_sql: {found[0].group()!r} is psycopg's placeholder; the driver takes "
        f"{style} and params as a sequence. Write: {rewritten!r:.300}{order_note}"
    )


#: The parameter types a query takes, in both drivers (NumPy scalars count as theirs).
PARAM_TYPES = (bool, int, float, str, bytes, datetime.date, decimal.Decimal, type(None))


def check_params(params: Sequence[Any]) -> tuple[Any, ...]:
    """``params`` as plain Python values: NumPy scalars as theirs, ``bytearray`` and
    ``memoryview`` as ``bytes``. A value of another type (a list, a dict, an object)
    raises naming its position: neither driver could bind it."""
    out = []
    for number, value in enumerate(params, 1):
        if isinstance(value, np.generic):
            value = value.item()
        elif isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not isinstance(value, PARAM_TYPES):
            raise InvalidArgumentError(
                f"from_sql: parameter {number} is a {type(value).__name__} ({value!r:.60}); a "
                f"query takes int, float, bool, str, bytes, datetime.date, datetime.datetime, "
                f"decimal.Decimal or None"
            )
        out.append(value)
    return tuple(out)


def sqlite_param(value: Any) -> Any:
    """A parameter as SQLite stores it: dates and times as ISO text (``2024-01-31``,
    ``2024-01-31 12:00:00``, what SQLite's date functions write; an aware datetime in
    UTC), a ``Decimal`` as its exact text (compared as a number by numeric columns),
    booleans as 1 and 0. (sqlite3's own date adapters are deprecated.)"""
    if isinstance(value, datetime.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
        return value.isoformat(sep=" ")
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bool):
        return int(value)
    return value


_PARAM_PARSERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": lambda text: {"true": True, "1": True, "false": False, "0": False}[text.lower()],
    "bytes": bytes.fromhex,
    "date": datetime.date.fromisoformat,
    "datetime": datetime.datetime.fromisoformat,
    "decimal": decimal.Decimal,
    "null": lambda text: None if text == "" else _refuse(text),
}


def _refuse(text: str) -> Any:
    raise ValueError(text)


def parse_param(text: str) -> Any:
    """A query parameter written as text (``headrace convert --param``): ``TYPE:VALUE``
    with TYPE one of ``int``, ``float``, ``bool`` (true/false/1/0), ``str``, ``bytes``
    (hex digits), ``date`` (``2024-01-31``), ``datetime`` (ISO 8601, with an offset for
    an aware one), ``decimal``, or ``null:`` for NULL; anything else is text as written
    (``str:`` keeps text that starts with one of these prefixes). PostgreSQL compares a
    text parameter with text only, so a date column needs ``date:...``. A value that is
    not its type raises ``ValueError`` naming both."""
    kind, colon, value = text.partition(":")
    parser = _PARAM_PARSERS.get(kind) if colon else None
    if parser is None:
        return text
    try:
        return parser(value)
    except (ValueError, KeyError, ArithmeticError):
        article = "an" if kind[0] in "aeiou" else "a"
        raise ValueError(f"{value!r} is not {article} {kind} value (in {text!r})") from None


# -- connections ----------------------------------------------------------------------------
#: SQLite's primary result codes that mean the file could not be read: SQLITE_IOERR,
#: SQLITE_CANTOPEN. Everything else (SQLITE_ERROR: no such table, a syntax error...) is final.
_SQLITE_LOST = frozenset({10, 14})
#: PostgreSQL SQLSTATEs, besides class 08 (connection exception), of a server going away.
_POSTGRES_LOST = frozenset({"57P01", "57P02", "57P03"})
_SQLSTATE = re.compile(r"SQLSTATE: ([0-9A-Z]{5})")


class _Dialect:
    """How one driver takes parameters and reports lost connections."""

    name = "sqlite"

    def placeholders(self, first: int, count: int) -> list[str]:
        return ["?"] * count

    def mod(self, column: str, first: int, shards: int, index: int) -> tuple[str, list[int]]:
        """``column`` is ``index`` modulo ``shards`` (negative keys too), and its parameters."""
        d1, d2, d3, r = self.placeholders(first, 4)
        return f"((({column} % {d1}) + {d2}) % {d3}) = {r}", [shards, shards, shards, index]

    def lost(self, error: BaseException) -> bool:
        """Whether the database file could not be read (I/O, or it went away): only that is
        retried. A missing table, a syntax error, a locked or corrupt database fail at once
        (SQLite reports them all as OperationalError; its error code tells them apart)."""
        if not isinstance(error, sqlite3.OperationalError):
            return False
        code = getattr(error, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in _SQLITE_LOST
        return str(error).startswith(("disk I/O error", "unable to open database file"))


class _PostgresDialect(_Dialect):
    name = "postgresql"

    def placeholders(self, first: int, count: int) -> list[str]:
        return [f"${first + i}" for i in range(count)]

    def mod(self, column: str, first: int, shards: int, index: int) -> tuple[str, list[int]]:
        d, r = self.placeholders(first, 2)
        return f"mod(mod({column}, {d}) + {d}, {d}) = {r}", [shards, index]

    def lost(self, error: BaseException) -> bool:
        """Whether the connection failed (SQLSTATE class 08, a server shutting down, or a
        socket error without SQLSTATE): only that is retried, never a wrong query, a
        missing table or a refused permission."""
        try:
            import adbc_driver_manager
        except ImportError:  # pragma: no cover - the route needs it
            return False
        state = getattr(error, "sqlstate", None)
        if not isinstance(state, str) or not state or state == "00000":
            found = _SQLSTATE.search(str(error))
            state = found.group(1) if found else None
        if state is not None:
            return state.startswith("08") or state in _POSTGRES_LOST
        if "ERROR:  " in str(error):
            # libpq's prefix of an error the server sent back (a row that failed while
            # streaming arrives as a bare OSError): the server is there, the query is wrong
            return False
        if isinstance(error, (adbc_driver_manager.ProgrammingError, adbc_driver_manager.DataError,
                              adbc_driver_manager.IntegrityError,
                              adbc_driver_manager.NotSupportedError)):
            return False  # the query is wrong, not the connection: retrying cannot help
        return isinstance(error, (adbc_driver_manager.Error, ConnectionError, OSError))


def _connect(connection: Any) -> tuple[Any, _Dialect]:
    """A live connection and its dialect, from a URL or a function."""
    if isinstance(connection, str):
        if connection.startswith("sqlite:///"):
            path = connection[len("sqlite:///"):]
            if path != ":memory:" and not os.path.isfile(path):
                # (sqlite3 would create an empty database there, then say "no such table")
                raise SqlError(f"from_sql: no SQLite database at {path!r}: "
                               f"{'it is not a file' if os.path.exists(path) else 'no such file'}")
            return sqlite3.connect(path), _Dialect()
        if connection.startswith(("postgresql://", "postgres://")):
            try:
                import adbc_driver_postgresql.dbapi as adbc_pg
            except ImportError:
                raise InvalidArgumentError(
                    "PostgreSQL needs the [postgres] extra: pip install 'headrace[postgres]'"
                ) from None
            return adbc_pg.connect(connection), _PostgresDialect()
        raise InvalidArgumentError(
            f"from_sql: connection must be 'sqlite:///path', 'postgresql://...' or a function "
            f"returning a connection, got {connection!r:.60}"
        )
    if callable(connection):
        live = connection()
        if isinstance(live, sqlite3.Connection):
            return live, _Dialect()
        if type(live).__module__.startswith("adbc_driver_manager"):
            return live, _PostgresDialect()
        raise InvalidArgumentError(
            f"from_sql: the connection function returned {type(live).__name__}; "
            "expected a sqlite3 or ADBC PostgreSQL connection"
        )
    raise InvalidArgumentError(f"from_sql: connection must be a URL or a function, got {connection!r:.60}")


def _same(a: Any, b: Any) -> bool:
    """Whether two key values are equal as the database orders them (NaN equals NaN)."""
    if a is None or b is None:
        return False
    return bool(a == b) or (a != a and b != b)


def _refused_login(error: BaseException) -> bool:
    """A login the server refused, or a database that does not exist: retrying cannot help."""
    state = getattr(error, "sqlstate", None)
    return isinstance(state, str) and state.startswith(("28", "3D"))


def _shown(connection: Any) -> str:
    """The connection for messages, without a password."""
    if isinstance(connection, str):
        return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", connection)
    return getattr(connection, "__qualname__", repr(connection))


# -- columns -----------------------------------------------------------------------------------
def _column_from_values(name: str, values: Sequence[Any], dtype: Any | None) -> np.dtype[Any]:
    if dtype is not None:
        resolved: np.dtype[Any] = np.dtype(dtype)
        return resolved
    kinds = {type(v) for v in values if v is not None}
    if not kinds:
        return np.dtype(object)
    if kinds <= {int, bool}:
        return np.dtype(bool) if kinds == {bool} else np.dtype(np.int64)
    if kinds <= {int, float}:
        return np.dtype(np.float64)
    return np.dtype(object)


class _Columns:
    """Turns pages of rows (SQLite tuples, or Arrow tables) into NumPy columns."""

    def __init__(self, names: list[str], null_defaults: Mapping[str, Any],
                 dtypes: Mapping[str, Any], key: str | None = None) -> None:
        self.names = names
        self.key = key
        self.null_defaults = null_defaults
        self.dtypes = dict(dtypes)
        self.fixed: dict[str, np.dtype[Any]] = {}

    def _has_default(self, name: str) -> bool:
        return name in self.null_defaults or ALL_COLUMNS in self.null_defaults

    def _default(self, name: str, kind: str) -> Any:
        """``name``'s NULL default as a value of ``kind`` (int, float, bool, text, bytes,
        decimal): a :class:`TextDefault` is parsed, anything else is used as given."""
        value = self.null_defaults.get(name, self.null_defaults.get(ALL_COLUMNS))
        if not isinstance(value, TextDefault):
            return value
        text = str(value)
        try:
            if kind == "int":
                return int(text)
            if kind == "float":
                return float(text)
            if kind == "decimal":
                import decimal

                return decimal.Decimal(text)  # a bad one raises InvalidOperation, an ArithmeticError
            if kind == "bool":
                flag = {"true": True, "1": True, "false": False, "0": False}.get(text.lower())
                if flag is None:
                    raise ValueError(text)
                return flag
        except (ValueError, ArithmeticError):
            raise SqlError(
                f"from_sql: the NULL default {text!r} for column {name!r} is not a {kind} "
                f"value; give that column a default of its own ('{name}=...')"
            ) from None
        return text.encode() if kind == "bytes" else text

    def _null_error(self, name: str, row: int, key: Any) -> SqlError:
        at = f" (key {key!r})" if key is not None else ""
        return SqlError(
            f"from_sql: NULL in column {name!r} at row {row}{at} of the query, and no default; "
            f"pass null_defaults={{{name!r}: ...}} or filter the NULLs in SQL"
        )

    def from_rows(self, rows: list[tuple[Any, ...]], first_row: int,
                  keys: Sequence[Any] | None) -> dict[str, np.ndarray[Any, Any]]:
        by_column = list(zip(*rows, strict=True)) if rows else [() for _ in self.names]
        out = {}
        for index, name in enumerate(self.names):
            values = list(by_column[index])
            if name not in self.fixed:
                self.fixed[name] = _column_from_values(name, values, self.dtypes.get(name))
            dtype = self.fixed[name]
            for position, value in enumerate(values):
                if value is None:
                    if not self._has_default(name):
                        key = keys[position] if keys is not None else None
                        raise self._null_error(name, first_row + position, key)
                    values[position] = self._default(name, _kind_of(dtype, values))
            if dtype == np.dtype(object):
                column = np.empty(len(values), dtype=object)
                column[:] = values
            else:
                # NumPy would convert 1.5 to 1 and '1' to 1 in silence: a value that does
                # not keep its type and its value in the column's dtype is an error
                bad = _first_unfit(values, dtype)
                if bad is None:
                    try:
                        column = np.array(values, dtype=dtype)
                    except (TypeError, ValueError, OverflowError):
                        bad = next(i for i, v in enumerate(values) if not _fits(v, dtype))
                if bad is not None:
                    raise self._type_error(name, first_row + bad, values[bad], dtype,
                                           keys[bad] if keys is not None else None)
            out[name] = column
        return out

    def _type_error(self, name: str, row: int, value: Any, dtype: np.dtype[Any],
                    key: Any) -> SqlError:
        is_key = name == self.key
        at = f" (key {key!r})" if key is not None and not is_key else ""
        what = f"the key column {name!r}" if is_key else f"column {name!r}"
        return SqlError(
            f"from_sql: {what} row {row}{at}: {value!r} (a {type(value).__name__}) does not fit "
            f"{dtype}, the type the column's first values had (SQLite columns may mix types: "
            f"which values come first depends on page_rows); converting it would change it. "
            f"Pass dtypes={{{name!r}: ...}} for a type that holds every value, or CAST it in SQL"
        )

    def from_arrow(self, table: Any, first_row: int, key: str | None) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.compute as pc

        out = {}
        for index, name in enumerate(self.names):
            column = table.column(index).combine_chunks() if table.num_rows else table.column(index)
            if isinstance(column, pa.ChunkedArray):
                column = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array(
                    [], column.type)
            if column.null_count:
                if not self._has_default(name):
                    row = int(pc.index(pc.is_null(column), True).as_py())
                    key_value = table.column(key)[row].as_py() if key is not None else None
                    raise self._null_error(name, first_row + row, key_value)
                default = self._default(name, _arrow_kind(column.type))
                try:
                    column = column.fill_null(
                        default if pa.types.is_decimal(column.type) or isinstance(
                            column.type, pa.BaseExtensionType) else pa.scalar(default, column.type))
                except (pa.ArrowException, TypeError, ValueError) as error:
                    raise SqlError(
                        f"from_sql: the NULL default {default!r} for column {name!r} does not "
                        f"fit its type {column.type}: {error}") from None
            metadata = table.schema.field(index).metadata or {}
            pg_type = metadata.get(b"POSTGRESQL:type", b"").decode()
            array = _arrow_to_numpy(name, column, pg_type, self.dtypes.get(name), first_row)
            wanted = self.dtypes.get(name)
            if wanted is not None and not (pg_type == "numeric" and np.dtype(wanted) == object):
                array = array.astype(wanted)
            out[name] = array
        return out


def _arrow_to_numpy(name: str, column: Any, pg_type: str, wanted: Any,
                    first_row: int) -> np.ndarray[Any, Any]:
    """One Arrow column (no NULLs left) as NumPy, by the rules of the module's doc."""
    import pyarrow as pa

    kind = column.type
    if pg_type == "numeric" or pa.types.is_decimal(kind):
        return _numeric_to_numpy(column, wanted)
    if pa.types.is_time(kind):  # time of day: the duration since midnight
        unit = kind.unit
        return np.asarray(column.cast(pa.int64()).to_numpy(zero_copy_only=False)).view(
            f"timedelta64[{unit}]")
    if pa.types.is_interval(kind):
        return _interval_to_numpy(name, column, first_row)
    if isinstance(kind, pa.BaseExtensionType):
        storage = column.storage
        if pg_type == "uuid" or getattr(kind, "extension_name", "") == "arrow.uuid":
            import uuid

            text = np.empty(len(storage), dtype=object)
            text[:] = [str(uuid.UUID(bytes=v)) for v in storage.to_pylist()]
            return text
        column, kind = storage, storage.type  # json, and types ADBC sends as text
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _lists_to_numpy(name, column, first_row)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(
            kind) or pa.types.is_large_binary(kind):
        objects = np.empty(len(column), dtype=object)
        objects[:] = column.to_pylist()
        return objects
    if pa.types.is_timestamp(kind) and kind.tz is not None:
        column = column.cast(pa.timestamp(kind.unit))  # the instant, in UTC
    return np.asarray(column.to_numpy(zero_copy_only=False))


def _numeric_to_numpy(column: Any, wanted: Any) -> np.ndarray[Any, Any]:
    """A numeric column as float64, or as exact ``decimal.Decimal`` objects when the
    dtype asked for is ``object``."""
    import pyarrow as pa

    if isinstance(column.type, pa.BaseExtensionType):
        column = column.storage  # (ADBC sends numeric as its text)
    values = column.to_pylist()
    if wanted is not None and np.dtype(wanted) == object:  # exact: decimal.Decimal
        exact = np.empty(len(values), dtype=object)
        exact[:] = [v if isinstance(v, decimal.Decimal) else decimal.Decimal(v)
                    for v in values]
        return exact
    return np.array([float(v) for v in values], dtype=np.float64)


def _interval_to_numpy(name: str, column: Any, first_row: int) -> np.ndarray[Any, Any]:
    """An interval column as timedelta64[us]; one with months is refused, since NumPy
    has no month (its length in microseconds is not fixed)."""
    micros = np.empty(len(column), dtype="timedelta64[us]")
    for row, value in enumerate(column.to_pylist()):
        months, days, nanoseconds = value
        if months:
            raise SqlError(
                f"from_sql: column {name!r} row {first_row + row}: the interval {value} "
                f"has months, whose length in days is not fixed; convert it in SQL "
                f"(EXTRACT(EPOCH FROM {name}) for seconds, or justify_interval)")
        micros[row] = days * 86_400_000_000 + nanoseconds // 1000
    return micros


def _lists_to_numpy(name: str, column: Any, first_row: int) -> np.ndarray[Any, Any]:
    """An array column as an object array of 1-D arrays; a NULL inside one is refused,
    naming its row."""
    values = column.flatten()  # (a sliced array's own values only)
    if values.null_count:
        import pyarrow.compute as pc

        offsets = np.asarray(column.offsets)
        at = int(pc.index(pc.is_null(values), True).as_py())
        row = int(np.searchsorted(offsets, at + offsets[0], side="right")) - 1
        raise SqlError(
            f"from_sql: column {name!r} row {first_row + row}: an array holds a NULL "
            f"element, which a NumPy array cannot; remove or replace it in SQL "
            f"(array_remove({name}, NULL), or COALESCE over unnest)")
    flat = _arrow_to_numpy(name, values, "", None, first_row)
    offsets = np.asarray(column.offsets)
    lists = np.empty(len(column), dtype=object)
    for row, part in enumerate(np.split(flat, offsets[1:-1] - offsets[0]) if len(column)
                               else []):
        lists[row] = part  # (one by one: equal lengths must not broadcast into 2-D)
    return lists


def _arrow_key(value: Any, field: Any) -> Any:
    """The key the next PostgreSQL page starts after: the last row's, as a Python value.
    A timestamptz key is a UTC instant: bound naive, the server would read it in the
    session's time zone and page from the wrong row."""
    key = value.item() if isinstance(value, np.generic) else value
    if isinstance(key, datetime.datetime) and getattr(field.type, "tz", None):
        key = key.replace(tzinfo=datetime.timezone.utc)
    return key


def _kind_of(dtype: np.dtype[Any], values: Sequence[Any]) -> str:
    """What a SQLite column holds, for parsing a :class:`TextDefault`."""
    if dtype.kind == "b":
        return "bool"
    if dtype.kind in "iu":
        return "int"
    if dtype.kind == "f":
        return "float"
    return "bytes" if any(isinstance(v, bytes) for v in values) else "text"


def _arrow_kind(kind: Any) -> str:
    """What an Arrow (PostgreSQL) column holds, for parsing a :class:`TextDefault`."""
    import pyarrow as pa

    for test, name in ((pa.types.is_boolean, "bool"), (pa.types.is_integer, "int"),
                       (pa.types.is_floating, "float"), (pa.types.is_decimal, "decimal"),
                       (pa.types.is_binary, "bytes"), (pa.types.is_large_binary, "bytes")):
        if test(kind):
            return name
    return "text"


#: Above this, not every integer is a float64 (2**53 + 1 is not).
_EXACT_FLOAT_INT = 2**53


def _first_unfit(values: Sequence[Any], dtype: np.dtype[Any]) -> int | None:
    """The index of the first value NumPy would change in ``dtype`` (text parsed as a
    number, a real truncated to an integer, an integer rounded to a float, 2 made
    True), or None. SQLite hands out int, float, str and bytes, whatever the column."""
    if dtype.kind == "b":
        plain: set[type] = {bool, np.bool_}
    elif dtype.kind in "iu":
        plain = {int, bool, np.bool_}
    elif dtype.kind == "f":
        plain = {float, bool, np.bool_}
    else:
        return None  # (dates, strings the caller asked for: NumPy's own checks)
    if set(map(type, values)) <= plain:
        return None
    for index, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)):
            continue
        if isinstance(value, (int, np.integer)):
            fits = (value in (0, 1) if dtype.kind == "b" else
                    abs(int(value)) <= _EXACT_FLOAT_INT if dtype.kind == "f" else True)
        elif isinstance(value, (float, np.floating)):
            fits = dtype.kind == "f" or (dtype.kind in "iu" and float(value).is_integer()
                                          and abs(value) <= _EXACT_FLOAT_INT)
        else:
            fits = False
        if not fits:
            return index
    return None


def _rows_nbytes(rows: list[Any]) -> int:
    """What DB-API rows (tuples of Python values) hold, about, at C speed.

    Columns whose value in the first row is a number cost that value's size in every
    row; the others (text, bytes, NULL) are measured value by value, by length. A huge
    value in a column that starts with numbers (SQLite's columns have no fixed type)
    is counted once the page is booked whole."""
    first = rows[0]
    fixed = sys.getsizeof(first)
    total = 0
    for index, value in enumerate(first):
        if isinstance(value, (int, float)):
            fixed += sys.getsizeof(value)
            continue
        column = map(itemgetter(index), rows)
        try:
            total += sum(map(len, column)) + len(rows) * _VALUE_HEADER
        except TypeError:  # NULLs or numbers among the values: each measured
            total += sum(map(sys.getsizeof, map(itemgetter(index), rows)))
    return total + fixed * len(rows)


def _fits(value: Any, dtype: np.dtype[Any]) -> bool:
    try:
        np.array([value], dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


#: ADBC's statement option for the size of the record batches it decodes (a hint), and
#: the most asked for: a few MiB, so a stream holds little beyond the booked page.
_BATCH_HINT = "adbc.postgresql.batch_size_hint_bytes"
_STREAM_BATCH_BYTES = 4 << 20
#: Most rows a page is fetched by at once (DB-API); fewer where they are large, since each
#: fetch is checked against the share: a page of large rows is refused about one row past
#: the share, not after all of its rows.
_FETCH_ROWS = 8192
#: The budget's own advice, which a page's refusal replaces with the page_rows that fits.
_GENERIC_ADVICE = " Raise Options(memory_budget=...), or make elements or batches smaller."
#: What a str or bytes value costs besides its characters (about: 33 to 49 bytes).
_VALUE_HEADER = sys.getsizeof("")


# -- the recipe node ----------------------------------------------------------------------------
class SqlNode(SourceNode):
    """The rows of a query, in batches of dicts of NumPy arrays (a streaming source)."""

    stage = "from_sql"
    budget_weight = 1.0

    def __init__(self, query: str, params: Sequence[Any], connection: Any, key: str | None,
                 batch_size: int, page_rows: int, null_defaults: Mapping[str, Any],
                 dtypes: Mapping[str, Any], max_retries: int, retry_delay: float,
                 shard: tuple[int, int] | None = None) -> None:
        super().__init__()
        if not isinstance(query, str) or not query.strip():
            raise InvalidArgumentError("from_sql: query must be a non-empty string")
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise InvalidArgumentError(
                f"from_sql: params must be a sequence of values, got {params!r:.60}"
            )
        for name, value in (("batch_size", batch_size), ("page_rows", page_rows),
                            ("max_retries", max_retries + 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"from_sql: {name} must be a positive int, got {value!r}")
        self.query = query.strip()  # (trailing ';' and comments go when it runs: one_statement)
        self.query_params = check_params(params)
        if isinstance(connection, str):  # (a function's database is known when it connects)
            refuse_pyformat(self.query, connection.startswith(("postgresql:", "postgres:")))
        self.connection = connection
        self.key = key
        self.quoted_key = quote_identifier(key) if key is not None else None
        self.batch_size, self.page_rows = batch_size, max(page_rows, batch_size)
        self.null_defaults = dict(null_defaults)
        self.dtypes = dict(dtypes)
        self.max_retries, self.retry_delay = max_retries, retry_delay
        if shard is not None and key is None:
            raise InvalidArgumentError("from_sql: sharding by key needs key=...")
        self.shard = shard

    def params(self) -> tuple[Any, ...]:
        return (self.query, self.query_params, _shown(self.connection), self.key, self.batch_size,
                self.page_rows, self.shard)

    @property
    def element_spec(self) -> Any:
        """Known once the query runs: found from the first batch, once, when asked for."""
        first = first_element(self, self.stage)
        return {name: TensorSpec((None, *column.shape[1:]), column.dtype,
                                 "str" if column.dtype == object and column.size and isinstance(
                                     column[0], str) else None)
                for name, column in first.items()}

    def cardinality(self) -> int:
        return UNKNOWN

    def shard_rows(self, num_shards: int, index: int) -> SqlNode:
        """This query with a ``WHERE`` on the key: worker ``index`` of ``num_shards`` reads
        the rows whose key is ``index`` modulo ``num_shards`` (integer keys)."""
        if self.key is None:
            raise InvalidArgumentError(
                "from_sql: sharding rows across workers needs key=... (an integer column)"
            )
        return SqlNode(self.query, self.query_params, self.connection, self.key, self.batch_size,
                       self.page_rows, self.null_defaults, self.dtypes, self.max_retries,
                       self.retry_delay, shard=(num_shards, index))

    def make_iterator(self, ctx: Context) -> Iterator:
        return _SqlIterator(self, ctx, ctx.account(self, f"{self.stage} (page)"))


class _SqlIterator(Iterator):
    stage = "from_sql"

    def __init__(self, node: SqlNode, ctx: Context, account: Buffer) -> None:
        super().__init__()
        self.node, self.ctx, self.account = node, ctx, account
        self.live: Any = None
        self.dialect: _Dialect = _Dialect()
        self.cursor: Any = None  # keyless: one cursor for the whole query
        self.columns: _Columns | None = None
        self.page: dict[str, np.ndarray[Any, Any]] | None = None
        self.page_rows = 0
        self.page_taken = 0
        self.booking: Reservation = NO_RESERVATION
        self.exhausted = False
        self.last_key: Any = None  # of the last row handed out
        self.read_key: Any = None  # of the last row read (the next page starts after it)
        self.delivered = 0  # rows handed out (keyless resume: skip this many)
        self.read_rows = 0  # rows of the query read into pages (for the row numbers of errors)

    # -- connections ---------------------------------------------------------------------------
    def _connection(self) -> Any:
        if self.live is None:
            try:
                self.live, self.dialect = _connect(self.node.connection)
            except (InvalidArgumentError, SqlError):
                raise
            except Exception as error:
                raise SqlError(
                    f"from_sql: cannot connect to {_shown(self.node.connection)}: {error}"
                ) from error
        return self.live

    def _drop_connection(self) -> None:
        for thing in (self.cursor, self.live):
            if thing is not None:
                with contextlib.suppress(Exception):  # a dead connection may fail to close
                    thing.close()
        self.cursor = None
        self.live = None
        self.__dict__.pop("_arrow_reader", None)  # it read from the cursor just closed
        self.__dict__.pop("_arrow_leftover", None)  # re-read from the last key instead

    def _with_retries(self, read: Callable[[], Any]) -> Any:
        node = self.node
        attempt = 0
        while True:
            try:
                self._connection()
                return read()
            except SqlError as error:  # could not connect
                if not isinstance(error.__cause__, Exception) or _refused_login(error.__cause__):
                    raise
                if attempt >= node.max_retries:
                    raise self._gave_up(attempt, error) from error
                failure: BaseException = error
            except Exception as error:
                self_made = isinstance(error, (InvalidArgumentError, SqlError, MemoryBudgetError))
                if self_made or not self.dialect.lost(error):
                    self._drop_connection()
                    if self_made:
                        raise
                    raise self._failed(error) from error
                if attempt >= node.max_retries:
                    self._drop_connection()
                    raise self._gave_up(attempt, error) from error
                failure = error
            attempt += 1
            self._drop_connection()
            if attempt > node.max_retries:  # pragma: no cover - guarded above
                raise failure
            time.sleep(node.retry_delay * attempt)

    def _failed(self, error: BaseException) -> SqlError:
        """The database refused the query (not a lost connection: never retried)."""
        return SqlError(
            f"from_sql: the query failed on {_shown(self.node.connection)} (not retried: "
            f"the query or the data is wrong, not the connection): {error}\n"
            f"  query: {self.node.query!r:.300}"
        )

    def _gave_up(self, attempts: int, error: BaseException) -> SqlError:
        node = self.node
        where = (f" after the row with key {self.last_key!r}" if node.key
                 else f" after {self.delivered} rows")
        return SqlError(
            f"from_sql: reading {_shown(node.connection)} failed{where} "
            f"({attempts} retries): {error}"
        )

    # -- queries --------------------------------------------------------------------------------
    def _page_query(self) -> tuple[str, list[Any]]:
        node = self.node
        dialect = self.dialect
        assert node.quoted_key is not None
        params: list[Any] = self._params()
        conditions = []
        if self.read_key is not None:
            # >=, not >: the row of the last key comes again, and a second one with that
            # key shows the key is not unique (_check_keys), instead of being skipped
            (mark,) = dialect.placeholders(len(params) + 1, 1)
            conditions.append(f"{node.quoted_key} >= {mark}")
            params.append(self.read_key)
        if node.shard is not None:
            condition, values = dialect.mod(node.quoted_key, len(params) + 1, *node.shard)
            conditions.append(condition)
            params.extend(values)
        (limit,) = dialect.placeholders(len(params) + 1, 1)
        params.append(node.page_rows + (self.read_key is not None))
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        sql = (f"SELECT * FROM ({self._query()}) AS headrace_query{where} "
               f"ORDER BY {node.quoted_key} LIMIT {limit}")
        return sql, params

    def _query(self) -> str:
        """The user's query as one statement, ready to nest (after the connection told
        which database reads it)."""
        postgres = self.dialect.name == "postgresql"
        cached = self.__dict__.get("_statement")
        if cached is None or cached[0] != postgres:
            refuse_pyformat(self.node.query, postgres)
            cached = self._statement = (postgres, one_statement(self.node.query, postgres))
        return cached[1]

    def _params(self) -> list[Any]:
        """The query's parameters as this connection's driver binds them."""
        if self.dialect.name == "postgresql":
            return list(self.node.query_params)
        return [sqlite_param(value) for value in self.node.query_params]

    def _check_keys(self, result: Any, names: list[str], paged: bool, first_row: int) -> Any:
        """The page's rows after the key's checks, without the row of the last key read.

        Keyset pages are exact only over a unique, non-NULL key: a NULL key would never
        be read (``key >= last`` is not true of NULL), and of rows sharing a key only
        those in the same page as the first of them would. So a NULL key, two equal keys
        side by side in a page, or a page that starts with a second row of the last key
        read (paged queries ask for ``key >= last``) raise :class:`SqlError`: every row
        before the error was delivered once, none is skipped in silence.
        """
        node = self.node
        assert node.key is not None
        index = names.index(node.key)
        arrow = self.dialect.name == "postgresql"
        count = result.num_rows if arrow else len(result)
        if arrow:
            import pyarrow.compute as pc

            column = result.column(index)
            null_at = int(pc.index(pc.is_null(column), True).as_py()) if column.null_count else -1
        else:
            keys = [row[index] for row in result]
            null_at = next((i for i, key in enumerate(keys) if key is None), -1)
        if null_at >= 0:
            raise SqlError(
                f"from_sql: NULL in the key column {node.key!r} at row {first_row + null_at} of "
                f"the query: a key must never be NULL (pages by key cannot reach NULL keys); "
                f"filter them out (WHERE {node.quoted_key} IS NOT NULL) or use another key"
            )
        allowed = 1 if paged and self.read_key is not None else 0
        head = (column.slice(0, allowed + 1).to_pylist() if arrow else keys[:allowed + 1])
        again = 0
        while again < len(head) and _same(head[again], self.read_key):
            again += 1
        if again > allowed:
            raise self._not_unique(self.read_key, first_row)
        if arrow:
            if count - again > 1:
                rest = column.slice(again)
                equal = pc.equal(rest.slice(1), rest.slice(0, len(rest) - 1))
                if pc.any(equal).as_py():
                    at = int(pc.index(equal, True).as_py())
                    raise self._not_unique(rest[at].as_py(), first_row + at + 1)
            result = result.slice(again, min(count - again, node.page_rows))
        else:
            for at in range(again + 1, count):
                if _same(keys[at], keys[at - 1]):
                    raise self._not_unique(keys[at], first_row + at - again)
            result = result[again:again + node.page_rows]
        return result

    def _not_unique(self, value: Any, row: int) -> SqlError:
        key = self.node.key
        return SqlError(
            f"from_sql: the key column {key!r} is not unique: more than one row has the key "
            f"{value!r} (row {row} of the query); pages by key would skip rows. Give a key "
            f"whose values are unique (a primary key, or a column with a UNIQUE index), or "
            f"key=None to read the query once in its own order"
        )

    def _check_no_null_key(self) -> None:
        """The rows with a NULL key, which pages never reach (and no shard's ``mod``
        selects): the last page of a paged read asks whether there are any."""
        node = self.node

        def read() -> Any:
            cursor = self._connection().cursor()
            try:
                cursor.execute(f"SELECT 1 AS headrace_null FROM ({self._query()}) AS "
                               f"headrace_query WHERE {node.quoted_key} IS NULL LIMIT 1",
                               self._params())
                return cursor.fetchall()
            finally:
                cursor.close()

        if self._with_retries(read):
            raise SqlError(
                f"from_sql: the key column {node.key!r} holds NULLs: a key must never be NULL "
                f"(pages by key cannot reach NULL keys, and those rows were not read); filter "
                f"them out (WHERE {node.quoted_key} IS NOT NULL) or use another key"
            )

    def _read_page(self) -> dict[str, np.ndarray[Any, Any]] | None:
        """The next page, booked; None at the end."""
        node = self.node
        result, names, paged = self._with_retries(self._read_rows)
        if node.key is not None and node.key not in names:
            # (SQLite reads an unknown "quoted" name as a string: check it is a column)
            raise SqlError(f"from_sql: the query has no column named {node.key!r} (key)")
        first_row = self.read_rows
        if node.key is not None:
            result = self._check_keys(result, names, paged, first_row)
        postgres = self.dialect.name == "postgresql"
        rows = result.num_rows if postgres else len(result)
        if paged and rows < node.page_rows and (postgres or node.shard is not None):
            self._check_no_null_key()  # (SQLite sorts NULLs first: the first page has them)
        if not rows:
            return None
        if self.columns is None:
            self.columns = _Columns(names, node.null_defaults, node.dtypes, node.key)
        if postgres:
            page = self.columns.from_arrow(result, first_row, node.key)
            if node.key is not None:
                self.read_key = _arrow_key(page[node.key][-1], result.schema.field(node.key))
        else:
            keys = None
            if node.key is not None:
                key_index = names.index(node.key)
                keys = [row[key_index] for row in result]
            page = self.columns.from_rows(result, first_row, keys)
            if keys is not None:
                # The next page starts from the key exactly as SQLite returned it, not as
                # converted for the batch: SQLite compares its own value, whatever its type.
                self.read_key = keys[-1]
        self.read_rows += rows
        leftover = getattr(self, "_arrow_leftover", None)
        held = sizeof(page) + (leftover.get_total_buffer_size() if leftover is not None else 0)
        self.booking = self.account.admit(held, together=f"one page of {rows} rows")
        self.page, self.page_rows, self.page_taken = page, rows, 0
        return page

    def _read_rows(self) -> tuple[Any, list[str], bool]:
        """One try at the next page's rows (an Arrow table from PostgreSQL, tuples from
        SQLite), their column names, and whether they came as a keyset page (not a
        stream or the one plain cursor)."""
        node = self.node
        live = self._connection()
        streams = node.key is not None and self._streams()
        if streams:
            if self.cursor is None:
                self.cursor = live.cursor()
                with contextlib.suppress(Exception):  # a hint: older drivers lack it
                    self.cursor.adbc_statement.set_options(
                        **{_BATCH_HINT: str(self._stream_batch_bytes())})
                self.cursor.execute(f"SELECT * FROM ({self._query()}) AS headrace_query "
                                    f"ORDER BY {node.quoted_key}")
            return (*self._fetch(self.cursor, node.page_rows), False)
        if node.key is not None:
            sql, params = self._page_query()
            cursor = live.cursor()
            try:
                cursor.execute(sql, params)
                return (*self._fetch(cursor, None), True)
            finally:
                cursor.close()
        if self.cursor is None:
            self.cursor = live.cursor()
            self.cursor.execute(self._query(), self._params())
            self._skip_delivered()
        return (*self._fetch(self.cursor, node.page_rows), False)

    def _streams(self) -> bool:
        """Whether a keyed PostgreSQL read goes as one ordered stream rather than pages.

        A query without parameters, read from its start, streams through ADBC's binary
        COPY reader (record batches decoded in C++ as they arrive, flat in memory): about
        twice as fast as pages, each of which is a parameterized query that libpq buffers
        whole and ADBC converts only then. Parameters (the user's, the last key of a
        restore or a retry, a shard's modulus) rule COPY out, so those reads use keyset
        pages. The stream's rows come in key order, so ``read_key`` and checkpoints mean
        the same in both modes, and a dropped stream goes on with pages from the last key.
        """
        node = self.node
        return self.dialect.name == "postgresql" and not node.query_params and (
            node.shard is None) and (self.cursor is not None or self.read_key is None)

    def _stream_batch_bytes(self) -> int:
        """The size of ADBC's batches: a part of this stage's share of the budget (a batch
        in the driver's hands, and the rest of one kept for the next page, count too)."""
        share = self.account.share()
        if share <= 0:
            return _STREAM_BATCH_BYTES
        return max(64 << 10, min(_STREAM_BATCH_BYTES, share // 8))

    def _fetch(self, cursor: Any, count: int | None) -> tuple[Any, list[str]]:
        names = [d[0] for d in cursor.description]
        if self.dialect.name == "postgresql":
            return self._fetch_arrow(cursor, count), names
        fetched: list[Any] = []
        cost = want = 0
        # A keyed page's query starts again at the last key's row, read already.
        again = int(count is None and self.read_key is not None)
        while count is None or len(fetched) < count:
            if fetched:  # as many rows as the share has room for, at the size seen so far
                per_row = 2 * cost // len(fetched) + 1
                want = max(1, min(_FETCH_ROWS, (self.account.share() - cost) // per_row))
            else:
                want = 1
            chunk = cursor.fetchmany(want if count is None else min(want, count - len(fetched)))
            if not chunk:
                break
            cost += _rows_nbytes(chunk)
            self._expect_page(cost, len(fetched) - again, chunk)
            fetched.extend(chunk)
        return fetched, names


    def _fetch_arrow(self, cursor: Any, count: int | None) -> Any:
        """PostgreSQL's next rows as an Arrow table: all of them (``count`` None), or
        ``count`` from the stream."""
        if count is None:
            return cursor.fetch_arrow_table()
        reader = getattr(self, "_arrow_reader", None)
        if reader is None:
            reader = self._arrow_reader = cursor.fetch_record_batch()
        import pyarrow as pa

        # Pages hold page_rows rows whatever size the driver's batches have: the rest
        # of a batch waits for the next page (booked with this one meanwhile).
        batches, rows, cost = [], 0, 0
        leftover = self.__dict__.pop("_arrow_leftover", None)
        while rows < count:
            if leftover is not None:
                batch, leftover = leftover, None
            else:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
            if rows + batch.num_rows > count:
                self._arrow_leftover = batch.slice(count - rows)
                batch = batch.slice(0, count - rows)
            batches.append(batch)
            rows += batch.num_rows
            cost += batch.get_total_buffer_size()
            self._expect_page(cost, rows - batch.num_rows, None)
        return pa.Table.from_batches(batches, schema=reader.schema)

    def _expect_page(self, nbytes: int, first: int, rows: list[Any] | None) -> None:
        """Refuse a page whose rows fetched so far (``nbytes``) cannot fit the share: the
        error names the query and the row, from ``rows`` (the last fetch, starting at
        row ``first`` of the page) where the driver gave them one by one."""
        try:
            self.account.expect(nbytes, together="one page of rows")
        except MemoryBudgetError as error:
            row, column = self.read_rows + first, ""
            if rows:  # the row that took the page past its share, and its largest value
                room = self.account.share() - (nbytes - _rows_nbytes(rows))
                for index, values in enumerate(rows):
                    room -= _rows_nbytes([values])
                    if room < 0 or index == len(rows) - 1:
                        row += index
                        sizes = [sys.getsizeof(value) for value in values]  # (the error path)
                        column = f", column {sizes.index(max(sizes))}" if sizes else ""
                        break
            raise MemoryBudgetError(
                f"from_sql: row {row}{column} of the query {self.node.query!r:.200} does not "
                f"fit the memory budget with its page ({nbytes} bytes read so far), so the "
                f"page was not read further. {self._page_advice(nbytes, first + max(1, len(rows or ())))} "
                f"{str(error).removesuffix(_GENERIC_ADVICE)}") from None

    def _page_advice(self, nbytes: int, rows: int) -> str:
        """The ``page_rows`` that fits rows of the size read so far (half the share: the
        batch cut from the page is booked beside it), or the ``batch_size`` if a page
        cannot be smaller than a batch."""
        per_row = max(1, nbytes // max(1, rows))
        fit = self.account.share() // (2 * per_row)
        node = self.node
        if fit >= node.batch_size:
            return (f"Pass page_rows={fit} or fewer (now {node.page_rows}): rows of this "
                    f"query take about {format_bytes(per_row)} each.")
        return (f"A page holds at least one batch, and rows of this query take about "
                f"{format_bytes(per_row)} each: pass batch_size={max(1, fit)} or fewer "
                f"(now {node.batch_size}) and page_rows={max(1, fit)}, or raise "
                f"Options(memory_budget=...).")

    def _skip_delivered(self) -> None:
        """Keyless restore or retry: re-run the query and drop the rows already handed
        out (every row read before a new page is read was handed out)."""
        skip = self.delivered
        while skip > 0:
            result, _ = self._fetch(self.cursor, min(skip, self.node.page_rows))
            got = result.num_rows if self.dialect.name == "postgresql" else len(result)
            if not got:
                break
            skip -= got

    # -- the iterator contract -------------------------------------------------------------------
    def pull(self) -> tuple[Any, Reservation]:
        """The next ``batch_size`` rows (fewer only at the end), across pages: batches do
        not depend on where pages start, so a restore gives the same batches."""
        pieces: list[dict[str, np.ndarray[Any, Any]]] = []
        rows = 0
        wanted = self.node.batch_size
        while rows < wanted:
            if self.page is None or self.page_taken >= self.page_rows:
                self._release_page()
                if self.exhausted or self._read_page() is None:
                    self.exhausted = True
                    break
            assert self.page is not None
            first = self.page_taken
            last = min(self.page_rows, first + wanted - rows)
            pieces.append({name: column[first:last] for name, column in self.page.items()})
            self.page_taken = last
            rows += last - first
            if self.node.key is not None and self.page_rows < self.node.page_rows and (
                    self.page_taken >= self.page_rows):
                self.exhausted = True  # a short page was the last one
        if not rows:
            raise StopIteration
        names = list(pieces[0])
        batch = {name: np.concatenate([piece[name] for piece in pieces]) if len(pieces) > 1
                 else pieces[0][name].copy() for name in names}
        self.delivered += rows
        if self.node.key is not None:
            value = batch[self.node.key][-1]
            self.last_key = value.item() if isinstance(value, np.generic) else value
        return batch, self.account.admit(sizeof(batch))

    def _release_page(self) -> None:
        self.booking.release()
        self.booking = NO_RESERVATION
        self.page = None

    def get_state(self) -> dict[str, Any]:
        key = self.last_key
        if key is not None and not isinstance(key, (int, float, str)):
            raise SqlError(
                f"from_sql: the key {self.node.key!r} has values of type {type(key).__name__}, "
                "which a checkpoint cannot hold; use an integer or text key"
            )
        return {"delivered": self.delivered, "last_key": key, "done": self.exhausted and (
            self.page is None or self.page_taken >= self.page_rows)}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        delivered = reader.integer("delivered")
        done = reader.flag("done")
        key = reader.raw("last_key")
        if key is not None and not isinstance(key, (int, float, str)):
            raise reader.error("last_key", f"= {key!r} is not an int, float or str")
        if self.node.key is None and key is not None:
            raise reader.error("last_key", "is set, but this query has no key")
        self._release_page()
        self._drop_connection()
        self.__dict__.pop("_arrow_reader", None)
        self.delivered, self.last_key, self.exhausted = delivered, key, done
        self.read_rows = delivered
        self.read_key = key

    def close(self) -> None:
        self._release_page()
        self.__dict__.pop("_arrow_reader", None)
        self._drop_connection()
