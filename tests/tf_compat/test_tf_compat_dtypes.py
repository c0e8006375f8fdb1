"""``headrace.tf_compat`` gives Python numbers TensorFlow's dtypes, where tf.data makes
them, and ``list_files`` bytes: each recipe runs under tf.data and through tf_compat,
and the elements (values, dtypes, shapes) must be the same. headrace's own API keeps
NumPy's int64/float64 (docs/differences.md)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import outcome

import headrace as hr
from headrace import tf_compat

pytestmark = pytest.mark.tf

RECIPES: dict[str, Any] = {
    "from_tensor_slices ints": lambda D: D.from_tensor_slices([1, 2, 3]),
    "from_tensor_slices floats": lambda D: D.from_tensor_slices([1.5, 2.0]),
    "from_tensor_slices ints and floats": lambda D: D.from_tensor_slices([1, 2.5]),
    "from_tensor_slices bools": lambda D: D.from_tensor_slices([True, False]),
    "from_tensor_slices an int past int32": lambda D: D.from_tensor_slices([1, 2**40]),
    "from_tensor_slices nested lists": lambda D: D.from_tensor_slices([[1, 2], [3, 4]]),
    "from_tensor_slices a dict": lambda D: D.from_tensor_slices(
        {"foo": [1.0, 2.0, 3.0], "bar": [[4.0], [5.0], [6.0]]}),
    "from_tensor_slices a tuple": lambda D: D.from_tensor_slices(([1, 2], [0.5, 1.5])),
    "from_tensor_slices NumPy keeps its dtype": lambda D: D.from_tensor_slices(
        (np.arange(3), np.arange(3.0))),
    "from_tensor_slices NumPy scalars in a list": lambda D: D.from_tensor_slices(
        [np.float64(1.0), np.float64(2.0)]),
    "from_tensors an int": lambda D: D.from_tensors(3),
    "from_tensors a float": lambda D: D.from_tensors(3.0),
    "from_tensors a list": lambda D: D.from_tensors([3, 4]),
    "from_tensors a NumPy int": lambda D: D.from_tensors(np.int64(3)),
    "from_tensors a tuple": lambda D: D.from_tensors((1, 2.0, True)),
    "map returns an int": lambda D: D.range(3).map(lambda i: 5),
    "map returns a float": lambda D: D.range(3).map(lambda i: 5.0),
    "map returns a list of ints in a tuple": lambda D: D.range(3).map(lambda i: (i, [5, 6])),
    "map returns Python numbers in a list": lambda D: D.range(3).map(lambda i: [1, 2.0]),
    "map keeps the input's dtype": lambda D: D.range(3).map(lambda i: i * 2),
    "map returns a dict": lambda D: D.range(2).map(lambda i: {"a": 1, "b": (i, 0.5)}),
    "range": lambda D: D.range(3),
    "enumerate": lambda D: D.from_tensor_slices([1.0, 2.0]).enumerate(),
    "scan with a Python state": lambda D: D.range(4).scan(0, lambda s, x: (s + 1, s)),
    "batch of from_tensor_slices ints": lambda D: D.from_tensor_slices([1, 2, 3]).batch(2),
    "padded_batch with a Python padding value": lambda D: D.from_tensor_slices(
        [[1, 2], [3, 4]]).padded_batch(2, padded_shapes=[4], padding_values=-1),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_python_numbers_take_tensorflows_dtypes(name: str) -> None:
    build = RECIPES[name]
    assert outcome(build, tf_compat.data.Dataset) == outcome(build, tf.data.Dataset)


def random_python_value(rng: random.Random, depth: int = 0) -> Any:
    """A Python number, or a rectangular nested list of one kind of them."""
    kind = rng.choice(["int", "float", "bool", "mixed", "big"])

    def number() -> Any:
        if kind == "int":
            return rng.randint(-(2**31), 2**31 - 1)
        if kind == "float":
            return rng.uniform(-1e6, 1e6)
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "big":
            return rng.choice([rng.randint(-5, 5), 2**31 + rng.randint(0, 2**40)])
        return rng.choice([rng.randint(-9, 9), rng.uniform(-9, 9)])

    shape = [rng.randint(1, 3) for _ in range(rng.randint(1, 2))]

    def nested(dims: list[int]) -> Any:
        if not dims:
            return number()
        return [nested(dims[1:]) for _ in range(dims[0])]

    return nested(shape)


@pytest.mark.parametrize("seed", range(40))
def test_generated_python_lists_match_tensorflow(seed: int) -> None:
    """from_tensor_slices, from_tensors and a map returning the value, on random nested
    lists of Python numbers: the same dtypes, shapes and values as tf.data."""
    rng = random.Random(seed)
    value = random_python_value(rng)
    for build in (
        lambda D: D.from_tensor_slices(value),
        lambda D: D.from_tensors(value),
        lambda D: D.range(2).map(lambda i: (i, value)),
    ):
        assert outcome(build, tf_compat.data.Dataset) == outcome(build, tf.data.Dataset), value


def test_constant_takes_tensorflows_dtypes() -> None:
    for value in [5, 5.0, True, [1, 2], [1.0, 2], [[1], [2]], 2**40, np.int64(3), np.float64(1)]:
        assert tf_compat.constant(value).dtype == tf.constant(value).dtype.as_numpy_dtype, value
    assert tf_compat.constant(5, dtype=tf_compat.int64).dtype == np.int64


def test_native_api_keeps_numpys_dtypes() -> None:
    assert hr.Dataset.from_tensor_slices([1, 2]).element_spec.dtype == np.int64
    assert hr.Dataset.range(2).map(lambda i: 5.0).element_spec.dtype == np.float64


def test_list_files_yields_bytes_as_tensorflow(tmp_path: Path) -> None:
    for name in ["b.txt", "a.txt", "c.txt"]:
        (tmp_path / name).write_text(name)
    pattern = str(tmp_path / "*.txt")
    theirs = [p.numpy() for p in tf.data.Dataset.list_files(pattern, shuffle=False)]
    ours = [p.numpy() for p in tf_compat.data.Dataset.list_files(pattern, shuffle=False)]
    assert ours == theirs and all(isinstance(p, bytes) for p in ours)
    assert tf_compat.data.Dataset.list_files(pattern).element_spec == hr.TensorSpec((), bytes)
    # they open as TensorFlow's do
    records = tf_compat.data.Dataset.list_files(pattern, shuffle=False).interleave(
        tf_compat.data.TextLineDataset, cycle_length=1)
    assert [r.numpy() for r in records] == [b"a.txt", b"b.txt", b"c.txt"]
    assert all(isinstance(p, str) for p in hr.Dataset.list_files(pattern))


def test_batch_of_unknown_shapes_names_the_element_and_component() -> None:
    """from_generator(output_types=...) leaves shapes unknown; batch then needs equal
    shapes at run time, as tf.data, and says which element and component differ."""

    def rows() -> Any:
        yield np.ones(2), 1
        yield np.ones(3), 2

    for D in (tf_compat.data.Dataset, hr.Dataset):
        dataset = D.from_generator(rows, output_types=(tf.float32, tf.int32)).batch(2)
        with pytest.raises(hr.ElementSpecError,
                           match=r"element 1 has shape \(3,\) for component \[0\].*element 0"):
            list(dataset)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"component 0.*element 1"):
        list(tf.data.Dataset.from_generator(rows, output_types=(tf.float32, tf.int32)).batch(2))
