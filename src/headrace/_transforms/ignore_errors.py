"""``ignore_errors(log_warning=False)``: drop the elements whose production raised.

An error raised at an element's position upstream (a map function, a parse, a
corrupt record read with a reader that goes on) is swallowed and the next
element is pulled, as tf.data's ``ignore_errors``. ``log_warning=True`` issues a
:class:`~headrace._errors.HeadraceWarning` naming each error. Errors of headrace's
own machinery that end the stream for good (a closed iterator, an exhausted
memory budget, a bad checkpoint, a stage whose worker processes cannot go on:
:class:`~headrace._errors.WorkerPoolError`) are not swallowed: skipping them
would spin, or end the epoch early with elements silently lost.

Nor is an error its input raises again without moving: the same error (type and
message) twice in a row with the input's state unchanged between them is a failure
of the stage, not of an element (a query that cannot run, say), and dropping it
again and again would spin forever. It is raised, with a note that says so.

A worker process that dies (a signal, the OOM killer) is no element's error: it
is replaced and its calls run again, so nothing is dropped here for it. The one
exception is an element whose call killed a worker twice (once in its chunk, once
alone): that is its own :class:`~headrace._errors.WorkerError`, in its place, and
like any error of the function it is dropped here (and counted).
"""

from __future__ import annotations

from typing import Any

from headrace._errors import HeadraceWarning
from headrace._memory.buffer import Reservation
from headrace._warn import warn_user
from headrace.core.element_errors import RepeatCheck
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, ShardRole, Traits, UnaryNode
from headrace.core.state import INNER, StateReader

__all__ = ["IgnoreErrorsNode"]

class IgnoreErrorsNode(UnaryNode):
    stage = "ignore_errors"

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # which element comes i-th depends on which fail

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, log_warning: bool) -> None:
        super().__init__(source)
        self.log_warning = bool(log_warning)

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT

    def params(self) -> tuple[Any, ...]:
        return (self.log_warning,)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        return inner if inner <= 0 else -2  # UNKNOWN: any element may be dropped

    def make_iterator(self, ctx: Context) -> Iterator:
        return _IgnoreErrorsIterator(self.inputs[0].make_iterator(ctx), self.log_warning)


class _IgnoreErrorsIterator(Iterator):
    stage = "ignore_errors"
    passes_origin = True

    def __init__(self, inner: Iterator, log_warning: bool) -> None:
        super().__init__(inner)
        self.inner, self.log_warning = inner, log_warning
        self.ignored = 0

    def pull(self) -> tuple[Any, Reservation]:
        repeats: RepeatCheck | None = None  # (made at the first error only)
        while True:
            try:
                return self.inner.pull()
            except StopIteration:
                raise
            except Exception as error:
                if repeats is None:
                    repeats = RepeatCheck(self.inner, "ignore_errors")
                repeats.check(error)  # (raises a stream's error, or one that repeats)
                self.ignored += 1
                if self.log_warning:
                    notes = "".join(
                        f"; {note}" for note in getattr(error, "__notes__", ())
                        if isinstance(note, str) and note.startswith("headrace:")
                    )  # where it failed: the stage, the element and its file and record
                    warn_user(
                        f"ignore_errors: dropped an element that raised "
                        f"{type(error).__name__}: {error}{notes}",
                        HeadraceWarning,
                    )

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), "ignored": self.ignored}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.inner.set_state(reader.child(INNER))
        self.ignored = reader.integer("ignored")
