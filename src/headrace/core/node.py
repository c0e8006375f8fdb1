"""The recipe side: immutable, picklable nodes that describe a pipeline.

A node knows its inputs, its element spec, its cardinality and how to build its
iterator; it holds no threads and no open files. :class:`headrace.Dataset`
is a thin fluent facade over a node.

Random access. Sources that can fetch element ``i`` directly (arrays, ranges,
indexed files) expose :meth:`Node.random_access`; per-element transformations
(map, zip, enumerate, cast) keep it. Over such a chain, ``shard``, ``take``,
``skip``, ``repeat`` and ``shuffle`` work on *indices* (:class:`IndexStream`)
before anything is read, and ``batch`` gathers a whole batch with one NumPy
indexing operation (a zero-copy slice when the indices are consecutive).
This is why ``from_tensor_slices(x).shuffle(len(x)).batch(1000)`` costs one
index buffer, not a copy of every row.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import enum
import hashlib
from collections.abc import Callable
from collections.abc import Iterator as PyIterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from headrace._errors import EmptyInputError, InvalidArgumentError
from headrace._options import Options
from headrace._structure import TensorSpec, flatten
from headrace.core.element_errors import STREAM_ERRORS
from headrace.core.indexing import (
    GatherIterator,
    IndexPlan,
    IndexStream,
    RandomAccess,
    Reach,
    Refusal,
    SequentialIndices,
)
from headrace.core.run import DatasetIterator

if TYPE_CHECKING:
    from headrace._memory.buffer import Buffer
    from headrace.core.iterator import Context, Iterator

__all__ = [
    "CAPABILITIES",
    "INFINITE",
    "UNKNOWN",
    "AccountStage",
    "Node",
    "ShardRole",
    "SourceNode",
    "SpecNeedsData",
    "Traits",
    "UnaryNode",
    "batching_role",
    "check_positive",
    "check_signature",
    "content_memo",
    "content_mode",
    "describing_content",
    "first_element",
    "known_spec",
    "probe_elements",
    "spec_sampling",
]

#: Cardinality of a dataset that never ends (same value as tf.data).
INFINITE = -1
#: Cardinality that cannot be known without reading the data (same as tf.data).
UNKNOWN = -2

# -- element specs that may need data ------------------------------------------------------
#
# A few nodes (map without output_signature, interleave) learn their element spec by
# reading the first element. That must never happen by surprise: not for repr(), not
# while a pipeline is being built, and when it does happen it runs under the
# pipeline's own options (its memory budget), not the defaults. The mode below says
# which: None (sample with default options), an Options (sample with those), or
# _NO_SAMPLING (refuse: raise SpecNeedsData).

_NO_SAMPLING: Any = object()
_sampling: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "headrace_spec_sampling", default=None
)


# -- fingerprints --------------------------------------------------------------------------
# Node identity is computed here; headrace.core.fingerprint describes the values in it
# and asks which of the two fingerprints is being made.

#: While a content fingerprint is computed: the digests made so far, by ``id`` (with the
#: array, so that the id stays its own); None while a structure fingerprint is.
_content: contextvars.ContextVar[dict[int, tuple[Any, str]] | None] = contextvars.ContextVar(
    "headrace_fingerprint_content", default=None
)


@contextlib.contextmanager
def describing_content(content: bool = True) -> PyIterator[None]:
    """Describe arrays by their contents (``content``) or by dtype and shape only,
    within the block: how :meth:`Node.data_fingerprint` and :meth:`Node.fingerprint`
    share every ``params()``. Nested content blocks share one digest memo."""
    current = _content.get()
    memo = (current if current is not None else {}) if content else None
    token = _content.set(memo)
    try:
        yield
    finally:
        _content.reset(token)


def content_memo() -> dict[int, tuple[Any, str]] | None:
    """The digests made so far in this content block, by ``id``; None outside one."""
    return _content.get()


def content_mode() -> bool:
    """Whether a content fingerprint is being computed (see :func:`describing_content`)."""
    return _content.get() is not None


class SpecNeedsData(Exception):
    """``element_spec`` would have to read data, and the caller asked it not to."""


@contextlib.contextmanager
def spec_sampling(options: Options | None) -> PyIterator[None]:
    """Within this block, element specs that need data read it with ``options``."""
    token = _sampling.set(options)
    try:
        yield
    finally:
        _sampling.reset(token)


def known_spec(node: Node) -> Any | None:
    """``node``'s element spec if it is known without reading any data, else None.

    Constructors use it to validate what they can at build time, leaving the rest
    for when the spec is asked for (building a pipeline never runs user code).
    """
    token = _sampling.set(_NO_SAMPLING)
    try:
        return node.element_spec
    except SpecNeedsData:
        return None
    finally:
        _sampling.reset(token)


@contextlib.contextmanager
def probe_elements(source: Node, stage: str) -> PyIterator[DatasetIterator]:
    """An iterator over ``source``'s elements, to learn a spec (a probe: no iteration
    counted), under the options :func:`spec_sampling` set; for a stage that may need
    to look past the first element (an interleave whose first inner datasets are empty).

    Raises :class:`SpecNeedsData` where sampling is off.
    """
    mode = _sampling.get()
    if mode is _NO_SAMPLING:
        raise SpecNeedsData(stage)
    options = (mode or Options()).merge(Options(warn_on_shrink=False))
    with DatasetIterator(source, options, probe=True) as iterator:
        yield iterator


#: Elements' errors a spec probe passes before it gives up and raises the first.
PROBE_ERRORS = 64


def first_element(source: Node, stage: str, hint: str = "") -> Any:
    """The first element of ``source`` that comes out, read to learn a spec (a probe: no
    iteration counted); see :func:`first_output`."""
    return first_output(source, stage, None, hint)


def first_output(
    source: Node, stage: str, apply: Callable[[Any, int], Any] | None, hint: str = ""
) -> Any:
    """``apply(element, index)`` of the first element of ``source`` for which it does not
    raise (the element itself without ``apply``), read to learn a spec (a probe: no
    iteration counted).

    Elements whose production (or ``apply``) raised are passed, up to
    :data:`PROBE_ERRORS`: their errors are the run's to raise in their places, where
    ``ignore_errors`` may drop them (a first element that failed made ``iter()`` itself
    raise). Where no output comes, the first error is raised; headrace's own stream
    errors at once.

    Raises :class:`SpecNeedsData` where sampling is off, and an
    :class:`~headrace._errors.EmptyInputError` naming ``stage`` (plus ``hint``, how to
    avoid the read) if the input is empty — never a bare ``StopIteration``.
    """
    first_error: Exception | None = None
    with probe_elements(source, stage) as iterator:
        for index in range(PROBE_ERRORS):
            try:
                element = next(iterator)
                return element if apply is None else apply(element, index)
            except StopIteration:
                break
            except STREAM_ERRORS:
                raise
            except Exception as error:
                first_error = first_error or error
    if first_error is not None:
        raise first_error
    raise EmptyInputError(
        f"{stage}: its element_spec is found by applying the function to the first "
        f"input element, but the input is empty{hint}"
    )


class ShardRole(enum.Enum):
    """What a stage does with element *positions*: where sharding may split a pipeline.

    Sharding (DataLoader workers, :func:`headrace.auto_shard`) is pushed down
    towards the sources only through stages whose output, over a partitioned
    input, is the partition of their output: then every worker reads only its
    own data and all workers together deliver the unsharded elements, each
    intact. Each node class answers :meth:`Node.shard_role` itself; a stage
    that does not is taken as :attr:`POSITIONAL` (the safe answer).
    """

    #: Output element ``k`` is made from input element ``k`` alone (map, prefetch):
    #: sharding the input at some positions shards the output at the same positions.
    ONE_TO_ONE = "one_to_one"
    #: The outputs do not depend on where an element sits in the stream (filter,
    #: shuffle, repeat, concatenate, interleave, batch keeping its remainder):
    #: over disjoint parts of the input, all workers' outputs together hold the
    #: same elements as the unsharded output, in another order or grouping.
    BY_CONTENT = "by_content"
    #: Combines its inputs position by position (zip): sharding its inputs apart
    #: would pair elements of different positions. It is sharded as one stream,
    #: or every input at the same positions (the same files, one-to-one below).
    PAIRS = "pairs"
    #: Counts, selects or drops elements by position (take, skip, enumerate,
    #: window, a batch dropping its remainder): it must see the whole stream, so
    #: sharding cannot go below it.
    POSITIONAL = "positional"


def batching_role(source: Node, drop_remainder: bool) -> ShardRole:
    """The :class:`ShardRole` of a stage that groups ``source``'s elements into batches.

    Keeping its remainder, a batch stage only regroups: BY_CONTENT. Dropping
    it, each worker would drop a partial batch of its own part, so the workers
    together would deliver fewer elements than the unsharded pipeline (1000
    rows in batches of 64: 960 unsharded, 896 over two workers): POSITIONAL,
    unless the input never ends, where nothing is ever dropped.
    """
    if drop_remainder and source.cardinality() != INFINITE:
        return ShardRole.POSITIONAL
    return ShardRole.BY_CONTENT


@dataclasses.dataclass(frozen=True)
class Traits:
    """Facts about a stage that modules outside it decide by (the recipe lint, sharding,
    the adapters), so that they ask the node rather than test its class.

    Each node class answers :meth:`Node.traits` in its own module; the defaults say
    "none of these", which is what a stage that declares nothing gets.
    """

    #: Calls a user function once per element, output ``k`` from input ``k`` (map): the
    #: lint weighs the work done for elements a later stage drops, and ``repeat`` does
    #: not replay indices under it (the function must know its epoch).
    maps: bool = False
    #: How many calls of a user function run at once, on threads (``num_parallel_calls``).
    parallel_calls: int | None = None
    #: The number of elements held to mix their order (a shuffle buffer).
    shuffle_buffer: int | None = None
    #: ``(num_shards, index)``: keeps one element in ``num_shards`` of its input.
    shards: tuple[int, int] | None = None
    #: Drops elements by a predicate on their content (filter).
    drops: bool = False
    #: Holds every element in memory (a cache without a file).
    caches_in_memory: bool = False
    #: Reads ahead of the consumer (prefetch), so the two overlap.
    prefetches: bool = False
    #: Groups elements into batches (their number then depends on how the input is split).
    groups: bool = False
    #: Opens the files its input elements name (interleave over ``list_files``).
    opens_named_files: bool = False
    #: Draws random numbers without a seed: another order in every process, so
    #: workers that each run the whole pipeline would not agree on it.
    unseeded: bool = False


_N = TypeVar("_N", bound="Node")

#: What every node class declares in its own body (or inherits from a base that lists
#: it in ``shared_capabilities``): how many elements it gives (``cardinality``), how
#: sharding may pass it (``shard_role``), how ``global_shuffle`` addresses its elements
#: (``element_access``) and the facts others read (``traits``). The base class's
#: answers are the safe ones; a stage that does not declare is refused by a test
#: (tests/project/test_node_capabilities.py) rather than silently given them.
CAPABILITIES = ("cardinality", "shard_role", "element_access", "traits")


class Node:
    """Base of every recipe node. Subclasses set ``inputs`` and implement the hooks."""

    #: Stage name shown in errors, warnings and profiles.
    stage = "node"
    #: A buffering stage's weight in the split of the budget (``Context.account``):
    #: shares are proportional to it, before minimum working sets re-split them.
    budget_weight: ClassVar[float] = 1.0
    #: Whether the stage's buffer size sets the order of elements (shuffle): such a
    #: share is never lent to another stage, so the order never depends on timing.
    sets_order: ClassVar[bool] = False

    #: The :data:`CAPABILITIES` this class declares for its subclasses too (a file
    #: reader's for every format); the others each subclass declares itself.
    shared_capabilities: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *inputs: Node) -> None:
        self.inputs: tuple[Node, ...] = inputs

    # -- what the pipeline produces ---------------------------------------------------
    @property
    def element_spec(self) -> Any:
        """Nested :class:`~headrace._structure.TensorSpec` of each element."""
        raise NotImplementedError

    def cardinality(self) -> int:
        """Number of elements, or :data:`INFINITE` / :data:`UNKNOWN`."""
        return UNKNOWN

    def shard_role(self) -> ShardRole:
        """How sharding may pass this stage (see :class:`ShardRole`); sources have no say."""
        return ShardRole.POSITIONAL

    def traits(self) -> Traits:
        """The facts about this stage that the lint, sharding and adapters read."""
        return Traits()

    # -- rewriting -----------------------------------------------------------------------
    def with_inputs(self: _N, inputs: tuple[Node, ...]) -> _N:
        """This node reading ``inputs`` instead of its own (its fingerprint recomputed).

        How sharding rewrites a pipeline; a node that keeps its inputs elsewhere too
        (zip, inside the user's nesting) overrides it.
        """
        clone = copy.copy(self)
        clone.__dict__.pop("_fingerprint", None)
        clone.inputs = inputs
        return clone

    def read_files(self) -> list[str] | None:
        """The files this source reads records from, in order, where it holds such a
        list (then sharding by file gives each worker only its own); else None."""
        return None

    def with_files(self, files: list[str]) -> Node:
        """This source over ``files`` only (where :meth:`read_files` is not None)."""
        raise NotImplementedError(f"{type(self).__name__} reads no list of files")

    def names_files(self) -> bool:
        """Whether this source is a list of file names (``list_files``), which a stage
        that opens named files (interleave) may split among workers."""
        return False

    # -- identity ------------------------------------------------------------------------
    def params(self) -> tuple[Any, ...]:
        """What distinguishes this node from another of its class (for the fingerprint)."""
        return ()

    def content(self) -> tuple[Any, ...]:
        """What this node reads beyond its arguments (for :meth:`data_fingerprint`):
        digests of its in-memory arrays, identities of its files. Sources override it."""
        return ()

    def fingerprint(self) -> str:
        """A digest of the pipeline's structure and arguments (not its data).

        Restoring an iterator state checks it, so a state saved from one
        pipeline is never fed into another. Arrays count by dtype and shape and
        files by name, so a checkpoint restores over the same data in a new
        process or on another disk (see :meth:`data_fingerprint` for what the data is).
        """
        return self._identity(content=False)

    def data_fingerprint(self) -> str:
        """A digest of the pipeline *and of what it reads*: the key of ``cache(filename)``,
        ``snapshot`` and ``save`` files.

        On top of :meth:`fingerprint`: a content digest of every in-memory array (the
        sources', those captured by functions and the module-level ones functions read)
        and the identity (path, size, mtime, inode) and a digest of the bytes of every
        file a source reads (see :func:`~headrace.core.fingerprint.file_identity`), so
        that a changed input makes a new
        snapshot or cache rather than serving the old one. Computed once per node (an
        array edited in place afterwards is not seen: build the dataset again, as
        tf.data, which copies arrays when the dataset is built).
        """
        return self._identity(content=True)

    def _identity(self, *, content: bool) -> str:
        # Both digests live in ``_fingerprint`` (one attribute, which copies that
        # rewrite a node's inputs or files drop, and pickling drops).
        cached: dict[str, str] | None = self.__dict__.get("_fingerprint")
        kind = "content" if content else "structure"
        if cached is not None and kind in cached:
            return cached[kind]
        with describing_content(content):
            digest = hashlib.sha256()
            digest.update(type(self).__qualname__.encode())
            digest.update(repr(self.params()).encode())
            if content:
                digest.update(repr(self.content()).encode())
            for child in self.inputs:
                digest.update(child._identity(content=content).encode())
        value = digest.hexdigest()[:20]
        self.__dict__.setdefault("_fingerprint", {})[kind] = value
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_fingerprint", None)
        state.pop("_iterations", None)
        return state

    # -- running --------------------------------------------------------------------------
    def random_access(self) -> RandomAccess | None:
        """Direct access to element ``i``, where the node supports it."""
        return None

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        """Element ``i`` of this stage's output as ``global_shuffle`` addresses it, or a
        :class:`~headrace.core.indexing.Refusal` saying why there is none.

        Wider than :meth:`random_access` (see :mod:`headrace._transforms._element_access`):
        stages that choose elements by position map indices onto their input's, which
        ``reach`` gives. The default refuses, the safe answer.
        """
        return Refusal(self)

    def direct_access(self) -> RandomAccess | Refusal:
        """:meth:`random_access`, or a refusal where there is none: the
        :meth:`element_access` of a source."""
        access = self.random_access()
        return Refusal(self) if access is None else access

    def index_plan(self) -> IndexPlan | None:
        """Random access plus the order of indices, where both are known.

        By default a random-access node is read in order 0..n-1.
        """
        access = self.random_access()
        if access is None:
            return None
        size = len(access)

        def sequential(ctx: Context) -> IndexStream:
            return SequentialIndices(size)

        return access, sequential

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator | None:
        """An iterator of whole batches, where the node can batch better than ``batch`` can.

        Each batch comes with its booking on ``account`` (the batch stage's share),
        made while the batch is assembled, not after.
        """
        return None

    def make_iterator(self, ctx: Context) -> Iterator:
        """Build this node's iterator (and its inputs') for one run."""
        plan = self.index_plan()
        if plan is None:
            raise NotImplementedError(f"{type(self).__name__} must implement make_iterator")
        access, make_stream = plan
        access.prepare(ctx)
        return GatherIterator(access, make_stream(ctx))


class SourceNode(Node):
    """A node that makes its elements itself (no inputs): sharding splits it, or its
    files, itself; ``global_shuffle`` reads it by index where it can; it has no lint
    facts. Each source still declares its own ``cardinality``."""

    shared_capabilities: ClassVar[tuple[str, ...]] = ("shard_role", "element_access", "traits")

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return self.direct_access()

    def traits(self) -> Traits:
        return Traits()


class AccountStage(Node):
    """Stands for a buffer outside the pipeline's stages (a writer's batches, an
    adapter's read-ahead) in the split of its budget: never iterated, so its answers
    are placeholders. Subclasses set ``stage`` and ``budget_weight``."""

    shared_capabilities: ClassVar[tuple[str, ...]] = CAPABILITIES

    def cardinality(self) -> int:
        return UNKNOWN

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)

    def traits(self) -> Traits:
        return Traits()


class UnaryNode(Node):
    """A node over one input that keeps its element spec (take, shard, prefetch, ...).

    Nodes that only choose *which* input elements come (take, skip, shard,
    repeat) implement :meth:`wrap_indices` to work on indices when the input is
    random-access, and :meth:`stream_iterator` otherwise.
    """

    def __init__(self, source: Node) -> None:
        super().__init__(source)

    @property
    def element_spec(self) -> Any:
        return self.inputs[0].element_spec

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()

    def wrap_indices(
        self, make_inner: Callable[[Context], IndexStream], ctx: Context
    ) -> IndexStream | None:
        """This node's index stream over the input's; None if it cannot work on indices."""
        return None

    def index_plan(self) -> IndexPlan | None:
        plan = self.inputs[0].index_plan()
        if plan is None or type(self).wrap_indices is UnaryNode.wrap_indices:
            return None
        access, make_inner = plan

        def make(ctx: Context) -> IndexStream:
            stream = self.wrap_indices(make_inner, ctx)
            return make_inner(ctx) if stream is None else stream

        return access, make

    def stream_iterator(self, inner: Iterator, ctx: Context) -> Iterator:
        """This node's iterator over a streaming input."""
        raise NotImplementedError

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        return self.stream_iterator(self.inputs[0].make_iterator(ctx), ctx)


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """Validate an integer argument at build time, with a message that says how to fix it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")
    return int(value)


def check_signature(signature: Any, stage: str) -> Any:
    """Validate an ``output_signature`` at build time: a TensorSpec or a nest of them."""
    for leaf in flatten(signature):
        if not isinstance(leaf, TensorSpec):
            raise InvalidArgumentError(
                f"{stage}: output_signature leaves must be TensorSpec, got {leaf!r}"
            )
    return signature
