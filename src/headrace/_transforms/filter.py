"""``filter(predicate)``: keep the elements for which the predicate is true.

The predicate must return a scalar boolean (Python bool, NumPy bool or a
0-d array), as in tf.data; anything else is an error naming what came back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError, InvalidArgumentError, note_element_error
from headrace._memory.buffer import Reservation
from headrace._transforms.map import apply_fn
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN, Node, ShardRole, Traits, UnaryNode
from headrace.core.state import INNER, StateReader

__all__ = ["FilterNode", "as_bool"]


def as_bool(value: Any, name: str) -> bool:
    """A predicate's result as a bool; anything but a scalar bool is an error naming it."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype == np.bool_:
        return bool(value)
    raise ElementSpecError(
        f"{name}: the predicate must return a scalar bool, got {value!r} "
        f"of type {type(value).__name__}"
    )


class FilterNode(UnaryNode):
    stage = "filter"

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # which element comes i-th depends on the others

    def traits(self) -> Traits:
        return Traits(drops=True)

    def __init__(self, source: Node, predicate: Callable[..., Any]) -> None:
        super().__init__(source)
        if not callable(predicate):
            raise InvalidArgumentError(f"filter: predicate must be callable, got {predicate!r}")
        self.predicate = predicate

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT

    def params(self) -> tuple[Any, ...]:
        return (function_fingerprint(self.predicate),)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        return inner if inner < 0 or inner == 0 else UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        return _FilterIterator(self.inputs[0].make_iterator(ctx), self.predicate)


class _FilterIterator(Iterator):
    stage = "filter"
    passes_origin = True

    def __init__(self, inner: Iterator, predicate: Callable[..., Any]) -> None:
        super().__init__(inner)
        self.inner, self.predicate = inner, predicate
        self.name = function_name(predicate)
        self.index = 0  # of the next input element (named in error notes)

    def pull(self) -> tuple[Any, Reservation]:
        while True:
            element, reservation = self.inner.pull()
            index = self.index
            self.index = index + 1
            try:
                keep = as_bool(apply_fn(self.predicate, element), f"filter({self.name})")
            except Exception as error:  # the element is dropped; the next call goes on
                reservation.release()
                raise note_element_error(error, f"filter({self.name})", index)  # noqa: B904
            if keep:
                return element, reservation
            reservation.release()

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.inner.set_state(reader.child(INNER))
        self.index = reader.integer("index") if "index" in state else 0
