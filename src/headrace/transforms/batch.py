"""``batch(batch_size, drop_remainder=False)``, with tf.data's order.

Batching a random-access input is one slice (consecutive rows) or one gather
(shuffled rows) per batch — no per-row Python work. Batching a stream books
every element on the stage's share of the budget while the batch is being
assembled, plus the output: that pair is the stage's minimum working set, and
a batch that cannot fit raises :class:`MemoryBudgetError` instead of
over-running the budget.

Bytes and strings batch into NumPy ``object`` arrays of the exact Python
objects (fixed-width ``S``/``U`` would drop trailing NULs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace.errors import (
    ElementSpecError,
    MemoryBudgetError,
)
from headrace.iterator import Context, Iterator
from headrace.memory.budget import Reservation, StageAccount, release_all
from headrace.node import INFINITE, UNKNOWN, IndexPlan, Node, check_positive
from headrace.options import format_bytes
from headrace.structure import (
    flatten,
    map_structure,
    pack_as,
    structure_paths,
)
from headrace.transforms.indexing import GatherBatchIterator

__all__ = ["BatchNode", "batched_cardinality", "stack_elements"]


def _stack_leaf(values: list[Any], path: str, stage: str, first_index: int) -> Any:
    first = values[0]
    if type(first) in (bytes, str) and all(type(value) is type(first) for value in values):
        out = np.empty(len(values), dtype=object)  # scalars: no shapes to compare
        out[:] = values
        return out
    if isinstance(first, (bytes, str)) or (isinstance(first, np.ndarray) and first.dtype == object):
        out = np.empty((len(values), *np.shape(first)), dtype=object)
        for row, value in enumerate(values):
            _check_same_shape(value, first, row, path, stage, first_index)
            out[row] = value
        return out
    try:
        return np.stack(values)
    except ValueError:
        for row, value in enumerate(values):
            _check_same_shape(value, first, row, path, stage, first_index)
        raise


def _check_same_shape(
    value: Any, first: Any, row: int, path: str, stage: str, first_index: int
) -> None:
    if np.shape(value) != np.shape(first):
        raise ElementSpecError(
            f"{stage}: element {first_index + row} has shape {np.shape(value)} for component "
            f"{path}, but element {first_index} of the same batch has shape {np.shape(first)}; "
            "all elements of a batch need equal shapes (use padded_batch for variable sizes)"
        )


def stack_elements(elements: Sequence[Any], *, stage: str, first_index: int = 0) -> Any:
    """One batched element from a list of elements of equal structure and shapes."""
    structure = elements[0]
    if not isinstance(structure, (dict, tuple)):
        return _stack_leaf(list(elements), "element", stage, first_index)
    columns = list(zip(*(flatten(element) for element in elements), strict=True))
    paths = structure_paths(structure)
    return pack_as(
        structure,
        [
            _stack_leaf(list(column), path, stage, first_index)
            for column, path in zip(columns, paths, strict=True)
        ],
    )


def _batched_spec(spec: Any, batch_size: int, drop_remainder: bool) -> Any:
    size = batch_size if drop_remainder else None
    return map_structure(lambda leaf: leaf.with_leading(size), spec)


class BatchNode(Node):
    stage = "batch"

    def __init__(self, source: Node, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(source)
        self.batch_size = check_positive("batch: batch_size", batch_size)
        self.drop_remainder = bool(drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.batch_size, self.drop_remainder)

    @property
    def element_spec(self) -> Any:
        return _batched_spec(self.inputs[0].element_spec, self.batch_size, self.drop_remainder)

    def cardinality(self) -> int:
        return batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def index_plan(self) -> IndexPlan | None:
        return None  # a batch is one element made of many: not addressable by one index

    def make_iterator(self, ctx: Context) -> Iterator:
        account = ctx.account(self, "batch", weight=2)
        plan = self.inputs[0].index_plan()
        if plan is not None:
            access, make_stream = plan
            access.prepare(ctx)
            return _ChargedBatches(
                GatherBatchIterator(access, make_stream(ctx), self.batch_size, self.drop_remainder),
                ctx,
                account,
            )
        pushed = self.inputs[0].batched_iterator(
            ctx, self.batch_size, self.drop_remainder, account
        )
        if pushed is not None:
            return pushed  # books each batch on `account` as it reads it
        return _BatchIterator(
            self.inputs[0].make_iterator(ctx), ctx, account, self.batch_size, self.drop_remainder
        )


def batched_cardinality(inner: int, batch_size: int, drop_remainder: bool) -> int:
    if inner in (INFINITE, UNKNOWN):
        return inner
    return inner // batch_size if drop_remainder else -(-inner // batch_size)


class _ChargedBatches(Iterator):
    """Books each batch made below (a gather, a reader) on the batch stage's share."""

    stage = "batch"

    def __init__(self, inner: Iterator, ctx: Context, account: StageAccount) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account

    def next_reserved(self) -> tuple[Any, Reservation]:
        batch = next(self.inner)
        return batch, self.account.hold(self.ctx.sizeof(batch), what="one batch")

    def __next__(self) -> Any:
        return next(self.inner)


class Assembler(Iterator):
    """Shared by the streaming batchers: pull and book up to N elements of a batch."""

    def __init__(self, inner: Iterator, ctx: Context, account: StageAccount) -> None:
        super().__init__(inner)
        self.inner, self.ctx, self.account = inner, ctx, account
        self.position = 0  # elements consumed, for error messages

    def pull(self, count: int) -> tuple[list[Any], list[Reservation]]:
        """Up to ``count`` elements, booked on this stage's share.

        Elements a buffering stage booked move here at once (keeping them on
        that stage's share while waiting for more would stall it); the others
        are booked together at the end, with one lock.
        """
        elements: list[Any] = []
        reservations: list[Reservation] = []
        unbooked = unbooked_count = 0
        sizeof, account = self.ctx.sizeof, self.account
        what = f"a batch of {count} elements"
        try:
            for _ in range(count):
                element, reservation = self.inner.next_reserved()
                elements.append(element)
                if reservation.account is None:
                    unbooked += sizeof(element)
                    unbooked_count += 1
                else:
                    reservations.append(reservation.move_to(account, sizeof(element)))
                if account.held + unbooked > account.limit:
                    raise MemoryBudgetError(
                        f"stage {account.name!r} needs more than its share of the memory "
                        f"budget ({format_bytes(account.limit)} of "
                        f"{format_bytes(account.budget.total)}) for {what}. Raise "
                        "Options(memory_budget=...) or use a smaller batch."
                    )
        except StopIteration:
            pass
        except BaseException:
            release_all(reservations)
            raise
        if unbooked:
            reservations.append(account.hold(unbooked, what=what, elements=unbooked_count))
        return elements, reservations

    def finish(
        self, batch: Any, reservations: list[Reservation], count: int
    ) -> tuple[Any, Reservation]:
        try:
            booked = self.account.hold(
                self.ctx.sizeof(batch), what=f"a batch of {count} elements plus its output"
            )
        finally:
            release_all(reservations)
        return batch, booked

    def get_state(self) -> dict[str, Any]:
        return {"inner": self.inner.get_state(), "position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        self.inner.set_state(state["inner"])
        self.position = int(state["position"])


class _BatchIterator(Assembler):
    stage = "batch"

    def __init__(
        self,
        inner: Iterator,
        ctx: Context,
        account: StageAccount,
        batch_size: int,
        drop_remainder: bool,
    ) -> None:
        super().__init__(inner, ctx, account)
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def next_reserved(self) -> tuple[Any, Reservation]:
        elements, reservations = self.pull(self.batch_size)
        first = self.position
        self.position += len(elements)
        if not elements or (self.drop_remainder and len(elements) < self.batch_size):
            release_all(reservations)
            raise StopIteration
        try:
            batch = stack_elements(elements, stage="batch", first_index=first)
        except BaseException:
            release_all(reservations)
            raise
        return self.finish(batch, reservations, len(elements))
