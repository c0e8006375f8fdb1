"""``shard(num_shards, index)``: every ``num_shards``-th element, as tf.data.

tf.data reads and discards the other shards' elements; on a random-access
input headrace selects indices instead, so a worker reads only its own rows.
For files, shard the *file list* before reading (see ``headrace.auto_shard``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace.core.indexing import (
    IndexMap,
    IndexStream,
    Indices,
    MappedIterator,
    RandomAccess,
    Reach,
    Refusal,
    mapped_access,
    mapped_indices,
)
from headrace.core.iterator import Context, Iterator
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits, UnaryNode
from headrace.core.state import POSITION, StateReader

__all__ = ["ShardNode", "Stride"]


class Stride(IndexMap):
    """Input positions ``phase, phase + step, ...``: ``shard(step, phase)``."""

    def __init__(self, step: int, phase: int) -> None:
        super().__init__(f"shard({step}, {phase})")
        self.step, self.phase = step, phase

    def length(self, size: int) -> int:
        return size // self.step + (self.phase < size % self.step)

    def position(self, indices: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
        return indices * self.step + self.phase

    def want(self, consumed: int, count: int) -> int:
        # to the next kept position, then count - 1 strides on, that one included
        return (self.phase - consumed) % self.step + (count - 1) * self.step + 1

    def select(self, consumed: int, block: Indices) -> Indices:
        return block[(self.phase - consumed) % self.step :: self.step]

    def old_state(self, reader: StateReader) -> tuple[int | None, int] | None:
        # it counted the input indices (over an index stream) or elements it had seen
        for key in ("seen", POSITION):
            if key in reader.state:
                return reader.integer(key), 0
        return None


class ShardNode(UnaryNode):
    stage = "shard"

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # keeps elements by position

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return mapped_access(self.index_map(), reach(self.inputs[0]))

    def index_map(self) -> Stride:
        """Which input positions come: every ``num_shards``-th from ``index``."""
        return Stride(self.num_shards, self.index)

    def traits(self) -> Traits:
        return Traits(shards=(self.num_shards, self.index))

    def __init__(self, source: Node, num_shards: int, index: int) -> None:
        super().__init__(source)
        for name, value in (("num_shards", num_shards), ("index", index)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidArgumentError(f"shard: {name} must be an int, got {value!r}")
        if num_shards <= 0:
            raise InvalidArgumentError(
                f"shard: number of shards must be greater than zero, got {num_shards}"
            )
        if not 0 <= index < num_shards:
            raise InvalidArgumentError(
                f"shard: index must be between 0 and {num_shards - 1}, got {index}"
            )
        self.num_shards, self.index = int(num_shards), int(index)

    def params(self) -> tuple[Any, ...]:
        return (self.num_shards, self.index)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if inner in (INFINITE, UNKNOWN):
            return inner
        return inner // self.num_shards + (self.index < inner % self.num_shards)

    def wrap_indices(
        self, make_inner: Callable[[Context], IndexStream], ctx: Context
    ) -> IndexStream | None:
        return mapped_indices(self.index_map(), make_inner, ctx)

    def stream_iterator(self, inner: Iterator, ctx: Context) -> Iterator:
        return MappedIterator(inner, self.index_map())
