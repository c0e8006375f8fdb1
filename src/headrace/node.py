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

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from headrace.iterator import Context, Iterator
    from headrace.memory.budget import StageAccount

__all__ = [
    "INFINITE",
    "UNKNOWN",
    "IndexPlan",
    "IndexStream",
    "Node",
    "RandomAccess",
    "function_name",
]

#: Cardinality of a dataset that never ends (same value as tf.data).
INFINITE = -1
#: Cardinality that cannot be known without reading the data (same as tf.data).
UNKNOWN = -2

Indices = range | np.ndarray  # a block of indices; a range means "consecutive"


def function_name(fn: Callable[..., Any]) -> str:
    """A stable name for a user function, for fingerprints and stage names."""
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}" if module else name


class RandomAccess:
    """Element ``i`` of a dataset, fetched directly.

    ``get_many`` returns the *batched* element for a block of indices; the
    default stacks ``get`` results, sources override it with one gather.
    """

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, index: int) -> Any:
        raise NotImplementedError

    def get_many(self, indices: Indices) -> Any:
        from headrace.transforms.batch import stack_elements

        return stack_elements([self.get(int(i)) for i in indices], stage="batch")

    def prepare(self, ctx: Context) -> None:
        """Called once per run: register pre-existing memory with the context."""

    def close(self) -> None:
        """Release what the run opened (files), when the iterator closes."""


class IndexStream:
    """A resumable stream of indices into a :class:`RandomAccess` (iterator side)."""

    def next_index(self) -> int:
        """The next index; ``StopIteration`` at the end."""
        block = self.take(1)
        if len(block) == 0:
            raise StopIteration
        return int(block[0])

    def take(self, count: int) -> Indices:
        """Up to ``count`` next indices (fewer only at the end, empty when done)."""
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release any budget the stream's own buffers hold."""


#: (random access, factory of a fresh index stream for one run)
IndexPlan = tuple[RandomAccess, Callable[["Context"], IndexStream]]


class Node:
    """Base of every recipe node. Subclasses set ``inputs`` and implement the hooks."""

    #: Stage name shown in errors, warnings and profiles.
    stage = "node"

    def __init__(self, *inputs: Node) -> None:
        self.inputs: tuple[Node, ...] = inputs

    # -- what the pipeline produces ---------------------------------------------------
    @property
    def element_spec(self) -> Any:
        """Nested :class:`~headrace.structure.TensorSpec` of each element."""
        raise NotImplementedError

    def cardinality(self) -> int:
        """Number of elements, or :data:`INFINITE` / :data:`UNKNOWN`."""
        return UNKNOWN

    # -- identity ------------------------------------------------------------------------
    def params(self) -> tuple[Any, ...]:
        """What distinguishes this node from another of its class (for the fingerprint)."""
        return ()

    def fingerprint(self) -> str:
        """A digest of the pipeline's structure and arguments (not its data).

        Restoring an iterator state checks it, so a state saved from one
        pipeline is never fed into another.
        """
        cached: str | None = getattr(self, "_fingerprint", None)
        if cached is None:
            digest = hashlib.sha256()
            digest.update(type(self).__qualname__.encode())
            digest.update(repr(self.params()).encode())
            for child in self.inputs:
                digest.update(child.fingerprint().encode())
            cached = digest.hexdigest()[:20]
            self._fingerprint = cached
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_fingerprint", None)
        state.pop("_iterations", None)
        return state

    # -- running --------------------------------------------------------------------------
    def random_access(self) -> RandomAccess | None:
        """Direct access to element ``i``, where the node supports it."""
        return None

    def index_plan(self) -> IndexPlan | None:
        """Random access plus the order of indices, where both are known.

        By default a random-access node is read in order 0..n-1.
        """
        access = self.random_access()
        if access is None:
            return None
        size = len(access)

        def sequential(ctx: Context) -> IndexStream:
            from headrace.transforms.indexing import SequentialIndices

            return SequentialIndices(size)

        return access, sequential

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: StageAccount
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
        from headrace.transforms.indexing import GatherIterator

        access, make_stream = plan
        access.prepare(ctx)
        return GatherIterator(access, make_stream(ctx))


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
    from headrace.errors import InvalidArgumentError

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")
    return int(value)
