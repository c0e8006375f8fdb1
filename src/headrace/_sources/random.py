"""``Dataset.random(seed)``: an infinite stream of pseudo-random int64 values, as tf.data.

Values are uniform in ``[0, 2**32)`` like tf.data's (Philox uint32 outputs in an
int64), but from NumPy's Philox keyed differently, so the sequence is not
TensorFlow's. A fixed seed gives the same sequence on every iteration unless
``rerandomize_each_iteration=True``; ``seed=None`` differs per iteration.
Resumable by count: a restore regenerates draws, nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from headrace._memory.buffer import NO_RESERVATION, Reservation
from headrace._structure import TensorSpec
from headrace._transforms._random import RandomStream, SeededNode
from headrace.core.iterator import Context, Iterator
from headrace.core.node import INFINITE, SourceNode, Traits
from headrace.core.state import StateReader

__all__ = ["RandomNode"]


class RandomNode(SourceNode, SeededNode):
    stage = "random"

    def traits(self) -> Traits:
        return Traits(unseeded=self.seed is None)

    def __init__(self, seed: int | None, rerandomize_each_iteration: bool | None) -> None:
        super().__init__()
        self.init_seed(seed, rerandomize_each_iteration, "random")

    def params(self) -> tuple[Any, ...]:
        return (self.seed, self.rerandomize)

    @property
    def element_spec(self) -> Any:
        return TensorSpec((), np.int64)

    def cardinality(self) -> int:
        return INFINITE

    def make_iterator(self, ctx: Context) -> Iterator:
        return _RandomIterator(self, ctx)


class _RandomIterator(Iterator):
    stage = "random"

    def __init__(self, node: RandomNode, ctx: Context) -> None:
        super().__init__()
        self.stream = RandomStream(node, ctx, self.stage)

    def pull(self) -> tuple[Any, Reservation]:
        return np.int64(self.stream.next()), NO_RESERVATION

    def get_state(self) -> dict[str, Any]:
        return self.stream.as_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.restore(StateReader(state, self.stage))
