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
import functools
import hashlib
import types
from collections.abc import Callable
from collections.abc import Iterator as PyIterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from headrace.iterator import Context, Iterator
    from headrace.memory.budget import StageAccount
    from headrace.options import Options

__all__ = [
    "INFINITE",
    "UNKNOWN",
    "IndexPlan",
    "IndexStream",
    "Node",
    "RandomAccess",
    "SpecNeedsData",
    "check_positive",
    "check_signature",
    "first_element",
    "function_fingerprint",
    "function_name",
    "known_spec",
    "spec_sampling",
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


def function_fingerprint(fn: Any) -> str:
    """A digest of what a user function computes, the same in every process.

    A state saved from ``map(lambda x: x + 1)`` must not restore into
    ``map(lambda x: x * 1000)``: both are ``<lambda>``, so the name alone
    cannot tell them apart. The digest covers the bytecode (``co_code``, its
    constants recursively, the names it uses), default arguments and the values
    of closure cells; callable objects (``functools.partial``, instances with
    ``__call__``) are described by their function and their attributes. Simple
    values (numbers, strings, bytes, NumPy scalars and dtypes, and containers of
    them) count by value; others by type (arrays by dtype and shape, datasets by
    their fingerprint). Nothing depends on ``id()``, hash randomization, file
    paths or line numbers, so a checkpoint restores in a new process, and
    after an edit that only moves code around.
    """
    return hashlib.sha256(_Describer().describe(fn, 0).encode()).hexdigest()[:16]


_SIMPLE = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), np.generic, np.dtype)


class _Describer:
    """Stable text for :func:`function_fingerprint`, bounded in depth and in total work
    (a closure over a large object graph costs a few thousand steps, not a walk of it)."""

    MAX_DEPTH = 6
    MAX_ITEMS = 256  # a longer container counts by type and length only
    MAX_STEPS = 20_000  # past this, values count by type only

    def __init__(self) -> None:
        self.active: set[int] = set()  # ids being described: a cycle counts by type
        self.steps = 0

    def describe(self, value: Any, depth: int) -> str:
        self.steps += 1
        if isinstance(value, _SIMPLE):
            return repr(value)
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if depth > self.MAX_DEPTH or self.steps > self.MAX_STEPS or id(value) in self.active:
            return kind
        if isinstance(value, np.ndarray):
            return f"{kind}({value.dtype},{value.shape})"
        if isinstance(value, type):
            return f"class {value.__module__}.{value.__qualname__}"
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(value, "__self__", None)
            bound = owner is not None and not isinstance(owner, types.ModuleType)
            prefix = f"{type(owner).__qualname__}." if bound else ""
            return f"builtin {getattr(value, '__module__', '')}.{prefix}{value.__qualname__}"
        node = value if isinstance(value, Node) else getattr(value, "_node", None)
        if isinstance(node, Node):  # a Dataset captured by a function (zip, interleave)
            return f"dataset {node.fingerprint()}"
        self.active.add(id(value))
        try:
            return self._compound(value, kind, depth + 1)
        finally:
            self.active.discard(id(value))

    def _compound(self, value: Any, kind: str, depth: int) -> str:
        def each(items: Any) -> str:
            return ",".join(self.describe(item, depth) for item in items)

        if isinstance(value, (tuple, list, set, frozenset, dict)) and len(value) > self.MAX_ITEMS:
            return f"{kind}[{len(value)}]"
        if isinstance(value, (tuple, list)):
            return f"{kind}({each(value)})"
        if isinstance(value, (set, frozenset)):  # sorted: iteration order follows the hash seed
            return f"{kind}({','.join(sorted(self.describe(v, depth) for v in value))})"
        if isinstance(value, dict):
            pairs = (f"{self.describe(k, depth)}:{self.describe(v, depth)}" for k, v in value.items())
            return f"{kind}({','.join(sorted(pairs))})"
        if isinstance(value, types.CodeType):
            return (
                f"code({value.co_name};{value.co_argcount};{value.co_kwonlyargcount};"
                f"{value.co_code.hex()};{each(value.co_consts)};{','.join(value.co_names)};"
                f"{','.join(value.co_varnames)})"
            )
        if isinstance(value, types.FunctionType):
            return (
                f"function {value.__module__}.{value.__qualname__}("
                f"{self.describe(value.__code__, depth)};{each(_cell_values(value))};"
                f"{self.describe(value.__defaults__, depth)};"
                f"{self.describe(value.__kwdefaults__, depth)})"
            )
        if isinstance(value, types.MethodType):
            return f"method({each((value.__func__, value.__self__))})"
        if isinstance(value, functools.partial):
            return f"partial({each((value.func, value.args, value.keywords))})"
        # any other object: its class, what calling it runs, and its attributes
        call = next(
            (cls.__dict__["__call__"] for cls in type(value).__mro__ if "__call__" in cls.__dict__),
            None,
        )
        fields = dict(getattr(value, "__dict__", None) or {})
        for cls in type(value).__mro__:
            slots = getattr(cls, "__slots__", ())
            for name in [slots] if isinstance(slots, str) else slots:
                if hasattr(value, name):
                    fields[name] = getattr(value, name)
        code = self.describe(call, depth) if isinstance(call, types.FunctionType) else ""
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        named = name if isinstance(name, str) else ""  # e.g. NumPy's ufuncs: add, multiply
        return f"object {kind} {named}({code};{self.describe(fields, depth)})"


def _cell_values(fn: types.FunctionType) -> list[Any]:
    """The values of ``fn``'s closure cells (a cell not assigned yet counts as a marker)."""
    values: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # the enclosing function has not assigned it yet
            values.append("<unassigned cell>")
    return values


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


def first_element(source: Node, stage: str, hint: str = "") -> Any:
    """The first element of ``source``, read to learn a spec (a probe: no iteration counted).

    Raises :class:`SpecNeedsData` where sampling is off, and an
    :class:`~headrace.errors.ElementSpecError` naming ``stage`` (plus ``hint``, how to
    avoid the read) if the input is empty — never a bare ``StopIteration``.
    """
    from headrace.errors import ElementSpecError
    from headrace.iterator import DatasetIterator
    from headrace.options import Options

    mode = _sampling.get()
    if mode is _NO_SAMPLING:
        raise SpecNeedsData(stage)
    options = (mode or Options()).merge(Options(warn_on_shrink=False))
    with DatasetIterator(source, options, probe=True) as iterator:
        try:
            return next(iterator)
        except StopIteration:
            raise ElementSpecError(
                f"{stage}: its element_spec is found by applying the function to the first "
                f"input element, but the input is empty{hint}"
            ) from None


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

    def gathers_batches(self) -> bool:
        """Whether :meth:`get_many` makes a batch without holding its rows first.

        True for sources that slice or gather (a batch costs only itself). The
        default ``get_many`` gets every row, then stacks them — a batch of
        inputs plus its output, allocated before the budget could see it — so
        ``batch`` assembles such rows in place instead, booked first.
        """
        return type(self).get_many is not RandomAccess.get_many

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


def check_signature(signature: Any, stage: str) -> Any:
    """Validate an ``output_signature`` at build time: a TensorSpec or a nest of them."""
    from headrace.errors import InvalidArgumentError
    from headrace.structure import TensorSpec, flatten

    for leaf in flatten(signature):
        if not isinstance(leaf, TensorSpec):
            raise InvalidArgumentError(
                f"{stage}: output_signature leaves must be TensorSpec, got {leaf!r}"
            )
    return signature
