"""The split of a stage's share into nested budgets (memory/nested.py): an interleave's slots.

A worker process drops an element past :meth:`NestedParts.ceiling` before it is
copied out. So every element past it must be refused by a slot's buffer (else
the worker would drop one the slot could take). And in a pipeline's own budget
it is tight: an element at it (less the bytes the split rounds away) fits once
the budget is split again. Checked over random budgets, cycle lengths, other
stages and nestings (where the ceiling is looser: the outer slot's part caps it).
"""

from __future__ import annotations

import random

import pytest

from headrace._errors import MemoryBudgetError
from headrace._memory.budget import MemoryBudget
from headrace._memory.buffer import Buffer
from headrace._memory.nested import NestedParts

MiB = 1 << 20


def _stage(rng: random.Random) -> tuple[bool, Buffer]:
    """An interleave's buffer in a random pipeline, maybe itself inside another slot
    (then the first value is True)."""
    budget = MemoryBudget(rng.randint(1, 256) * MiB + rng.randrange(MiB))
    outer: Buffer | None = None
    if rng.random() < 0.3:  # an interleave inside an outer interleave's slot
        outer = budget.account("interleave", weight=2)
        budget.allot()
        nested = NestedParts(outer, rng.randint(1, 4), "outer").open()
        budget = nested.budget
    stage = budget.account("interleave", weight=2)
    for _ in range(rng.randint(0, 2)):  # other stages beside it (their minima are 0)
        budget.account(rng.choice(("prefetch", "batch")), weight=rng.choice((1, 2, 4)))
    budget.allot()
    return outer is not None, stage


@pytest.mark.parametrize("seed", range(4))
def test_the_ceiling_is_what_a_slot_can_widen_to_and_no_more(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        nested, stage = _stage(rng)
        parts = NestedParts(stage, rng.randint(1, 16), "make")
        ceiling = parts.ceiling()
        part = parts.open()
        queue = part.budget.account("interleave slot", weight=1)
        part.budget.allot()
        with pytest.raises(MemoryBudgetError, match="interleave"):
            queue.fits(ceiling + 1)
        part.close()
        if nested:
            continue
        part = parts.open()
        queue = part.budget.account("interleave slot", weight=1)
        part.budget.allot()
        tight = ceiling - 16  # (each share is rounded down to whole bytes)
        assert queue.fits(tight), (ceiling, parts.count)
        assert part.size() >= tight
        part.close()


def test_arrays_a_part_owns_are_booked_while_it_lives_and_refused_past_it() -> None:
    rng = random.Random(7)
    for _ in range(50):
        nested, stage = _stage(rng)
        parts = NestedParts(stage, rng.randint(1, 8), "make")
        size = parts.part_size()
        part = parts.open()
        owned = rng.randrange(size)
        room = stage.room()
        part.own(owned)
        assert stage.room() == room - owned and part.size() == size - owned
        part.close()
        assert stage.room() == room
        part = parts.open()
        with pytest.raises(MemoryBudgetError, match=r"'interleave'.*make"):
            part.own(parts.ceiling() + 1)  # more than any split of the budget gives a part
        part.close()
        assert stage.room() == room
        if nested:
            continue
        # More than a part, where the budget can be split again: the stage widens (its
        # part was refused before, while another stage's share stood unused).
        part = parts.open()
        wanted = min(size + 1, parts.ceiling() - 64)
        if wanted > size:
            part.own(wanted)
            assert part.size() >= 1 and stage.share() >= parts.count * (wanted + 1)
        part.close()
