"""Sources shared by the transformation tests: one random-access, one streaming."""

from __future__ import annotations

import numpy as np

import headrace as hr


def ints(ds: hr.Dataset) -> list[int]:
    return [int(v) for v in ds]


def streaming(values: list[int]) -> hr.Dataset:
    """A non-random-access source, so the streaming code paths run."""
    return hr.Dataset.from_generator(
        lambda: iter(values), output_signature=hr.TensorSpec((), np.int64)
    )
