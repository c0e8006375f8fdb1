"""``group_by_window(key_func, reduce_func, window_size=...)``: tf.data's grouping, in its order.

Each element goes to the group of ``key_func(element)`` (an integer scalar).
When a group holds ``window_size`` elements (``window_size_func(key)``, asked
once per key), ``reduce_func(key, window)`` — ``window`` a dataset of the
group's elements — gives a dataset whose elements are emitted, before any
more input is read. At the end of the input the groups left are reduced in
ascending key order, as tf.data does. ``bucket_by_sequence_length`` is built on it.

Memory: the open groups are the stage's buffer, every element booked on its
share of the budget until its group's output is used up (a group that cannot
fit raises :class:`~headrace._errors.MemoryBudgetError` naming the stage); the
reduced dataset runs inside that share. State: the input's start plus counts,
replayed on restore (groups are data, and states never hold data); the replay
runs each reduced dataset it passes too, so that a tight budget is split as it
was in the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, note_element_error
from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._memory.nested import NestedParts
from headrace._structure import integer_scalar
from headrace._transforms._replay import ReplayedInput
from headrace._transforms.map import apply_fn
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import UNKNOWN, Node, ShardRole, Traits, check_positive, first_output
from headrace.core.state import StateReader

__all__ = ["GroupByWindowNode"]

#: A restore replays a group's reduced pipeline past its errors, but not past this many
#: in a row (one that raises at every pull would never end).
_REPLAY_FAILURES = 64


def _node_of(dataset: Any, where: str) -> Node:
    node = getattr(dataset, "_node", None)  # the Dataset facade sits above this layer
    if not isinstance(node, Node):
        raise InvalidArgumentError(f"{where} must return a Dataset, got {type(dataset).__name__}")
    return node


class GroupByWindowNode(Node):
    stage = "group_by_window"
    budget_weight = 2.0

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # windows are filled in stream order

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # a window's elements depend on the others

    def traits(self) -> Traits:
        return Traits()

    def __init__(
        self,
        source: Node,
        key_func: Callable[..., Any],
        reduce_func: Callable[[Any, Any], Any],
        window_size: int | None,
        window_size_func: Callable[[Any], Any] | None,
        make_dataset: Callable[[list[Any]], Any],
    ) -> None:
        super().__init__(source)
        for name, fn in (("key_func", key_func), ("reduce_func", reduce_func)):
            if not callable(fn):
                raise InvalidArgumentError(f"group_by_window: {name} must be callable, got {fn!r}")
        if (window_size is None) == (window_size_func is None):
            raise InvalidArgumentError(
                "group_by_window: pass exactly one of window_size and window_size_func"
            )
        if window_size is not None:
            window_size = check_positive("group_by_window: window_size", window_size)
        self.key_func, self.reduce_func = key_func, reduce_func
        self.window_size, self.window_size_func = window_size, window_size_func
        self.make_dataset = make_dataset
        self._spec: Any = None

    def params(self) -> tuple[Any, ...]:
        return (
            function_fingerprint(self.key_func),
            function_fingerprint(self.reduce_func),
            self.window_size,
            None if self.window_size_func is None else function_fingerprint(self.window_size_func),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_spec"] = None
        return state

    @property
    def element_spec(self) -> Any:
        if self._spec is None:  # the reduced dataset's spec, from the first element's group
            def reduced(element: Any, index: int) -> Any:
                return self.reduce_func(self.key_of(element, index), self.make_dataset([element]))

            result = first_output(self.inputs[0], self.stage, reduced)
            self._spec = _node_of(result, "group_by_window: reduce_func").element_spec
        return self._spec

    def cardinality(self) -> int:
        return 0 if self.inputs[0].cardinality() == 0 else UNKNOWN

    def key_of(self, element: Any, index: int) -> Any:
        try:
            key = apply_fn(self.key_func, element)
        except Exception as error:
            name = f"group_by_window({function_name(self.key_func)})"
            raise note_element_error(error, name, index)  # noqa: B904
        what = f"group_by_window: what key_func {function_name(self.key_func)} returns"
        return np.int64(integer_scalar(key, what))

    def size_of(self, key: np.int64) -> int:
        if self.window_size is not None:
            return self.window_size
        assert self.window_size_func is not None
        size = self.window_size_func(key)
        if isinstance(size, np.ndarray) and size.shape == ():
            size = size[()]
        return check_positive(
            f"group_by_window: window_size_func({int(key)})", size
        )

    def make_iterator(self, ctx: Context) -> Iterator:
        return _GroupIterator(self, self.inputs[0].make_iterator(ctx), ctx)


class _Group:
    __slots__ = ("booking", "elements", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.elements: list[Any] = []
        self.booking: Reservation = NO_RESERVATION


class _GroupIterator(Iterator):
    stage = "group_by_window"

    def __init__(self, node: GroupByWindowNode, inner: Iterator, ctx: Context) -> None:
        super().__init__(inner)
        self.node, self.ctx = node, ctx
        self.account = ctx.account(node)
        self.input = ReplayedInput(inner)
        self.groups: dict[int, _Group] = {}
        self.sizes: dict[int, int] = {}  # window_size_func is asked once per key
        self.input_done = False
        self.flush_order: list[int] = []
        self.flushed = 0
        self.output: Iterator | None = None
        self.output_booking: Reservation = NO_RESERVATION
        self.emitted = 0

    # -- groups ----------------------------------------------------------------------
    def _add(self, element: Any, reservation: Reservation) -> int | None:
        """File ``element`` in its group; the key of a group it completes."""
        key = int(self.node.key_of(element, self.input.consumed - 1))
        group = self.groups.get(key)
        if group is None:
            size = self.sizes.get(key)
            if size is None:
                size = self.sizes[key] = self.node.size_of(np.int64(key))
            group = self.groups[key] = _Group(size)
        element, cost = self.ctx.admit(element)
        group.booking = group.booking.absorb(
            self.account.admit(cost, reservation, together="the open groups"))
        group.elements.append(element)
        return key if len(group.elements) >= group.size else None

    def _start_output(self, key: int, skip: int = 0) -> None:
        group = self.groups.pop(key)
        try:
            window = self.node.make_dataset(group.elements)
            result = self.node.reduce_func(np.int64(key), window)
            node = _node_of(result, f"group_by_window: {function_name(self.node.reduce_func)}")
        except BaseException:  # its error stands for the group: its elements go (they
            group.booking.release()  # stayed booked, and every such group added to it)
            raise
        # Half the share, widened (the share split again) where the reduced pipeline
        # must hold more at once: refused at the half, it was refused far below the
        # budget while another stage's share stood unused.
        budget = NestedParts(self.account, 2, "reduce_func", "halves of the share").open().budget
        output = node.make_iterator(self.ctx.with_budget(budget))
        budget.allot()
        self.output, self.output_booking, self.emitted = output, group.booking, 0
        for _ in range(skip):
            _, reservation = output.pull()
            reservation.release()
            self.emitted += 1

    def _replay_output(self, key: int) -> None:
        """Run a group's reduced pipeline to its end and drop what it gives, as the run
        that took the state ran it: under a tight budget that pipeline widens its part of
        the share (:class:`~headrace._memory.nested.NestedParts`) and the stages beside
        it fill to what is left, so a shuffle upstream draws from as many elements in
        the replay as it did in the run (discarded unread, it drew from more, and the
        restored stream went another way). Its errors were raised in the run: passed."""
        try:
            self._start_output(key)
        except Exception:  # reduce_func raised: the run raised it in the group's place
            return
        output = self.output
        assert output is not None
        failed = 0  # in a row: a pipeline that raises at every pull is left after 64
        try:
            while failed < _REPLAY_FAILURES:
                try:
                    _, reservation = output.pull()
                except StopIteration:
                    break
                except Exception:
                    failed += 1
                    continue
                failed = 0
                reservation.release()
        finally:
            self._end_output()

    def _discard(self, key: int) -> None:
        self.groups.pop(key).booking.release()

    def _end_output(self) -> None:
        if self.output is not None:
            self.output.close()
            self.output = None
        self.output_booking.release()
        self.output_booking = NO_RESERVATION

    # -- iteration -------------------------------------------------------------------
    def pull(self) -> tuple[Any, Reservation]:
        while True:
            if self.output is not None:
                try:
                    pair = self.output.pull()
                except StopIteration:
                    self._end_output()
                else:
                    self.emitted += 1
                    return pair
            if not self.input_done:
                try:
                    element, reservation = self.input.pull()
                except StopIteration:
                    self.input_done = True
                    self.flush_order = sorted(self.groups)
                    continue
                key = self._add(element, reservation)
                if key is not None:
                    self._start_output(key)
                continue
            if self.flushed >= len(self.flush_order):
                raise StopIteration
            key = self.flush_order[self.flushed]
            self.flushed += 1
            self._start_output(key)

    def get_state(self) -> dict[str, Any]:
        return {
            **self.input.as_dict(),
            "input_done": self.input_done,
            "flushed": self.flushed,
            "current": self.output is not None,
            "emitted": self.emitted,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        input_done, current = reader.flag("input_done"), reader.flag("current")
        flushed, emitted = reader.integer("flushed"), reader.integer("emitted")
        self._reset()
        consumed = reader.integer("consumed")
        last_completed: list[int] = []

        def feed(element: Any, reservation: Reservation) -> None:
            key = self._add(element, reservation)
            if key is None:
                return
            if self.input.consumed == consumed and current and not input_done:
                last_completed.append(key)  # its output was being read at the checkpoint
            else:
                self._replay_output(key)  # its output was used up before the checkpoint

        self.input.restore(reader, feed)
        if last_completed:
            self._start_output(last_completed[0], emitted)
        if input_done:
            self.input_done = True
            self.flush_order = sorted(self.groups)
            if flushed > len(self.flush_order):
                raise reader.error("flushed", f"= {flushed}, but only {len(self.flush_order)} "
                                   "groups were left at the end of the input")
            for key in self.flush_order[: max(flushed - 1, 0)]:
                self._discard(key)
            self.flushed = flushed
            if flushed:
                last = self.flush_order[flushed - 1]
                if current:
                    self._start_output(last, emitted)
                else:
                    self._discard(last)

    def _reset(self) -> None:
        self._end_output()
        for group in self.groups.values():
            group.booking.release()
        self.groups.clear()
        self.input_done, self.flush_order, self.flushed, self.emitted = False, [], 0, 0

    def close(self) -> None:
        self._reset()
        super().close()
