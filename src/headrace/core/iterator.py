"""The run side of a stage: the iterator base class and the context a run shares.

``iter(dataset)`` turns the recipe (a tree of :class:`~headrace.core.node.Node`)
into a tree of :class:`Iterator` objects — classes, not generators, because
generators can neither checkpoint nor close deterministically.

The contract a stage implements is small: :meth:`Iterator.pull` returns the
next element *with the reservation that books it* (``NO_RESERVATION`` when the
stage holds nothing), ``get_state``/``set_state`` say where it is, ``close``
stops its threads and returns its bookings. ``__next__`` belongs to the base
class: it releases the reservation as the element leaves headrace, so no
stage can forget to.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from headrace._errors import Origin
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import admit, owner_of, sizeof
from headrace._memory.units import format_bytes
from headrace._options import Options
from headrace.core.state import INPUTS, StateReader
from headrace.io.mapped import is_file_backed

if TYPE_CHECKING:
    from headrace.core.node import Node
    from headrace.io.filepool import FileLimiter

__all__ = [
    "PROFILE_RECORD", "BatchToken", "Context", "Iterator", "RunFacts", "origin_probe",
    "row_origin",
]

#: The attribute where an iterator instrumented by a profile (``headrace.profiling.probe``)
#: keeps its stage's record: a stage that takes its input's elements other than through
#: ``pull`` (a batch fused with its reader) counts them into it itself.
PROFILE_RECORD = "_hr_record"


@dataclass
class RunFacts:
    """Facts about one run, shared by every context of it (epochs, interleave slots).

    ``iteration`` (how many iterators the dataset had before this one) and
    ``seeds`` are what restoring a state may change; the rest is run-wide
    bookkeeping that the stages fill in.
    """

    iteration: int
    #: Random base seeds of unseeded stages (``shuffle(seed=None)``), by id of their
    #: node, once a restored state has named them: every later epoch of the run
    #: then draws from the saved seed, not from the one this process picked.
    seeds: dict[int, int] = field(default_factory=dict)
    #: The pipeline's own cap on open descriptors (``Options.max_open_files``), made
    #: by the first reader that needs it and shared by all of them.
    file_limiter: FileLimiter | None = None
    #: Stages handing out elements out of order (``deterministic=False``), for the
    #: check of ``get_state`` (see :func:`headrace.core.state.mark_out_of_order`).
    out_of_order: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    #: Corrupt records skipped (``skip_corrupt=True``) and their bytes, for ``stats()``.
    skipped_records: int = 0
    skipped_bytes: int = 0
    #: True for a probe run (one element read to learn a spec): stages with side
    #: effects beyond the run (a cache writing files) stay out of its way.
    probe: bool = False


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
        self.run = RunFacts(iteration)
        self.epochs: tuple[int, ...] = ()
        self.deterministic = options.deterministic is not False
        #: ids of owning buffers that cost this run nothing (never charged).
        self.preexisting: set[int] = set()
        #: Bytes of arrays a nested pipeline's recipe owns (see :meth:`register_preexisting`).
        self.owned_bytes = 0
        self._nested = False
        #: Objects whose ``id`` is a key above, by id: kept once, alive while the run lives.
        self._keepalive: dict[int, object] = {}
        self._accounts: dict[int, Buffer] = {}

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
        if self._nested and not is_file_backed(owner):
            self.owned_bytes += int(getattr(array, "nbytes", 0))
        self.preexisting.add(key)
        self._keepalive[key] = owner  # ids stay valid while this run (or slot) lives

    def register_copy(
        self, array: np.ndarray[Any, Any], what: str, nbytes: int | None = None
    ) -> None:
        """Book an array a source's recipe made from the user's data and holds (a list
        of numbers stacked into one array), for the whole run.

        Unlike the user's own arrays (:meth:`register_preexisting`) it is headrace's
        memory: the run's budget is what is left beside it (its stages split that),
        and a copy that leaves nothing is a :class:`MemoryBudgetError` saying
        ``what`` it is. Views into it cost nothing more. In a nested pipeline it is
        part of ``owned_bytes``, which the slot books. ``nbytes``: what it costs, where
        that is less than what it keeps alive (an array of the user's own objects).
        """
        owner = owner_of(array)
        if id(owner) in self.preexisting:
            return
        self.register_preexisting(owner)
        if self._nested:
            return
        if nbytes is None:
            nbytes = sizeof(owner)
        self.budget.set_aside(nbytes, lambda total: (
            f"{what}: headrace converted it to a {array.dtype} array of shape "
            f"{array.shape} ({format_bytes(nbytes)}), which the dataset holds, and "
            f"that leaves nothing of the memory budget ({format_bytes(total)})"
            ". Convert it yourself before (np.asarray(...): an array you made is "
            "your memory, never charged), or raise Options(memory_budget=...)"
        ))

    def account(
        self, node: Node, name: str | None = None, *, weight: float | None = None
    ) -> Buffer:
        """The share of the budget of one buffering stage.

        ``node`` is the stage's recipe node. Its class declares how the budget
        is split (:attr:`Node.budget_weight`, :attr:`Node.sets_order`); ``name``
        and ``weight`` override the stage name and the weight where one class
        buffers in two ways. An iterator re-created for the same node (a new
        epoch under ``repeat``) gets the same account back, so the split made
        when the run started keeps holding.
        """
        account = self._accounts.get(id(node))
        if account is None:
            kind = type(node)
            account = self.budget.account(
                node.stage if name is None else name,
                weight=kind.budget_weight if weight is None else weight,
                sets_order=kind.sets_order,
            )
            self._accounts[id(node)] = account
            self._keepalive[id(node)] = node
        return account

    def sizeof(self, element: Any) -> int:
        """What ``element`` costs the budget (see :mod:`headrace._memory.sizeof`)."""
        return sizeof(element, self.preexisting)

    def admit(self, element: Any) -> tuple[Any, int]:
        """The element a buffering stage should keep, and its cost.

        Views pinning a much larger owner are copied out first, so a buffer of
        rows holds (and costs) the rows (see :func:`headrace._memory.sizeof.admit`).
        """
        return admit(element, self.preexisting)


class Iterator:
    """Base of every iterator in the tree.

    A stage implements :meth:`pull` (the next element and the reservation that
    books it; ``StopIteration`` at the end, again on every later call),
    ``get_state``/``set_state`` (small JSON-able dicts: offsets, indices,
    counters — never buffer contents) and ``close``. ``__next__`` is the base
    class's: it releases the reservation as the element leaves headrace.

    A stage that passes its input's elements through unchanged (take, shard,
    filter) passes their reservations through too; one that makes a new
    element (map) releases the input's and returns its own.
    """

    stage = "iterator"
    #: True where every element this stage returns is the one its (single) input
    #: returned last, or made from it alone, with nothing held between (map, filter,
    #: take, shard): the origin of its last element is its input's. A buffering stage
    #: (shuffle, prefetch, a parallel map) leaves it False, or overrides :meth:`origin`.
    passes_origin = False
    #: True where the state counts positions of the input's stream (take, skip, shard):
    #: elements a restore hands out again below it (an out-of-order map's at-least-once)
    #: would take positions of others, so a checkpoint there is refused.
    counts_positions = False

    def __init__(self, *inputs: Iterator) -> None:
        self.inputs = inputs

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__next__" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} overrides __next__; a stage implements pull() "
                "(the element and its reservation) and the base class releases it"
            )

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        element, reservation = self.pull()
        if reservation is not NO_RESERVATION:
            reservation.release()  # the element leaves headrace's buffers here
        return element

    def pull(self) -> tuple[Any, Reservation]:
        """The next element and the booking that holds it (``NO_RESERVATION`` if none)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pull()")

    def origin(self) -> Origin | None:
        """Where the element this iterator returned last came from (file, record, byte
        offset), or None where it cannot say.

        Asked only when a user function fails on that element (a sequential map asks
        its input right then, so the fast path costs nothing); a stage that holds
        elements between pulling and handing them out (a parallel map) takes
        :func:`origin_probe` of its input once and asks it for a token per element
        pulled (:meth:`origin_token`), which it turns into an origin on failure only.
        """
        if self.passes_origin and len(self.inputs) == 1:
            return self.inputs[0].origin()
        return None

    def origin_token(self) -> Any:
        """A cheap stand-in for :meth:`origin` of the element returned last (a tuple of
        ints, say), which :meth:`origin_of` turns into the :class:`Origin` later, after
        this iterator moved on. Sources override both, to keep per-element work small."""
        return self.origin()

    def origin_of(self, token: Any) -> Origin | None:
        """The origin a token of :meth:`origin_token` stands for."""
        return token if isinstance(token, Origin) else None

    def track_origins(self, tokens: bool = True) -> bool:
        """Called through :func:`origin_probe` by a stage that will ask for origins (a
        map, when it starts): a stage that must pay to remember them (a shuffle buffer
        keeps a token beside each element, a file source a log of offsets) starts doing
        so only then. ``tokens``: the caller will hold :meth:`origin_token` values
        (else it asks :meth:`origin` right after a pull). Returns whether this iterator
        can answer; a source that overrides those methods can."""
        return type(self).origin_token is not Iterator.origin_token

    def get_state(self) -> dict[str, Any]:
        """Where this iterator is, as a small JSON-able dict."""
        return {INPUTS: [child.get_state() for child in self.inputs]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a state produced by :meth:`get_state` of the same pipeline.

        Implementations read ``state`` through :class:`~headrace.core.state.StateReader`,
        so that a field of the wrong type or out of range is a ``CheckpointError``
        naming this stage and the field.
        """
        children = StateReader(state, self.stage).entries(INPUTS, len(self.inputs))
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


class BatchToken(NamedTuple):
    """The origin token of a batched element: one token per row (``tokens``, maybe a
    ``range`` of a file source's serials or a batch's row indices) and the function
    that makes one into an :class:`Origin`. Made per batch only where a stage above
    asks for origins; read (:meth:`origin`, :func:`row_origin`) only on failure."""

    origin_of: Callable[[Any], Origin | None]
    tokens: Sequence[Any]

    def origin(self) -> Origin | None:
        """The batch's origin (every row's; None where any row's is unknown)."""
        rows = []
        for token in self.tokens:
            row = self.origin_of(token)
            if row is None:
                return None
            rows.append(row)
        return Origin.of_rows(rows) if rows else None


def row_origin(
    token: Any, origin_of: Callable[[Any], Origin | None], row: int
) -> Origin | None:
    """The origin of row ``row`` of a batched element whose origin token is ``token``
    (``origin_of`` turns the token into the batch's origin): exact where the token
    is a batch's (:class:`BatchToken`), or its origin names its rows; else None."""
    if isinstance(token, BatchToken):
        return token.origin_of(token.tokens[row]) if 0 <= row < len(token.tokens) else None
    origin = None if token is None else origin_of(token)
    if origin is not None and 0 <= row < len(origin.rows):
        return origin.rows[row]
    return None


def origin_probe(
    iterator: Iterator, tokens: bool = True
) -> tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None:
    """The bound ``origin_token`` and ``origin_of`` of the iterator that answers for
    ``iterator``'s elements (past stages that pass origins through), or None where none
    can.

    A stage that pulls elements ahead of using them calls the first once per element
    pulled and the second only for an element that failed, so the chain of
    pass-through stages is walked once, here, not per element. ``tokens=False``: the
    caller asks ``origin()`` of its input right after pulling instead (a sequential
    map), so only the buffers below must remember origins, not the source.
    """
    current = iterator
    while current.passes_origin and len(current.inputs) == 1 and (
        type(current).origin_token is Iterator.origin_token
    ):
        current = current.inputs[0]
    if not current.track_origins(tokens):
        return None
    return current.origin_token, current.origin_of
