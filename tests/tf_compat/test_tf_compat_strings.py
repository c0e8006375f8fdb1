"""String scalars through ``tf_compat`` against TensorFlow: ``tf.constant(b"..")`` and
``decode_csv`` in a map, then the stages that keep the CSV fusion from applying, then a
batch. TensorFlow's batch of string scalars is a 1-D string tensor whose items are
``bytes``; headrace's must be an object array of ``bytes`` (not of 0-d arrays), item
for item, and an unbatched element must answer ``.numpy()`` with ``bytes`` as TF's does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from headrace import tf_compat as hr_tf

pytestmark = pytest.mark.tf

ROWS = "a,b,c\n1,1.5,x\n2,2.5,yy\n3,3.5,zz\x00\n4,4.5,w\n5,5.5,\u00e9\n"


def typed(value: Any) -> Any:
    """A batch or element as (type, value) items, through ``.numpy()`` where an element
    answers it (as TF code reads it): a nested 0-d array never equals bytes."""
    if isinstance(value, tuple | list):
        return tuple(typed(item) for item in value)
    if hasattr(value, "numpy"):  # a tf.Tensor, or tf_compat's EagerArray
        value = value.numpy()
    if isinstance(value, np.ndarray):
        plain = value.view(np.ndarray)
        items = plain.reshape(-1).tolist()
        if plain.dtype.kind in "OS":
            return (plain.shape, [(type(item).__name__, item) for item in items])
        return (plain.shape, items)
    return (type(value).__name__, value)


def pipelines(tf_: Any, path: str) -> Iterator[tuple[str, Any]]:
    defaults = [[0], [0.0], [""]]

    def lines() -> Any:
        return tf_.data.TextLineDataset(path).skip(1)

    def decode(line: Any) -> Any:
        return tf_.io.decode_csv(line, record_defaults=defaults)

    yield "constant", tf_.data.Dataset.range(3).map(lambda i: tf_.constant(b"ab\x00")).batch(3)
    yield "prefetch", lines().map(decode).prefetch(1).batch(2)
    yield "ignore_errors", lines().map(decode).ignore_errors().batch(2)
    yield "take", lines().map(decode).take(4).batch(2)
    yield "shuffle", lines().map(decode).shuffle(1).batch(2)
    yield "fused", lines().map(decode).batch(2)
    yield "padded_batch", lines().map(decode).padded_batch(2)
    yield "cache", lines().map(decode).cache().batch(2)
    yield "unbatch", lines().map(decode).prefetch(1).batch(2).unbatch()
    yield "rebatch", lines().map(decode).take(5).batch(2).rebatch(3)
    yield "unbatched", lines().map(decode)


@pytest.fixture
def csv_path(tmp_path: Path) -> str:
    path = tmp_path / "f.csv"
    path.write_text(ROWS, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name", [name for name, _ in pipelines(hr_tf, "")])
def test_string_scalars_batch_to_bytes_as_in_tensorflow(name: str, csv_path: str) -> None:
    theirs = [typed(element) for element in dict(pipelines(tf, csv_path))[name]]
    mine = [typed(element) for element in dict(pipelines(hr_tf, csv_path))[name]]
    assert mine == theirs


def test_a_batched_string_row_decodes_and_hashes(csv_path: str) -> None:
    ds = hr_tf.data.TextLineDataset(csv_path).skip(1).map(
        lambda line: hr_tf.io.decode_csv(line, record_defaults=[[0], [0.0], [""]])
    ).prefetch(1).batch(5)
    _, _, texts = next(iter(ds))
    assert [row.decode() for row in texts] == ["x", "yy", "zz\x00", "w", "\u00e9"]
    assert len(set(texts)) == 5
