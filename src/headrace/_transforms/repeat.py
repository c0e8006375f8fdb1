"""``repeat(count=None)``: the input again, with a fresh input iterator per epoch.

``None`` or any negative count repeats forever (tf.data's rule), ``0`` gives nothing; an input that turns
out empty ends the repetition instead of spinning (tf.data does the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import InvalidArgumentError, Origin
from headrace._memory.buffer import Reservation
from headrace.core.indexing import (
    IndexMap,
    IndexPlan,
    IndexStream,
    Indices,
    RandomAccess,
    Reach,
    Refusal,
    mapped_access,
    mapped_indices,
)
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import INFINITE, UNKNOWN, Node, ShardRole, Traits, UnaryNode
from headrace.core.state import EPOCH, INNER, INT64_MAX, PRODUCED, StateReader

__all__ = ["Cycle", "RepeatNode"]


class Cycle(IndexMap):
    """The input's positions ``count`` times over (``count < 0``: forever): repeat.

    Its period is the input's length; the stream starts a fresh input stream per
    epoch (a shuffle below draws each epoch's order anew) and ends at an epoch that
    gave nothing, rather than spin.
    """

    cycles = True

    def __init__(self, count: int) -> None:
        super().__init__(f"repeat({count})", keeps_from=0)
        self.count = count

    def length(self, size: int) -> int:
        return size * self.count

    def position(self, indices: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
        return indices % size

    def want(self, consumed: int, count: int) -> int:
        return 0 if self.count == 0 else count

    def select(self, consumed: int, block: Indices) -> Indices:
        return block

    def another_epoch(self, epoch: int) -> bool:
        return self.count < 0 or epoch + 1 < self.count

    def epoch_limit(self) -> int:
        return INT64_MAX if self.count < 0 else self.count

    def old_state(self, reader: StateReader) -> tuple[int | None, int] | None:
        # It wrote its count, and set it to 0 where an empty epoch had ended it; past
        # its last epoch (epoch == count), a fresh input it never read stands there.
        if "count" not in reader.state:
            return None
        count = self.count
        saved_count = reader.integer("count", low=-1, high=max(count, 0))
        if saved_count not in (count, 0):
            raise reader.error("count", f"= {saved_count}, but this repeat has count={count}")
        epoch = (
            reader.integer(EPOCH)
            if saved_count < 0
            else reader.integer(EPOCH, high=max(count, 0), why=self.call)
        )
        produced = reader.integer(PRODUCED)
        if saved_count == 0 and count != 0:
            return None, epoch
        return produced, epoch


def _maps_below(node: Node) -> bool:
    """Whether a map runs in ``node``'s recipe (its own inputs, not nested datasets)."""
    pending = [node]
    while pending:
        current = pending.pop()
        if current.traits().maps:
            return True
        pending.extend(current.inputs)
    return False


class RepeatNode(UnaryNode):
    stage = "repeat"

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        if self.count < 0:
            return Refusal(self, "an infinite repeat has no element i to shuffle to")
        return mapped_access(self.index_map(), reach(self.inputs[0]))

    def index_map(self) -> Cycle:
        """Which input positions come: all of them, ``count`` times over."""
        return Cycle(self.count)

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node, count: int | None) -> None:
        super().__init__(source)
        if count is None:
            count = -1
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise InvalidArgumentError(
                f"repeat: count must be None, an int >= 0, or negative (forever), got {count!r}"
            )
        self.count = -1 if count < 0 else int(count)

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT

    def params(self) -> tuple[Any, ...]:
        return (self.count,)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if self.count == 0 or inner == 0:
            return 0
        if self.count < 0 or inner == INFINITE:
            return INFINITE  # as tf.data, even for an input of unknown size
        if inner == UNKNOWN:
            return UNKNOWN
        return inner * self.count

    def index_plan(self) -> IndexPlan | None:
        """Indices repeated, unless a map is below: one random access serves every epoch
        of an index plan, and a map's function must know its epoch (an int-seeded
        random op draws anew each epoch, as tf.data's do): each epoch then builds its
        own input iterator, which knows it (see :mod:`headrace.core.position`)."""
        if _maps_below(self.inputs[0]):
            return None
        return super().index_plan()

    def wrap_indices(
        self, make_inner: Callable[[Context], IndexStream], ctx: Context
    ) -> IndexStream | None:
        return mapped_indices(self.index_map(), make_inner, ctx)

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        # not stream_iterator: each epoch builds its own input iterator
        return _RepeatIterator(self.inputs[0], ctx, self.count)


class _RepeatIterator(Iterator):
    stage = "repeat"

    def __init__(self, source: Node, ctx: Context, count: int) -> None:
        self.source, self.ctx, self.count = source, ctx, count
        self.epoch = 0
        self.produced_this_epoch = 0
        self.inner: Iterator | None = (
            source.make_iterator(ctx.with_epoch(0)) if count != 0 else None
        )
        self.tracking = self.tokens = False
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None
        super().__init__(*([self.inner] if self.inner else []))

    def _new_epoch(self) -> None:
        assert self.inner is not None
        self.inner.close()
        self.epoch += 1
        self.produced_this_epoch = 0
        self.inner = self.source.make_iterator(self.ctx.with_epoch(self.epoch))
        self.inputs = (self.inner,)
        if self.tracking:  # a stage above asks for origins: this epoch's input remembers them
            self.probe = origin_probe(self.inner, self.tokens)

    def pull(self) -> tuple[Any, Reservation]:
        while self.inner is not None:
            try:
                pair = self.inner.pull()
            except StopIteration:
                if self.produced_this_epoch == 0 or 0 <= self.count <= self.epoch + 1:
                    self.inner.close()
                    self.inner = None
                    self.inputs = ()
                    break
                self._new_epoch()
                continue
            self.produced_this_epoch += 1
            return pair
        raise StopIteration

    def origin(self) -> Origin | None:
        return None if self.inner is None else self.inner.origin()

    def origin_token(self) -> Any:
        probe = self.probe
        return None if probe is None or self.inner is None else probe[0]()

    def origin_of(self, token: Any) -> Origin | None:
        # every epoch's iterator reads the same recipe: the current one's probe can say
        probe = self.probe
        return None if probe is None or token is None else probe[1](token)

    def track_origins(self, tokens: bool = True) -> bool:
        self.tracking, self.tokens = True, self.tokens or tokens
        self.probe = None if self.inner is None else origin_probe(self.inner, self.tokens)
        return self.probe is not None

    def get_state(self) -> dict[str, Any]:
        return {
            EPOCH: self.epoch,
            PRODUCED: self.produced_this_epoch,
            INNER: None if self.inner is None else self.inner.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, "repeat")
        count = self.count
        # a new epoch starts only while another is due: epoch < count
        epoch = (
            reader.integer(EPOCH)
            if count < 0
            else reader.integer(EPOCH, high=max(count - 1, 0), why=f"repeat({count})")
        )
        produced = reader.integer(PRODUCED)
        inner_state = reader.optional_child(INNER)
        if count == 0 and inner_state is not None:
            raise reader.error(INNER, "must be null: repeat(0) has no input iterator")
        if self.inner is not None:
            self.inner.close()
        self.epoch, self.produced_this_epoch = epoch, produced
        if inner_state is None:
            self.inner = None
            self.inputs = ()
            return
        self.inner = self.source.make_iterator(self.ctx.with_epoch(self.epoch))
        self.inputs = (self.inner,)
        if self.tracking:  # a stage above asks for origins: this epoch's input remembers them
            self.probe = origin_probe(self.inner, self.tokens)
        self.inner.set_state(inner_state)
