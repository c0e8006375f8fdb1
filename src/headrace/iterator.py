"""The run side: iterator objects, the per-iterator context, and the public root iterator.

``iter(dataset)`` turns the recipe (a tree of :class:`~headrace.node.Node`) into a
tree of :class:`Iterator` objects — classes, not generators, because generators
can neither checkpoint nor close deterministically. Each has ``__next__``,
``close()``, ``get_state()`` and ``set_state()``. The root,
:class:`DatasetIterator`, is what users hold: it owns the budget, checks the
state's version and fingerprint, and is freed by garbage collection (with its
threads, files and budget) when abandoned without ``close()``.
"""

from __future__ import annotations

import copy
import itertools
import mmap
import threading
import time
import weakref
from collections.abc import Iterator as _PyIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._closing import ClosesOnExit
from headrace._state import StateReader
from headrace.errors import CheckpointError, IteratorClosedError
from headrace.memory.allocator import tune_allocator
from headrace.memory.budget import NO_RESERVATION, MemoryBudget, Reservation, StageAccount
from headrace.memory.sizeof import admit, owner_of, sizeof
from headrace.options import Options, available_memory

if TYPE_CHECKING:
    from headrace.node import Node
    from headrace.profiling.stats import RunStats

__all__ = ["STATE_VERSION", "Context", "DatasetIterator", "Iterator", "default_budget"]

#: Version of the state dicts; bumped when their layout changes incompatibly.
STATE_VERSION = 1

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


class _Run:
    """Facts about one run that restoring a state may change (shared by context copies)."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        #: Random base seeds of unseeded stages (``shuffle(seed=None)``), by id of their
        #: node, once a restored state has named them: every later epoch of the run
        #: then draws from the saved seed, not from the one this process picked.
        self.seeds: dict[int, int] = {}


class Context:
    """What every iterator of one pipeline run shares: options, budget, bookkeeping.

    ``epochs`` says which repetition of each enclosing ``repeat`` an iterator
    belongs to; with ``run.iteration`` (how many iterators the dataset had
    before this one) it seeds shuffles, so every epoch reshuffles and a
    restored run reshuffles exactly as the original did.

    Lifetimes. An epoch's context (:meth:`with_epoch`) shares everything with
    its parent: a new epoch re-registers the same recipe nodes and arrays, which
    are kept once (by ``id``), so nothing grows with epochs. A nested pipeline's
    context (:meth:`with_budget`, one per interleave slot) has its own accounts,
    its own registry of arrays and its own keep-alive list: all of it dies with
    the slot, so nothing grows with the number of inner datasets either.
    """

    def __init__(self, options: Options, budget: MemoryBudget, iteration: int = 0) -> None:
        self.options = options
        self.budget = budget
        self.run = _Run(iteration)
        self.epochs: tuple[int, ...] = ()
        self.deterministic = options.deterministic is not False
        #: ids of owning buffers that cost this run nothing (never charged).
        self.preexisting: set[int] = set()
        #: Bytes of arrays a nested pipeline's recipe owns (see :meth:`register_preexisting`).
        self.owned_bytes = 0
        self._nested = False
        #: Objects whose ``id`` is a key above, by id: kept once, alive while the run lives.
        self._keepalive: dict[int, object] = {}
        self._accounts: dict[int, StageAccount] = {}
        #: Run-wide objects created on first use (e.g. the pipeline's file limiter).
        self.shared: dict[str, Any] = {}

    def with_epoch(self, epoch: int) -> Context:
        """This context for the iterator of one repetition of an enclosing ``repeat``."""
        child = copy.copy(self)
        child.epochs = (*self.epochs, epoch)
        return child

    def with_budget(self, budget: MemoryBudget) -> Context:
        """The context of a nested pipeline with its own share (an interleave slot).

        Its registries are its own (copies of this one's ``preexisting``: the
        outer run's arrays stay free inside), so they are freed with the slot.
        Arrays the nested recipe holds that the outer run did not already have
        were made while iterating (by the interleave function): they are
        counted in ``owned_bytes``, for the slot to charge, not marked free.
        """
        child = copy.copy(self)
        child.budget = budget
        child.preexisting = set(self.preexisting)
        child.owned_bytes = 0
        child._nested = True
        child._keepalive = {}
        child._accounts = {}
        return child

    def seed_of(self, node: object, default: int) -> int:
        """The base seed of an unseeded random stage in this run: ``default`` unless a
        restored state set another with :meth:`restore_seed`."""
        return self.run.seeds.get(id(node), default)

    def restore_seed(self, node: object, seed: int) -> None:
        """Use ``seed`` for ``node`` for the rest of the run (all later epochs too)."""
        if id(node) not in self.run.seeds:
            self._keepalive[id(node)] = node  # the id stays valid while this run lives
        self.run.seeds[id(node)] = seed

    def register_preexisting(self, array: object) -> None:
        """Mark memory a source's recipe holds, so views into it are not charged again.

        ``array`` is the array the source serves rows of (or its owning buffer).
        In the outer run that memory is the user's, made before iteration: never
        charged. In a nested pipeline (an interleave slot) memory the outer run
        does not already have was made during iteration, by the interleave
        function: the bytes the array spans are added to ``owned_bytes``, which
        the slot books for as long as it lives; views into it then cost nothing
        more.
        """
        owner = owner_of(array) if isinstance(array, np.ndarray) else array
        key = id(owner)
        if key in self.preexisting:
            return
        if self._nested and not isinstance(owner, mmap.mmap):
            self.owned_bytes += int(getattr(array, "nbytes", 0))
        self.preexisting.add(key)
        self._keepalive[key] = owner  # ids stay valid while this run (or slot) lives

    def account(
        self, key: object, name: str, *, weight: float, sets_order: bool = False
    ) -> StageAccount:
        """The share of the budget of one buffering stage.

        ``key`` is the stage's recipe node: an iterator re-created for the same
        node (a new epoch under ``repeat``) gets the same account back, so the
        split made when the run started keeps holding.
        """
        account = self._accounts.get(id(key))
        if account is None:
            account = self.budget.account(name, weight=weight, sets_order=sets_order)
            self._accounts[id(key)] = account
            self._keepalive[id(key)] = key
        return account

    def sizeof(self, element: Any) -> int:
        """What ``element`` costs the budget (see :mod:`headrace.memory.sizeof`)."""
        return sizeof(element, self.preexisting)

    def admit(self, element: Any) -> tuple[Any, int]:
        """The element a buffering stage should keep, and its cost.

        Views pinning a much larger owner are copied out first, so a buffer of
        rows holds (and costs) the rows (see :func:`headrace.memory.sizeof.admit`).
        """
        return admit(element, self.preexisting)


class Iterator:
    """Base of every iterator in the tree.

    Subclasses implement ``__next__`` (raising ``StopIteration`` at the end,
    again on every later call), ``get_state``/``set_state`` (small JSON-able
    dicts: offsets, indices, counters — never buffer contents) and ``close``.
    Buffering stages also override :meth:`next_reserved` so that an element's
    budget booking travels with it.
    """

    stage = "iterator"

    def __init__(self, *inputs: Iterator) -> None:
        self.inputs = inputs

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        element, reservation = self.next_reserved()
        reservation.release()  # the element leaves headrace's buffers here
        return element

    def next_reserved(self) -> tuple[Any, Reservation]:
        """The next element and the booking that holds it (none by default).

        Subclasses override one of the two: ``__next__`` (stages that hold
        nothing) or ``next_reserved`` (stages that book what they hold).
        """
        if type(self).__next__ is Iterator.__next__:
            raise NotImplementedError(
                f"{type(self).__name__} must implement __next__ or next_reserved"
            )
        return type(self).__next__(self), NO_RESERVATION

    def get_state(self) -> dict[str, Any]:
        """Where this iterator is, as a small JSON-able dict."""
        return {"inputs": [child.get_state() for child in self.inputs]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a state produced by :meth:`get_state` of the same pipeline.

        Implementations read ``state`` through :class:`~headrace._state.StateReader`,
        so that a field of the wrong type or out of range is a ``CheckpointError``
        naming this stage and the field.
        """
        children = StateReader(state, self.stage).entries("inputs", len(self.inputs))
        for child, child_state in zip(self.inputs, children, strict=True):
            child.set_state(child_state)

    def close(self) -> None:
        """Stop threads, close files, return budget; idempotent."""
        for child in self.inputs:
            child.close()

    def walk(self) -> list[Iterator]:
        """This iterator and all below it, for the profiler."""
        out: list[Iterator] = [self]
        for child in self.inputs:
            out.extend(child.walk())
        return out


_iteration_counters_lock = threading.Lock()


def _iterations(node: Node) -> itertools.count[int]:
    """How many iterators this recipe has had: tf.data reshuffles on each new one."""
    with _iteration_counters_lock:
        counter: itertools.count[int] | None = node.__dict__.get("_iterations")
        if counter is None:
            counter = node.__dict__["_iterations"] = itertools.count()
        return counter


def _close_run(tree: Iterator, budget: MemoryBudget) -> None:
    budget.close()
    tree.close()


class DatasetIterator(ClosesOnExit, _PyIterator[Any]):
    """What ``iter(dataset)`` returns: the root of one run of the pipeline.

    Use it as a context manager, or call :meth:`close`, to stop its threads and
    return its memory at once; an iterator dropped without either is freed by
    garbage collection (no background thread keeps it alive).
    """

    def __init__(self, node: Node, options: Options, *, probe: bool = False) -> None:
        if options.tune_allocator:
            tune_allocator()
        self._node = node
        explicit = options.budget_bytes
        budget = MemoryBudget(explicit) if explicit is not None else default_budget().child()
        # A probe (reading one element to learn a spec) must not count as an
        # iteration: that would change which shuffle order the next real one gets.
        iteration = 0 if probe else next(_iterations(node))
        self._context = Context(options, budget, iteration)
        self._tree = node.make_iterator(self._context)
        budget.allot()
        self._closed = False
        self._close = weakref.finalize(self, _close_run, self._tree, budget)
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
        started = time.perf_counter()
        if self._started is None:
            self._started = started
        element, reservation = self._tree.next_reserved()
        reservation.release()
        self._elements += 1
        self._waited += time.perf_counter() - started
        return element

    def stats(self) -> RunStats:
        """A snapshot of this run: budget and per-stage bookings, throughput, process memory."""
        from headrace.profiling.stats import RunStats

        elapsed = 0.0 if self._started is None else time.perf_counter() - self._started
        skipped = tuple(self._context.shared.get("skipped", (0, 0)))
        return RunStats.capture(
            self._context.budget, self._elements, elapsed, self._waited, (skipped[0], skipped[1])
        )

    def get_state(self) -> dict[str, Any]:
        """A small JSON-able dict to resume exactly here with :meth:`set_state`."""
        self._check_open()
        return {
            "format": "headrace.iterator",
            "version": STATE_VERSION,
            "fingerprint": self._node.fingerprint(),
            "iteration": self._context.run.iteration,
            "state": self._tree.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`get_state` of an iterator over the same pipeline.

        Raises :class:`CheckpointError` if the state comes from another pipeline
        (fingerprint mismatch) or another state format version, or if any field
        of any stage is of the wrong type or out of range (a counter past the end
        of a finite input included). A refused state may leave this iterator
        part-way restored: restore another state or make a new iterator.
        """
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != "headrace.iterator":
            raise CheckpointError("not a headrace iterator state (missing 'format' marker)")
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(
                f"iterator state has format version {state.get('version')}, "
                f"this headrace reads version {STATE_VERSION}"
            )
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
        try:
            self._tree.set_state(tree_state)
        except StopIteration:  # a replay off the input's end, in a stage that did not say
            raise CheckpointError(
                "iterator state points past the end of the input; it belongs to other data"
            ) from None

    def close(self) -> None:
        """Stop threads, close files and return the budget now. Idempotent."""
        self._closed = True
        self._close()

    def _check_open(self) -> None:
        if self._closed:
            raise IteratorClosedError("this iterator was closed")


    def stages(self) -> list[Iterator]:
        """Every iterator of the run, root first (for the profiler)."""
        return self._tree.walk()
