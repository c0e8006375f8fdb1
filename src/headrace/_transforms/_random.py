"""Seeded, resumable random streams for the random stages (``Dataset.random``, sampling).

A stream is NumPy's Philox keyed by ``(seed, iteration, epochs)`` — the same
keying as shuffle — read in blocks; its state is the seed, the epoch list and
how many values were drawn, so a restore regenerates the blocks (no data is
read) and goes on with the very next value. The values are not tf.data's
(different generator), the distribution is.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from headrace.core.iterator import Context
from headrace.core.state import INT64_MAX, StateReader

__all__ = ["RandomStream", "SeededNode"]

_BLOCK = 4096


def _key(seed: int, epoch: list[int]) -> int:
    words = np.random.SeedSequence([seed, *epoch]).generate_state(2, dtype=np.uint64)
    return int(words[0]) << 64 | int(words[1])


class SeededNode:
    """Mixin for a node with ``seed`` and ``rerandomize_each_iteration`` (tf.data's meaning).

    ``seed=None`` draws a base seed once per recipe; a restored state carries it.
    """

    seed: int | None
    base_seed: int
    rerandomize: bool

    def init_seed(self, seed: Any, rerandomize: bool | None, stage: str) -> None:
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0
        ):
            from headrace._errors import InvalidArgumentError

            raise InvalidArgumentError(f"{stage}: seed must be None or an int >= 0, got {seed!r}")
        self.seed = None if seed is None else int(seed)
        self.base_seed = self.seed if self.seed is not None else secrets.randbits(63)
        # tf.data: the same sequence on each iteration unless asked otherwise
        self.rerandomize = bool(rerandomize)

    def epoch_of(self, ctx: Context) -> list[int]:
        return [ctx.run.iteration, *ctx.epochs] if self.rerandomize else []


class RandomStream:
    """uint32 values (as Python ints) from Philox, counted for checkpoints."""

    def __init__(self, node: SeededNode, ctx: Context, stage: str) -> None:
        self.node, self.ctx, self.stage = node, ctx, stage
        self.seed = ctx.seed_of(node, node.base_seed)
        self.epoch = node.epoch_of(ctx)
        self._start(0)

    def _start(self, count: int) -> None:
        self.generator = np.random.Generator(np.random.Philox(key=_key(self.seed, self.epoch)))
        self.count = 0
        self.block: list[int] = []
        self.position = 0
        while self.count + _BLOCK <= count:  # whole blocks: regenerate, never hand out
            self.generator.integers(0, 1 << 32, size=_BLOCK, dtype=np.uint64)
            self.count += _BLOCK
        while self.count < count:
            self.next()

    def next(self) -> int:
        if self.position == len(self.block):
            self.block = self.generator.integers(0, 1 << 32, size=_BLOCK, dtype=np.uint64).tolist()
            self.position = 0
        value = self.block[self.position]
        self.position += 1
        self.count += 1
        return value

    def uniform(self) -> float:
        """A float in [0, 1) from the next two draws (53 bits)."""
        high, low = self.next() >> 5, self.next() >> 6
        return (high * 67108864.0 + low) / 9007199254740992.0

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "drawn": self.count}

    def restore(self, reader: StateReader) -> None:
        seed = reader.integer("seed", high=INT64_MAX)
        if self.node.seed is not None and seed != self.node.seed:
            raise reader.error("seed", f"= {seed}, but this stage has seed={self.node.seed}")
        epoch = reader.integers("epoch")
        if self.node.rerandomize != bool(epoch):
            raise reader.error("epoch", f"= {epoch} does not match rerandomize_each_iteration")
        if self.node.seed is None:
            self.ctx.restore_seed(self.node, seed)
        self.seed, self.epoch = seed, epoch
        self._start(reader.integer("drawn"))
