"""A stage's share split into parts, each the budget of a nested pipeline.

An interleave runs up to ``cycle_length`` inner pipelines at once. Each one gets
an equal part of the stage's share as its own :class:`MemoryBudget`, drawn from
the stage's :class:`Buffer`: what the inner stages hold is the stage's holding.
This module owns that split, so the interleave asks for a part and never reads
the buffer's counters.

Two rules live here. Arrays the interleave function made for an inner dataset
(an inner ``from_tensor_slices`` over a new array, a window's values) are booked on
the stage for as long as the part lives; the part's budget is what is left (the
stage widens as below where they take the whole part). And a part whose
stages must hold more than the part at once (one large element) *widens*: every
part may need as much, so the stage's minimum becomes that many such parts, and
the pipeline's budget is split again to fit them, or refuses naming the stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from headrace._errors import MemoryBudgetError
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.units import format_bytes

__all__ = ["NestedPart", "NestedParts"]


class NestedPart:
    """One part: the nested pipeline's budget, and the booking of the arrays it owns.

    Closing it returns both: nothing of a nested pipeline outlives its part.
    """

    __slots__ = ("budget", "owned", "parts")

    def __init__(self, parts: NestedParts, budget: MemoryBudget) -> None:
        self.parts, self.budget = parts, budget
        self.owned: Reservation = NO_RESERVATION
        budget.widen = functools.partial(_widen, parts.buffer, parts.count, parts.unit, 0)

    def size(self) -> int:
        """The part's bytes now (a widen may have raised it)."""
        return self.budget.total

    def own(self, owned_bytes: int) -> None:
        """Book ``owned_bytes`` of arrays the nested recipe holds, for the part's life.

        They are made by the interleave function while the nested pipeline is
        built, so they are known only then. The part's budget is what is left;
        where they take the whole part, the stage widens (every part may hold as
        much), or :class:`MemoryBudgetError` says so. Call it before the budget's
        ``allot``.
        """
        if not owned_bytes:
            return
        parts = self.parts
        share = self.budget.total
        if owned_bytes >= share:  # the stage's share split again to hold them, if it can
            try:
                _widen(parts.buffer, parts.count, parts.unit, owned_bytes, 1,
                       f"{format_bytes(owned_bytes)} of arrays the dataset holds")
                share = max(parts.part_size(), owned_bytes + 1)
            except MemoryBudgetError:
                pass
        if owned_bytes >= share:
            raise MemoryBudgetError(
                f"stage {parts.buffer.name!r}: the dataset {parts.what} made holds "
                f"{format_bytes(owned_bytes)} of arrays, more than one slot's part of the "
                f"memory budget ({format_bytes(share)}: the stage's "
                f"{format_bytes(parts.buffer.share())} / cycle_length {parts.count}). "
                "Raise Options(memory_budget=...), lower cycle_length, or make the inner "
                "datasets smaller."
            )
        self.owned = parts.buffer.admit(owned_bytes)
        self.budget.total = share - owned_bytes
        self.budget.widen = functools.partial(_widen, parts.buffer, parts.count, parts.unit,
                                              owned_bytes)

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Wake the nested pipeline's waiting producers, run ``then`` (its close), and
        return the part's bookings."""
        try:
            self.budget.close()
            if then is not None:
                then()
        finally:
            self.owned.release()


class NestedParts:
    """``count`` equal parts of ``buffer``'s share, for nested pipelines.

    ``what`` names the function that makes the nested pipelines (in errors).
    """

    def __init__(self, buffer: Buffer, count: int, what: str,
                 unit: str = "interleave slots") -> None:
        self.buffer, self.count, self.what, self.unit = buffer, count, what, unit

    def part_size(self) -> int:
        """One part of the stage's share now (at least one byte)."""
        return max(self.buffer.share() // self.count, 1)

    def ceiling(self) -> int:
        """Bytes no part can ever hold at once, however the budget is split again.

        A part widens only while ``count`` such parts fit the pipeline's whole
        budget, so one element past this is refused wherever it is made. A
        worker process checks it before it sends an element on. (The largest
        total of the budgets above: never below what a re-split could give.)
        """
        budget: MemoryBudget | Buffer | None = self.buffer.budget
        total = 0
        while budget is not None:  # (no budget it draws from can give it more)
            total = max(total, budget.total)
            budget = budget.parent
        return total // self.count

    def open(self) -> NestedPart:
        """A new part: a budget of one part of the share, drawn from the stage.

        The caller registers the nested stages' buffers on it, books what the
        recipe owns (:meth:`NestedPart.own`), then calls the budget's ``allot``.
        """
        return NestedPart(self, MemoryBudget(self.part_size(), parent=self.buffer))


def _widen(buffer: Buffer, count: int, unit: str, owned_bytes: int, needed: int,
           what: str = "") -> int:
    """A part's stages must hold ``needed`` bytes at once, more than the part.

    Any part may, so the stage's minimum becomes ``count`` such parts, and the
    pipeline's budget is split again to fit them. Otherwise
    :class:`MemoryBudgetError` names the stage, and ``what`` the part's stages
    need (the file and record that did not fit). Returns the part's new total.
    """
    wanted = needed + owned_bytes
    buffer.require(
        wanted * count,
        what=f"{count} {unit} of {format_bytes(wanted)}"
        + (f" (in one, {what})" if what else ""),
    )
    return max(needed, buffer.share() // count - owned_bytes)
