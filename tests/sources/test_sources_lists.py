"""``from_tensor_slices`` / ``from_tensors`` of Python lists (and of arrays of strings)
serve the user's list row by row: nothing is stacked, so the pipeline holds no copy of it (a list of 300 arrays of
1 MiB was stacked into a new 300 MiB array under a 16 MiB budget; a list of str went
through a fixed-width ``<U`` copy and a UTF-8 one, 601 MiB).

The oracle for values is the array the list stands for — what the source made before,
``to_leaf_array(encode_str(list))``: the same element_spec, cardinality and elements,
through random access (batch, shuffle, shard, skip/take, repeat), checkpoint and
resume, cache and save. The oracle for memory is the process: its growth while the
dataset is made and iterated."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import headrace as hr
from headrace._errors import InvalidArgumentError
from headrace._structure import encode_str, to_leaf_array
from headrace.testing import assert_checkpoint_roundtrip

_DTYPES = [np.float32, np.float64, np.int64, np.int32, np.uint8, np.bool_, np.complex64]
_TEXTS = ["", "a", "é\0x", "日本語", "trailing\0", "x" * 40]


def _numeric_rows(rng: random.Random, count: int) -> list[Any]:
    shape = tuple(rng.choice([1, 2, 3, 0] if rng.random() < 0.1 else [1, 2, 3])
                  for _ in range(rng.randrange(1, 4)))
    dtypes = [rng.choice(_DTYPES)]
    if rng.random() < 0.3:
        dtypes.append(rng.choice([np.float32, np.int32, np.int64]))  # mixed: promoted
    np_rng = np.random.default_rng(rng.randrange(1 << 30))
    rows: list[Any] = []
    for _ in range(count):
        row = (np_rng.standard_normal(shape) * 100).astype(rng.choice(dtypes))
        if rng.random() < 0.2:
            row = np.asfortranarray(row)
        if rng.random() < 0.2 and row.ndim >= 1 and shape[0] > 1:
            row = np.repeat(row, 2, axis=0)[::2]  # a strided view
        rows.append(row)
    if rng.random() < 0.3:
        rows = [[row, row + 1] for row in rows]  # a list of lists of arrays
    return rows


def _text_rows(rng: random.Random, count: int) -> list[Any]:
    as_bytes = rng.random() < 0.4
    width = rng.choice([0, 0, 2])

    def one() -> Any:
        text = rng.choice(_TEXTS) + str(rng.randrange(100))
        return text.encode() if as_bytes else text

    rows: list[Any] = ([[one() for _ in range(width)] for _ in range(count)] if width
                       else [one() for _ in range(count)])
    if rng.random() < 0.4:  # an array of strings (<U, S, or object str): served the same
        return np.array(rows, dtype=object if not as_bytes and rng.random() < 0.5 else None)
    return rows


def _case(rng: random.Random) -> tuple[Any, Any]:
    """A structure of lists, and the same structure of the arrays they stand for."""
    count = rng.randrange(1, 12)
    lists = {f"c{k}": (_numeric_rows if rng.random() < 0.6 else _text_rows)(rng, count)
             for k in range(rng.randrange(1, 4))}
    shape = rng.choice(["single", "dict", "tuple"])
    tensors: Any = (lists["c0"] if shape == "single" else
                    lists if shape == "dict" else tuple(lists.values()))
    stacked = hr._structure.map_structure(lambda leaf: to_leaf_array(encode_str(leaf)), tensors)
    return tensors, stacked


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (bytes, str)) or isinstance(b, (bytes, str)):
        return type(a) is type(b) and a == b
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == object:
        return all(type(x) is type(y) and x == y for x, y in zip(a.flat, b.flat, strict=True))
    return bool(np.array_equal(a, b, equal_nan=True))


def _elements(ds: hr.Dataset) -> list[Any]:
    return list(ds)


def _pipelines(ds: hr.Dataset, rng: random.Random) -> list[hr.Dataset]:
    return [
        ds,
        ds.batch(rng.randrange(1, 5)),
        ds.shuffle(rng.randrange(1, 20), seed=rng.randrange(100)).batch(3),
        ds.shard(2, rng.randrange(2)),
        ds.skip(1).take(3),
        ds.repeat(2).batch(4),
    ]


@pytest.mark.parametrize("seed", range(30))
def test_a_list_gives_what_the_array_it_stands_for_gives(seed: int) -> None:
    rng = random.Random(seed)
    tensors, stacked = _case(rng)
    got, want = hr.Dataset.from_tensor_slices(tensors), hr.Dataset.from_tensor_slices(stacked)
    assert got.element_spec == want.element_spec
    assert got.cardinality() == want.cardinality()
    pick = random.Random(seed)
    for mine, theirs in zip(_pipelines(got, pick), _pipelines(want, random.Random(seed)),
                            strict=True):
        a, b = _elements(mine), _elements(theirs)
        assert len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    # the rows are served from the user's list: nothing stacked or converted (a list of
    # bytes is held as pointers to the user's own bytes objects), none writable
    node_leaves = got._node.leaves  # type: ignore[attr-defined]
    for leaf, original in zip(node_leaves, hr._structure.flatten(tensors), strict=True):
        if isinstance(leaf, np.ndarray):
            assert leaf.dtype == object and type(original) is list
            assert all(mine is theirs for mine, theirs in zip(leaf.tolist(), original,
                                                               strict=True))
    first = next(iter(got))
    for leaf in hr._structure.flatten(first):
        if isinstance(leaf, np.ndarray):
            assert not leaf.flags.writeable
    whole = hr.Dataset.from_tensors(tensors)
    assert whole.element_spec == hr.Dataset.from_tensors(stacked).element_spec
    assert _equal(next(iter(whole)), next(iter(hr.Dataset.from_tensors(stacked))))
    got_batches = list(whole.repeat(3).batch(2))
    want_batches = list(hr.Dataset.from_tensors(stacked).repeat(3).batch(2))
    assert all(_equal(x, y) for x, y in zip(got_batches, want_batches, strict=True))


@pytest.mark.parametrize("seed", range(4))
def test_a_list_resumes_caches_and_saves_like_its_array(seed: int, tmp_path: Any) -> None:
    rng = random.Random(100 + seed)
    tensors, stacked = _case(rng)
    ds = hr.Dataset.from_tensor_slices(tensors)
    assert_checkpoint_roundtrip(ds.shuffle(5, seed=seed).batch(2), max_checkpoints=8)
    want = _elements(hr.Dataset.from_tensor_slices(stacked))
    cached = ds.cache()
    for _ in range(2):
        got = _elements(cached)
        assert all(_equal(x, y) for x, y in zip(got, want, strict=True))
    ds.save(str(tmp_path / "saved"))
    loaded = _elements(hr.Dataset.load(str(tmp_path / "saved")))
    assert all(_equal(x, y) for x, y in zip(loaded, want, strict=True))
    # the content fingerprint follows the values: equal lists, equal
    same = hr.Dataset.from_tensor_slices(tensors)._node.content()  # type: ignore[attr-defined]
    assert same == ds._node.content()  # type: ignore[attr-defined]


def test_content_changes_with_the_lists_values() -> None:
    rows = [np.arange(4.0) + i for i in range(3)]
    before = hr.Dataset.from_tensor_slices(rows)._node.content()  # type: ignore[attr-defined]
    rows[1] = rows[1] + 1
    after = hr.Dataset.from_tensor_slices(rows)._node.content()  # type: ignore[attr-defined]
    assert before != after
    texts = hr.Dataset.from_tensor_slices(["a", "b"])._node.content()  # type: ignore[attr-defined]
    other = hr.Dataset.from_tensor_slices(["a", "c"])._node.content()  # type: ignore[attr-defined]
    assert texts != other


@pytest.mark.parametrize("rows", [
    [np.zeros(3), np.zeros(4)],
    [np.zeros((2, 2)), np.zeros(4)],
    ["a", ["b"]],
    [[np.zeros(2), np.zeros(2)], [np.zeros(2)]],
])
def test_a_ragged_list_is_refused_up_front_naming_the_rows(rows: list[Any]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"row 0 is .*row 1 is"):
        hr.Dataset.from_tensor_slices(rows)
    with pytest.raises(InvalidArgumentError, match=r"from_tensors: .*differ in shape"):
        hr.Dataset.from_tensors(rows)


_MEASURE = r"""
import sys, warnings
import numpy as np
import headrace as hr
from headrace.cli import _PeakSampler
warnings.simplefilter("ignore")
kind, count = sys.argv[1], int(sys.argv[2])
if kind == "arrays":
    rows = [np.full(1 << 17, i, np.float64) for i in range(count)]        # 1 MiB each
elif kind == "dict":
    rows = {"x": [np.full(1 << 17, i, np.float64) for i in range(count)],
            "y": list(range(count))}
elif kind == "bytes_list":  # held as pointers to these objects, no S array between
    rows = [b"x" * (1 << 20) + str(i).encode() for i in range(count)]
elif kind == "str_array":  # the user's <U array: 2 MiB a row, 1 MiB of UTF-8
    rows = np.array([("é" * (1 << 19)) + str(i) for i in range(count)])
else:
    rows = [("é" * (1 << 19)) + str(i) for i in range(count)]   # 1 MiB of UTF-8 each
with _PeakSampler(0.002) as sampler:
    ds = hr.Dataset.from_tensor_slices(rows).with_options(hr.Options(memory_budget="4MiB"))
    if kind == "whole":
        ds = hr.Dataset.from_tensors(rows)  # the recipe holds nothing: made, not iterated
    else:
        for element in ds.shuffle(count, seed=0):
            pass
print(sampler.growth)
"""


@pytest.mark.parametrize(
    "kind", ["arrays", "dict", "texts", "bytes_list", "str_array", "whole"])
def test_a_list_costs_the_process_no_copy_of_it(kind: str) -> None:
    """64 rows of 1 MiB under a 4 MiB budget: the process grows by about the budget
    (the shuffle's share and the element in hand), not by the list's 64 MiB."""
    count = 64
    out = subprocess.run([sys.executable, "-c", _MEASURE, kind, str(count)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip())
    assert growth <= 16 << 20, f"{kind}: grew {growth / (1 << 20):.1f} MiB for a 64 MiB list"


def test_a_list_of_numbers_is_still_one_array() -> None:
    """A list of numbers is stacked (smaller than the list, and as fast as an array)."""
    ds = hr.Dataset.from_tensor_slices(list(range(1000)))
    assert isinstance(ds._node.leaves[0], np.ndarray)  # type: ignore[attr-defined]
    (batch,) = list(ds.batch(1000))
    assert batch.tolist() == list(range(1000))


@pytest.mark.parametrize("seed", range(12))
def test_a_list_of_numbers_is_booked_on_the_budget_or_refused(seed: int) -> None:
    """The array a list of numbers is stacked into is headrace's, not the user's: each
    run's stages split what it leaves of the budget, and one it leaves nothing of is a
    MemoryBudgetError naming the component (an array the user made stays free)."""
    from headrace._errors import MemoryBudgetError
    from headrace._memory.sizeof import sizeof
    from headrace._memory.units import parse_bytes

    rng = random.Random(seed)
    count = rng.choice([10, 1000, 100_000, 300_000, 1_000_000])
    kind = rng.choice(["int", "float", "pairs", "bool"])
    values: list[Any] = (
        list(range(count)) if kind == "int" else [i / 3 for i in range(count)]
        if kind == "float" else [[i, -i] for i in range(count)]
        if kind == "pairs" else [i % 3 == 0 for i in range(count)]
    )
    budget = rng.choice(["1MiB", "4MiB", "16MiB"])
    total = parse_bytes(budget)
    user_array = np.arange(count, dtype=np.float64)  # the user's: never charged
    tensors = {"numbers": values, "mine": user_array} if rng.random() < 0.5 else values
    ds = hr.Dataset.from_tensor_slices(tensors).with_options(hr.Options(memory_budget=budget))
    copy = np.asarray(values)
    cost = sizeof(copy)
    if cost >= total:
        with pytest.raises(MemoryBudgetError, match=r"from_tensor_slices: component .*a list"):
            next(iter(ds))
        return
    with iter(ds.shuffle(8, seed=seed).batch(4)) as iterator:
        first = next(iterator)
        assert iterator.stats().budget_total == total - cost
    numbers = first["numbers"] if isinstance(first, dict) else first
    assert all(any(np.array_equal(row, want) for want in copy[:12]) for row in numbers)
    # the user's own array of the same numbers books nothing
    with iter(hr.Dataset.from_tensor_slices(copy).with_options(
            hr.Options(memory_budget=budget))) as iterator:
        next(iterator)
        assert iterator.stats().budget_total == total


@pytest.mark.parametrize("seed", range(16))
def test_from_tensors_of_a_list_refuses_an_element_larger_than_the_budget(seed: int) -> None:
    """from_tensors stacks a list when it makes its one element: an element the list
    cannot fit in the budget is a MemoryBudgetError before it is allocated (for
    strings, counting at least a byte a character and their bytes objects); one that
    fits is the stacked array."""
    from headrace._errors import MemoryBudgetError

    rng = random.Random(seed)
    count, width = rng.randrange(1, 40), rng.choice([1 << 10, 1 << 14, 1 << 16, 1 << 16])
    if rng.random() < 0.5:
        rows: list[Any] = [np.full(width, i, np.float64) for i in range(count)]
        least = count * width * 8
    else:
        rows = ["é" * width + str(i) for i in range(count)]
        least = sum(len(row) + sys.getsizeof(b"") + 8 for row in rows)
    budget = rng.choice([1 << 20, 4 << 20])
    ds = hr.Dataset.from_tensors(rows).with_options(hr.Options(memory_budget=budget))
    if least > budget:
        with pytest.raises(MemoryBudgetError, match=r"from_tensors: .*element: "):
            next(iter(ds))
    else:
        (element,) = list(ds)
        assert _equal(element, to_leaf_array(encode_str(rows)))


@pytest.mark.parametrize("seed", range(6))
def test_a_python_int_past_int64_is_refused_not_turned_into_a_float(seed: int) -> None:
    """Python ints become int64 (as in tf.data): a list holding one that does not fit
    was converted to floats, changing its value silently (2**63 + 1 came out as
    9.223372036854776e+18). Refused, naming the int, flat or nested, among ints or
    floats; lists that fit keep their exact values (the oracle: the ints themselves)."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 40))
    values: list[Any] = [int(v) for v in rng.integers(-(2**62), 2**62, count)]
    if seed % 2:
        values[int(rng.integers(0, count))] = float(rng.random())
    big = int(rng.choice([2**63, 2**63 + 1, 2**64 + 7, -(2**63) - 1]))
    position = int(rng.integers(0, count))
    bad = [*values[:position], big, *values[position:]]
    nested = seed % 3 == 0
    with pytest.raises(hr.ElementSpecError, match=str(big)):
        hr.Dataset.from_tensor_slices([bad, bad] if nested else bad)
    if not seed % 2:  # ints only, all within int64: exact
        got = [int(x) for x in hr.Dataset.from_tensor_slices(values)]
        assert got == values
