"""``unique()``: each distinct element once, in order of first appearance (tf.data's).

Elements are single tensors of an integer or string type, of any shape, as in
tf.data: two elements are the same when their shapes and values are (``[[1, 2]]``
and ``[[1], [2]]`` are not), and a stream may mix shapes. Floats and structures
(tuples, dicts) are refused, as tf.data refuses them; integer types beyond int32
and int64 are accepted. The set of values seen so far is the
stage's buffer: every new value is booked on the stage's share of the budget
(its Python object and its slot in the set) and held until the iterator
closes — it cannot shrink, so a stream with more distinct values than the
budget holds raises :class:`MemoryBudgetError` naming the stage. The state is
the input's start and a count; a restore re-reads the input to rebuild the set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from headrace._errors import ElementSpecError
from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._structure import TensorSpec
from headrace._transforms._replay import ReplayedInput
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN, Node, ShardRole, Traits, UnaryNode, known_spec
from headrace.core.state import StateReader

__all__ = ["UniqueNode"]

#: What one more entry of a Python set costs beyond the key object: its slot
#: (hash + pointer, 16 B) at a load factor of at most 3/5.
_SET_SLOT_BYTES = 27


_REFUSED = "unique: elements must be single integer or string tensors (as in tf.data), got"


def _check_spec(spec: Any) -> None:
    if not isinstance(spec, TensorSpec) or not (
        spec.kind in ("bytes", "str") or spec.dtype.kind in "iu"
    ):
        raise ElementSpecError(f"{_REFUSED} {spec!r}")


class UniqueNode(UnaryNode):
    stage = "unique"
    budget_weight = 1.0

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # an element is dropped for one seen before it, anywhere

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # which element comes i-th depends on the others

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node) -> None:
        super().__init__(source)
        spec = known_spec(source)
        if spec is not None:
            _check_spec(spec)

    def cardinality(self) -> int:
        return 0 if self.inputs[0].cardinality() == 0 else UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        return _UniqueIterator(self, self.inputs[0].make_iterator(ctx), ctx)


def _key(element: Any) -> Any:
    """What an element is compared by: the value of a scalar; the shape and the values
    of an array (integers as int64 bytes, so the key is compact and exact)."""
    if isinstance(element, (bytes, str)):
        return element
    if isinstance(element, (np.integer, int)) and not isinstance(element, bool):
        return int(element)
    if isinstance(element, np.ndarray):
        kind = element.dtype.kind
        if element.shape == () and kind in "iuSUO":
            return _key(element.item())
        if kind == "u" and element.dtype.itemsize == 8:  # past int64: its own bytes
            return ("u8", element.shape, element.tobytes())
        if kind in "iu":
            return ("i", element.shape, element.astype(np.int64, copy=False).tobytes())
        if kind in "SUO":
            values = tuple(element.ravel().tolist())
            if all(isinstance(v, (bytes, str)) for v in values):
                return ("s", element.shape, values)
    raise ElementSpecError(f"{_REFUSED} {type(element).__name__} {element!r:.60}")


class _UniqueIterator(Iterator):
    stage = "unique"
    passes_origin = True

    def __init__(self, node: UniqueNode, inner: Iterator, ctx: Context) -> None:
        super().__init__(inner)
        self.ctx = ctx
        self.account = ctx.account(node)
        self.input = ReplayedInput(inner)
        self.seen: set[Any] = set()
        self.booked = NO_RESERVATION  # every value seen, as one booking

    def _remember(self, element: Any) -> bool:
        key = _key(element)
        if key in self.seen:
            return False
        cost = self.ctx.sizeof(key) + _SET_SLOT_BYTES
        self.booked = self.booked.absorb(self.account.admit(cost, together="the set of values seen"))
        self.seen.add(key)
        return True

    def pull(self) -> tuple[Any, Reservation]:
        while True:
            element, reservation = self.input.pull()
            try:
                new = self._remember(element)
            except BaseException:
                reservation.release()
                raise
            if new:
                return element, reservation
            reservation.release()

    def get_state(self) -> dict[str, Any]:
        return self.input.as_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self._forget()

        def feed(element: Any, reservation: Reservation) -> None:
            reservation.release()
            self._remember(element)

        self.input.restore(StateReader(state, self.stage), feed)

    def _forget(self) -> None:
        self.booked.release()
        self.booked = NO_RESERVATION
        self.seen.clear()

    def close(self) -> None:
        self._forget()
        super().close()
