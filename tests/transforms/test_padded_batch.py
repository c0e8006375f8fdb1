"""``padded_batch``: outputs, orders and errors a user relies on."""

from __future__ import annotations

import numpy as np
import pytest

import headrace as hr


def test_padded_batch_pads_to_batch_max_and_fixed_shapes() -> None:
    ragged = hr.Dataset.from_generator(
        lambda: iter([[1], [2, 2], [3, 3, 3]]), output_signature=hr.TensorSpec((None,), np.int64)
    )
    assert [b.tolist() for b in ragged.padded_batch(2)] == [[[1, 0], [2, 2]], [[3, 3, 3]]]
    fixed = [b.tolist() for b in ragged.padded_batch(2, padded_shapes=[4], padding_values=-1)]
    assert fixed == [[[1, -1, -1, -1], [2, 2, -1, -1]], [[3, 3, 3, -1]]]
    with pytest.raises(hr.DataLossError, match="smaller size than the input element: element 2"):
        list(ragged.padded_batch(3, padded_shapes=[2]))


def test_padded_batch_of_bytes_uses_empty_bytes() -> None:
    ds = hr.Dataset.from_generator(
        lambda: iter([[b"a"], [b"b", b"c"]]), output_signature=hr.TensorSpec((None,), bytes)
    )
    (batch,) = list(ds.padded_batch(2))
    assert batch.tolist() == [[b"a", b""], [b"b", b"c"]]


def test_padded_batch_keeps_bytes_exact_with_trailing_nuls() -> None:
    """G5: bytes scalars were stored as 0-d fixed-width arrays, which drop trailing NULs."""
    values = [b"a\x00", b"bb", b"\x00"]
    ds = hr.Dataset.from_generator(
        lambda: iter(values), output_signature=hr.TensorSpec((), bytes)
    ).padded_batch(3)
    (batch,) = list(ds)
    assert batch.dtype == object and batch.tolist() == values
    assert all(type(item) is bytes for item in batch)
    rows = hr.Dataset.from_generator(
        lambda: iter([[b"a\x00"], [b"bb", b"\x00"]]),
        output_signature=hr.TensorSpec((None,), bytes),
    ).padded_batch(2)
    assert next(iter(rows)).tolist() == [[b"a\x00", b""], [b"bb", b"\x00"]]
