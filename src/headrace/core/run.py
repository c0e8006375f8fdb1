"""One run of a pipeline: the iterator users hold, the default budget, the state envelope.

:class:`DatasetIterator` is what ``iter(dataset)`` returns. It builds the
iterator tree from the recipe, owns the run's budget (its own, or a child of
the process-wide default), wraps the tree's state in a versioned,
fingerprinted envelope and checks that envelope on restore, and is freed by
garbage collection (with its threads, files and budget) when abandoned
without ``close()``.
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Iterator as _PyIterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from headrace._closing import ClosesOnExit
from headrace._errors import CheckpointError, IteratorClosedError, MemoryBudgetError, add_note
from headrace._memory.allocator import tune_allocator
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import NO_RESERVATION
from headrace._memory.sizeof import register_sizer
from headrace._memory.system import available_memory, live_runs
from headrace._options import Options
from headrace._stateful import StateDict
from headrace.core.element_errors import RepeatCheck
from headrace.core.iterator import Context, Iterator
from headrace.core.state import (
    OUT_OF_ORDER,
    StateReader,
    check_seal,
    out_of_order_marked,
    seal,
    stale_out_of_order,
)
from headrace.core.stats import RunStats
from headrace.io.filepool import FileLimiter

if TYPE_CHECKING:
    from headrace.core.node import Node

__all__ = [
    "STATE_VERSION",
    "DatasetIterator",
    "call_outside_collection",
    "default_budget",
    "join_abandoned",
]

#: Version of the state dicts; bumped when their layout or the fingerprints change
#: (2: functions fingerprinted by code and closure values, checked state fields;
#: 3: a checksum over every field, :func:`headrace.core.state.seal`;
#: 4: take, skip, shard and repeat over indices, and take, skip and shard over
#: elements, count what they consumed, one layout: :mod:`headrace.core.indexing`).
STATE_VERSION = 4
#: Older versions this headrace still restores: 3 differs only in those stages'
#: states, which read their version-3 fields too.
_READABLE_VERSIONS = (3, STATE_VERSION)

_perf_counter = time.perf_counter  # a global, not an attribute lookup, twice per element

_default_budget: MemoryBudget | None = None
_default_budget_lock = threading.Lock()


def default_budget() -> MemoryBudget:
    """The process-wide budget shared by every pipeline that sets none.

    Half of the memory available to this process when first needed (cgroup
    aware), like tf.data's ``ram_budget`` default — but enforced.
    """
    global _default_budget
    with _default_budget_lock:
        if _default_budget is None:
            _default_budget = MemoryBudget(available_memory() // 2)
        return _default_budget


_iteration_counters_lock = threading.Lock()


def _iterations(node: Node) -> itertools.count[int]:
    """How many iterators this recipe has had: tf.data reshuffles on each new one."""
    with _iteration_counters_lock:
        counter: itertools.count[int] | None = node.__dict__.get("_iterations")
        if counter is None:
            counter = node.__dict__["_iterations"] = itertools.count()
        return counter


def set_next_iteration(node: Node, value: int) -> None:
    """(Internal.) Make the next iterator over ``node`` iteration ``value``: a training
    loop resumed in a new process continues the reshuffling where the old one was."""
    with _iteration_counters_lock:
        node.__dict__["_iterations"] = itertools.count(value)


def _close_run(tree: Iterator, budget: MemoryBudget) -> None:
    budget.close()
    tree.close()
    live_runs.stop(budget)


def _close_abandoned(tree: Iterator, budget: MemoryBudget) -> None:
    """Finalizer of an iterator dropped without ``close()``.

    Dropped by its last reference (a ``for`` loop that ended or broke, a
    ``del``), it closes here and now, so its files and memory are back when the
    statement is done. Collected by the cycle collector, it runs inside
    whatever allocation triggered the collection, in any thread — also one in
    the middle of a booking, holding the lock the close needs (pipelines on the
    default budget share one) — so then it takes no lock: the close runs on a
    short thread of its own, which waits its turn (:func:`call_outside_collection`).
    """
    call_outside_collection(_close_run, tree, budget)


def call_outside_collection(function: Callable[..., None], *args: Any) -> None:
    """Call ``function(*args)`` now, or on a short thread of its own when the cycle
    collector is running (a finalizer that releases budget must not take the budget's
    lock inside a collection: the thread it interrupted may hold it)."""
    if not _collecting:
        function(*args)
        return
    closer = threading.Thread(target=function, args=args, name="headrace-close", daemon=True)
    try:
        closer.start()
    except RuntimeError:  # the interpreter is shutting down: nothing else runs any more
        function(*args)
        return
    _closers.add(closer)


_collecting = False


def _track_collections(phase: str, info: dict[str, Any]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_track_collections)

#: Closes of abandoned iterators still running (see :func:`join_abandoned`).
_closers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def join_abandoned(timeout: float = 10.0) -> bool:
    """Wait until every iterator collected so far is closed; False on timeout.

    For tests and for code that must see the memory of dropped iterators
    returned at a precise point (after ``gc.collect()``).
    """
    deadline = time.monotonic() + timeout
    for closer in list(_closers):
        closer.join(max(0.0, deadline - time.monotonic()))
    return not any(closer.is_alive() for closer in list(_closers))


class _Turn:
    """(Internal.) Lets one thread at a time into an iterator's stages.

    A lock's ``with`` costs about 2,000 instructions a ``next()`` (its ``acquire``
    parses keywords; an RLock also reads the thread's id), 10% of a batch of an
    array. The uncontended path here is a ``list.pop()`` and a ``list.append()`` of
    the one token (each atomic), about 800. A thread that finds no token waits on a
    condition, and whoever gives the token back wakes one waiter.

    A thread calling into the iterator from inside its own ``next()`` (a map
    function or a generator pulling from the iterator that runs it) is refused with
    :class:`RuntimeError`: it would wait on itself forever (the stages are not
    reentrant, so letting it in would corrupt them).
    """

    __slots__ = ("_changed", "_owner", "tokens", "waiting")

    def __init__(self, owner: DatasetIterator) -> None:
        self.tokens: list[None] = [None]
        #: Threads waiting for the token: read after the token is given back, so a
        #: waiter that found none is always woken (the count rises before it looks).
        self.waiting = 0
        self._changed = threading.Condition(threading.Lock())
        self._owner = weakref.ref(owner)

    def wait(self) -> None:
        """Block until this thread has the token."""
        if self._inside():
            raise RuntimeError(
                "this iterator was called from inside its own next(), get_state() or "
                "set_state() (a map function or generator pulling from the iterator that "
                "runs it); a pipeline's stages cannot be re-entered"
            )
        with self._changed:
            self.waiting += 1
            try:
                while True:
                    try:
                        self.tokens.pop()
                        return
                    except IndexError:
                        self._changed.wait()
            finally:
                self.waiting -= 1

    def wake(self) -> None:
        with self._changed:
            self._changed.notify()

    def _inside(self) -> bool:
        """Whether this thread is inside the iterator already: its stack shows the
        iterator's methods twice (the call asking now, and one that holds the turn)."""
        owner = self._owner()
        frame: FrameType | None = sys._getframe(1)
        seen = 0
        while frame is not None:
            if frame.f_code in _TURN_CODES and frame.f_locals.get("self") is owner:
                seen += 1
            frame = frame.f_back
        return seen > 1

    def __enter__(self) -> None:
        try:
            self.tokens.pop()
        except IndexError:
            self.wait()

    def __exit__(self, *exc: object) -> None:
        self.tokens.append(None)
        if self.waiting:
            self.wake()


class DatasetIterator(ClosesOnExit, StateDict, _PyIterator[Any]):
    """What ``iter(dataset)`` returns: the root of one run of the pipeline.

    Use it as a context manager, or call :meth:`close`, to stop its threads and
    return its memory at once; an iterator dropped without either is freed by
    garbage collection (no background thread keeps it alive).

    ``state_dict()``/``load_state_dict()`` are :meth:`get_state`/:meth:`set_state`
    for PyTorch's checkpoint tools (``torch.distributed.checkpoint``, torchdata's
    ``StatefulDataLoader``): see :mod:`headrace._stateful`.
    """

    def __init__(
        self,
        node: Node,
        options: Options,
        *,
        probe: bool = False,
        shared_budget: MemoryBudget | None = None,
        shared_part: int | None = None,
        file_limiter: FileLimiter | None = None,
    ) -> None:
        if options.tune_allocator:
            tune_allocator()
        self._node = node
        # ``shared_budget``/``file_limiter``: runs that must share one budget and one
        # descriptor cap (the consumers' streams of one headrace.serve producer);
        # ``shared_part``: this run's part of the shared budget (its stages' shares add
        # up to it), by default the whole.
        explicit = options.budget_bytes
        if shared_budget is not None:
            budget = (
                shared_budget.child() if shared_part is None
                else MemoryBudget(shared_part, parent=shared_budget)
            )
        else:
            budget = MemoryBudget(explicit) if explicit is not None else default_budget().child()
        # A probe (reading one element to learn a spec) must not count as an
        # iteration: that would change which shuffle order the next real one gets.
        iteration = 0 if probe else next(_iterations(node))
        self._context = Context(options, budget, iteration)
        self._context.run.probe = probe
        self._context.run.file_limiter = file_limiter
        self._tree = node.make_iterator(self._context)
        self._pull = self._tree.pull  # bound once: called per element
        # One thread at a time in the stages (as a tf.data iterator, it may be shared by
        # threads): a stage's pull is not reentrant (two threads through a shuffle
        # handed out elements twice and lost others; through an interleave, deadlocked).
        self._turn = _Turn(self)
        self._take_turn = self._turn.tokens.pop  # bound once: per element (see _Turn)
        self._give_turn = self._turn.tokens.append
        budget.allot()
        if not probe:
            live_runs.start(budget)
        self._closed = False
        # Made at the first error: whether the pipeline raises it again without moving.
        self._repeats: RepeatCheck | None = None
        self._close = weakref.finalize(self, _close_abandoned, self._tree, budget)
        self._elements = 0
        self._waited = 0.0
        self._started: float | None = None

    @property
    def context(self) -> Context:
        """The run's shared context (budget, options)."""
        return self._context

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise IteratorClosedError(
                "this iterator was closed; create a new one with iter(dataset)"
            )
        try:
            self._take_turn()
        except IndexError:  # another thread is in the stages
            self._turn.wait()
        try:
            started = _perf_counter()
            if self._started is None:
                self._started = started
            element, reservation = self._pull()
            if reservation is not NO_RESERVATION:  # most batches of arrays book nothing
                reservation.release()
            self._elements += 1
            self._waited += _perf_counter() - started
            if self._repeats is not None:
                self._repeats.moved()
        except Exception as error:
            self._end_if_stuck(error)
            raise
        finally:
            self._give_turn(None)
            if self._turn.waiting:
                self._turn.wake()
        return element

    def _end_if_stuck(self, error: Exception) -> None:
        """End the stream after an error the pipeline raises again without moving.

        Most errors stand in an element's place and iteration goes on past them (as
        in tf.data). One of headrace's own (a minimum working set over the budget)
        that comes back at every ``next()`` with the pipeline's state unchanged would
        make a loop that catches errors and goes on spin forever: after its third
        time in place, the stream ends, and later calls raise StopIteration as a
        Python generator does after it raised. Errors of the data or of user code
        (a reader that may succeed when asked again) are left to the caller. A
        restore (:meth:`set_state`) goes on from the state it is given."""
        if not isinstance(error, MemoryBudgetError):  # (a broken worker pool raises for
            return  # good, until the iterator is closed: documented, and resumable)
        if self._repeats is None:
            self._repeats = RepeatCheck(self._tree, "the pipeline", self._progress)
        if self._repeats.repeated(error):
            add_note(error, "headrace: the pipeline raised this error again without "
                            "moving, so it cannot go on: the stream ends here (next() "
                            "raises StopIteration)")
            self._pull = _ended

    def _progress(self, error: Exception) -> Any:
        """Where the stage is that refused ``error`` (the lowest of the run's stages named
        as its ``stage``, in each branch; where none is, the whole tree): a stage above
        it that counts errors as positions moves with every raise, it does not. (Of two
        stages of one name, one above the other, the lower one stands still whichever
        refused; it moves when the upper one's refusals take its elements.)"""
        stage = getattr(error, "stage", None)
        named = [] if stage is None else [
            iterator for iterator in self._tree.walk() if getattr(iterator, "stage", None) == stage]
        lowest = []
        for iterator in named:
            below = {id(other) for other in iterator.walk()[1:]}
            if not any(id(other) in below for other in named):
                lowest.append(iterator)
        if not lowest:
            return self._tree.get_state()
        return [iterator.get_state() for iterator in lowest]

    def stats(self) -> RunStats:
        """A snapshot of this run: budget and per-stage bookings, throughput, process memory."""
        elapsed = 0.0 if self._started is None else time.perf_counter() - self._started
        run = self._context.run
        return RunStats.capture(
            self._context.budget,
            self._elements,
            elapsed,
            self._waited,
            (run.skipped_records, run.skipped_bytes),
            workers=tuple(
                stage.worker_stats() for stage in self.stages() if hasattr(stage, "worker_stats")
            ),
        )

    def get_state(self) -> dict[str, Any]:
        """A small JSON-able dict to resume exactly here with :meth:`set_state`.

        Raises :class:`CheckpointError` where a stage runs out of order
        (``deterministic=False``) below a stage that kept its state from before
        the elements it has counted since (a batch being assembled, a prefetch's
        chunk): a restore replays those elements in another order, so the count
        would skip elements never seen. A checkpoint there would lose data; one
        where only stateless stages (``filter``, a sequential ``map``) sit above
        the out-of-order stage is at-least-once.
        """
        self._check_open()
        with self._turn:
            tree_state = self._tree.get_state()
        self._refuse_stale_out_of_order(tree_state)
        return seal(
            {
                "format": "headrace.iterator",
                "version": STATE_VERSION,
                "fingerprint": self._node.fingerprint(),
                "iteration": self._context.run.iteration,
                "state": tree_state,
            }
        )

    def _refuse_stale_out_of_order(self, tree_state: dict[str, Any]) -> None:
        stages = list(self._context.run.out_of_order)  # (interleave slots' stages too)
        if not stages:
            return
        for marked in out_of_order_marked(tree_state):
            for stage in stages:
                if stale_out_of_order(stage, marked[OUT_OF_ORDER]):
                    raise CheckpointError(
                        f"get_state: {stage.stage} runs out of order "
                        "(deterministic=False) and a stage above it resumes by "
                        "counting the elements it took since an earlier state; a "
                        "restore would replay them in another order and lose some. "
                        "Use deterministic=True in a pipeline you checkpoint, or "
                        "checkpoint where only stateless stages follow the "
                        "out-of-order one."
                    )
        replaying = [stage for stage in stages if hasattr(stage, "replays") and stage.replays()]
        if not replaying:
            return
        for counter in self._tree.walk():
            if not counter.counts_positions:
                continue
            below = counter.walk()
            for stage in replaying:
                if any(stage is other for other in below):
                    raise CheckpointError(
                        f"get_state: {stage.stage} runs out of order (deterministic=False), "
                        f"and a restore here would hand out {stage.replays()} of its elements "
                        f"again (at-least-once); {counter.stage} above it counts positions in "
                        "the stream, so those would take the places of others, which would be "
                        "lost. Use deterministic=True in a pipeline you checkpoint, or put "
                        f"{counter.stage} below the out-of-order stage."
                    )

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`get_state` of an iterator over the same pipeline.

        Raises :class:`CheckpointError` if the state comes from another pipeline
        (fingerprint mismatch) or another state format version, if it was changed
        after :meth:`get_state` made it (its checksum: integrity, not security — see
        :mod:`headrace.core.state`), or if any field
        of any stage is of the wrong type or out of range (a counter past the end
        of a finite input included). A refused state may leave this iterator
        part-way restored: restore another state or make a new iterator.
        """
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != "headrace.iterator":
            raise CheckpointError("not a headrace iterator state (missing 'format' marker)")
        if state.get("version") not in _READABLE_VERSIONS:
            raise CheckpointError(
                f"iterator state has format version {state.get('version')}, "
                f"this headrace reads versions {', '.join(map(str, _READABLE_VERSIONS))}"
            )
        check_seal(state, "iterator state")
        fingerprint = self._node.fingerprint()
        if state.get("fingerprint") != fingerprint:
            raise CheckpointError(
                "iterator state belongs to a different pipeline (fingerprint "
                f"{state.get('fingerprint')!r}, this pipeline is {fingerprint!r}); "
                "restoring it would feed the wrong data"
            )
        reader = StateReader(state, "iterator")
        iteration = reader.integer("iteration")
        tree_state = reader.child("state")
        self._context.run.iteration = iteration
        self._context.run.seeds.clear()
        # Every stage checks its own fields (naming itself); errors of the data or of
        # user functions met while replaying are raised as they are, not as the state's.
        self._pull, self._repeats = self._tree.pull, None  # (a stream that had ended)
        try:
            with self._turn:
                self._tree.set_state(tree_state)
        except StopIteration:  # a replay off the input's end, in a stage that did not say
            raise CheckpointError(
                "iterator state points past the end of the input; it belongs to other data"
            ) from None

    def close(self) -> None:
        """Stop threads, close files and return the budget now. Idempotent."""
        self._closed = True
        if self._close.detach() is not None:  # not closed yet: close here, and now
            _close_run(self._tree, self._context.budget)

    def _check_open(self) -> None:
        if self._closed:
            raise IteratorClosedError("this iterator was closed")


    def stages(self) -> list[Iterator]:
        """Every iterator of the run, root first (for the profiler)."""
        return self._tree.walk()


def _ended() -> tuple[Any, Any]:
    """The pull of a stream that cannot go on (:meth:`DatasetIterator._end_if_stuck`)."""
    raise StopIteration


def _iterator_size(iterator: DatasetIterator) -> int:
    """What an iterator keeps alive, for ``sizeof`` (an element, a generator's frame or a
    user's object holding one): the bytes its stages book, not a walk of its stages,
    threads and recipe (the doctor sized a generator that kept a pipeline's iterator by
    walking all of that: 90 s a look)."""
    return sys.getsizeof(iterator) + iterator._context.budget.booked()


register_sizer(DatasetIterator, _iterator_size)

#: The methods that hold an iterator's turn while they run (see :class:`_Turn`).
_TURN_CODES = frozenset(
    method.__code__
    for method in (DatasetIterator.__next__, DatasetIterator.get_state, DatasetIterator.set_state)
)
