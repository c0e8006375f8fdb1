"""``enumerate(start=0)``: ``(index, element)`` pairs with an int64 index, as tf.data."""

from __future__ import annotations

from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace._memory.buffer import Reservation
from headrace._structure import TensorSpec
from headrace.core.handoff import holds_a_place
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, ShardRole, Traits
from headrace.core.state import INNER, INT64_MAX, StateReader

__all__ = ["EnumerateNode"]


class EnumerateNode(Node):
    stage = "enumerate"

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # numbers elements by position

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        inner = reach(self.inputs[0])
        return inner if isinstance(inner, Refusal) else _EnumeratedAccess(inner, self.start)

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, start: int) -> None:
        super().__init__(source)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
            raise InvalidArgumentError(f"enumerate: start must be an int, got {start!r}")
        self.start = int(start)

    def params(self) -> tuple[Any, ...]:
        return (self.start,)

    @property
    def element_spec(self) -> Any:
        return (TensorSpec((), np.int64), self.inputs[0].element_spec)

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()

    def random_access(self) -> RandomAccess | None:
        inner = self.inputs[0].random_access()
        return None if inner is None else _EnumeratedAccess(inner, self.start)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        return _EnumerateIterator(self.inputs[0].make_iterator(ctx), self.start)


class _EnumeratedAccess(RandomAccess):
    def __init__(self, inner: RandomAccess, start: int) -> None:
        self.inner, self.start = inner, start

    def __len__(self) -> int:
        return len(self.inner)

    def get(self, index: int) -> Any:
        return np.int64(self.start + index), self.inner.get(index)

    def get_many(self, indices: range | Any) -> Any:
        return self.start + np.asarray(indices, dtype=np.int64), self.inner.get_many(indices)

    def gathers_batches(self) -> bool:
        return self.inner.gathers_batches()

    def prepare(self, ctx: Context) -> None:
        self.inner.prepare(ctx)


class _EnumerateIterator(Iterator):
    stage = "enumerate"
    passes_origin = True

    def __init__(self, inner: Iterator, start: int) -> None:
        super().__init__(inner)
        self.inner, self.next_value, self.start = inner, start, start

    def pull(self) -> tuple[Any, Reservation]:
        try:
            element, reservation = self.inner.pull()
        except StopIteration:
            raise
        except Exception as error:  # its error takes a number, as in tf.data (a zip with
            if holds_a_place(error):  # a range): the later elements keep their own
                self.next_value += 1
            raise
        value = np.int64(self.next_value)
        self.next_value += 1
        return (value, element), reservation

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), "next": self.next_value}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, "enumerate")
        # counts up from start; the value must still fit the int64 it is handed out as
        self.next_value = reader.integer("next", low=self.start, high=INT64_MAX)
        self.inner.set_state(reader.child(INNER))
