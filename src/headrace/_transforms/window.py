"""``window(size, shift=None, stride=1, drop_remainder=False)``: tf.data's windows of datasets.

Window k holds input elements ``k*shift + j*stride`` for ``j < size``; as in
tf.data each window is a *dataset* per component (``window(3).flat_map(lambda w:
w.batch(3))`` is the usual way to use it), the last windows are shorter unless
``drop_remainder``. The stage holds the input elements from the current
window's start to its end (``(size - 1) * stride + 1`` at most), each booked on
its share of the budget; a window that cannot fit raises
:class:`~headrace._errors.MemoryBudgetError` naming the stage. A handed-out
window is a copy of its values (a small dataset over them): it belongs to the
consumer. The state is the input's state before the window's first element:
a restore re-reads the window, never stores it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._structure import flatten, map_structure, pack_as
from headrace.core.handoff import holds_a_place, unpin
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits, check_positive
from headrace.core.state import INNER, POSITION, StateReader

__all__ = ["DatasetSpec", "WindowNode"]


@dataclass(frozen=True)
class DatasetSpec:
    """The spec of a component that is itself a dataset (a window): its elements' spec."""

    element_spec: Any


class WindowNode(Node):
    stage = "window"
    budget_weight = 1.0

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # groups elements by position

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # tf.data does not address windows

    def traits(self) -> Traits:
        return Traits()

    def __init__(
        self,
        source: Node,
        size: int,
        shift: int | None,
        stride: int,
        drop_remainder: bool,
        make_dataset: Callable[[list[Any]], Any],
    ) -> None:
        super().__init__(source)
        self.size = check_positive("window: size", size)
        self.shift = check_positive("window: shift", size if shift is None else shift)
        self.stride = check_positive("window: stride", stride)
        self.drop_remainder = bool(drop_remainder)
        self.make_dataset = make_dataset

    def params(self) -> tuple[Any, ...]:
        return (self.size, self.shift, self.stride, self.drop_remainder)

    @property
    def element_spec(self) -> Any:
        return map_structure(DatasetSpec, self.inputs[0].element_spec)

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        if self.drop_remainder:
            rest = n - ((self.size - 1) * self.stride + 1)
            return rest // self.shift + 1 if rest >= 0 else 0
        return -(-n // self.shift)

    def make_iterator(self, ctx: Context) -> Iterator:
        return _WindowIterator(self, self.inputs[0].make_iterator(ctx), ctx)


@dataclass(frozen=True)
class _Failed:
    """An element's error held in its place in the window buffer."""

    error: Exception


class _WindowIterator(Iterator):
    stage = "window"

    def __init__(self, node: WindowNode, inner: Iterator, ctx: Context) -> None:
        super().__init__(inner)
        self.node, self.inner, self.ctx = node, inner, ctx
        self.account = ctx.account(node)
        # (input index, input state before it, element, booking), from the window's start
        self.held: deque[tuple[int, dict[str, Any], Any, Reservation]] = deque()
        self.start = 0  # input index of the current window's first element
        self.next_index = 0  # input index of the next element to read
        self.exhausted = False

    def _read(self) -> bool:
        """Read one input element into the window buffer (False at the end of the input)."""
        if self.exhausted:
            return False
        before = self.inner.get_state()
        try:
            element, upstream = self.inner.pull()
        except StopIteration:
            self.exhausted = True
            return False
        except Exception as error:
            if not holds_a_place(error):
                raise
            # As tf.data: the error keeps its element's index, and each window that holds
            # it raises it (one outside every window is dropped with its element). An
            # error passed on at once shifted every later window by one.
            index, self.next_index = self.next_index, self.next_index + 1
            if index >= self.start:
                self.held.append((index, before, _Failed(unpin(error)), NO_RESERVATION))
            return True
        index, self.next_index = self.next_index, self.next_index + 1
        if index < self.start:  # between windows (shift > size * stride): not kept
            upstream.release()
            return True
        element, cost = self.ctx.admit(element)
        booking = self.account.admit(cost, upstream, together="one window")
        self.held.append((index, before, element, booking))
        return True

    def pull(self) -> tuple[Any, Reservation]:
        node = self.node
        last = self.start + (node.size - 1) * node.stride
        while self.next_index <= last and self._read():
            pass
        members = [
            element
            for index, _, element, _ in self.held
            if index <= last and (index - self.start) % node.stride == 0
        ]
        if not members or (node.drop_remainder and len(members) < node.size):
            self._drop_before(self.next_index + 1)
            self.start = self.next_index  # ended: every later pull ends too
            raise StopIteration
        failed = next((member for member in members if isinstance(member, _Failed)), None)
        if failed is not None:  # every window that holds it raises its error, in its place
            self.start += node.shift
            self._drop_before(self.start)
            raise failed.error.with_traceback(None)
        leaves = [flatten(element) for element in members]
        window = pack_as(
            members[0],
            [node.make_dataset([row[k] for row in leaves]) for k in range(len(leaves[0]))],
        )
        self.start += node.shift
        self._drop_before(self.start)
        return window, NO_RESERVATION  # copies, handed to the consumer

    def _drop_before(self, index: int) -> None:
        while self.held and self.held[0][0] < index:
            self.held.popleft()[3].release()

    def get_state(self) -> dict[str, Any]:
        if self.held:
            index, before, _, _ = self.held[0]
            return {INNER: before, POSITION: index, "start": self.start}
        return {INNER: self.inner.get_state(), POSITION: self.next_index, "start": self.start}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        position = reader.integer(POSITION)
        start = reader.integer("start")
        self._drop_before(1 << 63)
        self.inner.set_state(reader.child(INNER))
        self.next_index, self.start, self.exhausted = position, start, False

    def close(self) -> None:
        self._drop_before(1 << 63)
        super().close()
