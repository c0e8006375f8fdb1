"""``unbatch()`` and ``rebatch(batch_size, drop_remainder=False)``, with tf.data's orders.

Both read rows out of batched elements. A batch stays booked on the stage's
share while its rows go out. ``rebatch`` is ``unbatch().batch(N)`` in one
step with N cycling through a list of sizes (zeros give empty batches), each
row copied once. ``None`` components have no rows: they pass through as
``None`` (tf.data's ``NoneTensorSpec``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from headrace._errors import ElementSpecError, InvalidArgumentError, Origin
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation, release_all
from headrace._memory.sizeof import ARRAY_HEADER_BYTES
from headrace._structure import flatten, map_structure, pack_as, structure_paths
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator, origin_probe, row_origin
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    ShardRole,
    Traits,
    batching_role,
    check_positive,
    known_spec,
)
from headrace.core.state import StateReader

__all__ = ["RebatchNode", "UnbatchNode"]


def _check_batched(stage: str, spec: Any) -> Any:
    """``spec`` if every component but ``None`` ones has rank >= 1 (rows to take)."""
    leaves = flatten(spec)
    if all(leaf.kind == "none" for leaf in leaves):
        raise InvalidArgumentError(
            f"{stage}: every component is None; the input must have a batched component"
        )
    for leaf, path in zip(leaves, structure_paths(spec), strict=True):
        if leaf.kind != "none" and not leaf.shape:
            raise InvalidArgumentError(
                f"{stage}: component {path} is a scalar; the input must be batched "
                "(every component needs rank >= 1)"
            )
    return spec


def _static_rows(source: Node) -> int | None:
    """The number of rows every input batch has, if known without reading data."""
    spec = known_spec(source)
    leaves = [leaf for leaf in flatten(spec) if leaf.kind != "none"] if spec is not None else []
    rows = {leaf.shape[0] if leaf.shape else None for leaf in leaves}
    return rows.pop() if len(rows) == 1 else None


class UnbatchNode(Node):
    stage = "unbatch"

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # element i's batch depends on the sizes of those before

    def traits(self) -> Traits:
        return Traits()

    def __init__(self, source: Node) -> None:
        super().__init__(source)
        spec = known_spec(source)  # else checked when asked for: building reads no data
        if spec is not None:
            _check_batched("unbatch", spec)

    def shard_role(self) -> ShardRole:
        return ShardRole.BY_CONTENT

    @property
    def element_spec(self) -> Any:
        spec = _check_batched("unbatch", self.inputs[0].element_spec)
        return map_structure(lambda leaf: leaf.without_leading(), spec)

    def cardinality(self) -> int:
        inner = self.inputs[0].cardinality()
        if inner == INFINITE:
            return INFINITE
        rows = _static_rows(self.inputs[0])  # never reads data to count
        if inner >= 0 and rows is not None:
            return inner * rows  # every batch has the same static size
        return UNKNOWN

    def make_iterator(self, ctx: Context) -> Iterator:
        return _UnbatchIterator(
            self.inputs[0].make_iterator(ctx), ctx.account(self)
        )


class _Rows:
    """Rows of one batched element, handed out one (or a block) at a time."""

    def __init__(self, batch: Any, reservation: Reservation) -> None:
        self.structure = batch
        self.leaves = flatten(batch)
        sizes = {len(leaf) for leaf in self.leaves if leaf is not None}
        if len(sizes) > 1:
            raise ElementSpecError(
                f"unbatch: components of one batch have different first dimensions {sorted(sizes)}"
            )
        if not sizes:
            raise ElementSpecError("unbatch: every component of this batch is None; no rows to take")
        self.size = sizes.pop()
        self.position = 0
        self.reservation = reservation
        self.single = not isinstance(batch, (dict, tuple))

    def row(self) -> Any:
        index = self.position
        self.position += 1
        if self.single:
            return self.leaves[0][index]
        return pack_as(
            self.structure, [None if leaf is None else leaf[index] for leaf in self.leaves]
        )

    def block(self, count: int) -> list[Any]:
        start = self.position
        stop = min(start + count, self.size)
        self.position = stop
        return [None if leaf is None else leaf[start:stop] for leaf in self.leaves]


class _RowSource(Iterator):
    """Pulls batches from the input, keeping the current one booked while its rows go out."""

    def __init__(self, inner: Iterator, account: Buffer) -> None:
        super().__init__(inner)
        self.inner, self.account = inner, account
        self.current: _Rows | None = None
        # The input's state before the current batch: what lets a restore re-read it.
        self.state_before_current: dict[str, Any] = inner.get_state()
        #: The input's origin probe once a stage above asks for origins, and the token
        #: of the current batch: a row's origin is its batch's row (``row_origin``).
        self.probe: tuple[Callable[[], Any], Callable[[Any], Origin | None]] | None = None
        self.batch_token: Any = None

    def rows(self, *, together: str | None = None) -> _Rows:
        """The batch rows come from now, pulling the next one when it is used up.

        ``together``: the next batch is held with what the stage holds already
        (the pieces of an output being gathered); it is refused if they cannot fit.
        """
        while self.current is None or self.current.position >= self.current.size:
            self.close_current()
            self.state_before_current = self.inner.get_state()
            batch, reservation = self.inner.pull()
            if self.probe is not None:
                self.batch_token = self.probe[0]()
            if reservation.account is not None:
                reservation = self.account.admit(reservation.nbytes, reservation, together=together)
            self.current = _Rows(batch, reservation)
        return self.current

    def get_state(self) -> dict[str, Any]:
        return {
            "inner_before_current": self.state_before_current,
            "rows_taken": 0 if self.current is None else self.current.position,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        before = reader.child("inner_before_current")
        rows = reader.integer("rows_taken")
        self.close_current()
        self.inner.set_state(before)
        self.state_before_current = before
        if rows:
            try:
                current = self.rows()
            except StopIteration:
                raise reader.error(
                    "rows_taken", f"= {rows}, but the input has no batch left to take rows from"
                ) from None
            if rows > current.size:
                raise reader.error(
                    "rows_taken", f"= {rows}, but the batch it counts in has {current.size} rows"
                )
            current.position = rows

    def close_current(self) -> None:
        if self.current is not None:
            self.current.reservation.release()
            self.current = None

    def close(self) -> None:
        self.close_current()
        super().close()


class _UnbatchIterator(_RowSource):
    stage = "unbatch"

    def __init__(self, inner: Iterator, account: Buffer) -> None:
        super().__init__(inner, account)

    def pull(self) -> tuple[Any, Reservation]:
        return self.rows().row(), NO_RESERVATION

    def origin(self) -> Origin | None:
        return self.origin_of(self.origin_token())

    def origin_token(self) -> Any:
        """The current batch's token and the row handed out last (nothing per row)."""
        current = self.current
        return None if current is None else (self.batch_token, current.position - 1)

    def origin_of(self, token: Any) -> Origin | None:
        probe = self.probe
        if probe is None or token is None:
            return None
        return row_origin(token[0], probe[1], token[1])

    def track_origins(self, tokens: bool = True) -> bool:
        """Take the token of each batch pulled from now on: its rows' origins are its
        rows' (exact where the batch was made by a ``batch`` that kept them)."""
        if self.probe is None:
            self.probe = origin_probe(self.inner)
        return self.probe is not None


class RebatchNode(Node):
    stage = "rebatch"
    budget_weight = 2

    def cardinality(self) -> int:
        return UNKNOWN  # depends on the input batches' sizes

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # element i's rows depend on the sizes of the batches before

    def traits(self) -> Traits:
        return Traits(groups=True)

    def __init__(self, source: Node, batch_size: int | Sequence[int], drop_remainder: bool) -> None:
        super().__init__(source)
        sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size)
        if not sizes:
            raise InvalidArgumentError("rebatch: batch_size must not be empty")
        # Zeros in a list make empty batches (tf.data); all zeros would never end.
        self.sizes = [
            check_positive("rebatch: batch_size", size, allow_zero=True) for size in sizes
        ]
        if not any(self.sizes):
            raise InvalidArgumentError(f"rebatch: batch_size must have a size > 0, got {sizes}")
        self.drop_remainder = bool(drop_remainder)
        spec = known_spec(source)  # else checked when asked for: building reads no data
        if spec is not None:
            _check_batched("rebatch", spec)

    def shard_role(self) -> ShardRole:
        return batching_role(self.inputs[0], self.drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (tuple(self.sizes), self.drop_remainder)

    @property
    def element_spec(self) -> Any:
        spec = _check_batched("rebatch", self.inputs[0].element_spec)
        return map_structure(lambda leaf: leaf.without_leading().with_leading(self._static()), spec)

    def _static(self) -> int | None:
        """The batch size every output has, if that is known without reading (tf.data's rule)."""
        if len(set(self.sizes)) != 1:
            return None
        size = self.sizes[0]
        if self.drop_remainder:
            return size
        known = _static_rows(self.inputs[0])
        return size if known is not None and known % size == 0 else None

    def make_iterator(self, ctx: Context) -> Iterator:
        return _RebatchIterator(
            self.inputs[0].make_iterator(ctx), ctx, ctx.account(self), self
        )


class _RebatchIterator(_RowSource):
    """``unbatch().batch(N)`` with N cycling through the sizes, copying each row once."""

    stage = "rebatch"

    def __init__(
        self, inner: Iterator, ctx: Context, account: Buffer, node: RebatchNode
    ) -> None:
        super().__init__(inner, account)
        self.ctx, self.node = ctx, node
        self.batch_number = 0
        self.ended = False

    def pull(self) -> tuple[Any, Reservation]:
        # tf.data's RebatchDatasetV2: a size of 0 reads nothing and yields an empty
        # batch, even before any data or when there is none (range(0).batch(4)
        # .rebatch([0, 2]) yields one); once the input is seen to end, nothing more.
        if self.ended:
            raise StopIteration
        sizes = self.node.sizes
        wanted = sizes[self.batch_number % len(sizes)]
        # The pieces are held until the output is made. A used-up input batch stays
        # booked while a piece is a view of it, or its piece is copied out and booked
        # (``kept``); the next batch is refused before it is pulled past what the
        # pieces and it can hold together.
        what = f"a batch of {wanted} rows"
        kept: list[Reservation] = []
        try:
            pieces, structure, have = self._gather(wanted, what, kept)
            if (have == 0 and wanted > 0) or (self.node.drop_remainder and have < wanted):
                raise StopIteration
            self.batch_number += 1
            if wanted == 0:
                structure, leaves = self._empty_batch()
                return pack_as(structure, leaves), NO_RESERVATION
            return self._concatenate(pieces, structure, have)
        finally:
            release_all(kept)

    def _gather(
        self, wanted: int, what: str, kept: list[Reservation]
    ) -> tuple[list[list[Any]], Any, int]:
        """Views of the next ``wanted`` rows, over as many input batches as it takes."""
        pieces: list[list[Any]] = []
        structure: Any = None
        have = 0
        while have < wanted:
            current = self.current
            if pieces and current is not None and current.position >= current.size:
                pieces[-1] = self._keep(pieces[-1], current, what, kept)
            try:
                rows = self.rows(together=what if pieces else None)
            except StopIteration:
                self.ended = True
                break
            structure = rows.structure
            block = rows.block(wanted - have)
            have += len(next(leaf for leaf in block if leaf is not None))
            pieces.append(block)
        return pieces, structure, have

    def _keep(
        self, piece: list[Any], batch: _Rows, what: str, kept: list[Reservation]
    ) -> list[Any]:
        """Hold ``piece`` of a used-up input ``batch`` until the output is made.

        A view pins its whole batch: when the piece is most of it, the batch's
        booking is kept. A small piece is copied out (booked first), so the batch
        it came from can go.
        """
        nbytes = self._bytes([piece])
        if 2 * nbytes >= batch.reservation.nbytes:
            kept.append(batch.reservation)
            batch.reservation = NO_RESERVATION
            return piece
        kept.append(self.account.admit(nbytes, together=what, elements=0))
        return [None if leaf is None else leaf.copy() for leaf in piece]

    def _bytes(self, pieces: list[list[Any]]) -> int:
        """What the pieces' rows cost once placed in one array a component."""
        return sum(
            ARRAY_HEADER_BYTES
            + sum(
                piece[k].nbytes + (self.ctx.sizeof(piece[k]) if piece[k].dtype.hasobject else 0)
                for piece in pieces
            )
            for k in range(len(pieces[0]))
            if pieces[0][k] is not None
        )

    def _concatenate(
        self, pieces: list[list[Any]], structure: Any, have: int
    ) -> tuple[Any, Reservation]:
        # The output's size is known from the pieces: book it before it is allocated (G1).
        # Each output is a copy, so it never pins the input batch it came from.
        self._check_widths(pieces, structure)
        nbytes = self._bytes(pieces)
        booking = self.account.admit(nbytes, together=f"a batch of {have} rows")
        try:
            leaves = [
                None if pieces[0][k] is None else np.concatenate([piece[k] for piece in pieces])
                for k in range(len(pieces[0]))
            ]
        except BaseException:
            booking.release()
            raise
        return pack_as(structure, leaves), booking

    def _check_widths(self, pieces: list[list[Any]], structure: Any) -> None:
        """Input batches whose rows differ in shape (padded to other widths) cannot
        make one output batch: the error names the output batch and the component."""
        paths = structure_paths(structure) if isinstance(structure, (dict, tuple)) else None
        for k, first in enumerate(pieces[0]):
            if first is None:
                continue
            for piece in pieces[1:]:
                if piece[k].shape[1:] != first.shape[1:]:
                    component = "element" if paths is None else paths[k]
                    raise ElementSpecError(
                        f"rebatch: batch {self.batch_number - 1} would take rows of shape "
                        f"{first.shape[1:]} and {piece[k].shape[1:]} for component "
                        f"{component} from consecutive input batches; the rows of one "
                        "batch need equal shapes (padded_batch pads each input batch to "
                        "its own longest: pad to a fixed size with padded_shapes=)"
                    )

    def _empty_batch(self) -> tuple[Any, list[Any]]:
        """A zero-row batch built from the input's spec, as tf.data builds it from its
        output shapes: unknown sizes are 0, whatever the data's rows had."""
        spec = self.node.inputs[0].element_spec
        leaves = [
            None
            if leaf.kind == "none"
            else np.empty(
                (0,) if leaf.shape is None else (0, *(size or 0 for size in leaf.shape[1:])),
                dtype=leaf.dtype,
            )
            for leaf in flatten(spec)
        ]
        return spec, leaves

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "batch_number": self.batch_number, "ended": self.ended}

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, "rebatch")
        self.batch_number = reader.integer("batch_number")
        self.ended = reader.flag("ended") if "ended" in state else False
        super().set_state(state)
