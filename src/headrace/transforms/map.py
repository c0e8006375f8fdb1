"""``map(fn, num_parallel_calls=None, deterministic=None)``.

As in tf.data, a tuple element is passed to ``fn`` as positional arguments and
any other element (dict, array) as one argument. Sequentially, ``map`` keeps
random access, so a later ``shuffle`` or ``shard`` still works on indices.

With ``num_parallel_calls`` the calls run on a thread pool (NumPy, I/O and
most decoders release the GIL; for Python-heavy functions use process
workers). Work in flight is booked ahead on the stage's share of the budget
(:mod:`headrace.memory.inflight`): a new call starts only while the largest
output seen so far still fits, so ``AUTOTUNE`` means "as many threads as
cores, as many calls in flight as the budget allows". A call is booked at the
largest output so far, or at its input's size times the largest output/input
ratio so far, whichever is larger; only one call runs until the first output
is known. What was booked is also the call's allowance: a call whose outputs
pass it stops after that output, and the inputs it did not run wait for room
in a new call. So however the sizes jump, a call holds at most one output
past its booking. An input whose expected output does not fit beside what the
stage holds waits for room, its upstream booking kept. An output larger than
the whole budget raises :class:`~headrace.errors.MemoryBudgetError` naming the
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
from queue import Empty, SimpleQueue
from typing import Any, NamedTuple

from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.handoff import Handoff, restore_input, unpin
from headrace.core.indexing import IndexPlan, RandomAccess, Reach, Refusal, SequentialIndices
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import Node, ShardRole, Traits, check_signature, first_element
from headrace.core.position import CURRENT_POSITION as _POSITION
from headrace.core.state import INNER, SKIP, StateReader, mark_out_of_order
from headrace.errors import InvalidArgumentError, MemoryBudgetError, Origin, note_element_error
from headrace.memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace.memory.inflight import InFlight, Ticket
from headrace.options import AUTOTUNE
from headrace.structure import TensorSpec, flatten, map_structure, returned, spec_of
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
    """Call ``fn`` the way tf.data does: a tuple's components become the arguments, and
    a list it returns is a tuple of components (:func:`~headrace.structure.returned`)."""
    if isinstance(element, tuple):
        return returned(fn(*element))
    return returned(fn(element))


def call_at(fn: Callable[..., Any], element: Any, position: tuple[int, ...]) -> Any:
    """``apply_fn`` with the element's position published to the function (see
    :mod:`headrace.core.position`): random ops seeded with an int draw from it."""
    token = _POSITION.set(position)
    try:
        output = fn(*element) if isinstance(element, tuple) else fn(element)
    finally:
        _POSITION.reset(token)
    # (structure.returned, inlined: this runs per element)
    return tuple(output) if type(output) is list else output


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
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
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


_MapResult = tuple[list[Any], list[int], dict[int, Exception] | None, float]


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
    allowance: int | None = None,
    ledger: InFlight | None = None,
    forced: bool = False,
) -> _MapResult:
    """``fn`` over a chunk: the outputs as a buffer keeps them, their costs, the errors.

    Each output is admitted (costed, and copied out if it is a small view of a
    large temporary) as soon as ``fn`` returns it, in the worker: a chunk of
    views would otherwise keep a chunk of temporaries alive until the consumer
    collects it — memory no booking covers. An element whose call raised
    leaves ``None``, its error, and the error's cost (an exception may carry
    arrays). ``first``: the position in the map's input of ``elements[0]`` (in
    ``epochs``), published to ``fn`` (:func:`call_at`).

    ``allowance``: the bytes booked for the chunk's outputs. Once the outputs cost
    more and inputs remain, the call stops there and returns fewer outputs than
    inputs (:func:`~headrace.memory.inflight.over_allowance`). The consumer runs
    the rest in a later call. So a call holds at most one element past its booking.

    ``ledger``: the stage's in-flight ledger. Each output's cost is reported to it
    as it is made, and the call also stops *before* an input whose output, at the
    largest size seen so far (by any call), would pass the allowance
    (:meth:`~headrace.memory.inflight.InFlight.stop_before`): calls queued before a
    jump in size then hand their inputs back instead of each making one more large
    output. Its first input too, unless ``forced`` (the consumer waits for it).
    """
    started = time.perf_counter()
    outputs: list[Any] = []
    sizes: list[int] = []
    failed: dict[int, Exception] | None = None
    spent, last = 0, len(elements) - 1
    limit = -1 if allowance is None else allowance  # (over_allowance, inlined: per element)
    ahead = ledger is not None and limit >= 0
    # Per element, the ledger's stop_before and observe are called only where they can
    # answer or learn something: stop_before needs the largest output so far to pass
    # the allowance, and observe (without a hint) only raises the largest. The ledger's
    # fields are read here, as each call would (a Python call per element less, each).
    for position, element in enumerate(elements):
        if (
            ahead and (position or not forced)
            and spent + ledger._largest > limit  # type: ignore[union-attr]
            and ledger.stop_before(spent, limit)  # type: ignore[union-attr]
        ):
            break  # its output would pass the allowance: the rest goes back
        if progress is not None and not progress.claim(position):
            break  # the rest was given to another call
        try:
            output, size = admit(call_at(fn, element, (*epochs, first + position)))
        except Exception as error:  # raised in the consumer, at this element's position
            if failed is None:
                failed = {}
            failed[len(outputs)] = unpin(error)  # held until handed out: pins nothing
            # What the error keeps alive counts against the allowance like an output.
            output, size = None, admit(error)[1]
        outputs.append(output)
        sizes.append(size)
        spent += size
        if ledger is not None and (size > ledger._largest or ledger.hint is not None):
            ledger.observe(size, limit)
        if spent > limit >= 0 and position < last:
            break  # past the allowance: the inputs left go back to the consumer
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
    """Work in flight: a future over a chunk of inputs, its ticket, where it started.

    ``state_before`` is the input's state before the chunk's first element and
    ``first_index`` that element's index: a checkpoint inside a chunk restores the
    state and skips the elements already out, so the input's state is taken once per
    chunk, not once per element. ``error`` is what the input raised right after the
    chunk's elements (the chunk ends there): it is handed out in that place.
    ``start``: the position in that chunk of this call's first element (a call
    finishing a chunk whose first elements went out in another call: the tail of a
    split call, a handed-back tail, or an element that waited for room).
    ``ticket``: what the ledger booked for the outputs (one entry per input still
    this call's: a split takes entries away). ``elements``: the inputs, kept to hand
    them to a new call. ``origins``: where each came from, where the input can say
    (tokens of ``Iterator.origin_token``, made into origins for error notes only).
    ``future`` is None while the call waits to start: inputs handed back wait until
    their booking covers the first of them, or until the consumer needs them.
    """

    __slots__ = (
        "elements", "error", "first_index", "future", "origins", "progress", "start",
        "state_before", "ticket",
    )

    def __init__(
        self,
        ticket: Ticket,
        elements: list[Any],
        state_before: dict[str, Any],
        first_index: int,
        error: Exception | None,
        origins: list[Any] | None,
        start: int,
    ) -> None:
        self.ticket, self.elements = ticket, elements
        self.state_before, self.first_index, self.error = state_before, first_index, error
        self.origins, self.start = origins, start
        self.future: Future[_MapResult] | None = None
        self.progress: _Progress | None = None


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
    """A map's calls on a thread pool, their outputs booked through the in-flight ledger.

    The map keeps its own logic here: which inputs go into which call (chunks
    sized by time and by bytes), the order, errors in their element's place,
    and the input state a checkpoint restores. The bytes are the ledger's
    (:class:`~headrace.memory.inflight.InFlight`): it books each call ahead,
    and the booking is the call's allowance.

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
    - ``target_call_seconds``: how long a call should run; chunks grow to it.
    - ``max_chunk``: the most inputs in one call.
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
        self.threads, self.deterministic, self.stage = threads, deterministic, stage
        self.pool: ThreadPoolExecutor | None = None
        self.calls: deque[_Call] = deque()
        self.ready: deque[Handoff] = deque()  # outputs (and errors) to hand out, in order
        self.exhausted = False
        self.chunk = 1
        #: How long one call should run: chunks grow to it (process workers set more).
        self.target_call_seconds = _TARGET_CALL_SECONDS
        self.max_chunk = _MAX_CHUNK
        # Out of order, finished calls announce themselves here (one queue get per
        # call, not a wait() over every call in flight).
        self.finished: SimpleQueue[_Call] | None = None if deterministic else SimpleQueue()
        if not deterministic:
            ctx.run.out_of_order.add(self)
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
        # the count and the input index where this run (or its last restore) started
        self.handed_at_start = self.index_at_start = 0
        #: Out of order, the first call ran past _SPLIT_AFTER_SECONDS before any output
        #: was settled: one more call may start beside it (see :meth:`_take_call`).
        self.straggling = False

    @property
    def output_estimate(self) -> int:
        """The largest output so far (the ledger's)."""
        return self.ledger.largest()

    def _start_call(
        self, elements: list[Any], progress: _Progress | None = None, first: int = 0,
        allowance: int | None = None, forced: bool = False,
    ) -> Future[_MapResult]:
        """Run ``fn`` over a chunk in the background (see the class doc)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="headrace-map")
        return self.pool.submit(_apply_chunk, self.fn, elements, self.ctx.admit, progress,
                                first, self.ctx.epochs, allowance, self.ledger, forced)

    def _launch(
        self,
        elements: list[Any],
        ticket: Ticket,
        state_before: dict[str, Any],
        first_index: int,
        error: Exception | None,
        origins: list[Any] | None,
        start: int = 0,
        *,
        front: bool = False,
        wait: bool = False,
    ) -> None:
        """Add a call; ``front``: it is the next to collect in order (a handed-back tail);
        ``wait``: it starts later, once its booking covers its first input
        (:meth:`_start_waiting`) or the consumer needs it (:meth:`_take_call`)."""
        call = _Call(ticket, elements, state_before, first_index, error, origins, start)
        if front:
            self.calls.appendleft(call)
        else:
            self.calls.append(call)
        if not wait:
            self._start(call)

    def _start(self, call: _Call, *, forced: bool = False) -> None:
        """Start ``call``; ``forced``: the consumer waits for it, so it runs its first
        input whatever its booking (progress)."""
        elements = call.elements
        progress = _Progress(len(elements)) if self.finished is not None and elements else None
        try:
            future = self._start_call(elements, progress, call.first_index + call.start,
                                      allowance=call.ticket.booked, forced=forced)
        except Exception as refused:
            # The stage cannot run calls (its worker pool is broken): the chunk stays
            # pending with its elements' place and input state, and raises when its turn
            # comes, so a state taken now starts at it and nothing pulled is lost.
            future = Future()
            future.set_exception(refused)
        call.future, call.progress = future, progress
        if self.finished is not None:  # (the queue, not self: threads must not
            future.add_done_callback(functools.partial(_announce, self.finished, call))

    def _start_waiting(self) -> None:
        """Start the handed-back inputs whose booking now covers their first output
        (the ledger books more for them as room comes back)."""
        for call in self.calls:
            if call.future is None and self.ledger.top_up(
                call.ticket, call.elements
            ).covers_first():
                self._start(call)

    def _hand_on(self, call: _Call, at: int, ticket: Ticket, *, front: bool) -> None:
        """Run the inputs of ``call`` from position ``at`` on (booked by ``ticket``) in a
        new call: the rest of a slow call, or the inputs a call handed back. It starts
        now if its booking covers its first input; else it waits like new work."""
        ticket = self.ledger.top_up(ticket, call.elements[at : at + len(ticket)])
        wait = not ticket.covers_first()
        count = len(ticket)
        elements = call.elements[at : at + count]
        origins = call.origins
        error, call.error = call.error, None  # an input error comes after the tail
        self._launch(
            elements, ticket, call.state_before, call.first_index, error,
            None if origins is None else origins[at : at + count], call.start + at,
            front=front, wait=wait,
        )

    def _split_slow_calls(self) -> None:
        """Out of order only: give the elements after a long-running one to a new call."""
        older_than = time.perf_counter() - _SPLIT_AFTER_SECONDS
        for call in list(self.calls):
            if call.progress is None:
                continue
            given_up = call.progress.split(older_than)
            if given_up:
                self._hand_on(call, given_up.start,
                              self.ledger.split(call.ticket, given_up.start), front=False)

    def _submit_more(self) -> None:
        ledger = self.ledger
        self._start_waiting()
        # (settles happen on this thread, in _collect: not while this loop runs)
        most = 2 * self.threads if ledger.settled() else 1 + self.straggling
        while (
            not self.exhausted
            and len(self.calls) < most
            # Nothing in flight or ready: one call may always start (progress); otherwise
            # only while its output, at the largest size seen, fits beside what is held.
            and ledger.may_start(not self.calls and not self.ready)
        ):
            if self.aside is not None:
                if not self._launch_aside():
                    return
                continue
            state_before, first_index = self.state_after_last_input, self.next_index
            elements, ticket, error = self._pull_chunk()
            if elements or error is not None:
                self._launch(elements, ticket, state_before, first_index, error,
                             self.pulled_origins)

    def _launch_aside(self) -> bool:
        """Start the element set aside once its expected output fits beside what the
        stage holds (or nothing else is in flight or ready: progress); False while
        it must wait."""
        aside = self.aside
        assert aside is not None
        ledger = self.ledger
        size = ledger.guess(aside.element, aside.nbytes)
        if (self.calls or self.ready) and not ledger.fits(size):
            return False
        self.aside = None
        ticket = Ticket()
        ledger.add(ticket, aside.nbytes, size, aside.reservation)
        self._launch(
            [aside.element], ledger.book(ticket), aside.state_before, aside.first_index,
            None, None if aside.origin is None else [aside.origin], aside.position,
        )
        return True

    def _pull_chunk(self) -> tuple[list[Any], Ticket, Exception | None]:
        """Up to ``chunk`` inputs, booked at their expected output size, and the error
        the input raised after them (which ends the chunk), if any.

        A chunk books at most what fits beside what the stage holds, and at most
        a fraction of the share (:meth:`InFlight.call_bytes`), so several calls
        run side by side. An input whose expected output does not fit (known only
        once it is pulled: a larger output/input ratio, or what ``output_nbytes``
        says of it) ends the chunk and waits aside for room, unless nothing else
        is held. The ledger books the inputs (see :meth:`InFlight.add`).
        """
        elements: list[Any] = []
        ticket = Ticket()
        upstream_error: Exception | None = None
        sizeof, ledger = self.ctx.sizeof, self.ledger
        expect, add = ledger.expect, ledger.add
        probe = None if self.origin_probe is None else self.origin_probe[0]
        origins: list[Any] | None = None if probe is None else []
        self.pulled_origins = origins
        estimate = ledger.largest()
        # (what a chunk's first input must fit beside: nothing, where nothing is in flight)
        alone = not self.calls and not self.ready
        room = ledger.room()
        share = ledger.share()  # (expect's cap, read once a chunk)
        cap = ledger.call_bytes(2 * self.threads, room)
        spent = 0  # bytes this chunk books
        while len(elements) < self.chunk and (not elements or spent + estimate <= cap):
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
            try:
                if ledger.hint is None or ledger._distrust:  # (expect's guess, inlined)
                    size = int(nbytes * ledger._ratio)
                    if size > share:
                        size = share
                    largest = ledger._largest
                    if largest > size:
                        size = largest
                    if nbytes > size:
                        size = nbytes
                else:
                    size = expect(element, nbytes)
            except Exception as error:  # output_nbytes failed: the element's error, in its place
                reservation.release()
                where = None if origin is None or self.origin_probe is None else (
                    self.origin_probe[1](origin))
                upstream_error = unpin(note_element_error(
                    error, f"{self.stage}'s output_nbytes", self.next_index + len(elements),
                    where))
                break
            # (at most the estimate: it was checked to fit before the pull)
            if size > estimate and spent + size > (cap if elements else room) and (
                elements or not alone
            ):
                self.aside = _Aside(element, reservation, nbytes, origin,
                                    self.state_after_last_input, self.next_index, len(elements))
                break
            elements.append(element)
            if origins is not None:
                origins.append(origin)
            if reservation.account is None:  # (add's common case, inlined: per element)
                ticket.expected.append(size)
                ticket.inputs.append(nbytes or 1)  # (a sizer may say 0: a ratio's divisor)
                ticket.pending += size
            else:
                add(ticket, nbytes, size, reservation)
            spent += size
        if elements or upstream_error is not None or self.aside is not None:
            self.state_after_last_input = self.inner.get_state()
            self.next_index += (
                len(elements) + (upstream_error is not None) + (self.aside is not None))
        return elements, ledger.book(ticket), upstream_error

    def _take_call(self) -> _Call:
        """The next call to collect (still in ``calls``: :meth:`_collect` removes it)."""
        if self.finished is None:
            call = self.calls[0]
            if call.future is None:  # the consumer needs it now: it may run one past
                self._start(call, forced=True)
            return call
        while True:  # calls dropped by a restore may still announce themselves: skip them
            if all(call.future is None for call in self.calls):
                self._start(self.calls[0], forced=True)  # (progress: nothing else runs)
            self._split_slow_calls()
            try:
                call = self.finished.get(timeout=_SPLIT_AFTER_SECONDS)
            except Empty:
                self._pass_straggler()
                continue
            if any(live is call for live in self.calls):
                return call

    def _pass_straggler(self) -> None:
        """Out of order, before any output size is known, one call runs alone (its
        output sets what later calls are booked at). When that first call straggles,
        as tf.data lets a slow first element be overtaken, one more call starts beside
        it, booked at its input's size like the first; the first of the two to finish
        settles the ledger, and the usual calls in flight follow."""
        if (self.straggling or self.threads < 2 or self.exhausted
                or self.ledger.settled() or len(self.calls) != 1):
            return
        self.straggling = True
        self._submit_more()

    def _collect(self, call: _Call) -> None:
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
            if self.finished is not None:
                self.finished.put(call)  # announced again: taken (and raised) again
            raise
        if self.calls[0] is call:
            self.calls.popleft()
        else:
            self.calls.remove(call)
        # Out of order the future's callback holds the call: a cycle that kept the
        # outputs alive, unbooked, until the cyclic GC ran. Dropped here.
        call.future = None
        ledger, ticket, ran = self.ledger, call.ticket, len(outputs)
        # Inputs the call did not run (past its allowance) take what is left of the
        # booking once the outputs made are paid for.
        rest = ledger.split(ticket, ran, sum(costs)) if ran < len(ticket.expected) else None
        per_element = seconds / max(ran, 1)
        if per_element > 0:
            wanted = int(self.target_call_seconds / per_element) or 1
            self.chunk = max(1, min(self.max_chunk, wanted))
        errors: dict[int, Exception] | None = None
        # the failed positions hold no output: their errors are booked below
        good = [p for p in range(ran) if failed is None or p not in failed]
        sizes = costs if failed is None else [costs[p] for p in good]
        inputs = ticket.inputs if failed is None else [ticket.inputs[p] for p in good]
        reservations = [NO_RESERVATION] * ran
        try:
            booked = ledger.settle(ticket, sizes, inputs, whole=failed is None and rest is None)
        except BaseException:  # (the budget closed): book nothing more
            if rest is not None:
                rest.release()
            raise
        for position, booking in zip(good, booked, strict=True):
            if isinstance(booking, MemoryBudgetError):  # never fits: its error, in its place
                outputs[position] = None
                failed = {} if failed is None else failed
                failed[position] = booking
            else:
                reservations[position] = booking
        if rest is not None:  # next in order, where the order is kept
            self._hand_on(call, ran, rest, front=self.finished is None)
        call.elements = []
        if failed is not None:
            origins, probe = call.origins, self.origin_probe
            errors = {
                position: note_element_error(
                    error, self.stage, call.first_index + call.start + position,
                    None if origins is None or probe is None else probe[1](origins[position]),
                )
                for position, error in failed.items()
            }
            for position, error in errors.items():  # held for their turn: booked
                reservations[position] = ledger.hold_error(self.ctx.sizeof(error))
        if call.error is not None:
            errors = errors or {}
            errors[len(outputs)] = call.error
            outputs.append(None)
            reservations.append(ledger.hold_error(self.ctx.sizeof(call.error)))
        if not outputs:  # every input handed back (see _apply_chunk): nothing to hand out
            return
        start = call.start
        if start:  # positions in the chunk, after those another call handed out
            outputs = [None] * start + outputs
            reservations = [NO_RESERVATION] * start + reservations
            if errors is not None:
                errors = {start + position: error for position, error in errors.items()}
        self.ready.append(Handoff(
            outputs, reservations, call.state_before, errors, call.first_index, start=start))

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
        state = {INNER: state_before, SKIP: skip, "index": index}
        return state if self.finished is None else mark_out_of_order(state, self)

    def _earliest(self) -> tuple[int, Any, int]:
        """Where the earliest input not handed out yet is: a restore runs again from there
        (its index, the input's state before its chunk, its position in the chunk).

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
        return earliest or (self.next_index, self.state_after_last_input, 0)

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
        restore_input(self.inner, inner_state, skip, self.stage)
        self.state_after_last_input = self.inner.get_state()
        self.next_index = reader.integer("index") if "index" in state else 0
        self.handed_at_start, self.index_at_start = self.handed, self.next_index
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
            if call.future is not None:
                call.future.cancel()
            call.ticket.release()

    def close(self) -> None:
        self._drop_calls()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        super().close()


# The names sibling modules use (internal to headrace, not part of its API).
MapIterator = _MapIterator
ParallelMapIterator = _ParallelMapIterator
apply_chunk = _apply_chunk
TARGET_CALL_SECONDS = _TARGET_CALL_SECONDS
