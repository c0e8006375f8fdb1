"""Every error headrace raises on purpose, in one hierarchy.

Catch :class:`HeadraceError` to catch them all. Each subclass also derives from
the builtin exception a Python user would expect in its place, so existing
``except ValueError`` / ``except OSError`` code keeps working::

    HeadraceError
    ├── MemoryBudgetError (MemoryError)       the pipeline's minimum working set
    │                                         cannot fit in its byte budget
    ├── FileLimitError (OSError)              no file descriptor left, for a reason
    │                                         outside headrace's own cap
    ├── InvalidArgumentError (ValueError)     bad arguments, raised at build time
    ├── ElementSpecError (TypeError)          an element does not match the declared
    │   │                                     structure / dtype / shape
    │   └── EmptyInputError                   a spec learnt from the first element, of
    │                                         an input that has none
    ├── DataLossError (OSError)               corrupt or truncated input; names the
    │   │                                     file and the byte offset
    │   └── RecordTooLargeError               a declared length over max_record_bytes
    ├── ParseError (ValueError)               a record that cannot be parsed with the
    │                                         given spec; names the feature and record
    ├── CheckpointError (ValueError)          a state that does not belong to this
    │                                         pipeline or format version
    ├── IteratorClosedError (RuntimeError)    next() on a closed iterator
    └── WorkerError (RuntimeError)            a user function failed in a worker
        │                                     thread or process; carries its traceback
        └── WorkerPoolError                   a stage's worker processes cannot go on
                                              (one cannot start, or the pool is closed)

Warnings are one class, :class:`HeadraceWarning` (a ``UserWarning``, so Python
shows it by default): a pipeline that silently did less than asked — a shuffle
buffer shrunk to fit the budget, an order that depends on the machine — is a
bug report waiting to happen. Each says what changed and how to avoid it, and
comes once per iterator and stage; silence them by class with
``warnings.filterwarnings("ignore", category=headrace.HeadraceWarning)``.

Errors carry the *where* (stage, file, offset, record, feature) in the message,
because a user debugging a 2 TB input needs to find the bad byte without
re-running anything.

Errors raised by the user's own code (a ``map`` function, a ``filter``
predicate, a generator) keep their type and traceback: headrace adds a PEP 678
note naming the stage and the element (:func:`note_element_error`) and, where the
source knows it, the element's :class:`Origin` — file, record index, byte offset
(:func:`element_origin`) — so ``except KeyError`` around a pipeline still works
and a bad JPEG in shard 731 of 1,000 is found without re-running anything. Such an error takes its
element's place in the stream: every earlier element was delivered before it,
and the next ``next()`` continues with the following element, as in tf.data.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "CheckpointError",
    "DataLossError",
    "ElementSpecError",
    "EmptyInputError",
    "FileLimitError",
    "HeadraceError",
    "HeadraceWarning",
    "InvalidArgumentError",
    "IteratorClosedError",
    "MemoryBudgetError",
    "Origin",
    "ParseError",
    "RecordTooLargeError",
    "WorkerError",
    "WorkerPoolError",
    "add_note",
    "element_origin",
    "mark_batch_row",
    "note_element_error",
]


class HeadraceError(Exception):
    """Base class of every error headrace raises deliberately."""


class HeadraceWarning(UserWarning):
    """Base class of every warning headrace issues: visible by default, filterable by class.

    Not a ``ResourceWarning`` (hidden by default): a user whose ``shuffle(10000)``
    became a shuffle within 2,686 elements must be told.
    """


class MemoryBudgetError(HeadraceError, MemoryError):
    """The pipeline cannot run inside its memory budget.

    Raised when the *minimum working set* of a stage (for example one batch
    being assembled plus its output) is larger than the share of the budget
    that stage can ever get. Larger-than-possible buffer requests do not raise:
    they shrink, with a warning.
    """

    #: The stage whose share refused (its name in profiles), where one did: the
    #: iterator uses it to tell a refusal that stands for elements from one that
    #: leaves that stage where it was.
    stage: str | None = None


class FileLimitError(HeadraceError, OSError):
    """The process ran out of file descriptors for a reason outside headrace's cap."""


class InvalidArgumentError(HeadraceError, ValueError):
    """An argument is invalid on its own, before any data is read."""


class ElementSpecError(HeadraceError, TypeError):
    """An element does not match the structure, dtype or shape it must have."""


class EmptyInputError(ElementSpecError):
    """``element_spec`` had to be learnt from an element (``map`` without
    ``output_signature``, ``interleave``, ``scan``), and the input has none.

    Only asking for the spec raises it: iterating such a pipeline never needs the
    spec, and an empty stream yields nothing, as in tf.data (whose tracing knows the
    spec without data). Stages that want the spec to run (``padded_batch``) catch it
    and lay out from the first element they are given instead.
    """


class DataLossError(HeadraceError, OSError):
    """Input bytes are corrupt or truncated.

    Attributes ``path`` and ``offset`` say where; for compressed files the
    offset counts *decompressed* bytes, and the message says so.
    """

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.path = path
        self.offset = offset

    def __str__(self) -> str:  # OSError's own __str__ would print the args tuple
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_data_loss, (type(self), str(self), self.path, self.offset))


def _rebuild_data_loss(
    cls: type[DataLossError], message: str, path: str | None, offset: int | None
) -> DataLossError:
    return cls(message, path=path, offset=offset)


class RecordTooLargeError(DataLossError):
    """A record declares a length above ``max_record_bytes``; nothing was allocated.

    ``field``: for a CSV record, the index (among its file's fields) of the field the
    read stopped in, where known (None otherwise); ``fields_before``: the record's whole
    fields before it (a type inference counts them).
    """

    field: int | None = None
    fields_before: tuple[bytes, ...] = ()


class ParseError(HeadraceError, ValueError):
    """A serialized record cannot be parsed with the given feature spec."""


class CheckpointError(HeadraceError, ValueError):
    """An iterator state cannot be restored into this pipeline."""


class IteratorClosedError(HeadraceError, RuntimeError):
    """The iterator was closed; create a new one with ``iter(dataset)``."""


class WorkerError(HeadraceError, RuntimeError):
    """A user function raised inside a worker; the message carries its traceback.

    Also the error of one element whose call killed a worker process twice (see
    :class:`WorkerPoolError` for a stage that cannot go on at all): it takes that
    element's place like any error of the function, and ``ignore_errors`` drops it.
    """


class WorkerPoolError(WorkerError):
    """A stage's worker processes cannot go on: a worker could not start (or died
    while starting), its function could not be loaded there, or the pool was closed.

    A worker that dies while it runs calls is not this: it is restarted and its
    calls run again (see :mod:`headrace._workers.processes`). This error is the
    stage's, not an element's: it is raised again at every ``next()`` (never the
    end of the data), ``ignore_errors`` does not swallow it, and a state taken
    after it still starts at the first element not handed out.
    """


class Origin(NamedTuple):
    """Where an element came from: the file, the record's index in it and its byte offset.

    A source that knows positions (TFRecord and text files, arrays by index, indexed
    TFRecords) says it through :meth:`headrace.core.Iterator.origin`; a stage whose
    user function fails on an element names it in the error's note, and
    :func:`element_origin` returns it. ``path`` is None for an in-memory source
    (``record`` is then the element's index in it); ``offset`` counts decompressed
    bytes where ``compressed``.

    A batched element (``batch``, then a map over the batch) has ``span`` records:
    ``rows`` holds each row's origin, in row order, and ``path``, ``record`` and
    ``offset`` are its first row's (see :meth:`of_rows`). Rows that are consecutive
    records of one file read "records 40-71 (from byte offset 2600) of file X";
    others (a shuffle before the batch) name the first few rows and count the rest.
    A function that fails on one row of the batch and says which
    (:func:`mark_batch_row`: ``parse_examples``, ``InceptionCrop.batch``) gets that
    row's own origin.
    """

    path: str | None
    record: int
    offset: int | None = None
    span: int = 1
    compressed: bool = False
    rows: tuple[Origin, ...] = ()

    @classmethod
    def of_rows(cls, rows: Sequence[Origin]) -> Origin:
        """The origin of a batch whose rows came from ``rows`` (at least one)."""
        first = rows[0]
        return cls(first.path, first.record, first.offset, len(rows), first.compressed,
                   tuple(rows))

    @property
    def consecutive(self) -> bool:
        """Whether the element's records follow each other in one file (or source)."""
        first = self.rows[0] if self.rows else self
        return all(
            row.path == first.path and row.record == first.record + at and row.span == 1
            for at, row in enumerate(self.rows)
        )

    def __str__(self) -> str:
        if not self.consecutive:
            shown = ", ".join(str(row) for row in self.rows[:_ROWS_NAMED])
            more = len(self.rows) - _ROWS_NAMED
            return f"a batch of {self.span} records: {shown}" + (
                f" and {more} more" if more > 0 else "")
        last = self.record + self.span - 1
        if self.path is None:
            which = f"element {self.record}" if self.span == 1 else f"elements {self.record}-{last}"
            return f"{which} of the source"
        which = f"record {self.record}" if self.span == 1 else f"records {self.record}-{last}"
        unit = "decompressed byte" if self.compressed else "byte"
        if self.offset is not None:
            at = "at" if self.span == 1 else "from"
            which += f" ({at} {unit} offset {self.offset})"
        return f"{which} of file {self.path}"


#: Rows of a batch of scattered records named in its origin's text (the rest counted).
_ROWS_NAMED = 3
#: The attribute :func:`mark_batch_row` sets on an error.
_BATCH_ROW = "headrace_batch_row"
#: How headrace's batched parsers name the record that failed in their messages.
_RECORD_OF_BATCH = re.compile(r"\brecord (\d+) of the batch\b")


def mark_batch_row(error: BaseException, row: int | None = None) -> BaseException:
    """Say that ``error``, raised by a function over a whole batch, is about row ``row``
    of it (None: the row that headrace's batched parsers name in the message, as in
    "record 3 of the batch", if any). A map over the batch then names that row's own
    origin (file, record, offset), not the batch's. Returns ``error``."""
    if row is None:
        found = _RECORD_OF_BATCH.search(str(error))
        if found is None:
            return error
        row = int(found.group(1))
    with contextlib.suppress(AttributeError):
        setattr(error, _BATCH_ROW, row)
    return error


def element_origin(error: BaseException) -> Origin | None:
    """The :class:`Origin` of the element a user function raised ``error`` on, where
    the stage knew it (see :func:`note_element_error`), else None."""
    origin = getattr(error, "headrace_origin", None)
    return origin if isinstance(origin, Origin) else None


def note_element_error(
    error: Exception, stage: str, index: int, origin: Origin | None = None
) -> Exception:
    """Say where a user function failed: ``stage``, the element's ``index`` and, where
    the input knows it, the element's ``origin`` (file, record, byte offset).

    The index counts from 0 the elements of the stage's input (for a source, the
    elements it produced), since the start of the iteration, checkpoints included.
    The origin is kept on the error too (:func:`element_origin`), for a program to
    read rather than parse. Where the element is a batch and the error names its row
    (:func:`mark_batch_row`), the origin is that row's.

    Returns the error to raise: ``error`` itself with a PEP 678 note added (its type
    and traceback stay the user's, so their ``except`` clauses keep working), or, for
    a ``StopIteration`` escaping the user's code, a :class:`RuntimeError` caused by it —
    raised as is, a ``StopIteration`` would end the pipeline and silently drop the
    rest of the data (the same reason PEP 479 converts it in generators).
    """
    where = f"headrace: raised in {stage} on element {index}"
    if origin is not None and origin.rows:
        row = getattr(error, _BATCH_ROW, None)
        if isinstance(row, int) and 0 <= row < len(origin.rows):
            where += f", row {row} of a batch of {origin.span}"
            origin = origin.rows[row]
    if origin is not None:
        where += f", {origin}"
    if isinstance(error, StopIteration):
        converted = RuntimeError(f"{where}: StopIteration escaped the user function")
        converted.__cause__ = error
        error = converted
    else:
        add_note(error, where)
    if origin is not None:
        with contextlib.suppress(AttributeError):  # (__slots__: the note still says it)
            error.headrace_origin = origin  # type: ignore[attr-defined]
    return error


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (PEP 678), also on Python 3.10, which lacks the method."""
    method = getattr(error, "add_note", None)  # Python >= 3.11
    if method is not None:
        method(note)
    else:  # Python 3.10: the attribute PEP 678 defines, for tools that show it
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
