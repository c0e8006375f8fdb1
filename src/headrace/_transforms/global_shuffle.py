"""``global_shuffle(seed=None, reshuffle_each_iteration=True)``: a full permutation, O(1) memory.

A buffered ``shuffle`` only mixes within its window. ``global_shuffle`` needs a
random-access input (arrays, ranges, indexed TFRecord files, through the
stages tf.data 2.21 addresses: see :mod:`headrace._transforms._element_access`;
an empty input is refused, as in tf.data) and visits every
element exactly once in a pseudo-random order given by a keyed bijection of
``[0, n)`` — a Feistel network with cycle-walking — so it holds no buffer and
no index list at all, and the state is one position: resuming is O(1) even
at record 900 million.

Workers of a distributed job that use the same seed see the same permutation,
so ``global_shuffle(seed).shard(num_workers, rank)`` splits it disjointly.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, Origin
from headrace._transforms._element_access import Refusal, element_access
from headrace.core.indexing import IndexPlan, IndexStream, Indices, RandomAccess, Reach
from headrace.core.iterator import Context
from headrace.core.node import Node, ShardRole, Traits, UnaryNode, check_positive
from headrace.core.state import EPOCH, INT64_MAX, POSITION, StateReader

__all__ = ["FeistelPermutation", "GlobalShuffleNode"]

_ROUNDS = 4
_CACHE_POSITIONS = 4096
_MASK64 = (1 << 64) - 1


class FeistelPermutation:
    """A keyed bijection of ``[0, size)``, evaluated on NumPy arrays of positions."""

    def __init__(self, size: int, key: int) -> None:
        self.size = size
        bits = max((size - 1).bit_length(), 2)
        self.half_bits = (bits + 1) // 2
        self.half_mask = np.uint64((1 << self.half_bits) - 1)
        generator = np.random.Generator(np.random.Philox(key=key))
        self.round_keys = generator.integers(0, 1 << 63, size=_ROUNDS, dtype=np.uint64)

    def _round(self, value: np.ndarray[Any, Any], key: np.uint64) -> np.ndarray[Any, Any]:
        # splitmix64-style mixing of the half-block with the round key
        mixed = (value ^ key) * np.uint64(0x9E3779B97F4A7C15)
        mixed ^= mixed >> np.uint64(29)
        mixed *= np.uint64(0xBF58476D1CE4E5B9)
        mixed ^= mixed >> np.uint64(32)
        masked: np.ndarray[Any, Any] = mixed & self.half_mask
        return masked

    def _encrypt(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        shift = np.uint64(self.half_bits)
        left = positions >> shift
        right = positions & self.half_mask
        for key in self.round_keys:
            left, right = right, left ^ self._round(right, key)
        joined: np.ndarray[Any, Any] = (left << shift) | right
        return joined

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The permuted index of each position (cycle-walking keeps values in range)."""
        with np.errstate(over="ignore"):
            values = self._encrypt(positions.astype(np.uint64))
            outside = values >= np.uint64(self.size)
            while outside.any():
                values[outside] = self._encrypt(values[outside])
                outside = values >= np.uint64(self.size)
        return values.astype(np.int64)


class GlobalShuffleNode(UnaryNode):
    stage = "global_shuffle"

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()  # one element out per element in

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # its permutation spans the whole input

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        inner = reach(self.inputs[0])
        if isinstance(inner, Refusal):
            return inner
        # Element i is the input's element at the permuted position i. Not the input's
        # access as it is: a stage above (take, batch, shard) would then cut or group
        # the unshuffled order. The permutation is the first run's of
        # reshuffle_each_iteration=False; with reshuffling it is one fixed draw.
        return _PermutedAccess(inner, _permutation(len(inner), self.base_seed, []))

    def traits(self) -> Traits:
        return Traits(unseeded=self.seed is None)

    def __init__(self, source: Node, seed: int | None, reshuffle_each_iteration: bool) -> None:
        super().__init__(source)
        access = element_access(source)
        if isinstance(access, Refusal):
            raise InvalidArgumentError(access.message())
        if len(access) == 0:  # tf.data's rule: nothing to permute is a mistake upstream
            raise InvalidArgumentError(
                "global_shuffle needs a non-empty input (tf.data refuses an empty one too); "
                "this one has no elements"
            )
        if seed is not None:
            check_positive("global_shuffle: seed", seed, allow_zero=True)
        self.seed = seed
        self.base_seed = seed if seed is not None else secrets.randbits(63)
        self.reshuffle = bool(reshuffle_each_iteration)

    def params(self) -> tuple[Any, ...]:
        return (self.seed, self.reshuffle)

    def epoch_of(self, ctx: Context) -> list[int]:
        """What keys the permutation besides the seed: which iteration and repetition it is."""
        return [ctx.run.iteration, *ctx.epochs] if self.reshuffle else []

    def index_plan(self) -> IndexPlan | None:
        access = element_access(self.inputs[0])
        assert isinstance(access, RandomAccess)
        size = len(access)

        def make(ctx: Context) -> IndexStream:
            return _PermutedIndices(self, ctx, size, self.epoch_of(ctx))

        return access, make


def _permutation(size: int, seed: int, epoch: list[int]) -> FeistelPermutation:
    """The permutation of ``size`` positions that ``seed`` and ``epoch`` key."""
    words = np.random.SeedSequence([seed, *epoch]).generate_state(2, np.uint64)
    return FeistelPermutation(size, int(words[0]) << 64 | int(words[1]))


class _PermutedAccess(RandomAccess):
    """A global_shuffle's random access: element ``i`` is the input's element
    ``permutation(i)``."""

    def __init__(self, inner: RandomAccess, permutation: FeistelPermutation) -> None:
        self.inner, self.permutation = inner, permutation

    def __len__(self) -> int:
        return len(self.inner)

    def _positions(self, indices: Indices) -> np.ndarray[Any, Any]:
        return self.permutation(np.asarray(indices, dtype=np.int64))

    def get(self, index: int) -> Any:
        if not 0 <= index < len(self.inner):
            raise IndexError(index)
        return self.inner.get(int(self._positions(range(index, index + 1))[0]))

    def get_many(self, indices: Indices) -> Any:
        return self.inner.get_many(self._positions(indices))

    def origin(self, index: int) -> Origin | None:
        return self.inner.origin(int(self._positions(range(index, index + 1))[0]))

    def gathers_batches(self) -> bool:
        return self.inner.gathers_batches()

    def prepare(self, ctx: Context) -> None:
        self.inner.prepare(ctx)

    def close(self) -> None:
        self.inner.close()


class _PermutedIndices(IndexStream):
    def __init__(self, node: GlobalShuffleNode, ctx: Context, size: int, epoch: list[int]) -> None:
        self.node, self.ctx = node, ctx
        # seed=None: a restored run keeps the saved seed for every later epoch too
        self.size, self.seed, self.epoch = size, ctx.seed_of(node, node.base_seed), epoch
        self.position = 0
        self._permutation = self._build()
        self._cache: tuple[int, np.ndarray[Any, Any]] = (0, np.empty(0, np.int64))

    def _build(self) -> FeistelPermutation:
        return _permutation(self.size, self.seed, self.epoch)

    def _permuted(self, start: int, stop: int) -> np.ndarray[Any, Any]:
        """Permuted indices of positions [start, stop), computed a block at a time."""
        cache_start, cache = self._cache
        if not (cache_start <= start and stop <= cache_start + len(cache)):
            end = max(stop, min(start + _CACHE_POSITIONS, self.size))
            cache = self._permutation(np.arange(start, end, dtype=np.uint64))
            cache_start = start
            self._cache = (cache_start, cache)
        return cache[start - cache_start : stop - cache_start]

    def take(self, count: int) -> Indices:
        stop = min(self.position + count, self.size)
        if stop <= self.position:
            return range(0)
        block = self._permuted(self.position, stop)
        self.position = stop
        return block

    def next_index(self) -> int:
        if self.position >= self.size:
            raise StopIteration
        index = int(self._permuted(self.position, self.position + 1)[0])
        self.position += 1
        return index

    def get_state(self) -> dict[str, Any]:
        return {POSITION: self.position, "seed": self.seed, EPOCH: self.epoch}

    def set_state(self, state: dict[str, Any]) -> None:
        node, reader = self.node, StateReader(state, "global_shuffle")
        position = reader.integer(POSITION, high=self.size, why=f"the input has {self.size} elements")
        seed = reader.integer("seed", high=max(INT64_MAX, node.seed or 0))
        if node.seed is not None and seed != node.seed:
            raise reader.error("seed", f"= {seed}, but this global_shuffle has seed={node.seed}")
        epoch, expected = reader.integers(EPOCH), node.epoch_of(self.ctx)
        if epoch != expected:
            raise reader.error(
                EPOCH, f"= {epoch}, but this iterator is at {expected} (its iteration "
                "and the epoch of each enclosing repeat)"
            )
        if node.seed is None:
            self.ctx.restore_seed(node, seed)
        self.position, self.seed, self.epoch = position, seed, epoch
        self._permutation = self._build()
        self._cache = (0, np.empty(0, np.int64))
