"""headrace's engine core: what a stage is made of, for built-in and third-party stages.

A pipeline has two sides. The *recipe* is a tree of immutable, picklable
:class:`Node` objects (``Dataset`` is a fluent facade over one); ``iter()``
turns it into a tree of :class:`Iterator` objects for one *run*, which share a
:class:`Context` (options, the run's budget, the costs of elements) and are
driven by a :class:`~headrace.core.run.DatasetIterator`.

To write a transformation: subclass :class:`Node` (or :class:`UnaryNode`),
give it a ``stage`` name, its element spec, cardinality and ``params()`` (for
the checkpoint fingerprint), its ``shard_role()`` (where sharding may pass it;
the default keeps sharding above it), its ``element_access()`` (how ``global_shuffle``
reaches element ``i`` through it; the default refuses) and its ``traits()`` (the
facts the lint and the adapters read; the default claims none), and build an
:class:`Iterator` whose ``pull()``
returns ``(element, reservation)``. A stage that buffers elements declares
``budget_weight`` on its node class, asks ``ctx.account(node)`` for its share
and books each element on it before holding it. ``Dataset.apply`` plugs a
function returning such a dataset into a chain; docs/guide/custom-stages.md shows one end to end.

Nothing here imports a transformation, a source or the ``Dataset`` facade:
the layers above depend on this one, never the reverse.
"""

from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace.core.fingerprint import function_fingerprint, function_name
from headrace.core.handoff import Handoff, restore_input
from headrace.core.indexing import IndexPlan, IndexStream, Indices, RandomAccess, Refusal
from headrace.core.iterator import Context, Iterator, RunFacts
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits, UnaryNode
from headrace.core.run import STATE_VERSION, DatasetIterator, default_budget
from headrace.core.state import StateReader

__all__ = [
    "INFINITE",
    "NO_RESERVATION",
    "STATE_VERSION",
    "UNKNOWN",
    "Buffer",
    "Context",
    "DatasetIterator",
    "Handoff",
    "IndexPlan",
    "IndexStream",
    "Indices",
    "Iterator",
    "Node",
    "RandomAccess",
    "Refusal",
    "Reservation",
    "RunFacts",
    "ShardRole",
    "StateReader",
    "Traits",
    "UnaryNode",
    "default_budget",
    "function_fingerprint",
    "function_name",
    "restore_input",
]
