"""``map(fn, num_parallel_calls=None, deterministic=None)``.

As in tf.data, a tuple element is passed to ``fn`` as positional arguments and
any other element (dict, array) as one argument. Sequentially, ``map`` keeps
random access, so a later ``shuffle`` or ``shard`` still works on indices.

With ``num_parallel_calls`` the calls run on a thread pool (NumPy, I/O and
most decoders release the GIL; for Python-heavy functions use process
workers). Work in flight is booked on the stage's share of the budget: a new
call starts only while the largest element seen so far still fits, so
``AUTOTUNE`` means "as many threads as cores, as many calls in flight as the
budget allows" (each call in flight is booked at the largest output seen so
far, or at its input's size times the largest output/input ratio seen, whichever
is larger; only one call runs until the first output is known; an input whose
expected output does not fit beside what the stage holds waits for room, its
upstream booking kept). ``deterministic=True`` (the default) keeps input order;
``False`` hands out whichever result is ready first, and its checkpoints are
at-least-once (elements finished out of order may be seen again on resume;
one that a stage above would turn into a loss is refused: ``Run.get_state``).
Calls take chunks of quick elements (fewer hand-offs); with
``deterministic=False`` a chunk whose element runs long gives up the elements
after it to a new call, so one slow element holds back no later one, as in
tf.data — except the very first element: its output's size is what calls in
flight are booked at, so nothing starts beside it.

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
element's :class:`~headrace.errors.WorkerError`); a stage whose workers cannot
go on raises :class:`~headrace.errors.WorkerPoolError` at every ``next()``, and a
state taken then still starts at its first element not handed out. An error from the input comes the same way.
Where the input knows where its elements come from (a TFRecord or text file, an
array, through pass-through stages, shuffles, prefetches, interleaves (their
read-ahead threads too) and batch -> unbatch: ``Iterator.origin``), the note
names the file, the record's index in it and its byte offset too, and
:func:`headrace.errors.element_origin` returns them; for a batch, its rows' records,
or the one row the error names (:func:`headrace.errors.mark_batch_row`). A
sequential map asks its input only when ``fn`` raises; a parallel one (threads or
processes) keeps a token per element in flight (an int for a file source), made
into an origin on failure.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from operator import truediv
from queue import Empty, SimpleQueue
from typing import Any, NamedTuple

from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.handoff import Handoff, restore_input, unpin
from headrace.core.indexing import IndexPlan, RandomAccess, SequentialIndices
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import Node, ShardRole, check_signature, first_element
from headrace.core.position import _POSITION
from headrace.core.state import INNER, SKIP, StateReader, mark_out_of_order
from headrace.errors import InvalidArgumentError, Origin, note_element_error
from headrace.memory.budget import (
    NO_RESERVATION,
    Overdraft,
    Reservation,
    StageAccount,
    release_all,
)
from headrace.options import AUTOTUNE
from headrace.structure import TensorSpec, flatten, map_structure, spec_of
from headrace.transforms.batch import batch_iterator
from headrace.transforms.parse_fusion import FusedParse, FusedParseIterator, fused_parse

__all__ = [
    "MapNode", "PositionedCall", "apply_fn", "call_at", "process_iterator",
    "restore_process_node",
]

#: Builds the iterator of a map on worker processes (``workers="processes"`` or
#: ``"auto"``). Set by :mod:`headrace.transforms.process_map`, which the facade imports:
#: that module builds on this one, so this one does not import it.
process_iterator: Callable[..., Iterator] | None = None
#: Set by the same module: rebuilds a pickled map node whose calls run on processes.
#: Such a node pickles as a call of it, so that unpickling the node anywhere (a worker
#: process reading an interleave's slot, say) imports that module, which registers
#: :data:`process_iterator` there too.
restore_process_node: Callable[..., Any] | None = None


def apply_fn(fn: Callable[..., Any], element: Any) -> Any:
    """Call ``fn`` the way tf.data does: a tuple's components become the arguments."""
    if isinstance(element, tuple):
        return fn(*element)
    return fn(element)


def call_at(fn: Callable[..., Any], element: Any, position: tuple[int, ...]) -> Any:
    """``apply_fn`` with the element's position published to the function (see
    :mod:`headrace.core.position`): random ops seeded with an int draw from it."""
    token = _POSITION.set(position)
    try:
        if isinstance(element, tuple):
            return fn(*element)
        return fn(element)
    finally:
        _POSITION.reset(token)


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
            from headrace.workers.processes import check_workers

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
            element = first_element(
                self.inputs[0], self.stage, "; pass map(..., output_signature=...) to state it"
            )
            self._spec = _relaxed(  # (as element 0: a seeded random op draws as it will)
                spec_of(call_at(self.fn, element, (0,))), self.inputs[0].element_spec
            )
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
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: StageAccount
    ) -> Iterator | None:
        """A map that only parses its record, then ``batch``: one columnar parse per batch
        (see :mod:`headrace.transforms.parse_fusion`)."""
        if not self._traced:  # once per recipe, as tf.data traces once
            self._fused, self._traced = fused_parse(self.fn), True
        if self._fused is None:
            return None
        records = batch_iterator(self.inputs[0], ctx, account, batch_size, drop_remainder)
        return FusedParseIterator(records, self._fused, self.fn, self.stage, ctx, account)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        inner = self.inputs[0].make_iterator(ctx)
        if self.num_parallel_calls is None:
            return _MapIterator(inner, self.fn, self.stage, ctx.epochs)
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
            assert process_iterator is not None, "headrace.transforms.process_map not imported"
            return process_iterator(self, inner, ctx, account, deterministic)
        return _ParallelMapIterator(
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


class _MapIterator(Iterator):
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


class _Progress:
    """Where a chunk's worker is, so that the elements after a slow one can be taken away.

    The worker claims each element under the lock; :meth:`split` lowers ``limit``
    to just past the element being computed and returns the positions given up.
    """

    __slots__ = ("limit", "lock", "position", "since")

    def __init__(self, limit: int) -> None:
        self.lock = threading.Lock()
        self.limit, self.position, self.since = limit, -1, 0.0

    def claim(self, position: int) -> bool:
        with self.lock:
            if position >= self.limit:
                return False
            self.position, self.since = position, time.perf_counter()
            return True

    def split(self, older_than: float) -> range:
        with self.lock:
            running = self.position
            if running < 0 or running + 1 >= self.limit or self.since > older_than:
                return range(0)
            given_up = range(running + 1, self.limit)
            self.limit = running + 1
            return given_up


def _apply_chunk(
    fn: Callable[..., Any],
    elements: list[Any],
    admit: Callable[[Any], tuple[Any, int]],
    progress: _Progress | None = None,
    first: int = 0,
    epochs: tuple[int, ...] = (),
) -> tuple[list[Any], list[int], dict[int, Exception] | None, float]:
    """``fn`` over a chunk: the outputs as a buffer keeps them, their costs, the errors.

    Each output is admitted (costed, and copied out if it is a small view of a
    large temporary) as soon as ``fn`` returns it, in the worker: a chunk of
    views would otherwise keep a chunk of temporaries alive until the consumer
    collects it — memory no booking covers. An element whose call raised
    leaves ``None``, cost 0, and its error. ``first``: the position in the map's input
    of ``elements[0]`` (in ``epochs``), published to ``fn`` (:func:`call_at`).
    """
    started = time.perf_counter()
    outputs: list[Any] = []
    sizes: list[int] = []
    failed: dict[int, Exception] | None = None
    for position, element in enumerate(elements):
        if progress is not None and not progress.claim(position):
            break  # the rest was given to another call
        try:
            output, size = admit(call_at(fn, element, (*epochs, first + position)))
        except Exception as error:  # raised in the consumer, at this element's position
            if failed is None:
                failed = {}
            failed[len(outputs)] = unpin(error)  # held until handed out: pins nothing
            output, size = None, 0
        outputs.append(output)
        sizes.append(size)
    return outputs, sizes, failed, time.perf_counter() - started


#: A call is given several elements when ``fn`` is quick, so that the fixed
#: cost of a thread hand-off (20-200 us with the GIL contended) stays small against
#: the work it carries.
_TARGET_CALL_SECONDS = 2e-3
_MAX_CHUNK = 256
#: With ``deterministic=False``, an element running this long gives up the rest of its
#: chunk (a few target calls: quick elements never pay for it).
_SPLIT_AFTER_SECONDS = 4 * _TARGET_CALL_SECONDS


class _Call:
    """Work in flight: a future over a chunk of elements, its bookings, where it started.

    ``state_before`` is the input's state before the chunk's first element and
    ``first_index`` that element's index: a checkpoint inside a chunk restores the
    state and skips the elements already out, so the input's state is taken once per
    chunk, not once per element. ``error`` is what the input raised right after the
    chunk's elements (the chunk ends there): it is handed out in that place.
    ``start``: the position in that chunk of this call's first element (a call
    finishing a chunk whose first elements went out in another call: the tail of a
    split call, or an element that waited for room).
    """

    __slots__ = (
        "booked", "bookings", "count", "elements", "error", "first_index", "future", "inputs",
        "origins", "progress", "start", "state_before",
    )

    def __init__(
        self,
        future: Future[tuple[list[Any], list[int], dict[int, Exception] | None, float]],
        bookings: list[Reservation],
        state_before: dict[str, Any],
        first_index: int,
        error: Exception | None,
        start: int = 0,
    ) -> None:
        self.future, self.bookings, self.state_before = future, bookings, state_before
        self.first_index, self.error, self.start = first_index, error, start
        self.count = 0  # elements in the chunk (set by the caller)
        #: Each input's own size, and what the chunk's expected outputs were booked at
        #: (set by the caller): an estimate that grows rebooks the difference.
        self.inputs: list[int] = []
        self.booked = 0
        self.elements: list[Any] = []  # kept only where the chunk may be split
        self.progress: _Progress | None = None
        #: Where each element came from, where the input can say: tokens of
        #: ``Iterator.origin_token``, made into origins for error notes only.
        self.origins: list[Any] | None = None


def _carve(bookings: list[Reservation], nbytes: int) -> Reservation:
    """Up to ``nbytes`` of ``bookings`` as a booking of their own: the part of a chunk's
    bookings that its split-off tail's inputs were booked with. Nothing is booked or
    released — the bytes change hands, so the split books exactly what the chunk did
    (an overdraft's excess stays with it)."""
    carved: Reservation = NO_RESERVATION
    for booking in bookings:
        if nbytes <= 0:
            break
        movable = booking.nbytes - (booking.excess if isinstance(booking, Overdraft) else 0)
        take = min(movable, nbytes)
        if take <= 0 or booking.account is None:
            continue
        booking.nbytes -= take
        nbytes -= take
        carved = carved.absorb(Reservation(booking.account, take))
    return carved


class _Aside(NamedTuple):
    """An input pulled but not started (its expected output did not fit yet): the
    last position of its chunk (``state_before``, ``first_index``: the chunk's)."""

    element: Any
    reservation: Reservation  # its upstream booking, kept while it waits
    nbytes: int
    origin: Any
    state_before: dict[str, Any]
    first_index: int
    position: int


def _announce(finished: SimpleQueue[_Call], call: _Call, _: Future[Any]) -> None:
    finished.put(call)


class _ParallelMapIterator(Iterator):
    def __init__(
        self,
        inner: Iterator,
        fn: Callable[..., Any],
        ctx: Context,
        account: StageAccount,
        threads: int,
        deterministic: bool,
        stage: str,
        output_nbytes: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__(inner)
        self.inner, self.fn, self.ctx, self.account = inner, fn, ctx, account
        self.output_nbytes = output_nbytes
        self.threads, self.deterministic, self.stage = threads, deterministic, stage
        self.pool: ThreadPoolExecutor | None = None
        self.calls: deque[_Call] = deque()
        self.ready: deque[Handoff] = deque()  # outputs (and errors) to hand out, in order
        self.exhausted = False
        self.chunk = 1
        #: How long one call should run: chunks grow to it (process workers set more).
        self.target_call_seconds = _TARGET_CALL_SECONDS
        # Out of order, finished calls announce themselves here (one queue get per
        # call, not a wait() over every call in flight).
        self.max_chunk = _MAX_CHUNK
        self.finished: SimpleQueue[_Call] | None = None if deterministic else SimpleQueue()
        if not deterministic:
            ctx.run.out_of_order.add(self)
        self.output_estimate = 0  # the largest output so far: what a call in flight will need
        # The largest output/input size ratio so far: what an input larger than those
        # seen will need (a chunk of small inputs sized the calls, then large ones came).
        self.output_ratio = 0.0
        # What outputs cost beyond what ``output_nbytes`` said (an array's header, where
        # a hint counts its data), added to each hint: the least per element a call has
        # shown (exact for a fixed overhead; a process map's segment slack, which varies
        # by chunk, must not inflate every later booking).
        self.hint_slack: int | None = None
        self.pulled_inputs: list[int] = []  # sizes of the last chunk pulled's inputs
        self.state_after_last_input = inner.get_state()
        self.next_index = 0  # of the next input element to pull
        # Where the input's elements come from: asked per element pulled (a call ahead
        # of their failing), so the chain of stages passing it through is walked once.
        self.origin_probe = origin_probe(inner)
        self.pulled_origins: list[Any] | None = None  # tokens of the last chunk pulled
        #: The element that ended its chunk because its expected output did not fit
        #: beside what the stage holds: it starts once it fits (its upstream booking
        #: kept until then), as the last position of its chunk.
        self.aside: _Aside | None = None
        self.handed = 0  # elements handed out: whether a state taken out of order is stale

    def _start_call(
        self, elements: list[Any], progress: _Progress | None = None, first: int = 0
    ) -> Future[tuple[list[Any], list[int], dict[int, Exception] | None, float]]:
        """Run ``fn`` over a chunk in the background (process workers override this
        and never split a chunk: ``progress`` is ignored there). ``first``: the position
        of ``elements[0]`` in the map's input."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="headrace-map")
        return self.pool.submit(_apply_chunk, self.fn, elements, self.ctx.admit, progress,
                                first, self.ctx.epochs)

    def _launch(
        self,
        elements: list[Any],
        bookings: list[Reservation],
        state_before: dict[str, Any],
        first_index: int,
        error: Exception | None,
        origins: list[Any] | None,
        inputs: list[int],
        booked: int,
        start: int = 0,
    ) -> None:
        progress = _Progress(len(elements)) if self.finished is not None and elements else None
        try:
            future = self._start_call(elements, progress, first_index + start)
        except Exception as refused:
            # The stage cannot run calls (its worker pool is broken): the chunk stays
            # pending with its elements' place and input state, and raises when its turn
            # comes, so a state taken now starts at it and nothing pulled is lost.
            future = Future()
            future.set_exception(refused)
        call = _Call(future, bookings, state_before, first_index, error, start)
        call.count, call.origins = len(elements), origins
        call.inputs, call.booked = inputs, booked
        if progress is not None:
            call.elements, call.progress = elements, progress
        self.calls.append(call)
        if self.finished is not None:  # (the queue, not self: threads must not
            future.add_done_callback(functools.partial(_announce, self.finished, call))

    def _split_slow_calls(self) -> None:
        """Out of order only: give the elements after a long-running one to a new call."""
        older_than = time.perf_counter() - _SPLIT_AFTER_SECONDS
        for call in list(self.calls):
            if call.progress is None:
                continue
            given_up = call.progress.split(older_than)
            if not given_up:
                continue
            tail = call.elements[given_up.start : given_up.stop]
            inputs = call.inputs[given_up.start : given_up.stop]
            call.count -= len(tail)
            call.inputs = call.inputs[: given_up.start]
            error, call.error = call.error, None  # an input error comes after the tail
            estimate = self.output_estimate
            booking = _carve(call.bookings, sum(
                max(nbytes, self._expected_output(element, estimate, nbytes))
                for element, nbytes in zip(tail, inputs, strict=True)))
            call.booked -= booking.nbytes
            origins = call.origins
            self._launch(
                tail, [booking], call.state_before, call.first_index, error,
                None if origins is None else origins[given_up.start : given_up.stop], inputs,
                booking.nbytes, call.start + given_up.start,
            )

    def _submit_more(self) -> None:
        while (
            not self.exhausted
            and len(self.calls) < (2 * self.threads if self.output_estimate else 1)
            # Nothing in flight or ready: one call may always start (progress); otherwise
            # only while its output, at the largest size seen, fits beside what is held.
            and ((not self.calls and not self.ready) or self.account.fits(self.output_estimate))
        ):
            if self.aside is not None:
                if not self._launch_aside():
                    return
                continue
            state_before, first_index = self.state_after_last_input, self.next_index
            elements, bookings, error = self._pull_chunk()
            if elements or error is not None:
                self._launch(
                    elements, bookings, state_before, first_index, error, self.pulled_origins,
                    self.pulled_inputs, sum(booking.nbytes for booking in bookings),
                )

    def _launch_aside(self) -> bool:
        """Start the element set aside once its expected output fits beside what the
        stage holds (or nothing else is in flight or ready: progress); False while
        it must wait."""
        aside = self.aside
        assert aside is not None
        account = self.account
        size = max(aside.nbytes, self._expected_output(
            aside.element, self.output_estimate, aside.nbytes))
        if (self.calls or self.ready) and account.held + size > account.limit:
            return False
        self.aside = None
        booking = account.book_existing_total([size], count=False)
        aside.reservation.release()
        self._launch(
            [aside.element], [booking], aside.state_before, aside.first_index, None,
            None if aside.origin is None else [aside.origin], [aside.nbytes or 1], size,
            aside.position,
        )
        return True

    def _pull_chunk(self) -> tuple[list[Any], list[Reservation], Exception | None]:
        """Up to ``chunk`` inputs, booked at their expected output size, and the error
        the input raised after them (which ends the chunk), if any.

        Inputs that a buffering stage booked move onto this stage's share at once
        (holding them while waiting for that stage would deadlock it); the others
        are booked together, with one lock, when the chunk is complete. An input
        whose expected output does not fit beside them (known only once it is
        pulled: a larger output/input ratio, or what ``output_nbytes`` says of it)
        ends the chunk and waits aside for room, unless nothing else is held.
        """
        elements: list[Any] = []
        bookings: list[Reservation] = []
        upstream_error: Exception | None = None
        pending: list[int] = []  # sizes of inputs nobody booked, booked together below
        pending_bytes = 0
        sizeof, estimate, account = self.ctx.sizeof, self.output_estimate, self.account
        probe = None if self.origin_probe is None else self.origin_probe[0]
        origins: list[Any] | None = None if probe is None else []
        self.pulled_origins = origins
        inputs: list[int] = []
        self.pulled_inputs = inputs
        # (_expected_output without a hint, inlined: this runs per element)
        hinted, ratio, limit = self.output_nbytes is not None, self.output_ratio, account.limit
        # (what a chunk's first input must fit beside: nothing, where nothing is in flight)
        alone = not self.calls and not self.ready
        while len(elements) < self.chunk and (
            not elements or account.held + pending_bytes + estimate <= account.limit
        ):
            try:
                element, reservation = self.inner.pull()
            except StopIteration:
                self.exhausted = True
                break
            except Exception as error:  # an upstream element's error: handed out in its place
                upstream_error = unpin(error)  # held by the call: must pin no element
                break
            origin = None if probe is None else probe()
            # A call in flight will soon hold its output: book the larger of the two
            # (the output's size from the input itself, where output_nbytes says it).
            nbytes = sizeof(element)
            if hinted:
                size = max(nbytes, self._expected_output(element, estimate, nbytes))
            else:
                size = max(nbytes, estimate, min(int(nbytes * ratio), limit))
            # (at most the estimate: it was checked to fit before the pull)
            if size > estimate and account.held + pending_bytes + size > account.limit and (
                elements or not alone
            ):
                self.aside = _Aside(element, reservation, nbytes, origin,
                                    self.state_after_last_input, self.next_index, len(elements))
                break
            elements.append(element)
            if origins is not None:
                origins.append(origin)
            inputs.append(nbytes or 1)  # (a registered sizer may say 0: a ratio's divisor)
            if reservation.account is None:
                pending.append(size)
                pending_bytes += size
            else:  # booked upstream: it moves here at once (the stage above may be waiting
                # for that room to give us the next input), booked as it is
                bookings.append(account.book_existing_total([size], count=False))
                reservation.release()
        if elements or upstream_error is not None or self.aside is not None:
            self.state_after_last_input = self.inner.get_state()
            self.next_index += (
                len(elements) + (upstream_error is not None) + (self.aside is not None))
        if pending:  # the inputs exist: booked as they are (past the share only if the
            # chunk's first input alone did not fit beside what is held), as one booking
            # for the call: they are released together when it is collected
            bookings.append(account.book_existing_total(pending, count=False))
        return elements, bookings, upstream_error

    def _expected_output(self, element: Any, estimate: int, nbytes: int) -> int:
        """What the call on ``element`` (of ``nbytes``) will hold: ``output_nbytes(element)``
        (an image's decoded size from its header, before it is decoded), or else the
        largest output so far or the input's size at the largest output/input ratio so
        far, whichever is larger (at most the stage's share: a guess must not refuse).

        A hint that fails books the estimate: the call itself then raises in the
        element's place."""
        if self.output_nbytes is None:
            return max(estimate, min(int(nbytes * self.output_ratio), self.account.limit))
        try:
            return int(self.output_nbytes(element)) + (self.hint_slack or 0)
        except Exception:
            return estimate

    def _take_call(self) -> _Call:
        """The next call to collect (still in ``calls``: :meth:`_collect` removes it)."""
        if self.finished is None:
            return self.calls[0]
        while True:  # calls dropped by a restore may still announce themselves: skip them
            self._split_slow_calls()
            try:
                call = self.finished.get(timeout=_SPLIT_AFTER_SECONDS)
            except Empty:
                continue
            if any(live is call for live in self.calls):
                return call

    def _collect(self, call: _Call) -> None:
        """A call's outputs (and errors) into ``ready``.

        A call that failed as a whole (its worker pool is broken: the elements' own
        errors come in ``failed``) stays where it is, bookings and all, and raises
        again at the next pull: a state taken after the error starts at its first
        element, which is not lost (issue 22: popped first, four elements were)."""
        try:
            outputs, costs, failed, seconds = call.future.result()
        except BaseException:
            if self.finished is not None:
                self.finished.put(call)  # announced again: taken (and raised) again
            raise
        if self.calls[0] is call:
            self.calls.popleft()
        else:
            self.calls.remove(call)
        release_all(call.bookings)
        per_element = seconds / max(len(outputs), 1)
        if per_element > 0:
            wanted = int(self.target_call_seconds / per_element) or 1
            self.chunk = max(1, min(self.max_chunk, wanted))
        errors: dict[int, Exception] | None = None
        # the failed positions hold no output and book nothing
        good = [p for p in range(len(outputs)) if failed is None or p not in failed]
        sizes = costs if failed is None else [costs[p] for p in good]
        reservations = [NO_RESERVATION] * len(outputs)
        # The outputs exist: booked as they are, beyond the share if they outgrew the estimate.
        for position, booking in zip(good, self.account.book_existing(sizes), strict=True):
            reservations[position] = booking
        if failed is not None:
            origins, probe = call.origins, self.origin_probe
            errors = {
                position: note_element_error(
                    error, self.stage, call.first_index + call.start + position,
                    None if origins is None or probe is None else probe[1](origins[position]),
                )
                for position, error in failed.items()
            }
        if sizes:
            ratio = 0.0  # (unused where a hint tells each output's size)
            if self.output_nbytes is None:
                inputs = call.inputs if failed is None else [call.inputs[p] for p in good]
                ratio = max(map(truediv, sizes, inputs), default=0.0)
            elif failed is None:  # booked at the hints: what the outputs cost beyond them
                excess = max(0, -((call.booked - sum(sizes)) // len(sizes)))
                slack = self.hint_slack
                self.hint_slack = excess if slack is None else min(slack, excess)
            self._learn(max(sizes), ratio)
        if call.error is not None:
            errors = errors or {}
            errors[len(outputs)] = call.error
            outputs.append(None)
            reservations.append(NO_RESERVATION)
        start = call.start
        if start:  # positions in the chunk, after those another call handed out
            outputs = [None] * start + outputs
            reservations = [NO_RESERVATION] * start + reservations
            if errors is not None:
                errors = {start + position: error for position, error in errors.items()}
        self.ready.append(Handoff(
            outputs, reservations, call.state_before, errors, call.first_index, start=start))

    def _learn(self, largest: int, ratio: float) -> None:
        """Outputs came in, the ``largest`` of them and the largest output/input size
        ``ratio`` among them: raise the estimates they pass, and book the calls in
        flight at the new ones now (past the share if it must: that work is already
        running; no new call starts until the stage is back within its share).

        Not with ``output_nbytes``: each call in flight was booked at its own
        outputs' sizes, told by the hint, so a large output says nothing about
        theirs. Rebooking them at it double-booked them as an overdraft (12 MB for
        a map decoding heavy-tailed JPEGs, budget fuzzer seed 300003 of
        ``newer_spec``), which held the stage back for nothing.

        Why the ratio: calls are sized (chunked) by how quick the elements so far
        were, and booked at the largest output so far. Inputs 100x larger than the
        first ones, each growing 4x, then filled chunks booked at their inputs'
        size that made 4x that: 90 MB of overdraft on a 24 MB share (budget fuzzer
        seed 130361).
        """
        grew = largest > self.output_estimate
        self.output_estimate = max(self.output_estimate, largest)
        if self.output_nbytes is not None:
            return
        if ratio > self.output_ratio:
            self.output_ratio, grew = ratio, True
        if not grew:
            return
        estimate = self.output_estimate
        for call in self.calls:
            if not call.count:
                continue
            need = sum(max(nbytes, self._expected_output(None, estimate, nbytes))
                       for nbytes in call.inputs[: call.count])
            if need > call.booked:
                call.bookings.append(self.account.overdraw(need - call.booked))
                call.booked = need

    def pull(self) -> tuple[Any, Reservation]:
        if not self.ready:
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
        """Where the earliest input not handed out yet is: a restore runs again from there.

        In order, that is the first chunk ready or in flight. Out of order, a later
        chunk may be ready (or partly handed out) while an earlier one still runs:
        restoring at the first chunk ready lost the earlier one's elements, so the
        earliest of all is taken, and what came out after it comes again
        (at-least-once)."""
        aside = self.aside
        pending = itertools.chain(  # (index, the chunk's input state, position in it)
            ((chunk.first_index + chunk.taken, chunk.state_before, chunk.taken)
             for chunk in self.ready),
            ((call.first_index + call.start, call.state_before, call.start)
             for call in self.calls),
            () if aside is None else
            ((aside.first_index + aside.position, aside.state_before, aside.position),),
        )
        if self.finished is None:  # in order: the first is the earliest
            earliest = next(pending, None)
        else:
            earliest = min(pending, key=lambda where: where[0], default=None)
        index, state_before, skip = earliest or (self.next_index, self.state_after_last_input, 0)
        state = {INNER: state_before, SKIP: skip, "index": index}
        return state if self.finished is None else mark_out_of_order(state, self)

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        inner_state = reader.child(INNER)
        # outputs of the chunk already handed out: a position inside one chunk
        skip = reader.integer(SKIP, high=_MAX_CHUNK + 1, why="the largest chunk and its error")
        self._drop_calls()
        restore_input(self.inner, inner_state, skip, self.stage)
        self.state_after_last_input = self.inner.get_state()
        self.next_index = reader.integer("index") if "index" in state else 0
        self.exhausted = False

    def _drop_calls(self) -> None:
        for chunk in self.ready:
            chunk.release()
        self.ready.clear()
        if self.aside is not None:
            self.aside.reservation.release()
            self.aside = None
        while self.calls:
            call = self.calls.popleft()
            call.future.cancel()
            release_all(call.bookings)

    def close(self) -> None:
        self._drop_calls()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        super().close()
