"""``map(fn, num_parallel_calls=None, deterministic=None)``.

As in tf.data, a tuple element is passed to ``fn`` as positional arguments and
any other element (dict, array) as one argument. Sequentially, ``map`` keeps
random access, so a later ``shuffle`` or ``shard`` still works on indices.

With ``num_parallel_calls`` the calls run on a thread pool (NumPy, I/O and
most decoders release the GIL; for Python-heavy functions use process
workers). Work in flight is booked ahead on the stage's share of the budget
(:mod:`headrace._memory.inflight`): a new call starts only while the largest
output seen so far still fits, so ``AUTOTUNE`` means "as many threads as
cores, as many calls in flight as the budget allows". A call is booked at the
largest output so far, or at its input's size times the largest output/input
ratio so far, whichever is larger; only one call runs until the first output
is known. What was booked is also the call's allowance: a call whose outputs
pass it stops after that output, and the inputs it did not run wait for room
in a new call. So however the sizes jump, a call holds at most one output
past its booking. An input whose expected output does not fit beside what the
stage holds waits for room, its upstream booking kept. An output larger than
the whole budget raises :class:`~headrace._errors.MemoryBudgetError` naming the
stage and the size. ``deterministic=True`` (the default) keeps input order;
``False`` hands out whichever result is ready first, and its checkpoints are
at-least-once (elements finished out of order may be seen again on resume;
one that a stage above would turn into a loss is refused: ``Run.get_state``).
Calls take chunks of quick elements (fewer hand-offs); with
``deterministic=False`` a chunk whose element runs long gives up the elements
after it to a new call, so one slow element holds back no later one, as in
tf.data. Until a first output's size is known, one call runs at a time (that
size is what calls in flight are booked at); when that first call straggles, one
more starts beside it, booked at its input's size, so a slow first element is
overtaken too.

Positions. While ``fn`` runs, the element's position (its index in the map's input,
counted the same sequentially, on threads and on processes, and the epoch of each
enclosing ``repeat``) is published to it (:mod:`headrace.core.position`): random
image ops seeded with an int draw from it, so augmentations do not depend on who
ran the element (G3) and come again after a restore (G4).

Errors. When ``fn`` raises for element i, ``next()`` raises that exception
(its own type and traceback, with a note naming the stage and i) after every
earlier element, and the following ``next()`` returns element i+1's output:
the failing element is dropped, the iteration goes on — tf.data's behaviour,
whatever ``num_parallel_calls``. On worker processes, a worker that dies is
replaced and its calls run again (an element that ends two workers is that
element's :class:`~headrace._errors.WorkerError`); a stage whose workers cannot
go on raises :class:`~headrace._errors.WorkerPoolError` at every ``next()``, and a
state taken then still starts at its first element not handed out. An error from the input comes the same way.
Where the input knows where its elements come from (a TFRecord or text file, an
array, through pass-through stages, shuffles, prefetches, interleaves (their
read-ahead threads too) and batch -> unbatch: ``Iterator.origin``), the note
names the file, the record's index in it and its byte offset too, and
:func:`headrace._errors.element_origin` returns them; for a batch, its rows' records,
or the one row the error names (:func:`headrace._errors.mark_batch_row`). A
sequential map asks its input only when ``fn`` raises; a parallel one (threads or
processes) keeps a token per element in flight (an int for a file source), made
into an origin on failure.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from headrace._errors import InvalidArgumentError, Origin, note_element_error
from headrace._memory.buffer import Buffer, Reservation
from headrace._memory.inflight import InFlight
from headrace._options import AUTOTUNE
from headrace._structure import TensorSpec, flatten, map_structure, returned, spec_of
from headrace._transforms._map_calls import Call, CallFuture, Calls, Progress, apply_chunk, call_at
from headrace._transforms._map_chunks import MAX_CHUNK as _MAX_CHUNK
from headrace._transforms._map_chunks import TARGET_CALL_SECONDS as TARGET_CALL_SECONDS
from headrace._transforms._map_chunks import ChunkSize, InputFeed
from headrace._transforms._map_order import InOrder, OutOfOrder
from headrace._transforms._map_outputs import CallOutputs
from headrace._transforms._map_threads import MapThreads
from headrace._transforms.batch import batch_iterator
from headrace._transforms.parse_fusion import FusedParse, FusedParseIterator, fused_parse
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.handoff import Handoff
from headrace.core.indexing import IndexPlan, RandomAccess, Reach, Refusal, SequentialIndices
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import Node, ShardRole, Traits, check_signature, first_output
from headrace.core.state import INNER, SKIP, StateReader

__all__ = [
    "MapNode", "PositionedCall", "apply_fn", "call_at", "process_iterator",
    "restore_process_node",
]

#: Builds the iterator of a map on worker processes (``workers="processes"`` or
#: ``"auto"``). Set by :mod:`headrace._transforms.process_map`, which the facade imports:
#: that module builds on this one, so this one does not import it.
process_iterator: Callable[..., Iterator] | None = None
#: Set by the same module: rebuilds a pickled map node whose calls run on processes.
#: Such a node pickles as a call of it, so that unpickling the node anywhere (a worker
#: process reading an interleave's slot, say) imports that module, which registers
#: :data:`process_iterator` there too.
restore_process_node: Callable[..., Any] | None = None


def apply_fn(fn: Callable[..., Any], element: Any) -> Any:
    """Call ``fn`` the way tf.data does: a tuple's components become the arguments, and
    a list it returns is a tuple of components (:func:`~headrace._structure.returned`)."""
    if isinstance(element, tuple):
        return returned(fn(*element))
    return returned(fn(element))


class PositionedCall:
    """``fn`` over ``(position, element)`` pairs: how a chunk goes to a worker process
    with its elements' positions. Picklable where ``fn`` is."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, item: tuple[tuple[int, ...], Any]) -> Any:
        return call_at(self.fn, item[1], item[0])

    def __getstate__(self) -> Callable[..., Any]:
        return self.fn

    def __setstate__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn


def _relaxed(spec: Any, input_spec: Any) -> Any:
    """The output spec from one sample, keeping the sizes that cannot depend on the data.

    tf.data traces the function and its shape inference knows the outputs' sizes;
    one sample cannot tell a size fixed by the code from one that depends on the
    element (``r[: r[0]]``, a filter by mask), and a size wrongly fixed breaks
    ``padded_batch`` on the next element. So an output size is kept only where an
    input of the same rank has that size at that position (``x * 2`` over
    ``(None, 3)`` is ``(None, 3)``, over ``(4, 3)`` is ``(4, 3)``); the others
    become ``None``. ``map(..., output_signature=...)`` states them exactly.
    """
    inputs = [leaf for leaf in flatten(input_spec) if isinstance(leaf, TensorSpec)]
    known: dict[int, list[tuple[int | None, ...]]] = {}
    for leaf in inputs:
        if leaf.shape is not None:
            known.setdefault(len(leaf.shape), []).append(leaf.shape)

    def relax(leaf: TensorSpec) -> TensorSpec:
        if leaf.shape is None:
            return leaf
        shapes = known.get(len(leaf.shape), [])
        dims = tuple(
            size if any(shape[i] == size for shape in shapes) else None
            for i, size in enumerate(leaf.shape)
        )
        return TensorSpec(dims, leaf.dtype, leaf.kind)

    return map_structure(relax, spec)


class MapNode(Node):
    stage = "map"
    shared_capabilities = ("cardinality", "shard_role", "element_access", "traits")

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        inner = reach(self.inputs[0])  # each element computed when it is fetched
        return inner if isinstance(inner, Refusal) else _MappedAccess(inner, self.fn, self.stage)

    def traits(self) -> Traits:
        return Traits(maps=True, parallel_calls=self.num_parallel_calls)

    def __init__(
        self,
        source: Node,
        fn: Callable[..., Any],
        num_parallel_calls: int | None,
        deterministic: bool | None,
        *,
        stage: str | None = None,
        output_signature: Any = None,
        workers: str | None = None,
        output_nbytes: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__(source)
        if not callable(fn):
            raise InvalidArgumentError(f"map: fn must be callable, got {fn!r}")
        if num_parallel_calls is not None and (
            isinstance(num_parallel_calls, bool)
            or not isinstance(num_parallel_calls, int)
            or (num_parallel_calls < 1 and num_parallel_calls != AUTOTUNE)
        ):
            raise InvalidArgumentError(
                f"map: num_parallel_calls must be a positive int or AUTOTUNE, "
                f"got {num_parallel_calls!r}"
            )
        self.stage = stage or f"map({function_name(fn)})"
        if workers is not None:  # (imported here: multiprocessing costs import time)
            from headrace._workers.processes import check_workers

            check_workers(workers, num_parallel_calls, fn, self.stage)
        if output_nbytes is not None and not callable(output_nbytes):
            raise InvalidArgumentError(
                f"{self.stage}: output_nbytes must be a function of the input element, "
                f"got {output_nbytes!r}"
            )
        self.output_nbytes = output_nbytes
        self.workers = workers
        self.fn = fn
        self.num_parallel_calls = num_parallel_calls
        self.deterministic = deterministic
        self.signature = (
            None if output_signature is None else check_signature(output_signature, self.stage)
        )
        self._spec: Any = None
        self._fused: FusedParse | None = None
        self._traced = False

    def shard_role(self) -> ShardRole:
        # deterministic=False lets outputs overtake each other: position k is no longer
        # input k's result (None follows the pipeline's option, True by default)
        return ShardRole.BY_CONTENT if self.deterministic is False else ShardRole.ONE_TO_ONE

    def params(self) -> tuple[Any, ...]:
        return (
            function_fingerprint(self.fn),
            self.num_parallel_calls,
            self.deterministic,
            repr(self.signature),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_spec"] = None
        state["_fused"], state["_traced"] = None, False
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.workers in ("processes", "auto") and restore_process_node is not None:
            # unpickled in a worker that never built a process map: the import that the
            # restore function's pickle makes registers it (else make_iterator failed
            # there with "process_map not imported": served fuzz, a process map inside
            # a process interleave's inner pipeline)
            return (restore_process_node, (type(self), self.__getstate__()))
        return super().__reduce_ex__(protocol)

    @property
    def element_spec(self) -> Any:
        """The ``output_signature`` given, or else found by applying ``fn`` to the first
        input element (tf.data traces instead), under the pipeline's options."""
        if self.signature is not None:
            return self.signature
        if self._spec is None:
            output = first_output(  # (at its element's position: a seeded random op draws
                self.inputs[0], self.stage,  # as it will in the run)
                lambda element, index: call_at(self.fn, element, (index,)),
                "; pass map(..., output_signature=...) to state it",
            )
            self._spec = _relaxed(spec_of(output), self.inputs[0].element_spec)
        return self._spec

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()

    def random_access(self) -> RandomAccess | None:
        if self.num_parallel_calls is not None:
            return None
        inner = self.inputs[0].random_access()
        return None if inner is None else _MappedAccess(inner, self.fn, self.stage)

    def index_plan(self) -> IndexPlan | None:
        """Random access read in order, where the input is addressable element by
        element (its element ``i`` is at index ``i``). Not over an input read through
        index stages (shuffle, take, skip, shard, repeat below the map): there the
        index an element is read at is not its position in the map's input, which is
        what a random op seeded with an int draws from (G3: the same as when the map
        runs on threads or processes), so the map streams."""
        access = self.random_access()
        if access is None:
            return None
        size = len(access)
        return access, lambda ctx: SequentialIndices(size)

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator | None:
        """A map that only parses its record, then ``batch``: one columnar parse per batch
        (see :mod:`headrace._transforms.parse_fusion`)."""
        if not self._traced:  # once per recipe, as tf.data traces once
            self._fused, self._traced = fused_parse(self.fn), True
        if self._fused is None:
            return None
        # (a short last batch is parsed, then dropped: its error is raised, as tf.data's)
        records = batch_iterator(self.inputs[0], ctx, account, batch_size, False)
        return FusedParseIterator(records, self._fused, self.fn, self.stage, ctx, account,
                                  batch_size if drop_remainder else 0)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        inner = self.inputs[0].make_iterator(ctx)
        if self.num_parallel_calls is None:
            return MapIterator(inner, self.fn, self.stage, ctx.epochs)
        threads = (
            (os.cpu_count() or 1)
            if self.num_parallel_calls == AUTOTUNE
            else self.num_parallel_calls
        )
        deterministic = (
            ctx.deterministic if self.deterministic is None else bool(self.deterministic)
        )
        account = ctx.account(self)
        if self.workers in ("processes", "auto"):
            assert process_iterator is not None, "headrace._transforms.process_map not imported"
            return process_iterator(self, inner, ctx, account, deterministic)
        return ParallelMapIterator(
            inner, self.fn, ctx, account, threads, deterministic, self.stage,
            self.output_nbytes,
        )


class _MappedAccess(RandomAccess):
    """Element ``i`` is ``fn`` of the input's element ``i``, called at position
    ``(*epochs, i)``: the epochs of the run it was prepared for (a repeat above a map
    streams, so that each epoch's access knows its epoch)."""

    def __init__(self, inner: RandomAccess, fn: Callable[..., Any], stage: str) -> None:
        self.inner, self.fn, self.stage = inner, fn, stage
        self.epochs: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.inner)

    def get(self, index: int) -> Any:
        element = self.inner.get(index)
        try:
            return call_at(self.fn, element, (*self.epochs, index))
        except Exception as error:
            origin = self.inner.origin(index)
            raise note_element_error(error, self.stage, index, origin)  # noqa: B904

    def origin(self, index: int) -> Origin | None:
        return self.inner.origin(index)

    def prepare(self, ctx: Context) -> None:
        self.epochs = ctx.epochs
        self.inner.prepare(ctx)


class MapIterator(Iterator):
    passes_origin = True

    def __init__(self, inner: Iterator, fn: Callable[..., Any], stage: str,
                 epochs: tuple[int, ...] = ()) -> None:
        super().__init__(inner)
        self.inner, self.fn, self.stage, self.epochs = inner, fn, stage, epochs
        # of the next input element (named in error notes; the function's position)
        self.index = 0
        # origin() is asked on failure only; probing now makes a shuffle below keep them
        origin_probe(inner, tokens=False)

    def pull(self) -> tuple[Any, Reservation]:
        index = self.index
        try:
            element, reservation = self.inner.pull()
        except StopIteration:
            raise
        except Exception:  # an input element's error takes its position, as in parallel
            self.index = index + 1
            raise
        self.index = index + 1
        try:
            return call_at(self.fn, element, (*self.epochs, index)), reservation
        except Exception as error:  # the element is dropped; the next call goes on
            reservation.release()
            origin = self.inner.origin()  # the input is still on the element: ask it now
            raise note_element_error(error, self.stage, index, origin)  # noqa: B904

    def get_state(self) -> dict[str, Any]:
        return {INNER: self.inner.get_state(), "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        self.inner.set_state(reader.child(INNER))
        self.index = reader.integer("index") if "index" in state else 0


class ParallelMapIterator(Iterator):
    """A map's calls on a thread pool, their outputs booked through the in-flight ledger.

    This class coordinates the pieces of a parallel map, each in its own module:

    - the input side (:class:`~headrace._transforms._map_chunks.InputFeed`): which
      inputs go into a call, in chunks sized by time
      (:class:`~headrace._transforms._map_chunks.ChunkSize`) and by bytes, each input
      booked ahead on the in-flight ledger
      (:class:`~headrace._memory.inflight.InFlight`), whose booking is the call's
      allowance; an input that does not fit waits aside;
    - the calls in flight (:class:`~headrace._transforms._map_calls.Calls`): started,
      waiting for room, the inputs a call gives up handed on to a new call;
    - the delivery order (:mod:`headrace._transforms._map_order`): which call is
      collected next, and where a checkpoint restores;
    - a finished call settled (:class:`~headrace._transforms._map_outputs.CallOutputs`):
      its outputs booked as they are, errors in their element's place;
    - the worker threads (:class:`~headrace._transforms._map_threads.MapThreads`): a
      call handed to them and back with as few wake-ups as can be.

    Hooks for subclasses (``ProcessMapIterator`` runs the calls on processes):

    - ``_start_call(elements, progress=None, first=0, allowance=None, forced=False)``
      starts a call and returns a future of ``(outputs, sizes, failed, seconds)``.
      ``first`` is the position of ``elements[0]`` in the map's input.
      ``allowance`` is the bytes booked for the outputs: past it, with inputs
      left, the call stops and returns fewer outputs than inputs
      (``len(outputs) == len(sizes) <= len(elements)``). This class runs the
      inputs handed back in a new call, in order; a call may hand back even its
      first input (its output would pass the allowance at the largest size seen
      since it was booked), unless ``forced``: the consumer waits for it. ``failed``
      maps positions in ``outputs`` to errors. ``progress`` (threads, out of order)
      may be ignored.
    - ``chunks.target_seconds``: how long a call should run; chunks grow to it.
    - ``ledger``: the in-flight ledger (``largest()``, ``share()``).
    """

    def __init__(
        self,
        inner: Iterator,
        fn: Callable[..., Any],
        ctx: Context,
        account: Buffer,
        threads: int,
        deterministic: bool,
        stage: str,
        output_nbytes: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__(inner)
        self.inner, self.fn, self.ctx, self.account = inner, fn, ctx, account
        self.output_nbytes = output_nbytes
        self.ledger = InFlight(account, output_nbytes)
        self.threads, self.stage = threads, stage
        self.pool: MapThreads | None = None
        self.order = InOrder() if deterministic else OutOfOrder()
        if not deterministic:
            ctx.run.out_of_order.add(self)
        self.feed = InputFeed(inner, ctx, self.ledger, stage)
        #: How many inputs a call gets (process workers aim at longer calls).
        self.chunks = ChunkSize(TARGET_CALL_SECONDS, _MAX_CHUNK)
        self.calls = Calls(self.ledger, self.order, self._start_call)
        self.outputs = CallOutputs(self.ledger, ctx.sizeof, stage, self.feed.origin)
        self.ready: deque[Handoff] = deque()  # outputs (and errors) to hand out, in order
        self.handed = 0  # elements handed out: whether a state taken out of order is stale
        # the count and the input index where this run (or its last restore) started
        self.handed_at_start = self.index_at_start = 0

    @property
    def output_estimate(self) -> int:
        """The largest output so far (the ledger's)."""
        return self.ledger.largest()

    def _start_call(
        self, elements: list[Any], progress: Progress | None = None, first: int = 0,
        allowance: int | None = None, forced: bool = False,
    ) -> CallFuture:
        """Run ``fn`` over a chunk in the background (see the class doc)."""
        if self.pool is None:
            self.pool = MapThreads(self.threads)
        return self.pool.submit(apply_chunk, self.fn, elements, self.ctx.admit, progress,
                                first, self.ctx.epochs, allowance, self.ledger, forced)

    def _submit_more(self) -> None:
        """Start calls while the order and the budget allow: handed-back inputs whose
        booking now covers them, the input set aside once it fits, new chunks."""
        calls, feed, ledger = self.calls, self.feed, self.ledger
        calls.start_waiting()
        # (settles happen on this thread, in _collect: not while this loop runs)
        most = self.order.most_calls(self.threads, ledger.settled())
        while not feed.exhausted and len(calls) < most:
            # Nothing in flight or ready: one call may always start (progress); otherwise
            # only while its output, at the largest size seen, fits beside what is held.
            alone = not calls and not self.ready
            if not ledger.may_start(alone):
                return
            if feed.aside is not None:
                call = feed.take_aside(alone)
                if call is None:  # it waits for room
                    return
            else:
                call = feed.pull_chunk(self.chunks.chunk, 2 * self.threads, alone)
                if not call.elements and call.error is None:
                    continue  # the input ended, or its first element waits aside
            calls.add(call)

    def _take_call(self) -> Call:
        """The next call to collect (still in ``calls``: :meth:`_collect` removes it).
        Out of order, while none finishes, a first call that straggles before any
        output size is known gets one more call beside it (as tf.data lets a slow
        first element be overtaken)."""
        order = self.order
        while True:
            call = order.next_call(self.calls)
            if call is not None:
                return call
            if not self.feed.exhausted and order.overtake(
                self.threads, len(self.calls), self.ledger.settled()
            ):
                self._submit_more()

    def _collect(self, call: Call) -> None:
        """A call's outputs (and errors) into ``ready``; the inputs it handed back into a
        new call, collected next where the order is kept.

        A call that failed as a whole (its worker pool is broken: the elements' own
        errors come in ``failed``) stays where it is, bookings and all, and raises
        again at the next pull: a state taken after the error starts at its first
        element, which is not lost (issue 22: popped first, four elements were)."""
        assert call.future is not None
        try:
            outputs, costs, failed, seconds = call.future.result()
        except BaseException:
            self.order.failed(call)
            raise
        self.calls.remove(call)
        # Out of order the future's callback holds the call: a cycle that kept the
        # outputs alive, unbooked, until the cyclic GC ran. Dropped here.
        call.future = None
        ticket, ran = call.ticket, len(outputs)
        # Inputs the call did not run (past its allowance) take what is left of the
        # booking once the outputs made are paid for.
        rest = self.ledger.split(ticket, ran, sum(costs)) if ran < len(ticket.expected) else None
        self.chunks.learn(seconds, ran)
        reservations, failed = self.outputs.book(ticket, outputs, costs, failed, rest)
        if rest is not None:  # next in order, where the order is kept
            self.calls.hand_on(call, ran, rest, front=self.order.hands_back_first)
        call.elements = []
        handoff = self.outputs.handoff(call, outputs, reservations, failed)
        if handoff is not None:
            self.ready.append(handoff)

    def pull(self) -> tuple[Any, Reservation]:
        while not self.ready:  # (a call may hand every input back: collected, none ready)
            self._submit_more()
            if not self.calls:
                raise StopIteration
            self._collect(self._take_call())
            self._submit_more()
        chunk = self.ready[0]
        if chunk.taken + 1 == len(chunk):
            self.ready.popleft()
        self.handed += 1
        return chunk.take()

    def get_state(self) -> dict[str, Any]:
        index, state_before, skip = self._earliest()
        return self.order.mark({INNER: state_before, SKIP: skip, "index": index}, self)

    def _earliest(self) -> tuple[int, Any, int]:
        """Where the earliest input not handed out yet is: a restore runs again from there
        (its index, the input's state before its chunk, its position in the chunk).

        The chunks ready come first, then the calls in flight, then what the input
        side holds (the input set aside, else the next input to pull); the order
        picks the earliest of them (out of order, what came out after it comes again:
        at-least-once)."""
        pending = itertools.chain(  # (index, the chunk's input state, position in it)
            ((chunk.first_index + chunk.taken, chunk.state_before, chunk.taken)
             for chunk in self.ready),
            ((call.first_index + call.start, call.state_before, call.start)
             for call in self.calls),
            (self.feed.earliest(),),
        )
        earliest = self.order.earliest(pending)
        assert earliest is not None  # (the input side always says where it is)
        return earliest

    def replays(self) -> int:
        """How many elements a restore at :meth:`get_state` hands out again: those
        handed out past the earliest input not handed out (out of order; one output
        per input, an error in its place counting as one)."""
        index = self._earliest()[0]
        return (self.handed - self.handed_at_start) - (index - self.index_at_start)

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        inner_state = reader.child(INNER)
        # outputs of the chunk already handed out: a position inside one chunk
        skip = reader.integer(SKIP, high=_MAX_CHUNK + 1, why="the largest chunk and its error")
        self._drop_calls()
        feed = self.feed
        feed.restore(inner_state, skip)
        feed.next_index = reader.integer("index") if "index" in state else 0
        self.handed_at_start, self.index_at_start = self.handed, feed.next_index

    def _drop_calls(self) -> None:
        for chunk in self.ready:
            chunk.release()
        self.ready.clear()
        self.feed.drop_aside()
        self.calls.drop()

    def close(self) -> None:
        self._drop_calls()
        if self.pool is not None:
            self.pool.shutdown()  # (the calls were cancelled: the threads go at once)
            self.pool = None
        super().close()
