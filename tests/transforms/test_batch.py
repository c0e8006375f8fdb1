"""``batch``: outputs, orders and errors a user relies on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import headrace as hr


def test_batch_and_drop_remainder(source) -> None:
    batches = [b.tolist() for b in source(7).batch(3)]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in source(7).batch(3, drop_remainder=True)] == [[0, 1, 2], [3, 4, 5]]
    assert source(7).batch(3, drop_remainder=True).element_spec.shape == (3,)
    assert source(7).batch(3).element_spec.shape == (None,)


def test_batch_shape_mismatch_names_element_and_shapes() -> None:
    ds = hr.Dataset.from_generator(
        lambda: iter([np.zeros(2), np.zeros(2), np.zeros(3)]),
        output_signature=hr.TensorSpec((None,), np.float64),
    ).batch(4)
    with pytest.raises(hr.ElementSpecError, match=r"element 2 has shape \(3,\).*element 0.*\(2,\)"):
        list(ds)


@pytest.mark.parametrize(("batch_size", "budget_mib"), [(2, 16), (3, 12), (4, 16)])
def test_a_batch_refused_by_the_budget_stands_for_all_its_rows(
    tmp_path: Any, batch_size: int, budget_mib: int
) -> None:
    """Found by the sixth outsider attack: 2 MiB records, ``batch(n).unbatch()`` under a
    budget that refuses some batches (unbatch holds one while the next is assembled). A
    refused batch raised after the rows it had taken: the next batch started with its
    other rows, and a last refused batch could end the stream without its error (records
    lost without a word). A refused batch now drops all its rows and raises in their
    place, so every batch of the unrefused run comes out whole or as one error."""
    from headrace.io.tfrecord import write_tfrecord

    mib = 1 << 20
    paths = [str(tmp_path / f"{i}.tfrecord") for i in range(3)]
    sizes = [[64 << 10] * 4, [2 * mib] * 9, [2 * mib] * 9]
    for i, path in enumerate(paths):
        write_tfrecord(path, [b"%d/%d/" % (i, r) + b"x" * (s - 10) for r, s in enumerate(sizes[i])])

    def tag(record: Any) -> str:
        return bytes(record[:8]).split(b"x")[0].decode()

    records = hr.Dataset.from_tensor_slices(paths).interleave(
        hr.TFRecordDataset, cycle_length=4, block_length=2)
    batches = [[tag(row) for row in batch] for batch in records.batch(batch_size)]
    got: list[Any] = []
    budgeted = records.batch(batch_size).unbatch().with_options(
        hr.Options(memory_budget=budget_mib * mib))
    with iter(budgeted) as it:
        while True:
            try:
                got.append(tag(next(it)))
            except StopIteration:
                break
            except hr.MemoryBudgetError:
                got.append("refused")
    at = refused = 0
    for batch in batches:  # each batch of the unrefused run: its rows, or one error
        if got[at:at + len(batch)] == batch:
            at += len(batch)
        else:
            assert got[at] == "refused", (at, got, batches)
            at, refused = at + 1, refused + 1
    assert at == len(got) and refused >= 2, (got, batches)
