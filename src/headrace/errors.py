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
    │                                         structure / dtype / shape
    ├── DataLossError (OSError)               corrupt or truncated input; names the
    │   │                                     file and the byte offset
    │   └── RecordTooLargeError               a declared length over max_record_bytes
    ├── ParseError (ValueError)               a record that cannot be parsed with the
    │                                         given spec; names the feature and record
    ├── CheckpointError (ValueError)          a state that does not belong to this
    │                                         pipeline or format version
    ├── IteratorClosedError (RuntimeError)    next() on a closed iterator
    └── WorkerError (RuntimeError)            a user function failed in a worker
                                              thread or process; carries its traceback

Errors carry the *where* (stage, file, offset, record, feature) in the message,
because a user debugging a 2 TB input needs to find the bad byte without
re-running anything.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DataLossError",
    "ElementSpecError",
    "FileLimitError",
    "HeadraceError",
    "InvalidArgumentError",
    "IteratorClosedError",
    "MemoryBudgetError",
    "ParseError",
    "RecordTooLargeError",
    "WorkerError",
]


class HeadraceError(Exception):
    """Base class of every error headrace raises deliberately."""


class MemoryBudgetError(HeadraceError, MemoryError):
    """The pipeline cannot run inside its memory budget.

    Raised when the *minimum working set* of a stage (for example one batch
    being assembled plus its output) is larger than the share of the budget
    that stage can ever get. Larger-than-possible buffer requests do not raise:
    they shrink, with a warning.
    """


class FileLimitError(HeadraceError, OSError):
    """The process ran out of file descriptors for a reason outside headrace's cap."""


class InvalidArgumentError(HeadraceError, ValueError):
    """An argument is invalid on its own, before any data is read."""


class ElementSpecError(HeadraceError, TypeError):
    """An element does not match the structure, dtype or shape it must have."""


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
    """A record declares a length above ``max_record_bytes``; nothing was allocated."""


class ParseError(HeadraceError, ValueError):
    """A serialized record cannot be parsed with the given feature spec."""


class CheckpointError(HeadraceError, ValueError):
    """An iterator state cannot be restored into this pipeline."""


class IteratorClosedError(HeadraceError, RuntimeError):
    """The iterator was closed; create a new one with ``iter(dataset)``."""


class WorkerError(HeadraceError, RuntimeError):
    """A user function raised inside a worker; the message carries its traceback."""
