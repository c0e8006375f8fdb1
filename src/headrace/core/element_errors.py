"""Errors raised in an element's place, told apart from failures of the stream itself.

Internal. A stage that passes elements' errors by (``ignore_errors`` drops them, a
cache does not keep them and a restore of it passes them again) must not do so for
an error that ends the stream for good, nor for one its input raises again and again
without moving: passing those would spin forever, or lose elements silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headrace._errors import (
    CheckpointError,
    IteratorClosedError,
    MemoryBudgetError,
    WorkerPoolError,
    add_note,
)
from headrace.core.iterator import Iterator
from headrace.core.state import without_errors_met

__all__ = ["STREAM_ERRORS", "RepeatCheck"]

#: Errors of headrace's own machinery that end the stream: never an element's.
STREAM_ERRORS = (CheckpointError, IteratorClosedError, MemoryBudgetError, WorkerPoolError)


class RepeatCheck:
    """Raises an error that ``inner`` raised again without moving.

    The same error (type and message) twice in a row with the input's state
    unchanged between them is a failure of the stage, not of an element (a query
    that cannot run, a file that cannot be opened where the reader does not go
    on). The input's state is taken only when an error repeats the one before it.
    Call :meth:`moved` after an element came out.
    """

    __slots__ = ("inner", "last", "progress", "who")

    def __init__(self, inner: Iterator, who: str,
                 progress: Callable[[Exception], Any] | None = None) -> None:
        self.inner, self.who = inner, who
        #: The state that says whether the stream moved between two raises of ``error``
        #: (by default the whole input's: a stage above the one that raised it that
        #: counts errors as positions moves with every repeat).
        self.progress = progress
        self.last: tuple[type, str, Any] | None = None

    def moved(self) -> None:
        self.last = None

    def check(self, error: Exception) -> None:
        """Raise ``error`` (a stream error, or one repeated in place), else return."""
        if isinstance(error, STREAM_ERRORS):
            raise error
        if self.repeated(error):
            add_note(error, f"headrace: {self.who} raised this error, not an element's: "
                            "the input raised it again without moving (a failure of the "
                            "stage)")
            raise error

    def repeated(self, error: Exception) -> bool:
        """Whether ``error`` repeats the error before it with the input's state unchanged
        but for counts of errors met (that input cannot move past it)."""
        key = (type(error), str(error))
        last = self.last
        if last is None or key != last[:2]:
            self.last = (*key, None)
            return False
        try:
            progress = self.inner.get_state() if self.progress is None else self.progress(error)
            state = without_errors_met(progress)
        except Exception:  # a stage that cannot checkpoint: nothing to compare
            self.last = (*key, None)
            return False
        if last[2] is not None and state == last[2]:
            return True
        self.last = (*key, state)
        return False
