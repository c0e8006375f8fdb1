"""Element ``i`` of a pipeline, for ``global_shuffle``: what tf.data calls random access.

``Node.random_access`` answers for the stages that *are* addressable as they
run (sources, per-element maps, zip, concatenate, enumerate). ``global_shuffle``
reaches further, as tf.data 2.21's does: it addresses through stages that only
choose or regroup elements by position — ``take``, ``skip``, ``shard``, a
finite ``repeat``, ``batch(drop_remainder=True)`` — and through stages that
change nothing but timing — ``prefetch``, ``cache``, a parallel ``map`` (each
element is computed when it is fetched), and an inner ``global_shuffle`` (a
uniformly random permutation composed with any other is again uniformly
random, so the inner one is skipped). Those stages run as they always do
anywhere else; only ``global_shuffle`` reads through them.

Stages whose elements depend on other elements (filter, shuffle, interleave,
unbatch, padded_batch, ...), an infinite ``repeat`` and ``batch`` keeping a
partial last batch are refused, as tf.data refuses them, with the stage named.

Each stage says which it is in its own module (:meth:`Node.element_access`), mapping
indices with the accesses of :mod:`headrace.core.indexing`; this module walks them.
"""

from __future__ import annotations

from headrace.core.indexing import RandomAccess, Refusal
from headrace.core.node import Node

__all__ = ["Refusal", "element_access"]


def element_access(node: Node) -> RandomAccess | Refusal:
    """Random access to ``node``'s elements in their order, or why there is none."""
    return node.element_access(element_access)
