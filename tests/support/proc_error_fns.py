"""User exception classes that pickle cannot rebuild as ``type(*args)``, and functions
that raise them: module level, so worker processes can load them (see process_fns)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


class TwoArgs(ValueError):
    """The common pattern: ``__init__`` takes the parts, passes one message up."""

    def __init__(self, i: int, why: str) -> None:
        super().__init__(f"bad row {i}: {why}")


class KeywordOnly(Exception):
    def __init__(self, *, row: int) -> None:
        super().__init__(f"row {row} refused")
        self.row = row


class StrFromAttributes(Exception):
    """No args passed up: its message comes from attributes ``__init__`` set."""

    def __init__(self, row: int, column: str) -> None:
        super().__init__()
        self.row, self.column = row, column

    def __str__(self) -> str:
        return f"column {self.column} of row {self.row} is empty"


class MissingFile(OSError):
    def __init__(self, path: str, row: int) -> None:
        super().__init__(2, f"missing {path} for row {row}")


class HoldsALock(Exception):
    """Its lock attribute cannot travel: the rest of it does."""

    def __init__(self, row: int, why: str) -> None:
        super().__init__(f"row {row}: {why}")
        self.lock = threading.Lock()


class LockInArgs(Exception):
    """Cannot travel at all (a lock in its args): only its type name and message do."""

    def __init__(self, row: int) -> None:
        super().__init__(threading.Lock())
        self.row = row

    def __str__(self) -> str:
        return f"row {self.row} is locked"


class Plain(Exception):
    """Pickle rebuilds it as it is."""


KINDS = ("two_args", "keyword_only", "str_from_attributes", "missing_file", "holds_a_lock",
         "lock_in_args", "plain")


def make_error(kind: str, row: int) -> Exception:
    if kind == "two_args":
        return TwoArgs(row, "negative length")
    if kind == "keyword_only":
        return KeywordOnly(row=row)
    if kind == "str_from_attributes":
        return StrFromAttributes(row, "price")
    if kind == "missing_file":
        return MissingFile(f"/data/{row}.bin", row)
    if kind == "holds_a_lock":
        return HoldsALock(row, "locked")
    if kind == "lock_in_args":
        return LockInArgs(row)
    return Plain(f"plain {row}")


def raise_on(plan: dict[int, str], x: Any) -> Any:
    """``x * 10`` as an array, or the planned error for the elements in ``plan``."""
    row = int(x)
    if row in plan:
        raise make_error(plan[row], row)
    return np.full(3, row * 10, np.int64)


def inner_raising(plan: dict[int, str], rows: int, k: Any) -> Any:
    """An interleave's inner dataset: ``rows`` rows of shard ``k``, mapped by
    :func:`raise_on` (the planned rows fail)."""
    import functools

    import headrace as hr

    start = int(k) * rows
    return hr.Dataset.range(start, start + rows).map(functools.partial(raise_on, plan))


class Inflating(Exception):
    """Small when pickled (its ``__reduce__`` gives its size), large when made: an array
    of ``nbytes``, made again wherever it is rebuilt."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.blob = np.ones(nbytes, np.uint8)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Inflating, (self.args[0],))


#: How an error of :func:`shaped_error` holds its array.
SHAPES = ("args", "inflate", "cause", "context", "local", "none")


def shaped_error(shape: str, every: int, nbytes: int, seconds: float, x: Any) -> Any:
    """``[x]`` for every ``every``-th element (after ``seconds``: the errors raised
    meanwhile wait for their turn); the others raise an error holding ``nbytes``
    the way ``shape`` says: in its args, made by its ``__init__`` (small pickle), on
    its ``__cause__`` or ``__context__``, in a local of the failing frame, or none."""
    i = int(x)
    if i % every == 0:
        time.sleep(seconds)
        return np.full(4, i, np.int64)
    if shape == "args":
        raise ValueError(f"bad {i}", np.ones(nbytes, np.uint8))
    if shape == "inflate":
        raise Inflating(nbytes)
    if shape in ("cause", "context"):
        try:
            raise KeyError(np.ones(nbytes, np.uint8))
        except KeyError as error:
            if shape == "cause":
                raise RuntimeError(f"bad {i}") from error
            raise RuntimeError(f"bad {i}")  # noqa: B904 (its context is the point)
    if shape == "local":
        temporary = np.ones(nbytes, np.uint8)
        raise ValueError(f"bad {i} ({temporary[:4].sum()})")
    raise ValueError(f"bad {i}")


def chained_error(plan: dict[int, list[str]], x: Any) -> Any:
    """``x`` or, for the elements in ``plan``, an error whose chain follows its list:
    each step ``"cause"`` (``raise .. from``), ``"context"`` (raised while handling),
    ``"suppressed"`` (``from None``), ``"custom"`` (a cause that pickle cannot rebuild
    as ``type(*args)``) from the innermost out."""
    row = int(x)
    steps = plan.get(row)
    if steps is None:
        return row
    error: BaseException = KeyError(f"root {row}")
    for depth, step in enumerate(steps):
        try:
            raise error
        except BaseException as inner:
            outer: BaseException = (TwoArgs(row, f"level {depth}") if step == "custom"
                                    else RuntimeError(f"level {depth} of {row}"))
            try:
                if step in ("cause", "custom"):
                    raise outer from inner
                if step == "suppressed":
                    raise outer from None
                raise outer
            except BaseException as made:
                error = made
    raise error
