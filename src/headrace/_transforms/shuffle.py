"""``shuffle(buffer_size, seed=None, reshuffle_each_iteration=True)``.

The algorithm is tf.data's fill-then-draw ring buffer: fill to ``buffer_size``
elements, output a uniformly drawn one, move the oldest into its slot, refill.
The random numbers come from NumPy's Philox generator (not TensorFlow's
Philox4x32 stream), so orders match tf.data's *distribution*, not its exact
sequence.

Memory. On a random-access input the buffer holds 8-byte indices and elements
are read when drawn, so a full shuffle of a 500 MB array costs ~1 MB. On a
streaming input the buffer holds elements, each booked on the stage's share of
the budget; a ``buffer_size`` that cannot fit shrinks — deterministically,
from the element sizes and the share alone — with one warning.

Resuming. The state is the input's state when this epoch's shuffle started,
the seed and the number of draws: restoring replays the draws (for indices
this reads no data; for a streaming input it re-reads the epoch up to the
checkpoint, exact when the input is deterministic).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from headrace._errors import CheckpointError, HeadraceWarning, MemoryBudgetError, Origin
from headrace._memory.buffer import Buffer, Reservation, release_all
from headrace._memory.units import format_bytes
from headrace._warn import warn_user
from headrace.core.indexing import (
    IndexPlan,
    IndexStream,
    Indices,
    RandomAccess,
    Reach,
    Refusal,
    take_all,
)
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.node import Node, ShardRole, Traits, UnaryNode, check_positive
from headrace.core.state import EPOCH, ERRORS_MET, INT64_MAX, StateReader, past_end
from headrace.io._native import native_module

__all__ = ["ShuffleNode"]

_DRAW_BLOCK = 4096
_INDEX_SLOT_BYTES = 8


class _Draws:
    """uint32 draws from Philox, generated in blocks of 4,096; resumable by count.

    ``next`` serves one draw (the element path); ``peek``/``advance`` serve
    many at once (the index path). Both read the same sequence.
    """

    def __init__(self, key: int) -> None:
        self.key = key
        self.count = 0
        self._generator = np.random.Generator(np.random.Philox(key=key))
        self._block = np.empty(0, np.uint64)
        self._listed: list[int] = []
        self._position = 0

    def _new_block(self) -> np.ndarray[Any, Any]:
        return self._generator.integers(0, 1 << 32, size=_DRAW_BLOCK, dtype=np.uint64)

    def next(self) -> int:
        if self._position == len(self._listed):
            self._listed = self._new_block().tolist()
            self._position = 0
        value = self._listed[self._position]
        self._position += 1
        self.count += 1
        return value

    def peek(self, count: int) -> np.ndarray[Any, Any]:
        """The next ``count`` draws, without using them up."""
        while len(self._block) - self._position < count:
            self._block = np.concatenate([self._block[self._position :], self._new_block()])
            self._position = 0
        return self._block[self._position : self._position + count]

    def advance(self, count: int) -> None:
        """Use up ``count`` draws returned by :meth:`peek`."""
        self._position += count
        self.count += count


def _epoch_key(seed: int, epoch: list[int]) -> int:
    words = np.random.SeedSequence([seed, *epoch]).generate_state(2, dtype=np.uint64)
    return int(words[0]) << 64 | int(words[1])


class ShuffleNode(UnaryNode):
    stage = "shuffle"
    budget_weight = 4  # a buffer of elements; a buffer of indices weighs 1
    sets_order = True

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()  # one element out per element in

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # element i is drawn from a buffer of those before it

    def traits(self) -> Traits:
        return Traits(shuffle_buffer=self.buffer_size, unseeded=self.seed is None)

    def __init__(
        self, source: Node, buffer_size: int, seed: int | None, reshuffle_each_iteration: bool
    ) -> None:
        super().__init__(source)
        self.buffer_size = check_positive("shuffle: buffer_size", buffer_size)
        if seed is not None:
            check_positive("shuffle: seed", seed, allow_zero=True)
        self.seed = seed
        self.base_seed = seed if seed is not None else secrets.randbits(63)
        self.reshuffle = bool(reshuffle_each_iteration)

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT

    def params(self) -> tuple[Any, ...]:
        return (self.buffer_size, self.seed, self.reshuffle)

    def epoch_of(self, ctx: Context) -> list[int]:
        """What seeds this iterator besides the seed: which iteration and repetition it is."""
        return [ctx.run.iteration, *ctx.epochs] if self.reshuffle else []

    def index_plan(self) -> IndexPlan | None:
        plan = self.inputs[0].index_plan()
        if plan is None:
            return None
        access, make_inner = plan

        def make(ctx: Context) -> IndexStream:
            account = ctx.account(self, weight=1)
            return _ShuffledIndices(self, make_inner(ctx), account, ctx)

        return access, make

    def make_iterator(self, ctx: Context) -> Iterator:
        if self.index_plan() is not None:
            return super().make_iterator(ctx)
        account = ctx.account(self)
        return _ShuffleIterator(self, self.inputs[0].make_iterator(ctx), ctx, account)


class _Ring:
    """tf.data's ring: slots ``start % capacity`` .. ``end % capacity``.

    The list grows only while the ring first fills (tf.data draws only from a
    full buffer), so it never holds more slots than elements it has held.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: list[Any] = []
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def push(self, item: Any) -> None:
        slot = self.end % self.capacity
        if slot == len(self.slots):
            self.slots.append(item)
        else:
            self.slots[slot] = item
        self.end += 1

    def shrink_to_current(self) -> None:
        """Make the ring's capacity what it holds now (only before the first draw)."""
        if self.start == 0 and self.end:
            self.capacity = self.end

    def pop_drawn(self, draw: int) -> Any:
        slots, capacity = self.slots, self.capacity
        start_slot = self.start % capacity
        slot = (self.start + draw % (self.end - self.start)) % capacity
        item = slots[slot]
        slots[slot] = slots[start_slot]
        slots[start_slot] = None
        self.start += 1
        return item

    def items(self) -> list[Any]:
        return [item for item in self.slots if item is not None]


class _ShuffleState:
    """The parts of the state both shuffle paths share: epoch, draws, input start."""

    def __init__(self, node: ShuffleNode, ctx: Context, inner_start: dict[str, Any]) -> None:
        self.node, self.ctx = node, ctx
        # seed=None: a restored run keeps the saved seed for every later epoch too
        self.seed = ctx.seed_of(node, node.base_seed)
        self.epoch = node.epoch_of(ctx)
        self.draws = _Draws(_epoch_key(self.seed, self.epoch))
        self.inner_start = inner_start

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        return {
            "seed": self.seed,
            EPOCH: self.epoch,
            "drawn": self.draws.count,
            "inner_start": self.inner_start,
            **extra,
        }

    def restore(self, state: dict[str, Any]) -> tuple[StateReader, int]:
        """Check and take the shared fields; the reader (for the rest) and the draw count.

        The draw count is bounded by the input's size when that is known, so a
        forged count is refused at once instead of replaying for hours.
        """
        node, reader = self.node, StateReader(state, "shuffle")
        seed = reader.integer("seed", high=max(INT64_MAX, node.seed or 0))
        if node.seed is not None and seed != node.seed:
            raise reader.error("seed", f"= {seed}, but this shuffle has seed={node.seed}")
        epoch = reader.integers(EPOCH)
        expected = node.epoch_of(self.ctx)
        if epoch != expected:
            raise reader.error(
                EPOCH, f"= {epoch}, but this iterator is at {expected} (its iteration "
                "and the epoch of each enclosing repeat)"
            )
        size = node.inputs[0].cardinality()
        drawn = (
            reader.integer("drawn", high=size, why=f"the input has {size} elements")
            if size >= 0 else reader.integer("drawn")
        )
        self.inner_start = reader.child("inner_start")
        if node.seed is None:
            self.ctx.restore_seed(node, seed)
        self.seed, self.epoch = seed, epoch
        self.draws = _Draws(_epoch_key(seed, epoch))
        return reader, drawn


def _draw_python(
    ring: np.ndarray[Any, Any],
    capacity: int,
    start: int,
    end: int,
    incoming: np.ndarray[Any, Any],
    draws: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
) -> tuple[int, int, int, int]:
    """The pure-Python twin of the C kernel ``shuffle_draw`` (identical results)."""
    slots, arriving, drawn = ring.tolist(), incoming.tolist(), draws.tolist()
    used = produced = 0
    while produced < len(out):
        if end - start < capacity and used < len(arriving):
            slots[end % capacity] = arriving[used]
            used += 1
            end += 1
        if end == start:
            break
        first = start % capacity
        slot = (start + drawn[produced] % (end - start)) % capacity
        out[produced] = slots[slot]
        slots[slot] = slots[first]
        start += 1
        produced += 1
    ring[:] = slots
    return produced, start, end, used


class _ShuffledIndices(IndexStream):
    """tf.data's shuffle ring over indices: 8 bytes a slot, drawn in C a block at a time."""

    def __init__(
        self, node: ShuffleNode, inner: IndexStream, account: Buffer, ctx: Context
    ) -> None:
        self.node, self.inner, self.account = node, inner, account
        self.shared = _ShuffleState(node, ctx, inner.get_state())
        self.warn = ctx.options.warn_on_shrink
        self.booked = 0
        self._reset(node.buffer_size)

    def _reset(self, capacity: int) -> None:
        self.capacity = capacity
        self.ring = np.empty(0, np.int64)
        self.start = self.end = 0
        self.pending = np.empty(0, np.int64)  # indices pulled but not yet in the ring
        self.exhausted = False
        self.filled = False

    def _fill(self) -> None:
        """The first fill: up to ``capacity`` indices, booked on the budget as they come."""
        blocks: list[np.ndarray[Any, Any]] = []
        held = 0
        while held < self.capacity and not self.exhausted:
            wanted = self._book_slots(held + min(self.capacity - held, 1 << 16)) - held
            if wanted <= 0:
                break
            block = take_all(self.inner, wanted)
            if len(block) < wanted:
                self.exhausted = True
            if len(block):
                blocks.append(np.asarray(block, dtype=np.int64))
                held += len(block)
        self.ring = np.concatenate(blocks) if blocks else np.empty(0, np.int64)
        self.end = held
        self.filled = True

    def _book_slots(self, slots: int) -> int:
        """Book the budget for ``slots`` index slots; shrink the ring if they cannot fit."""
        needed = slots * _INDEX_SLOT_BYTES - self.booked
        if needed <= 0:
            return slots
        room = self.account.room()
        if needed > room:
            fits = max((self.booked + max(room, 0)) // _INDEX_SLOT_BYTES, 1)
            self.capacity = min(self.capacity, fits)
            if self.warn:
                self.warn = False  # once per iterator
                _warn_shrink(self.node, self.account, fits, _INDEX_SLOT_BYTES)
            slots = fits
            needed = slots * _INDEX_SLOT_BYTES - self.booked
        if needed > 0:
            self.account.admit(needed)
            self.booked += needed
        return slots

    def take(self, count: int) -> Indices:
        if not self.filled:
            self._fill()
        if len(self.pending) < count and not self.exhausted:
            block = take_all(self.inner, count - len(self.pending))
            if len(block) < count - len(self.pending):
                self.exhausted = True
            self.pending = np.concatenate([self.pending, np.asarray(block, dtype=np.int64)])
        out = np.empty(count, np.int64)
        native = native_module()
        kernel = native.shuffle_draw if native is not None else _draw_python
        produced, self.start, self.end, used = kernel(
            self.ring, self.capacity, self.start, self.end, self.pending,
            self.shared.draws.peek(count), out,
        )
        self.shared.draws.advance(produced)
        self.pending = self.pending[used:]
        return out[:produced]

    def get_state(self) -> dict[str, Any]:
        return self.shared.as_dict(capacity=self.capacity)

    def set_state(self, state: dict[str, Any]) -> None:
        reader, drawn = self.shared.restore(state)
        capacity = reader.integer("capacity", 1, self.node.buffer_size, why="the buffer_size")
        self.inner.set_state(self.shared.inner_start)
        self._reset(capacity)
        done = 0
        while done < drawn:  # replay the draws: indices only, no data is read
            block = len(self.take(min(drawn - done, 1 << 16)))
            if not block:
                raise past_end("shuffle", "drawn", drawn, done)
            done += block

    def close(self) -> None:
        self.account.release(self.booked)
        self.booked = 0
        self.inner.close()


def _warn_shrink(node: ShuffleNode, account: Buffer, fits: int, element_bytes: int) -> None:

    warn_user(
        f"shuffle: buffer_size={node.buffer_size} does not fit in this stage's share of the "
        f"memory budget ({account.share_text()}); "
        f"at ~{format_bytes(element_bytes)} per element it shuffles within {fits} elements. "
        "Raise Options(memory_budget=...) or shuffle a random-access source (indices cost 8 B).",
        HeadraceWarning,
    )


class _ShuffleIterator(Iterator):
    stage = "shuffle"

    def __init__(
        self, node: ShuffleNode, inner: Iterator, ctx: Context, account: Buffer
    ) -> None:
        super().__init__(inner)
        self.node, self.inner, self.ctx, self.account = node, inner, ctx, account
        self.shared = _ShuffleState(node, ctx, inner.get_state())
        self.ring = _Ring(node.buffer_size)
        self.exhausted = False
        self.shrunk_to: int | None = None
        self.aside: tuple[Any, Reservation, int, Any] | None = None
        #: The input's origin probe, once a stage above asked for origins: each slot of
        #: the ring then keeps the token of its element (else slots are pairs).
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None
        self.last_token: Any = None
        #: Errors the input raised while the ring filled (each raised in its place, the
        #: input going on after it): a restore's replay meets them again and passes them.
        self.errors = 0

    def _fill(self) -> None:
        """Fill the ring up to its capacity, as long as each next element fits the share.

        An element is costed (and compacted) before it enters; one that does
        not fit waits in ``aside`` — booked by the stage it came from, if any —
        until draws have made room: the one element beyond the share.
        """
        ring, account = self.ring, self.account
        probe = None if self.probe is None else self.probe[0]
        while len(ring) < ring.capacity:
            if self.aside is None:
                if self.exhausted:
                    return
                try:
                    element, reservation = self.inner.pull()
                except StopIteration:
                    self.exhausted = True
                    return
                except Exception:
                    self.errors += 1
                    raise
                element, cost = self.ctx.admit(element)
                self.aside = (element, reservation, cost, None if probe is None else probe())
            element, reservation, cost, token = self.aside
            try:
                fits = account.fits(cost)
            except MemoryBudgetError:  # it can never fit: its error stands in its place,
                self.aside = None  # counted as the input's are, and the fill goes on
                reservation.release()  # after it (it stayed aside, refused at every pull)
                self.errors += 1
                raise
            if not fits:
                self._note_shrink(len(ring))
                return
            self.aside = None
            if probe is None:
                ring.push((element, account.admit(cost, reservation)))
            else:
                ring.push((element, account.admit(cost, reservation), token))

    def _note_shrink(self, held: int) -> None:
        if self.shrunk_to is None and self.ring.start == 0:
            self.ring.shrink_to_current()
            self.shrunk_to = self.ring.capacity
            if self.ctx.options.warn_on_shrink:
                _warn_shrink(self.node, self.account, held, max(self.account.largest(), 1))

    def pull(self) -> tuple[Any, Reservation]:
        self._fill()
        if not len(self.ring):
            raise StopIteration
        item = self.ring.pop_drawn(self.shared.draws.next())
        if self.probe is None:
            return item  # type: ignore[no-any-return]
        try:
            element, reservation, self.last_token = item
        except ValueError:  # (it came in before tracking began)
            element, reservation = item
            self.last_token = None
        return element, reservation

    def origin(self) -> Origin | None:
        return self.origin_of(self.origin_token())

    def origin_token(self) -> Any:
        return self.last_token

    def origin_of(self, token: Any) -> Origin | None:
        return None if self.probe is None or token is None else self.probe[1](token)

    def track_origins(self, tokens: bool = True) -> bool:
        """Keep each element's origin token beside it from now on (elements already in
        the buffer have none: a map asks when the pipeline starts, before any is)."""
        if self.probe is None:
            self.probe = origin_probe(self.inner)
        return self.probe is not None

    def get_state(self) -> dict[str, Any]:
        errors = {ERRORS_MET: self.errors} if self.errors else {}
        return self.shared.as_dict(shrunk_to=self.shrunk_to, **errors)

    def set_state(self, state: dict[str, Any]) -> None:
        reader, drawn = self.shared.restore(state)
        shrunk_to = reader.optional_integer(
            "shrunk_to", 1, self.node.buffer_size, why="the buffer_size"
        )
        errors = reader.optional_integer(ERRORS_MET, 1, INT64_MAX) or 0
        self._clear()
        self.inner.set_state(self.shared.inner_start)
        self.shrunk_to = shrunk_to
        if shrunk_to is not None:
            self.ring.capacity = shrunk_to
        self.exhausted = False
        self.errors = 0
        self._replay(drawn, errors)

    def _replay(self, drawn: int, errors: int) -> None:
        """Draw ``drawn`` elements again, passing the ``errors`` the input raised meanwhile
        (also those raised after the last draw, while the ring refilled: a state taken
        right after an error resumes after it, not with it)."""
        done = 0
        while done < drawn or self.errors < errors:
            try:
                if done < drawn:
                    self.pull()[1].release()
                    done += 1
                    continue
                self._fill()
            except StopIteration:
                raise past_end("shuffle", "drawn", drawn, done) from None
            except Exception:
                if self.errors > errors:
                    raise
                continue
            raise CheckpointError(  # the refill raised none of the errors left to pass
                f"shuffle: state field 'errors' = {errors}, but the input raised "
                f"{self.errors} before this point; the state belongs to other data"
            )

    def _clear(self) -> None:
        release_all(item[1] for item in self.ring.items())
        if self.aside is not None:
            self.aside[1].release()
            self.aside = None
        self.ring = _Ring(self.node.buffer_size)

    def close(self) -> None:
        self._clear()
        super().close()

