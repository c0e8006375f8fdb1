"""The interleave's cycle over its slots: tf.data's order, its state, its slots.

This is the logic every run mode shares. A run mode (sequential and threads in
:mod:`headrace._transforms._interleave_threads`, worker processes in
:mod:`headrace._transforms.process_interleave`) says only how a slot is opened
and how its elements are read.

The order is tf.data's sequential one (``interleave_dataset_op.cc``). Slots fill
lazily in visit order. An exhausted inner pipeline is noticed on a visit, which
then moves on; its slot is refilled only when the cycle comes back. An empty
inner dataset costs a visit.

Each slot's budget is one part of the stage's share (see
:mod:`headrace._memory.nested`). So a cycle of many inner pipelines cannot hold
more than the stage's share, and nothing of an inner pipeline outlives its slot.

Slots opened ahead. A run mode that reads slots on other threads or processes
opens the next input element's slot *before its turn* once a slot has read its
last element (:meth:`CycleIterator.open_ahead`), as tf.data's parallel
interleave prefetches input elements. Otherwise every file boundary stalls the
cycle while the new file's first records are read, and with same-sized shards
all ``cycle_length`` boundaries come at once. At most ``cycle_length`` slots
wait ahead. They enter the cycle in input order, exactly where the sequential
interleave opens them, so the order does not change. Until then the state names
the input from before them (a restore reopens them), an error opening one is
raised in its turn, and their parts of the share come out of the stage's share
like any slot's: reading ahead never holds more than the stage's share.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from headrace._errors import CheckpointError, Origin, note_element_error
from headrace._memory.buffer import Buffer, Reservation
from headrace._memory.nested import NestedPart, NestedParts
from headrace.core.fingerprint import function_name
from headrace.core.handoff import unpin
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.state import INNER, StateReader

if TYPE_CHECKING:
    from headrace._transforms.interleave import InterleaveNode

__all__ = ["Ahead", "CycleIterator", "Slot", "SlotNotBuilt"]


class SlotNotBuilt(Exception):
    """A slot's inner dataset could not be built, found on its first pull: the run
    mode builds it elsewhere (a worker process builds it on the slot's first request).

    The cycle treats it as the sequential interleave treats a failed open: the slot
    is closed, the cycle stays where it is (the next input element takes the same
    place), and ``error`` is raised, noted with the input element's ``index``. Treated
    as an error of the slot's first element instead, the failed slot took a visit of
    the cycle and the order from there on was another one.
    """

    def __init__(self, error: Exception, index: int) -> None:
        super().__init__(error, index)
        self.error, self.index = error, index


class Slot:
    """One open inner pipeline: its iterator, its budget, where its input element was.

    ``part`` is the slot's part of the stage's share (its budget, and the arrays
    the interleave function made for it). ``queue`` is the buffer its elements
    wait in before the cycle takes them (a read-ahead's queue, a worker's
    chunks), or None. Closing the slot returns all of it.
    """

    __slots__ = ("ahead_asked", "ctx", "input_before", "iterator", "part", "probe", "queue")

    def __init__(
        self,
        iterator: Iterator,
        part: NestedPart,
        input_before: dict[str, Any],
        ctx: Context,
        queue: Buffer | None,
    ) -> None:
        self.iterator, self.part, self.input_before = iterator, part, input_before
        self.ctx, self.queue = ctx, queue
        #: ``origin_probe`` of the inner pipeline (of its read-ahead, where a thread reads
        #: it: that one hands out each element's token), once a stage above asks for origins.
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None
        self.ahead_asked = False  # the slot has read its last element: the next one was opened

    def close(self) -> None:
        self.part.close(then=self.iterator.close)


class Ahead:
    """An input element's slot opened before its turn, or the error opening it raised
    (raised in its turn, as the sequential interleave would)."""

    __slots__ = ("before", "error", "index", "pulled", "slot")

    def __init__(
        self,
        slot: Slot | None,
        before: dict[str, Any],
        index: int,
        error: BaseException | None,
        *,
        pulled: bool = True,
    ) -> None:
        self.slot, self.before, self.index, self.error = slot, before, index, error
        self.pulled = pulled  # False: the input itself raised (no element was taken)


class CycleIterator(Iterator):
    """The cycle over ``cycle_length`` slots, in tf.data's order, with its state.

    A run mode implements :meth:`_open_slot`. It may set ``pull_from`` to read
    a slot's element another way (AUTOTUNE's timing of its pulls).
    """

    stage = "interleave"
    #: Whether slots may read ahead on threads (a state may then say they do).
    may_thread = False

    def __init__(
        self, node: InterleaveNode, inner: Iterator, ctx: Context, account: Buffer
    ) -> None:
        super().__init__(inner)
        self.node, self.input, self.ctx, self.account = node, inner, ctx, account
        self.parts = NestedParts(account, node.cycle_length, function_name(node.map_func))
        #: How the cycle reads a slot's next element; None: ``slot.iterator.pull()``.
        self.pull_from: Callable[[Slot], tuple[Any, Reservation]] | None = None
        self.tracking = self.origin_tokens = False  # a stage above asks for origins
        self._reset()

    @property
    def threaded(self) -> bool:
        """Whether slots read ahead on threads now (kept in the state)."""
        return False

    def _reset(self) -> None:
        self.slots: list[Slot | None] = [None] * self.node.cycle_length
        self.last_slot: Slot | None = None  # the slot of the element returned last
        self.cycle_index = 0
        self.block_index = 0
        self.end_of_input = False
        self.num_open = 0
        self.input_index = 0  # of the next input element (named in error notes)
        self.ahead: deque[Ahead] = deque()  # slots opened before their turn, in input order
        self.input_done = False  # the input ended while opening ahead (not yet in turn)

    # -- slots -------------------------------------------------------------------------
    def _open_slot(self, element: Any, input_before: dict[str, Any], *, start: bool) -> Slot:
        """The slot of one input element; ``start``: it may begin reading now."""
        raise NotImplementedError

    def _pull_input(self, *, start: bool = True) -> Slot | None:
        """The next input element's slot (opened ahead, or now); None: the input ended."""
        if self.ahead:
            entry = self.ahead.popleft()
            if entry.pulled:  # the input element was taken (its slot, or its open failed)
                self.input_index += 1
            if entry.error is not None:
                raise entry.error
            return entry.slot
        if self.input_done:
            self.end_of_input = True
            return None
        before = self.input.get_state()
        try:
            element = next(self.input)
        except StopIteration:
            self.end_of_input = True
            return None
        index = self.input_index
        self.input_index = index + 1
        try:
            return self._open_slot(element, before, start=start)
        except Exception as error:  # the input element is dropped; the next call goes on
            raise note_element_error(error, self._stage_name(), index)  # noqa: B904

    def open_ahead(self) -> None:
        """Open the next input element's slot now, before its turn (a slot has read its
        last element; see the module text). Runs on the cycle's thread."""
        if (
            self.input_done or self.end_of_input
            or len(self.ahead) >= self.node.cycle_length
            or any(entry.error is not None for entry in self.ahead)
        ):
            return
        before = self.input.get_state()
        index = self.input_index + len(self.ahead)
        try:
            element = next(self.input)
        except StopIteration:
            self.input_done = True
            return
        except Exception as error:  # the input's own error: raised in its turn
            self.ahead.append(Ahead(None, before, index, unpin(error), pulled=False))
            return
        try:
            slot = self._open_ahead_slot(element, before, index)
        except Exception as error:
            error = unpin(note_element_error(error, self._stage_name(), index))
            self.ahead.append(Ahead(None, before, index, error))
            return
        self.ahead.append(Ahead(slot, before, index, None))

    def _open_ahead_slot(self, element: Any, before: dict[str, Any], index: int) -> Slot:
        """The slot of an input element opened ahead of its turn, reading already."""
        return self._open_slot(element, before, start=True)

    def _stage_name(self) -> str:
        return f"interleave({function_name(self.node.map_func)})"

    def _advance(self) -> None:
        self.block_index = 0
        self.cycle_index = (self.cycle_index + 1) % self.node.cycle_length

    def _close_slot(self, index: int) -> None:
        slot = self.slots[index]
        if slot is not None:
            slot.close()
            self.slots[index] = None
            self.num_open -= 1
            if slot is self.last_slot:  # (its budget's widen refers back to the stage:
                self.last_slot = None  # kept, the pair would wait for the cyclic collector)

    def _close_all(self) -> None:
        try:
            for index in range(len(self.slots)):
                self._close_slot(index)
        finally:
            while self.ahead:
                slot = self.ahead.popleft().slot
                if slot is not None:
                    slot.close()

    # -- the order -----------------------------------------------------------------------
    def pull(self) -> tuple[Any, Reservation]:
        while not self.end_of_input or self.num_open > 0:
            slot = self.slots[self.cycle_index]
            if slot is not None:
                pull_from = self.pull_from
                try:
                    pair = slot.iterator.pull() if pull_from is None else pull_from(slot)
                except StopIteration:
                    self._close_slot(self.cycle_index)
                    self._advance()
                    continue
                except SlotNotBuilt as failed:  # as if its open had failed: no visit taken
                    not_built: SlotNotBuilt | None = failed
                else:
                    not_built = None
                if not_built is not None:  # (raised outside the handler: no context kept)
                    self._close_slot(self.cycle_index)
                    error = note_element_error(not_built.error, self._stage_name(), not_built.index)
                    raise error
                self.last_slot = slot
                self.block_index += 1
                if self.block_index == self.node.block_length:
                    self._advance()
                return pair
            if not self.end_of_input:
                opened = self._pull_input()
                if opened is not None:
                    self.slots[self.cycle_index] = opened
                    self.num_open += 1
                continue
            self._advance()
        raise StopIteration

    # -- origins ---------------------------------------------------------------------------
    def origin(self) -> Origin | None:
        """The origin of the last element, asked of its slot's pipeline (of its
        read-ahead, where a thread reads the slot: it keeps each element's token)."""
        slot = self.last_slot
        return None if slot is None else slot.iterator.origin()

    def origin_token(self) -> Any:
        slot = self.last_slot
        probe = None if slot is None else slot.probe
        return None if probe is None else (probe[1], probe[0]())

    def origin_of(self, token: Any) -> Origin | None:
        return None if token is None else token[0](token[1])  # type: ignore[no-any-return]

    def track_origins(self, tokens: bool = True) -> bool:
        self.tracking, self.origin_tokens = True, self.origin_tokens or tokens
        for slot in self.slots:
            if slot is not None:
                slot.probe = origin_probe(slot.iterator, self.origin_tokens)
        return True

    # -- state -----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        ahead = self.ahead[0] if self.ahead else None
        return {
            "threaded": self.threaded,  # slots' states are read-ahead states then
            # slots opened ahead are not in the cycle yet: a restore reads the input
            # from before them and opens them again
            "input": self.input.get_state() if ahead is None else ahead.before,
            "cycle_index": self.cycle_index,
            "block_index": self.block_index,
            "end_of_input": self.end_of_input,
            "input_index": self.input_index if ahead is None else ahead.index,
            "slots": [
                None
                if slot is None
                else {"input_before": slot.input_before, INNER: slot.iterator.get_state()}
                for slot in self.slots
            ],
        }

    def _read_state(self, state: dict[str, Any]) -> tuple[StateReader, list[Any], bool]:
        """Check every field before anything is closed: the reader, the slots, threaded."""
        node, reader = self.node, StateReader(state, "interleave")
        # States without the key come from before AUTOTUNE could stay sequential: slots
        # read ahead whenever num_parallel_calls was set.
        threaded = reader.flag("threaded") if "threaded" in state else self.may_thread
        if threaded and not self.may_thread:
            raise reader.error("threaded", "is true, but this interleave has no num_parallel_calls")
        reader.child("input")
        reader.integer("cycle_index", high=node.cycle_length - 1, why="cycle_length")
        reader.integer("block_index", high=node.block_length - 1, why="block_length")
        reader.flag("end_of_input")
        slots = reader.entries("slots", node.cycle_length)
        for index, saved in enumerate(slots):
            if saved is not None:
                slot = StateReader(saved, f"interleave slot {index}")
                slot.child("input_before")
                slot.child(INNER)
        return reader, slots, threaded

    def _restore_mode(self, saved_threaded: bool) -> None:
        """Before slots are restored: run in the mode the state was saved in."""

    def _slot_state(self, saved: dict[str, Any], saved_threaded: bool) -> dict[str, Any]:
        """A slot's saved inner state, as this iterator's slot reads it."""
        return saved

    def _resume_slot(self, slot: Slot) -> None:
        """A restored slot may begin reading now."""

    def set_state(self, state: dict[str, Any]) -> None:
        reader, saved_slots, saved_threaded = self._read_state(state)
        self._close_all()
        self._reset()
        self._restore_mode(saved_threaded)
        for index, saved in enumerate(saved_slots):
            if saved is None:
                continue
            self.input.set_state(saved["input_before"])
            slot = self._pull_input(start=False)
            if slot is None:
                raise CheckpointError(
                    f"interleave: state field 'slots' [{index}] names an input element past "
                    "the end of the input; the state belongs to other data"
                )
            try:
                slot.iterator.set_state(self._slot_state(saved[INNER], saved_threaded))
            except BaseException:
                slot.close()
                raise
            self._resume_slot(slot)
            self.slots[index] = slot
            self.num_open += 1
        self.input.set_state(reader.child("input"))
        self.cycle_index = reader.integer("cycle_index")
        self.block_index = reader.integer("block_index")
        self.end_of_input = reader.flag("end_of_input")
        self.input_index = reader.integer("input_index") if "input_index" in state else 0

    def close(self) -> None:
        try:
            self._close_all()
        finally:
            super().close()
