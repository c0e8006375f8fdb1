"""``scan(initial_state, scan_func)``: a running state through the input, as tf.data.

``scan_func(state, element)`` returns ``(new_state, output)``; ``output`` is the
element emitted. The carried state is data, not a position, so the iterator's
checkpoint is the input's start plus a count, and a restore re-runs
``scan_func`` over the input so far (exact when the input and the function are
deterministic). ``Dataset.reduce`` is a scan whose last state is returned.

Memory. The stage holds the state between calls, so the state is booked on the
stage's share of the budget. Its size is known after each call, and is booked
then: a state that outgrows what the budget can give raises
:class:`MemoryBudgetError` naming the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError, InvalidArgumentError, note_element_error
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._structure import flatten, returned, spec_of
from headrace._transforms._replay import ReplayedInput
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, ShardRole, Traits, UnaryNode, first_output
from headrace.core.state import StateReader

__all__ = ["ScanNode", "scan_step"]


def scan_step(fn: Callable[..., Any], state: Any, element: Any, stage: str) -> tuple[Any, Any]:
    """``fn(state, element)``, checked to return ``(new_state, output)`` of a stable structure."""
    result = returned(fn(state, element))  # a list is a tuple, as tf.data packs it
    if not isinstance(result, tuple) or len(result) != 2:
        raise ElementSpecError(
            f"{stage}: {function_name(fn)} must return (new_state, output), got "
            f"{type(result).__name__} {result!r:.60}"
        )
    new_state, output = result
    if len(flatten(new_state)) != len(flatten(state)):
        raise ElementSpecError(
            f"{stage}: {function_name(fn)} changed the structure of the state from "
            f"{spec_of(state)} to {spec_of(new_state)}; it must keep it, as in tf.data"
        )
    return new_state, output


#: States whose size cannot grow while their type stays (a counter, a running sum).
_SCALAR_TYPES = (float, bool, complex, np.generic)


class ScanNode(UnaryNode):
    stage = "scan"
    budget_weight = 0.5  # most states are small; a large one declares its minimum

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()  # one element out per element in

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # its state runs through every element in order

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # element i depends on every element before it

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, initial_state: Any, scan_func: Callable[..., Any]) -> None:
        super().__init__(source)
        if not callable(scan_func):
            raise InvalidArgumentError(f"scan: scan_func must be callable, got {scan_func!r}")
        self.initial_state, self.scan_func = initial_state, scan_func
        self._spec: Any = None

    def params(self) -> tuple[Any, ...]:
        return (repr(spec_of(self.initial_state)), repr(self.initial_state)[:200],
                function_fingerprint(self.scan_func))

    @property
    def element_spec(self) -> Any:
        if self._spec is None:
            _, output = first_output(self.inputs[0], self.stage, lambda element, _: scan_step(
                self.scan_func, self.initial_state, element, self.stage))
            self._spec = spec_of(output)
        return self._spec

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_spec"] = None
        return state

    def make_iterator(self, ctx: Context) -> Iterator:
        return _ScanIterator(self, self.inputs[0].make_iterator(ctx), ctx)


class _ScanIterator(Iterator):
    stage = "scan"
    passes_origin = True

    def __init__(self, node: ScanNode, inner: Iterator, ctx: Context) -> None:
        super().__init__(inner)
        self.node, self.ctx = node, ctx
        self.input = ReplayedInput(inner)
        self.state = node.initial_state
        self.name = f"scan({function_name(node.scan_func)})"
        self.account: Buffer = ctx.account(node, self.name)
        #: The booking of the state the stage holds now.
        self.booked = NO_RESERVATION
        #: The state's type while it is a scalar booked already (see _book_state).
        self.scalar_type: type | None = None

    def _step(self, element: Any, index: int) -> Any:
        try:
            self.state, output = scan_step(self.node.scan_func, self.state, element, self.name)
        except Exception as error:
            raise note_element_error(error, self.name, index)  # noqa: B904
        if type(self.state) is not self.scalar_type:
            self._book_state()
        return output

    def _book_state(self) -> None:
        """Book the state as it is now, in place of the last one.

        A state's size is known only once the call made it. So a state past what
        the budget can give is refused right after that call, naming its size.
        """
        state = self.state
        # A scalar keeps its size: booked once, not sized again while its type stays.
        self.scalar_type = type(state) if isinstance(state, _SCALAR_TYPES) else None
        nbytes = self.ctx.sizeof(state)
        if nbytes == self.booked.nbytes:
            return
        self.booked.release()
        self.booked = self.account.admit(nbytes, together="its carried state", elements=0)

    def pull(self) -> tuple[Any, Reservation]:
        element, reservation = self.input.pull()
        reservation.release()
        return self._step(element, self.input.consumed - 1), NO_RESERVATION

    def get_state(self) -> dict[str, Any]:
        return self.input.as_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = self.node.initial_state
        self.booked.release()
        self.scalar_type = None

        def feed(element: Any, reservation: Reservation) -> None:
            reservation.release()
            self._step(element, self.input.consumed - 1)

        self.input.restore(StateReader(state, self.stage), feed)

    def close(self) -> None:
        self.booked.release()
        super().close()
