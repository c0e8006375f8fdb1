"""Sources shared by the transformation tests (one random-access, one streaming), and
the positions of an iteration whose elements may raise."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import headrace as hr


def ints(ds: hr.Dataset) -> list[int]:
    return [int(v) for v in ds]


def streaming(values: list[int]) -> hr.Dataset:
    """A non-random-access source, so the streaming code paths run."""
    return hr.Dataset.from_generator(
        lambda: iter(values), output_signature=hr.TensorSpec((), np.int64)
    )


def positions(
    iterator: Any,
    errors: type[BaseException] | tuple[type[BaseException], ...],
    limit: int | None = None,
    pause: float = 0.0,
) -> list[Any]:
    """Every position of an iteration, in order: the element (an int), or
    ``("error", message)`` where one of ``errors`` is raised in its place and the
    iteration goes on. ``limit``: at most that many positions; ``pause``: seconds slept
    before each ``next()`` (the stages' threads run ahead meanwhile)."""
    got: list[Any] = []
    while limit is None or len(got) < limit:
        if pause:
            time.sleep(pause)
        try:
            got.append(int(next(iterator)))
        except StopIteration:
            break
        except errors as error:
            got.append(("error", str(error)))
    return got
