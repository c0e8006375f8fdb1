"""String scalars a function returns as 0-d object arrays, batched: every batcher and
the stages that may stand between a map and a batch give batches of the exact Python
objects (``bytes``/``str``), as the same pipeline over plain ``bytes`` does and as
tf.data does. A batch that held 0-d arrays instead broke ``.decode()``, hashing and
``==`` on its rows."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from process_fns import string_element

import headrace as hr
from headrace.core.stack import stack_elements

KINDS = ("bytes", "str", "tuple", "dict", "vector")
#: Stages between the map and the batcher (each leaves the elements as they are).
BETWEEN = ("prefetch", "take", "shuffle", "cache", "cache_file", "filter", "ignore_errors",
           "save_load", "threads")
BATCHERS = ("batch", "batch_drop", "padded_batch", "ragged_batch", "rebatch", "unbatch",
            "unbatch_batch")


def strict(value: Any) -> Any:
    """A value as nested Python data that keeps every item's type: a row holding a 0-d
    array where the oracle holds bytes compares unequal."""
    if isinstance(value, dict):
        return {key: strict(item) for key, item in sorted(value.items())}
    if isinstance(value, tuple):
        return tuple(strict(item) for item in value)
    if hasattr(value, "row_splits") and hasattr(value, "values"):
        return ("ragged", strict(np.asarray(value.values)), np.asarray(value.row_splits).tolist())
    if isinstance(value, np.ndarray):
        kind = "O" if value.dtype.hasobject else value.dtype.str
        return (kind, value.shape, [strict(item) for item in value.reshape(-1).tolist()])
    return (type(value).__name__, value)


def build(ds: hr.Dataset, steps: list[str], batcher: str, size: int, path: Path) -> hr.Dataset:
    for step in steps:
        if step == "prefetch":
            ds = ds.prefetch(1)
        elif step == "take":
            ds = ds.take(7)
        elif step == "shuffle":
            ds = ds.shuffle(1)
        elif step == "cache":
            ds = ds.cache()
        elif step == "cache_file":
            ds = ds.cache(str(path / f"cache{len(list(path.iterdir()))}"))
        elif step == "filter":
            ds = ds.filter(lambda *x: True)
        elif step == "ignore_errors":
            ds = ds.ignore_errors()
        elif step == "save_load":
            target = path / f"saved{len(list(path.iterdir()))}"
            ds.save(str(target))
            ds = hr.Dataset.load(str(target))
        elif step == "threads":
            ds = ds.map(lambda *x: x if len(x) > 1 else x[0], num_parallel_calls=2)
    if batcher == "batch":
        return ds.batch(size)
    if batcher == "batch_drop":
        return ds.batch(size, drop_remainder=True)
    if batcher == "padded_batch":
        return ds.padded_batch(size)
    if batcher == "ragged_batch":
        return ds.ragged_batch(size)
    if batcher == "rebatch":
        return ds.batch(size).rebatch(size + 1)
    if batcher == "unbatch":
        return ds.batch(size).unbatch()
    return ds.batch(size).unbatch().batch(size + 1)


def draw(seed: int) -> tuple[str, list[str], str, int, str]:
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    steps = rng.sample(BETWEEN, rng.randint(0, 2))
    batcher = rng.choice(BATCHERS)
    if kind == "vector" and batcher == "padded_batch":
        batcher = "batch"  # (a fixed-size object vector: padding has nothing to add)
    return kind, steps, batcher, rng.randint(1, 4), rng.choice(["array", "constant"])


def run(kind: str, steps: list[str], batcher: str, size: int, wrap: str, path: Path) -> Any:
    fn = functools.partial(string_element, kind, wrap)
    return [strict(b) for b in build(hr.Dataset.range(9).map(fn), steps, batcher, size, path)]


@pytest.mark.parametrize("seed", range(60))
def test_wrapped_string_scalars_batch_as_their_plain_twin(seed: int, tmp_path: Path) -> None:
    kind, steps, batcher, size, wrap = draw(seed)
    (tmp_path / "w").mkdir()
    (tmp_path / "p").mkdir()
    got = run(kind, steps, batcher, size, wrap, tmp_path / "w")
    # tf_compat.constant encodes str, as TensorFlow does: the twin holds the bytes
    plain = "plain-encoded" if wrap == "constant" else "plain"
    assert got == run(kind, steps, batcher, size, plain, tmp_path / "p"), (
        kind, steps, batcher, size, wrap)


@pytest.mark.parametrize("workers", ["processes", "threads"])
def test_map_workers_hand_over_string_scalars_that_batch_to_bytes(workers: str) -> None:
    fn = functools.partial(string_element, "tuple", "array")
    ds = hr.Dataset.range(7).map(fn, num_parallel_calls=2, workers=workers).batch(3)
    texts = [row for _, column, _ in ds for row in column]
    assert texts == [b"s%d\x00" % i for i in range(7)]
    assert all(type(text) is bytes for text in texts)
    assert {text.decode() for text in texts} == {f"s{i}\x00" for i in range(7)}  # hashable


def test_a_batched_row_is_bytes_that_decode_hash_and_compare() -> None:
    batch = next(iter(hr.Dataset.range(3).map(
        lambda i: np.array(b"x%d" % i, dtype=object)).batch(3)))
    assert batch.dtype == object and batch.shape == (3,)
    assert [type(row) for row in batch] == [bytes, bytes, bytes]
    assert batch[2].decode() == "x2"
    assert set(batch) == {b"x0", b"x1", b"x2"}


def test_the_unbatched_element_is_what_the_function_returned() -> None:
    # A map's element is not rewritten (as a numeric 0-d array stays one); a batch
    # holds its item, and unbatching that batch hands out the item itself.
    element = next(iter(hr.Dataset.range(1).map(lambda i: np.array(b"x", dtype=object))))
    assert type(element) is np.ndarray and element.shape == () and element[()] == b"x"
    rows = list(hr.Dataset.range(2).map(lambda i: np.array(b"x", dtype=object)).batch(2).unbatch())
    assert rows == [b"x", b"x"] and all(type(row) is bytes for row in rows)


def test_stack_elements_stores_the_items_of_0d_object_arrays() -> None:
    # the default RandomAccess.get_many stacks computed rows with this
    stacked = stack_elements(
        [(np.array(b"a", dtype=object), np.int32(1)), (b"b", np.int32(2))], stage="batch")
    assert [type(row) for row in stacked[0]] == [bytes, bytes]
    assert stacked[0].tolist() == [b"a", b"b"] and stacked[1].tolist() == [1, 2]


@pytest.mark.parametrize("seed", range(8))
def test_rows_mixing_bytes_and_0d_arrays_batch_to_bytes(seed: int) -> None:
    # any of the three forms may come first: the column is laid out from the first row
    from headrace import tf_compat

    rng = random.Random(seed)
    forms = [rng.choice(["bytes", "array", "constant"]) for _ in range(10)]

    def element(i: Any) -> Any:
        value = b"m%d" % int(i)
        form = forms[int(i)]
        if form == "array":
            return np.array(value, dtype=object)
        return tf_compat.constant(value) if form == "constant" else value

    rows = [row for batch in hr.Dataset.range(10).map(element).batch(4) for row in batch]
    assert rows == [b"m%d" % i for i in range(10)], forms
    assert all(type(row) is bytes for row in rows), forms
