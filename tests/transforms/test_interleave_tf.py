"""interleave's order against TensorFlow itself, on randomized configurations (G3)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import headrace as hr

pytestmark = pytest.mark.tf


def padded(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max([len(values) for values in lists] + [1])
    table = np.zeros((len(lists), width), np.int64)
    for row, values in enumerate(lists):
        table[row, : len(values)] = values
    return table, np.array([len(values) for values in lists], np.int64)


@settings(max_examples=40, deadline=None)
@given(
    lists=st.lists(st.lists(st.integers(0, 999), max_size=6), min_size=1, max_size=8),
    cycle_length=st.integers(1, 5),
    block_length=st.integers(1, 4),
    parallel=st.sampled_from([None, 1, 2, "cycle"]),
)
def test_interleave_order_matches_tensorflow(lists, cycle_length, block_length, parallel) -> None:
    table, lengths = padded(lists)
    calls = cycle_length if parallel == "cycle" else parallel
    if calls is not None:
        calls = min(calls, cycle_length)

    def tf_inner(i):
        return tf.data.Dataset.from_tensor_slices(tf.gather(table, i)[: tf.gather(lengths, i)])

    tf_ds = tf.data.Dataset.range(len(lists)).interleave(
        tf_inner, cycle_length=cycle_length, block_length=block_length,
        num_parallel_calls=calls, deterministic=True if calls else None,
    )
    expected = [int(v) for v in tf_ds.as_numpy_iterator()]

    def hr_inner(i):
        return hr.Dataset.from_tensor_slices(table[int(i), : lengths[int(i)]])

    hr_ds = hr.Dataset.range(len(lists)).interleave(
        hr_inner, cycle_length=cycle_length, block_length=block_length,
        num_parallel_calls=calls,
    )
    assert [int(v) for v in hr_ds] == expected


def test_text_files_num_parallel_reads_match_tensorflow(tmp_path) -> None:
    files = []
    for i, count in enumerate([3, 1, 0, 2, 5]):
        path = tmp_path / f"{i}.txt"
        path.write_bytes("".join(f"{i}-{j}\n" for j in range(count)).encode())
        files.append(str(path))
    for reads in (1, 2, 3):
        expected = list(tf.data.TextLineDataset(files, num_parallel_reads=reads).as_numpy_iterator())
        assert list(hr.TextLineDataset(files, num_parallel_reads=reads)) == expected
