"""``take_while(predicate)``: elements up to (not including) the first one failing ``predicate``.

As tf.data: the input is not read past the first false; the predicate returns a
scalar bool (anything else is an error naming what came back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headrace._errors import InvalidArgumentError, note_element_error
from headrace._memory.buffer import Reservation
from headrace._transforms.filter import as_bool
from headrace._transforms.map import apply_fn
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN, Node, ShardRole, Traits, UnaryNode
from headrace.core.state import INNER, StateReader

__all__ = ["TakeWhileNode"]


class TakeWhileNode(UnaryNode):
    stage = "take_while"

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # stops at the first element refused

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # its length depends on the elements

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, predicate: Callable[..., Any]) -> None:
        super().__init__(source)
        if not callable(predicate):
            raise InvalidArgumentError(f"take_while: predicate must be callable, got {predicate!r}")
        self.predicate = predicate

    def params(self) -> tuple[Any, ...]:
        return (function_fingerprint(self.predicate),)

    def cardinality(self) -> int:
        return 0 if self.inputs[0].cardinality() == 0 else UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        return _TakeWhileIterator(self.inputs[0].make_iterator(ctx), self.predicate)


class _TakeWhileIterator(Iterator):
    stage = "take_while"
    passes_origin = True

    def __init__(self, inner: Iterator, predicate: Callable[..., Any]) -> None:
        super().__init__(inner)
        self.inner, self.predicate = inner, predicate
        self.name = function_name(predicate)
        self.index = 0
        self.done = False

    def pull(self) -> tuple[Any, Reservation]:
        if self.done:
            raise StopIteration
        element, reservation = self.inner.pull()
        index, self.index = self.index, self.index + 1
        try:
            keep = as_bool(apply_fn(self.predicate, element), f"take_while({self.name})")
        except Exception as error:
            reservation.release()
            raise note_element_error(error, f"take_while({self.name})", index)  # noqa: B904
        if keep:
            return element, reservation
        reservation.release()
        self.done = True
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), "index": self.index, "done": self.done}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.inner.set_state(reader.child(INNER))
        self.index, self.done = reader.integer("index"), reader.flag("done")
