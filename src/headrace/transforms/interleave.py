"""``interleave`` and ``flat_map``, in tf.data's exact order.

The sequential algorithm is tf.data's (``interleave_dataset_op.cc``): slots
fill lazily in visit order; an exhausted input is noticed on a visit, which
then moves on, and the slot is refilled only when the cycle comes back; an
empty inner dataset costs a visit. With ``num_parallel_calls`` and
``deterministic=True`` (the default) every slot reads ahead on its own thread,
but elements are handed out in exactly that sequential order; with
``deterministic=False`` the first slot with an element ready wins.

Threads. In CPython, reading ahead on threads pays only when the inner
pipelines wait on I/O or run code that releases the GIL (network reads, a slow
disk, NumPy, decoders). headrace's TFRecord and text readers reading from the
page cache are GIL-bound: for them the sequential interleave is the faster one
(about 2x tf.data's parallel interleave on 1,000 small files here, against half
of it with threads — see benchmarks/results/tfrecord.md). So
``num_parallel_calls=AUTOTUNE`` starts sequential and watches its pulls
(see ``WaitWatch``): once they spend most of their time waiting — not on this
thread's CPU, and not for the GIL — every slot starts reading ahead on its own
thread (up to ``cycle_length`` at once: waiting costs no core). The switch is one-way, is
kept in checkpoints, and changes no order, only timing. A number
``num_parallel_calls=k`` always uses threads, k running at once.

Memory. The stage's share of the budget is split among the ``cycle_length``
slots; each inner pipeline runs inside its slot's part (its own prefetches,
shuffles and read-ahead queues included), so a cycle of 1,000 inner pipelines
cannot hold more than the stage's share. Arrays the function makes (an inner
``from_tensor_slices`` over a new array) are booked for as long as their slot
lives, and the slot's budget is what is left of its part. Nothing of an inner
pipeline (its iterators, accounts, arrays) outlives its slot, so memory does not
grow with the number of inner datasets or epochs. Files opened by inner datasets
go through the process-wide file pool, so the descriptor cap holds too.

Errors. An error from an inner pipeline is raised at its element's place in
the order; like tf.data's sequential interleave, it does not count as an
element of the block (tf.data's *parallel* interleave counts it, so there the
next element may come from the next slot): headrace keeps one order for both,
so that AUTOTUNE's switch to threads changes no order around errors either. The
next call continues with the same slot. An error from the input or from
``map_func`` drops that input element; the next call pulls the next one.

Origins. Once a stage above asks for them (a map), each element's origin is its
slot's: asked of the inner pipeline where slots are read in turn, and of the
slot's read-ahead where a thread reads it (that one takes the inner pipeline's
token right after each pull and hands it out with the element), so a failing
element names its file and record in either mode, across AUTOTUNE's switch, and in
any order (``deterministic=False``). Slots in worker processes name none yet.

Resuming. The state keeps, per open slot, the input's state just before that
slot's input element, plus the inner iterator's state: restoring re-reads the
input element (a filename, typically) and resumes the inner iterator.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.handoff import unpin
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    ShardRole,
    check_positive,
    probe_elements,
)
from headrace.core.state import INNER, StateReader, mark_out_of_order
from headrace.errors import (
    CheckpointError,
    EmptyInputError,
    HeadraceWarning,
    InvalidArgumentError,
    MemoryBudgetError,
    Origin,
    note_element_error,
)
from headrace.memory.budget import NO_RESERVATION, MemoryBudget, Reservation, StageAccount
from headrace.memory.units import format_bytes
from headrace.options import AUTOTUNE
from headrace.structure import TensorSpec, flatten, map_structure
from headrace.transforms._wait_watch import WaitWatch
from headrace.transforms.map import apply_fn
from headrace.transforms.prefetch import PrefetchIterator

__all__ = ["InterleaveNode"]

#: Elements a slot reads ahead (tf.data: 2 * block_length + 1), bounded by the slot's
#: part of the budget; more per hand-off keeps thread switches off the per-element path.
_SLOT_DEPTH = 64


def _machine_cycle_length(num_parallel_calls: int | None) -> int:
    """tf.data's default cycle_length, which depends on the machine's CPU count."""
    cpus = os.cpu_count() or 1
    if num_parallel_calls is None:
        return cpus
    if num_parallel_calls == AUTOTUNE:
        return -(-cpus // 3)
    return min(num_parallel_calls, cpus)


class InterleaveNode(Node):
    stage = "interleave"
    budget_weight = 2

    def __init__(
        self,
        source: Node,
        map_func: Callable[..., Any],
        cycle_length: int | None,
        block_length: int | None,
        num_parallel_calls: int | None,
        deterministic: bool | None,
        workers: str = "threads",
    ) -> None:
        super().__init__(source)
        if not callable(map_func):
            raise InvalidArgumentError(f"interleave: map_func must be callable, got {map_func!r}")
        if workers != "threads":  # (imported here: multiprocessing costs import time)
            from headrace.workers.processes import check_workers

            if workers == "auto":
                raise InvalidArgumentError(
                    "interleave: workers must be 'threads' or 'processes' (an interleave "
                    "cannot measure its inner pipelines before it opens them), got 'auto'"
                )
            check_workers(workers, num_parallel_calls, map_func, "interleave")
        self.workers = workers
        if num_parallel_calls is not None and num_parallel_calls != AUTOTUNE:
            check_positive("interleave: num_parallel_calls", num_parallel_calls)
        if deterministic is not None and num_parallel_calls is None:
            warnings.warn(
                "interleave: `deterministic` has no effect without `num_parallel_calls` "
                "(a sequential interleave always keeps its order); drop it or pass "
                "num_parallel_calls",
                HeadraceWarning,
                stacklevel=3,
            )
        if cycle_length == AUTOTUNE:  # asked for explicitly: the user chose the machine's
            cycle_length = _machine_cycle_length(num_parallel_calls)
        elif cycle_length is None:
            cycle_length = _machine_cycle_length(num_parallel_calls)
            warnings.warn(
                f"interleave: cycle_length defaults to {cycle_length} on this machine (it "
                "depends on the CPU count, as in tf.data), so the order differs between "
                "machines; pass cycle_length explicitly for a reproducible order",
                HeadraceWarning,
                stacklevel=3,
            )
        self.cycle_length = check_positive("interleave: cycle_length", cycle_length)
        self.block_length = check_positive(
            "interleave: block_length", 1 if block_length is None else block_length
        )
        if (
            num_parallel_calls is not None
            and num_parallel_calls != AUTOTUNE
            and num_parallel_calls > self.cycle_length
        ):
            raise InvalidArgumentError(
                f"interleave: num_parallel_calls ({num_parallel_calls}) must be <= "
                f"cycle_length ({self.cycle_length})"
            )
        self.map_func = map_func
        self.num_parallel_calls = num_parallel_calls
        self.deterministic = deterministic
        self._spec: Any = None  # learnt from the first input element, when asked for

    def shard_role(self) -> ShardRole:
        # each input element's inner dataset is read whole, wherever the element sits
        return ShardRole.BY_CONTENT

    def params(self) -> tuple[Any, ...]:
        return (
            function_fingerprint(self.map_func),
            self.cycle_length,
            self.block_length,
            self.num_parallel_calls,
            self.deterministic,
            # a slot's state differs in a worker (a chunk's start and a count): no
            # checkpoint moves between the two
            *(("processes",) if self.workers == "processes" else ()),
        )

    @property
    def element_spec(self) -> Any:
        """The spec of the dataset ``map_func`` makes of the first input element whose
        dataset's spec can be known. An inner dataset that learns its spec from its own
        first element (a ``map`` without ``output_signature``) and is empty is passed
        over for the next one: tf.data traces ``map_func`` and never sees that it is
        empty, so a first empty inner dataset must not stop the pipeline."""
        if self._spec is None:
            empty = 0
            with probe_elements(self.inputs[0], "interleave") as elements:
                for element in elements:
                    try:
                        spec = self.inner_node(element).element_spec
                    except EmptyInputError:
                        empty += 1
                        continue
                    self._spec = _open_sizes_stay_open(
                        spec, element, self.inputs[0].element_spec
                    )
                    break
            if self._spec is None:
                if not empty:
                    raise EmptyInputError(
                        "interleave: its element_spec is that of the dataset map_func makes "
                        "of an input element, but the input is empty"
                    )
                raise EmptyInputError(
                    f"interleave: its element_spec is that of the datasets map_func makes, "
                    f"but all {empty} it made of the input's elements are empty and know "
                    "their spec only from an element"
                )
        return self._spec

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_spec"] = None
        return state

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if inner == 0:
            return 0
        # tf.data's rule: a parallel interleave of an infinite input is infinite; a
        # sequential one (and any other) is unknown
        if inner == INFINITE and self.num_parallel_calls is not None:
            return INFINITE
        return UNKNOWN

    def inner_node(self, element: Any) -> Node:
        result = apply_fn(self.map_func, element)
        # A Dataset is the facade over its recipe node; the facade sits above this layer.
        node = getattr(result, "_node", None)
        if not isinstance(node, Node):
            raise InvalidArgumentError(
                f"interleave: {function_name(self.map_func)} must return a Dataset, "
                f"got {type(result).__name__}"
            )
        return node

    def make_iterator(self, ctx: Context) -> Iterator:
        deterministic = ctx.deterministic if self.deterministic is None else self.deterministic
        account = ctx.account(self)
        kind = _ProcessInterleaveIterator if self.workers == "processes" else _InterleaveIterator
        return kind(self, self.inputs[0].make_iterator(ctx), ctx, account, deterministic)


def _open_sizes_stay_open(spec: Any, first: Any, input_spec: Any) -> Any:
    """The inner dataset's spec of the first input element, with None where a size came
    from that element: tf.data traces ``map_func`` over the input's spec, so
    ``from_tensors`` of a (None, None, 3) image is (None, None, 3), not the first
    image's (74, 74, 3) (fixed, it made ``padded_batch`` pad later images to it). A
    size is taken to come from the element where the element has it, at that position
    in a leaf of that rank, and the input's spec leaves it open (None); declared and
    constant sizes stay.
    """
    opened: set[tuple[int, int, int]] = set()
    for leaf_spec, leaf in zip(flatten(input_spec), flatten(first), strict=False):
        shape = getattr(leaf, "shape", None)
        if not isinstance(leaf_spec, TensorSpec) or leaf_spec.shape is None or shape is None:
            continue
        if len(shape) != len(leaf_spec.shape):
            continue
        for position, (declared, size) in enumerate(zip(leaf_spec.shape, shape, strict=True)):
            if declared is None:
                opened.add((len(shape), position, int(size)))
    if not opened:
        return spec

    def reopen(leaf: TensorSpec) -> TensorSpec:
        if leaf.shape is None:
            return leaf
        rank = len(leaf.shape)
        dims = tuple(None if (rank, i, size) in opened else size
                     for i, size in enumerate(leaf.shape))
        return TensorSpec(dims, leaf.dtype, leaf.kind)

    return map_structure(reopen, spec)


class _Slot:
    """One open inner pipeline: its iterator, its budget, where its input element was.

    ``queue`` is the account of the read-ahead queue (registered whenever threads may
    be used, so the budget's split never depends on timing); ``ctx`` the inner context;
    ``owned`` books the arrays the inner recipe holds (made by the interleave function).
    Closing the slot returns all of it: nothing of an inner pipeline outlives its slot.
    """

    def __init__(
        self,
        iterator: Iterator,
        budget: MemoryBudget,
        input_before: dict[str, Any],
        ctx: Context,
        queue: StageAccount | None,
        owned: Reservation,
    ) -> None:
        self.iterator, self.budget, self.input_before = iterator, budget, input_before
        self.ctx, self.queue, self.owned = ctx, queue, owned
        #: ``origin_probe`` of the inner pipeline (of its read-ahead, where a thread reads
        #: it: that one hands out each element's token), once a stage above asks for origins.
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None

    def close(self) -> None:
        self.budget.close()
        try:
            self.iterator.close()
        finally:
            self.owned.release()


class _InterleaveIterator(Iterator):
    stage = "interleave"

    def __init__(
        self,
        node: InterleaveNode,
        inner: Iterator,
        ctx: Context,
        account: StageAccount,
        deterministic: bool,
    ) -> None:
        super().__init__(inner)
        self.node, self.input, self.ctx, self.account = node, inner, ctx, account
        self.processes: Any = None  # the worker pool of workers="processes", once started
        remote = node.workers == "processes"
        self.deterministic = deterministic or remote  # processes keep the order always
        parallel = None if remote else node.num_parallel_calls
        self.may_thread = parallel is not None
        # AUTOTUNE starts sequential and watches for waiting (see the module docstring).
        self.watch = WaitWatch() if parallel == AUTOTUNE else None
        self.gate: threading.Semaphore | None = None
        if parallel is not None and parallel != AUTOTUNE:
            self.gate = threading.Semaphore(parallel)
        # Only "first ready wins" needs one condition for all slots (the consumer waits
        # for any of them); in order, each slot's own condition avoids waking them all.
        self.ready = threading.Condition() if self.may_thread and not deterministic else None
        self.handed = 0  # elements handed out, where the order may be the first ready's
        if self.ready is not None:
            ctx.run.out_of_order.add(self)
        self.tracking = self.origin_tokens = False  # a stage above asks for origins
        self._reset()

    @property
    def threaded(self) -> bool:
        """Whether slots read ahead on threads (now; AUTOTUNE may switch them on)."""
        return self.gate is not None

    def _start_threads(self) -> None:
        """AUTOTUNE's switch: from now on every slot, open or not, reads ahead. The mode
        (``threaded``) changes only once every open slot is wrapped, so a failure on the
        way leaves a consistent sequential iterator."""
        gate = threading.Semaphore(self.node.cycle_length)
        for slot in self.slots:
            if slot is not None and not isinstance(slot.iterator, PrefetchIterator):
                slot.iterator = self._read_ahead(slot.iterator, slot.ctx, slot.queue, gate)
                if self.tracking:  # its source now runs ahead: the read-ahead keeps tokens
                    slot.probe = origin_probe(slot.iterator, self.origin_tokens)
        self.watch = None
        self.gate = gate

    def _reset(self) -> None:
        self.slots: list[_Slot | None] = [None] * self.node.cycle_length
        self.last_slot: _Slot | None = None  # the slot of the element returned last
        self.cycle_index = 0
        self.block_index = 0
        self.end_of_input = False
        self.num_open = 0
        self.input_index = 0  # of the next input element (named in error notes)

    # -- slots -------------------------------------------------------------------------
    def _open_slot(self, element: Any, input_before: dict[str, Any], *, start: bool) -> _Slot:
        node = self.node
        share = max(self.account.limit // node.cycle_length, 1)
        # The slot's budget draws from the stage's account: what its stages hold is the
        # interleave's holding, and a re-split that lowers the stage's share holds them too.
        budget = MemoryBudget(share, parent=self.account)
        inner_ctx = self.ctx.with_budget(budget)
        if node.workers == "processes":
            return self._open_remote_slot(element, input_before, budget, inner_ctx, share)
        iterator = node.inner_node(element).make_iterator(inner_ctx)
        # Arrays the function made for this inner dataset live as long as the slot: they
        # are booked on the stage's account, and the slot's budget is the rest of its part.
        owned_bytes = inner_ctx.owned_bytes
        if owned_bytes >= share:
            iterator.close()
            raise MemoryBudgetError(
                f"stage 'interleave': the dataset {function_name(node.map_func)} made holds "
                f"{format_bytes(owned_bytes)} of arrays, more than one slot's part of the "
                f"memory budget ({format_bytes(share)}: the stage's "
                f"{format_bytes(self.account.limit)} / cycle_length {node.cycle_length}). "
                "Raise Options(memory_budget=...), lower cycle_length, or make the inner "
                "datasets smaller."
            )
        owned = self.account.charge(owned_bytes) if owned_bytes else NO_RESERVATION
        budget.total = share - owned_bytes
        budget.widen = functools.partial(self._widen_slot, owned_bytes)
        queue = budget.account("interleave slot", weight=1) if self.may_thread else None
        budget.allot()
        probe = None
        if self.gate is not None:
            iterator = self._read_ahead(iterator, inner_ctx, queue, self.gate, start=start)
        if self.tracking:
            probe = origin_probe(iterator, self.origin_tokens)
        slot = _Slot(iterator, budget, input_before, inner_ctx, queue, owned)
        slot.probe = probe
        return slot

    def _widen_slot(self, owned_bytes: int, needed: int, what: str = "") -> int:
        """A slot's stages must hold ``needed`` bytes at once (its first large element),
        more than its part of the stage's share: any slot may, so the stage's minimum
        becomes ``cycle_length`` such parts, and the pipeline's budget is split again
        to fit them (or MemoryBudgetError names the interleave, and ``what`` the slot's
        stages need: the file and record that did not fit). The slot's new total.

        Before, a slot refused an element larger than its part outright, with a
        message naming the slot's part as "the memory budget", even where the
        pipeline's budget held such slots easily (budget fuzzer seed 300004 of
        ``newer_spec``, with threads and processes alike).
        """
        cycle = self.node.cycle_length
        self.account.require(
            (needed + owned_bytes) * cycle,
            what=f"{cycle} interleave slots of {format_bytes(needed + owned_bytes)}"
            + (f" (in a slot, {what})" if what else ""),
        )
        return max(needed, self.account.limit // cycle - owned_bytes)

    def _open_remote_slot(
        self,
        element: Any,
        input_before: dict[str, Any],
        budget: MemoryBudget,
        inner_ctx: Context,
        share: int,
    ) -> _Slot:
        """A slot whose inner pipeline runs in a worker process (workers="processes")."""
        from headrace.transforms.process_interleave import RemoteSlotIterator, slot_pool
        from headrace.transforms.process_map import cpu_count

        node = self.node
        if self.processes is None:
            parallel = node.num_parallel_calls
            # AUTOTUNE: a worker per CPU, but no more than there are slots (each slot
            # reads on one worker, so a worker past cycle_length would never get work)
            count = min(cpu_count(), node.cycle_length) if parallel == AUTOTUNE else int(parallel or 1)
            stage = f"interleave({function_name(node.map_func)})"
            self.processes = slot_pool(node, self.ctx.options, share, count, stage, self.account)
        account = budget.account("interleave slot", weight=1)
        budget.widen = functools.partial(self._widen_slot, 0)
        budget.allot()
        iterator = RemoteSlotIterator(
            self.processes, element, inner_ctx, account, budget.total, "interleave slot",
            prefer=getattr(self, "worker_hint", None),
        )
        iterator.on_ended = getattr(self, "open_ahead", None)
        return _Slot(iterator, budget, input_before, inner_ctx, account, NO_RESERVATION)

    def _read_ahead(
        self,
        iterator: Iterator,
        ctx: Context,
        queue: StageAccount | None,
        gate: threading.Semaphore,
        *,
        start: bool = True,
    ) -> PrefetchIterator:
        """Wrap a slot's iterator so that it reads ahead on its own thread."""
        assert queue is not None  # registered whenever threads may be used
        depth = max(2 * self.node.block_length + 1, _SLOT_DEPTH)
        ahead = PrefetchIterator(iterator, ctx, queue, depth, gate=gate, ready=self.ready)
        if self.tracking:  # before its thread starts: each element read ahead has its token
            ahead.track_origins()
        if start:
            ahead.start()
        return ahead

    def _pull_input(self, *, start: bool = True) -> _Slot | None:
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
            stage = f"interleave({function_name(self.node.map_func)})"
            raise note_element_error(error, stage, index)  # noqa: B904 - the same error

    def _advance(self) -> None:
        self.block_index = 0
        self.cycle_index = (self.cycle_index + 1) % self.node.cycle_length

    def _close_slot(self, index: int) -> None:
        slot = self.slots[index]
        if slot is not None:
            slot.close()
            self.slots[index] = None
            self.num_open -= 1
            if slot is self.last_slot:  # (its budget's widen refers back to this iterator:
                self.last_slot = None  # kept, the pair would wait for the cyclic collector)

    # -- the order -----------------------------------------------------------------------
    def pull(self) -> tuple[Any, Reservation]:
        if not self.deterministic and self.threaded:
            return self._next_first_ready()
        while not self.end_of_input or self.num_open > 0:
            slot = self.slots[self.cycle_index]
            if slot is not None:
                try:
                    watch = self.watch
                    if watch is None:
                        pair = slot.iterator.pull()
                    elif watch.resting:
                        watch.resting -= 1
                        if not watch.resting:
                            watch.rest_chunk_done()
                        pair = slot.iterator.pull()
                    else:  # inline: this runs for every watched element
                        watch.countdown -= 1
                        if watch.countdown:
                            started = perf_counter()
                            try:
                                pair = slot.iterator.pull()
                            finally:
                                watch.pull_wall += perf_counter() - started
                        else:
                            pair = watch.sampled_pull(slot.iterator.pull)
                        if watch.pull_wall >= watch.WINDOW_SECONDS and watch.waiting_mostly():
                            self._start_threads()
                except StopIteration:
                    self._close_slot(self.cycle_index)
                    self._advance()
                    continue
                self.last_slot = slot
                self.block_index += 1
                if self.block_index == self.node.block_length:
                    self._advance()
                if self.ready is not None:  # (AUTOTUNE in order until threads start)
                    self.handed += 1
                return pair
            if not self.end_of_input:
                opened = self._pull_input()
                if opened is not None:
                    self.slots[self.cycle_index] = opened
                    self.num_open += 1
                continue
            self._advance()
        raise StopIteration

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

    def _next_first_ready(self) -> tuple[Any, Reservation]:
        assert self.ready is not None  # set for deterministic=False with threads
        while True:
            for index, slot in enumerate(self.slots):
                if slot is None and not self.end_of_input:
                    opened = self._pull_input()
                    if opened is not None:
                        self.slots[index] = opened
                        self.num_open += 1
            if self.num_open == 0:
                raise StopIteration
            with self.ready:
                chosen = self._first_ready_slot()
                if chosen is None:
                    self.ready.wait()
                    continue
            slot = self.slots[chosen]
            assert slot is not None
            try:
                pair = slot.iterator.pull()
            except StopIteration:
                self._close_slot(chosen)
                continue
            self.last_slot = slot  # (whose element this is: its origin)
            self.cycle_index = (chosen + 1) % self.node.cycle_length
            self.handed += 1
            return pair

    def _first_ready_slot(self) -> int | None:
        length = self.node.cycle_length
        for step in range(length):
            index = (self.cycle_index + step) % length
            slot = self.slots[index]
            if (
                slot is not None
                and isinstance(slot.iterator, PrefetchIterator)
                and slot.iterator.has_output()
            ):
                return index
        return None

    # -- state -----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        state = {
            "threaded": self.threaded,  # slots' states are read-ahead states then
            "input": self.input.get_state(),
            "cycle_index": self.cycle_index,
            "block_index": self.block_index,
            "end_of_input": self.end_of_input,
            "input_index": self.input_index,
            "slots": [
                None
                if slot is None
                else {"input_before": slot.input_before, INNER: slot.iterator.get_state()}
                for slot in self.slots
            ],
        }
        return state if self.ready is None else mark_out_of_order(state, self)

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

    def set_state(self, state: dict[str, Any]) -> None:
        reader, saved_slots, saved_threaded = self._read_state(state)
        self._close_all()
        self._reset()
        if saved_threaded and not self.threaded:  # AUTOTUNE had switched: switch again
            self._start_threads()
        elif self.watch is not None:  # not switched: watch afresh from here
            self.watch = WaitWatch()
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
            inner = saved[INNER]
            if self.threaded and not saved_threaded:  # saved before this iterator switched
                inner = PrefetchIterator.state_at(inner)
            try:
                slot.iterator.set_state(inner)
            except BaseException:
                slot.close()
                raise
            if isinstance(slot.iterator, PrefetchIterator):
                slot.iterator.start()
            self.slots[index] = slot
            self.num_open += 1
        self.input.set_state(reader.child("input"))
        self.cycle_index = reader.integer("cycle_index")
        self.block_index = reader.integer("block_index")
        self.end_of_input = reader.flag("end_of_input")
        self.input_index = reader.integer("input_index") if "input_index" in state else 0

    def _close_all(self) -> None:
        for index in range(len(self.slots)):
            self._close_slot(index)

    def close(self) -> None:
        try:
            self._close_all()
            super().close()
        finally:
            if self.processes is not None:
                self.processes.shutdown()


class _Ahead:
    """An input element's slot opened before its turn, or the error opening it raised
    (raised in its turn, as the sequential interleave would)."""

    __slots__ = ("before", "error", "index", "pulled", "slot")

    def __init__(
        self,
        slot: _Slot | None,
        before: dict[str, Any],
        index: int,
        error: BaseException | None,
        *,
        pulled: bool = True,
    ) -> None:
        self.slot, self.before, self.index, self.error = slot, before, index, error
        self.pulled = pulled  # False: the input itself raised (no element was taken)


class _ProcessInterleaveIterator(_InterleaveIterator):
    """workers="processes": the same order and state, slots in worker processes.

    A slot whose last chunk has come in (its inner pipeline ended in the worker)
    opens the next input element's slot *ahead* of its turn, on the same worker,
    so that the new slot's first chunks are read while the ending slot hands out
    the rest of its own — every file boundary would otherwise stall the cycle for
    a chunk's read (tf.data's parallel interleave prefetches input elements too).
    Slots opened ahead enter the cycle in input order exactly where the sequential
    interleave would open them; until then the state names the input from before
    them, so a checkpoint reopens them, and an error opening one is raised in its
    turn.
    """

    def _reset(self) -> None:
        super()._reset()
        self.ahead: deque[_Ahead] = deque()
        self.input_done = False  # the input ended while opening ahead (not yet in turn)
        self.worker_hint: int | None = None

    def open_ahead(self, worker: int | None = None) -> None:
        """Open the next input element's slot now (a slot's last chunk is in)."""
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
            self.ahead.append(_Ahead(None, before, index, unpin(error), pulled=False))
            return
        self.worker_hint = worker
        try:
            slot = self._open_slot(element, before, start=True)
        except Exception as error:
            stage = f"interleave({function_name(self.node.map_func)})"
            error = unpin(note_element_error(error, stage, index))
            self.ahead.append(_Ahead(None, before, index, error))
            return
        finally:
            self.worker_hint = None
        slot.iterator.start()  # type: ignore[attr-defined]
        self.ahead.append(_Ahead(slot, before, index, None))

    def _pull_input(self, *, start: bool = True) -> _Slot | None:
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
        return super()._pull_input(start=start)

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.ahead:  # not in the cycle yet: a restore reads the input from before them
            state["input"] = self.ahead[0].before
            state["input_index"] = self.ahead[0].index
        return state

    def _close_all(self) -> None:
        try:
            super()._close_all()
        finally:
            while self.ahead:
                slot = self.ahead.popleft().slot
                if slot is not None:
                    slot.close()

    def worker_stats(self) -> Any:
        """What the slots run on, and the worker processes' memory now."""
        from headrace.workers.memory import WorkerStats

        node = self.node
        reason = "workers='processes'"
        if node.num_parallel_calls == AUTOTUNE:
            reason += f", AUTOTUNE: one per CPU, at most cycle_length ({node.cycle_length})"
        if self.processes is None:
            return WorkerStats(self.stage, "processes", 0, reason)
        traffic = self.processes.traffic
        with traffic.lock:  # chunks are the slots' requests; elements, the same count
            return WorkerStats(
                self.stage, "processes", self.processes.count, reason, self.processes.memory(),
                chunks=traffic.chunks, elements=traffic.elements,
                compute_seconds=traffic.compute_seconds,
                transfer_seconds=traffic.transfer_seconds, sent_bytes=traffic.sent_bytes,
                received_bytes=traffic.received_bytes, segments=traffic.segments,
            )
