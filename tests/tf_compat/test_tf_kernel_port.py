"""TensorFlow's own kernel tests for the transformations headrace had before, as a table.

The cases come from ``tensorflow/python/data/kernel_tests``: batch_test,
shard_test, take_test, skip_test, repeat_test, concatenate_test, zip_test,
enumerate_test, filter_test, flat_map_test, padded_batch_test, unbatch_test,
rebatch_test, prefetch_test, from_tensor_slices_test, from_tensors_test,
cache_test, cardinality_test, and the cases of map_test, scan_test and
from_generator_test about the structures functions return and generators
yield — their inputs, parameters, expected outputs and expected errors, not
their code. Each case is one recipe run under tf.data
and under headrace: the same elements (values, dtypes, shapes) in the same
order, or an error from both. Cases where headrace deliberately differs are in
``DIFFERENCES`` with the reason; the README's list of differences says the same,
and the test checks that they still differ (a fix must update the README).
Every case also runs through ``headrace.tf_compat``, where none may differ.

TensorFlow 2.21 itself crashes (segmentation fault) on ``rebatch([-1])``, so that
case of rebatch_test (testNegativeBatchSize) is checked on headrace alone.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_compare import outcome, without_dtypes

import headrace as hr
from headrace import tf_compat

pytestmark = pytest.mark.tf

Build = Callable[[Any], Any]
CASES: dict[str, Build] = {}


def fill(D: Any, x: Any) -> Any:
    """A vector of ``x`` copies of ``x`` (tf.fill), in the library of ``D``."""
    if D is tf.data.Dataset:
        return tf.fill([tf.cast(x, tf.int32)], x)
    return np.full(int(x), x)


def components(n: int) -> tuple[Any, ...]:
    """batch_test/take_test/skip_test's three components of ``n`` rows."""
    return (
        np.arange(n),
        np.array([[1, 2, 3]]) * np.arange(n)[:, np.newaxis],
        np.array(37.0) * np.arange(n),
    )


def square(x: Any, y: Any, z: Any) -> Any:
    return x * x, y * y, z * z


# -- batch_test.py ----------------------------------------------------------------------------
for count, size, drop, calls in itertools.product([0, 28], [14, 15], [True, False], [None, 1, 2, 4]):
    CASES[f"batch/testBasic count={count} size={size} drop={drop} calls={calls}"] = (
        lambda D, c=count, b=size, d=drop, n=calls: D.from_tensor_slices(components(7))
        .map(square).repeat(c).batch(b, d, num_parallel_calls=n)
    )
CASES["batch/testInvalidBatchSize"] = lambda D: D.range(10).batch(0)
CASES["batch/testNoneComponent"] = (
    lambda D: D.range(10).map(lambda x: (x, None)).batch(10).map(lambda x, y: x)
)
CASES["batch/testShapeError"] = lambda D: D.from_generator(
    lambda: iter([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0]]),
    output_signature=(tf if D is tf.data.Dataset else hr).TensorSpec([None], np.float32),
).batch(3)
CASES["batch/testName"] = lambda D: D.range(5).batch(5)
CASES["batch/testDataset (from_tensors inside)"] = lambda D: D.range(10).batch(5).unbatch()
for count, size, drop in itertools.product([0, 10, 50], [1, 3, 7, 20], [True, False]):
    CASES[f"batch/RandomAccess testBasic count={count} size={size} drop={drop}"] = (
        lambda D, c=count, b=size, d=drop: D.from_tensor_slices(np.arange(c, dtype=np.int32))
        .batch(b, drop_remainder=d)
    )

# -- shard_test.py ----------------------------------------------------------------------------
SHARDS = {
    "testSimpleCase": (10, 5, 2), "testOffsetZero": (10, 5, 0),
    "testOffsetGreaterNumShards": (10, 5, 7), "testNegativeOffset": (10, 5, -3),
    "testNegativeNumShards": (10, -3, 1), "testZeroNumShards": (10, 0, 1),
    "testIteratorEndsBeforeFirstElem": (1, 5, 2), "testLargerWorkerPool": (10, 7, 5),
    "testIndexEqualsNumShards": (10, 5, 4), "testIndexEqualsNumShards2": (10, 4, 3),
    "testNumShardsLargerThanDataset": (10, 20, 5),
}
for name, (n, shards, index) in SHARDS.items():
    CASES[f"shard/{name}"] = lambda D, n=n, s=shards, i=index: D.range(n).shard(s, i)
CASES["shard/testNestedData"] = (
    lambda D: D.zip((D.range(10), D.range(10, 0, -1))).shard(5, 2)
)
for elements, shards, index in itertools.product([0, 10, 50], [5, 7, 10], [0, 1, 4]):
    CASES[f"shard/testMultipleCombinations {elements} {shards} {index}"] = (
        lambda D, e=elements, s=shards, i=index: D.range(e).shard(s, i)
    )

# -- take_test.py / skip_test.py ------------------------------------------------------------
for count in [-1, 0, 4, 10, 25]:
    CASES[f"take/testTakeTensorDataset count={count}"] = (
        lambda D, c=count: D.from_tensor_slices(components(10)).take(c)
    )
    CASES[f"skip/testSkipTensorDataset count={count}"] = (
        lambda D, c=count: D.from_tensor_slices(components(10)).skip(c)
    )
CASES["take/testTakeNegative(-2)"] = lambda D: D.range(5).take(-2)
CASES["skip/testSkipNegative(-2)"] = lambda D: D.range(5).skip(-2)
CASES["take/of an infinite repeat"] = lambda D: D.range(3).repeat().take(7)

# -- repeat_test.py ---------------------------------------------------------------------------
for count in [0, 1, 3, 7]:
    CASES[f"repeat/testFiniteRepeat count={count}"] = (
        lambda D, c=count: D.from_tensors((np.array(1), np.array([1, 2, 3]), np.array(37.0))).repeat(c)
    )
CASES["repeat/testInfiniteRepeat take(10)"] = (
    lambda D: D.from_tensors((np.array(1), np.array([1, 2, 3]))).repeat().take(10)
)
CASES["repeat/testInfiniteRepeat repeat(-2)"] = lambda D: D.range(2).repeat(-2).take(5)
CASES["repeat/testRepeatRepeat"] = lambda D: D.from_tensors(np.array(1)).repeat(2).repeat(3)
CASES["repeat/testRepeatEmpty"] = lambda D: D.range(0).repeat().take(3)
CASES["repeat/of a numpy count"] = lambda D: D.range(3).repeat(np.int64(2))

# -- concatenate_test.py ----------------------------------------------------------------------
CONCAT_A = (np.tile(np.array([[1], [2], [3], [4]]), 20), np.tile(np.array([[12], [13], [14], [15]]), 15),
            np.array([37.0, 38.0, 39.0, 40.0]))
CONCAT_B = (np.tile(np.array([[1], [2], [3], [4], [5]]), 20), np.tile(np.array([[12], [13], [14], [15], [16]]), 15),
            np.array([37.0, 38.0, 39.0, 40.0, 41.0]))
CASES["concatenate/testConcatenateDataset"] = (
    lambda D: D.from_tensor_slices(CONCAT_A).concatenate(D.from_tensor_slices(CONCAT_B))
)
CASES["concatenate/testConcatenateDatasetDifferentShape"] = (
    lambda D: D.from_tensor_slices((np.tile(np.array([[1], [2], [3], [4]]), 20),))
    .concatenate(D.from_tensor_slices((np.tile(np.array([[1], [2], [3], [4]]), 15),)))
)
CASES["concatenate/testConcatenateDatasetDifferentStructure"] = (
    lambda D: D.from_tensor_slices((np.arange(4), np.arange(4))).concatenate(D.range(3))
)
CASES["concatenate/testConcatenateDatasetDifferentKeys"] = (
    lambda D: D.from_tensor_slices({"a": np.arange(3)}).concatenate(D.from_tensor_slices({"b": np.arange(3)}))
)
CASES["concatenate/testConcatenateDatasetDifferentType"] = (
    lambda D: D.from_tensor_slices(np.arange(3)).concatenate(D.from_tensor_slices(np.arange(3.0)))
)
CASES["concatenate/empty first"] = lambda D: D.range(0).concatenate(D.range(3))

# -- zip_test.py -----------------------------------------------------------------------------
CASES["zip/testZipEqual"] = lambda D: D.zip((D.range(4), D.from_tensor_slices(np.arange(4.0) * 2)))
CASES["zip/testZipUnequal"] = lambda D: D.zip((D.range(7), D.range(3), D.range(5)))
CASES["zip/testNested"] = lambda D: D.zip((D.range(3), (D.range(3, 6), D.range(6, 9))))
CASES["zip/testDict"] = lambda D: D.zip({"a": D.range(3), "b": D.from_tensor_slices([b"x", b"y", b"z"])})
CASES["zip/testZipEmpty"] = lambda D: D.zip((D.range(0), D.range(3)))

# -- enumerate_test.py -----------------------------------------------------------------------
CASES["enumerate/testEnumerate"] = lambda D: D.from_tensor_slices(
    ([b"a", b"b"], [1, 2], [37.0, 38.0])
).enumerate(20)
CASES["enumerate/numpy start"] = lambda D: D.range(3).enumerate(np.int64(20))
CASES["enumerate/default start"] = lambda D: D.range(5, 8).enumerate()

# -- filter_test.py --------------------------------------------------------------------------
for count, modulus in [(14, 2), (4, 18), (0, 1), (7, 3)]:
    CASES[f"filter/testFilterDataset count={count} modulus={modulus}"] = (
        lambda D, c=count, m=modulus: D.from_tensor_slices(components(7)).map(square).repeat(c)
        .filter(lambda x, _y, _z: x % m == 0)
    )
CASES["filter/testFilterDict"] = lambda D: D.range(10).map(lambda x: {"foo": x * 2, "bar": x * x}).filter(
    lambda d: d["bar"] % 2 == 0
)
CASES["filter/testUseStepContainerInFilter"] = lambda D: D.range(10).filter(lambda x: x < 5)

# -- flat_map_test.py ------------------------------------------------------------------------
REPEATS = [1, 2, 3, 4, 5, 0, 1]
CASES["flat_map/testFlatMapDataset"] = lambda D: D.from_tensor_slices(np.array(REPEATS, np.int64)).flat_map(
    lambda x: D.from_tensors([x]).repeat(x)
)
CASES["flat_map/testNestedFlatMapDataset"] = lambda D: D.from_tensor_slices(
    np.array([[1, 2], [3, 4]], np.int64)
).flat_map(lambda row: D.from_tensor_slices(row).flat_map(lambda x: D.from_tensors(x).repeat(x)))
CASES["flat_map/of zip"] = lambda D: D.range(3).flat_map(lambda x: D.zip((D.range(x), D.range(x).map(lambda y: y * 10))))

# -- padded_batch_test.py --------------------------------------------------------------------
SEQ_LENS = np.array([3, 0, 5, 1, 7, 2, 4, 4, 6, 1, 0, 9], np.int32)
for size, shape, drop in itertools.product([4, 5], [None, 12], [False, True]):
    CASES[f"padded_batch/testPaddedBatchDataset size={size} shape={shape} drop={drop}"] = (
        lambda D, b=size, s=shape, d=drop: D.from_tensor_slices(SEQ_LENS)
        .map(lambda x: fill(D, x)).padded_batch(b, padded_shapes=[s], drop_remainder=d)
    )
CASES["padded_batch/testPaddedBatchShortPadding"] = lambda D: D.from_tensor_slices(SEQ_LENS).map(
    lambda x: fill(D, x)
).padded_batch(4, padded_shapes=[5])
CASES["padded_batch/testPaddedBatchEmptyTensors"] = lambda D: D.from_tensor_slices(
    np.zeros(6, np.int32)
).map(lambda x: fill(D, x)).padded_batch(4, padded_shapes=[None])
CASES["padded_batch/padding_values"] = lambda D: D.from_tensor_slices(SEQ_LENS[:6]).map(
    lambda x: fill(D, x)
).padded_batch(3, padded_shapes=[None], padding_values=np.int32(-1))
CASES["padded_batch/testPaddedBatchDatasetNonDefaultPadding strings"] = lambda D: D.from_tensor_slices(
    np.array([b"a", b"bb", b"ccc"], dtype=object)
).map(lambda x: (x, x)).padded_batch(2, padded_shapes=([], []))
CASES["padded_batch/tuple of shapes"] = lambda D: D.from_tensor_slices(SEQ_LENS[:5]).map(
    lambda x: (fill(D, x), x)
).padded_batch(2, padded_shapes=([None], []))

def as_string(D: Any, x: Any) -> Any:
    """tf.strings.as_string (string_ops.as_string) in the library of ``D``."""
    if D is tf.data.Dataset:
        return tf.strings.as_string(x)
    return np.array([str(v).encode() for v in np.asarray(x).ravel()], dtype=object).reshape(
        np.shape(x))


def fill_tuple(D: Any, x: Any) -> Any:
    """testPaddedBatchDatasetNonDefaultPadding's element: a vector, its strings, a dict."""
    filled = fill(D, x)
    return (filled, as_string(D, filled), {"structure": as_string(D, filled)})


def spec(D: Any, shape: Any, dtype: Any) -> Any:
    """A TensorSpec of the library of ``D`` (TensorFlow's dtypes serve both)."""
    return (tf.TensorSpec if D is tf.data.Dataset else hr.TensorSpec)(shape, dtype)


NON_DEFAULT_PADDING = {"(-1, '<end>', {'structure': ''})": (-1, "<end>", {"structure": ""}),
                       "(-1, '<end>', None)": (-1, "<end>", None)}
for label, values in NON_DEFAULT_PADDING.items():
    CASES[f"padded_batch/testPaddedBatchDatasetNonDefaultPadding {label}"] = (
        lambda D, v=values: D.from_tensor_slices(SEQ_LENS).map(lambda x: fill_tuple(D, x))
        .padded_batch(4, padded_shapes=([-1], [-1], {"structure": [-1]}), padding_values=v)
    )


def unicode_generator() -> Any:
    data = [["Простой", "тест", "юникода"], ["никогда", "не", "бывает", "простым"]]
    for seq in data:
        yield seq, [0, 1, 2, 3]


CASES["padded_batch/testPaddedBatchDatasetUnicode"] = lambda D: D.from_generator(
    unicode_generator, (tf.string, tf.int32), ([None], [None])
).padded_batch(2, padded_shapes=([None], [None]), padding_values=("", 0))
CASES["padded_batch/testDefaultPaddedValueShapes"] = lambda D: D.zip((
    D.from_tensor_slices(np.array([1, 2, 3, 4], np.int32)).map(lambda x: fill(D, x)),
    D.from_tensor_slices(np.array([1, 2, 3, 4], np.int32)).map(lambda x: fill(D, x)),
)).padded_batch(2, padding_values=np.int32(-1))

# -- map_test.py / scan_test.py: a list a function returns is a tuple of components ---------
CASES["map/list return batches as columns"] = lambda D: D.range(5).map(
    lambda i: [i, i * 10]).batch(2)
CASES["map/list return unpacked by the next map"] = lambda D: D.range(4).map(
    lambda i: [i, i * 10]).map(lambda a, b: a + b)
CASES["map/one-item list return"] = lambda D: D.range(3).map(lambda i: [i])
CASES["map/nested list is one component"] = lambda D: D.range(4).map(
    lambda i: (i, [i, i * 10])).batch(3)
CASES["map/list of lists"] = lambda D: D.range(3).map(lambda i: [[i, i], [i, i + 1]])
CASES["map/dict of a list"] = lambda D: D.range(3).map(lambda i: {"a": [i, i]})
CASES["map/list return, parallel"] = lambda D: D.range(20).map(
    lambda i: [i, i * 2], num_parallel_calls=4).batch(8)
CASES["scan/list return"] = lambda D: D.range(4).scan(
    np.int64(0), lambda s, x: [s + x, [s, x]])
CASES["flat_map/list element"] = lambda D: D.range(3).flat_map(
    lambda i: D.from_tensors([i, i]))

# -- from_generator_test.py ------------------------------------------------------------------


def rows_generator() -> Any:
    yield np.ones(2), 1
    yield np.ones(2) * 2, 2
    yield np.ones(3), 3


CASES["from_generator/output_types without shapes"] = lambda D: D.from_generator(
    rows_generator, output_types=(tf.float32, tf.int32))
CASES["from_generator/output_types, batch of equal shapes"] = lambda D: D.from_generator(
    rows_generator, output_types=(tf.float32, tf.int32)).take(2).batch(2)
CASES["from_generator/output_types, batch of unequal shapes (error)"] = (
    lambda D: D.from_generator(rows_generator, output_types=(tf.float32, tf.int32)).batch(3))
CASES["from_generator/nested sequences for vector specs"] = lambda D: D.from_generator(
    lambda: iter([([1.0, 2.5], (1, 2)), ((3.0,), [4])]),
    output_signature=(spec(D, (None,), tf.float32), spec(D, (None,), tf.int32)))
CASES["from_generator/list of floats for a vector spec"] = lambda D: D.from_generator(
    lambda: iter([[1.0, 2.0], [3.0]]), output_signature=spec(D, (None,), tf.float32)
).padded_batch(2)
CASES["from_generator/list for a tuple signature (error)"] = lambda D: D.from_generator(
    lambda: iter([[1.0, 2]]),
    output_signature=(spec(D, (), tf.float32), spec(D, (), tf.int32)))
CASES["from_generator/dict of sequences"] = lambda D: D.from_generator(
    lambda: iter([{"a": [1, 2], "b": (0.5,)}]),
    output_signature={"a": spec(D, (2,), tf.int64), "b": spec(D, (None,), tf.float64)})


# -- unbatch_test.py -------------------------------------------------------------------------
CASES["unbatch/testUnbatchScalarDataset"] = lambda D: D.from_tensor_slices(
    (np.arange(10), np.arange(10.0), np.arange(10, dtype=np.int32))
).batch(3).unbatch()
CASES["unbatch/testUnbatchNestedDataset"] = lambda D: D.from_tensor_slices(
    {"a": np.arange(10), "b": (np.arange(10.0), np.arange(10, dtype=np.int32))}
).batch(4).unbatch()
CASES["unbatch/testUnbatchDatasetWithStrings"] = lambda D: D.from_tensor_slices(
    (np.arange(5), np.array([b"a", b"b", b"c", b"d", b"e"], dtype=object))
).batch(2).unbatch()
CASES["unbatch/testUnbatchEmpty"] = lambda D: D.from_tensors(
    (np.zeros((0,), np.int32), np.zeros((0, 4), np.int64))
).unbatch()
CASES["unbatch/testUnbatchMultiElementTupleDataset"] = lambda D: D.from_tensors(
    (np.arange(12).reshape(3, 4), np.arange(3.0))
).repeat(2).unbatch()
CASES["unbatch/testUnbatchStaticShapeMismatch"] = lambda D: D.from_tensors(
    (np.arange(8), np.arange(9))
).unbatch()
CASES["unbatch/testUnbatchScalar (error)"] = lambda D: D.from_tensors(np.int64(1)).unbatch()

# -- rebatch_test.py -------------------------------------------------------------------------
REBATCH = {
    "testBasic": (8, 4, True, [2, 1, 1], False),
    "testScalarBatchSizeInput": (8, 4, False, 2, False),
    "testEmptyFirstSplits": (8, 4, False, [0, 1], False),
    "testEmptyLastSplits": (8, 4, False, [1, 0], False),
    "testEmptyMiddleSplits": (8, 4, False, [1, 0, 1], False),
    "testDropRemainder": (8, 4, False, [3], True),
    "testPartialBatch": (5, 2, False, [2, 1], False),
    "testPartialBatchDropRemainder": (5, 2, False, [2, 1], True),
    "testMultipleBatches": (16, 2, False, [3, 1], False),
    "testRebatchOfEmpty": (0, 4, False, [0, 2], False),
}
for name, (n, size, drop_in, sizes, drop) in REBATCH.items():
    CASES[f"rebatch/{name}"] = (
        lambda D, n=n, b=size, di=drop_in, s=sizes, d=drop: D.range(n).batch(b, di).rebatch(s, d)
    )
CASES["rebatch/testEmptyBatchSizes"] = lambda D: D.range(8).batch(4).rebatch([])
CASES["rebatch/testNoBatch (scalar input)"] = lambda D: D.range(8).rebatch(2)
CASES["rebatch/testNestedDictionaryOutput"] = lambda D: D.range(8).map(
    lambda x: {"a": x, "b": {"c": x + 1}}
).batch(4).rebatch([1, 3])

# -- prefetch_test.py ------------------------------------------------------------------------
for buffer_size in [-1, None, 0, 1, 5, 42]:
    CASES[f"prefetch/testBufferSize {buffer_size}"] = lambda D, b=buffer_size: D.range(10).prefetch(b)
CASES["prefetch/testInvalidBufferSize -2"] = lambda D: D.range(10).prefetch(-2)

# -- from_tensor_slices_test.py / from_tensors_test.py -----------------------------------------
CASES["from_tensor_slices/testFromTensorSlices"] = lambda D: D.from_tensor_slices(components(4))
CASES["from_tensor_slices/testFromTensorSlicesDict"] = lambda D: D.from_tensor_slices(
    {"foo": [1.0, 2.0, 3.0], "bar": [[4.0], [5.0], [6.0]]}
)
CASES["from_tensor_slices/testFromTensorSlicesMixed strings"] = lambda D: D.from_tensor_slices(
    ([b"a", b"b"], ["c", "d"], [1, 2])
)
CASES["from_tensor_slices/testFromTensorSlicesEmptyComponent"] = lambda D: D.from_tensor_slices(
    np.zeros((0, 3), np.float32)
)
CASES["from_tensor_slices/testFromTensorSlicesMismatched"] = lambda D: D.from_tensor_slices(
    (np.arange(3), np.arange(4))
)
CASES["from_tensor_slices/testFromTensorSlicesScalar"] = lambda D: D.from_tensor_slices(np.int64(3))
CASES["from_tensors/testFromTensors"] = lambda D: D.from_tensors(components(2))
CASES["from_tensors/testFromTensorsDictAndStrings"] = lambda D: D.from_tensors(
    {"a": np.arange(3), "b": b"bytes", "c": "str"}
)

# -- cache_test.py ---------------------------------------------------------------------------
CASES["cache/testCacheMemory twice"] = lambda D: D.range(5).cache().repeat(2)
CASES["cache/testCacheTake"] = lambda D: D.range(10).cache().take(4).repeat(2)

# -- cardinality_test.py (as elements: the lengths are compared below) -------------------------
CARDINALITY: dict[str, Build] = {
    "range": lambda D: D.range(10),
    "batch": lambda D: D.range(10).batch(3),
    "batch drop": lambda D: D.range(10).batch(3, drop_remainder=True),
    "filter": lambda D: D.range(10).filter(lambda x: x > 3),
    "repeat()": lambda D: D.range(10).repeat(),
    "repeat(0)": lambda D: D.range(10).repeat(0),
    "repeat of empty": lambda D: D.range(0).repeat(),
    "take of repeat": lambda D: D.range(10).repeat().take(5),
    "skip of repeat": lambda D: D.range(10).repeat().skip(5),
    "skip past the end": lambda D: D.range(10).skip(15),
    "skip(-1)": lambda D: D.range(10).skip(-1),
    "skip(-1) of an infinite input": lambda D: D.range(10).repeat().skip(-1),
    "skip(-1) of a filter": lambda D: D.range(10).filter(lambda x: x > 3).skip(-1),
    "shard": lambda D: D.range(10).shard(3, 1),
    "concatenate": lambda D: D.range(3).concatenate(D.range(4)),
    "concatenate infinite": lambda D: D.range(3).repeat().concatenate(D.range(4)),
    "zip": lambda D: D.zip((D.range(3), D.range(5))),
    "zip with filter": lambda D: D.zip((D.range(3), D.range(5).filter(lambda x: x > 1))),
    "zip with infinite": lambda D: D.zip((D.range(3), D.range(5).repeat())),
    "flat_map": lambda D: D.range(3).flat_map(lambda x: D.range(x)),
    "interleave of infinite": lambda D: D.range(5).repeat().interleave(
        lambda x: D.range(x), cycle_length=2
    ),
    "enumerate": lambda D: D.range(4).enumerate(),
    "prefetch": lambda D: D.range(4).prefetch(1),
    "map": lambda D: D.range(4).map(lambda x: x),
    "padded_batch": lambda D: D.range(10).padded_batch(4),
    "unbatch": lambda D: D.range(10).batch(2).unbatch(),
    "rebatch": lambda D: D.range(10).batch(2, drop_remainder=True).rebatch(4),
    "cache": lambda D: D.range(7).cache(),
    "from_tensors": lambda D: D.from_tensors(np.arange(3)),
}



#: Cases where headrace deliberately differs (README, "Differences from tf.data"):
#: Python ints and floats become NumPy's int64 and float64; tf.data picks int32 and
#: float32 for Python lists. The values and shapes are the same.
PYTHON_NUMBER_DTYPES = {
    "enumerate/testEnumerate",
    "from_tensor_slices/testFromTensorSlicesDict",
    "from_tensor_slices/testFromTensorSlicesMixed strings",
}


@functools.cache
def tf_outcome(case: str) -> Any:
    """What tf.data gives for ``case`` (computed once for both libraries' tests)."""
    return outcome(CASES[case], tf.data.Dataset)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_case_matches_tf(case: str) -> None:
    build = CASES[case]
    expected = tf_outcome(case)
    got = outcome(build, hr.Dataset)
    if isinstance(expected, tuple) or isinstance(got, tuple):  # an error: both must raise
        assert isinstance(expected, tuple) and isinstance(got, tuple), (expected, got)
        return
    if case in PYTHON_NUMBER_DTYPES:  # documented: only the dtypes differ
        assert got != expected and without_dtypes(got) == without_dtypes(expected)
        return
    assert got == expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_case_through_tf_compat_matches_tf(case: str) -> None:
    """The same recipes through ``headrace.tf_compat``: Python numbers take TensorFlow's
    dtypes there, so even the cases where headrace's own API differs must agree."""
    expected = tf_outcome(case)
    got = outcome(CASES[case], tf_compat.data.Dataset)
    if isinstance(expected, tuple) or isinstance(got, tuple):
        assert isinstance(expected, tuple) and isinstance(got, tuple), (expected, got)
        return
    assert got == expected


@pytest.mark.parametrize(
    ("local", "global_"), list(itertools.product([None, True, False], [True, False])))
def test_map_determinism_configuration(local: bool | None, global_: bool) -> None:
    """map_test.testDeterminismConfiguration: the first of 1000 elements sleeps; the order
    is kept unless ``deterministic=False``, or it is None and the pipeline's
    ``Options().deterministic`` is False (then the straggler is overtaken, as in tf.data)."""
    expect_determinism = local or (local is None and global_)
    elements = list(range(1000))

    def build(D: Any, delay_ms: int) -> Any:
        def map_function(x: Any) -> Any:
            if D is tf.data.Dataset:
                def sleep(v: Any) -> Any:
                    time.sleep(delay_ms / 1000)
                    return v
                return tf.cond(tf.equal(x, 0), lambda: tf.py_function(sleep, [x], x.dtype),
                               lambda: x)
            if x == 0:
                time.sleep(delay_ms / 1000)
            return x

        options = (tf.data.Options if D is tf.data.Dataset else hr.Options)()
        options.deterministic = global_
        return D.from_tensor_slices(np.array(elements)).map(
            map_function, num_parallel_calls=2, deterministic=local).with_options(options)

    for D in (tf.data.Dataset, hr.Dataset):
        actual = [int(x) for x in build(D, 100)]
        assert sorted(actual) == elements
        assert (actual == elements) == bool(expect_determinism), (D, actual[:5])


def test_rebatch_negative_size_is_refused() -> None:
    """rebatch_test.testNegativeBatchSize: tf.data 2.21 crashes the process here."""
    with pytest.raises(hr.InvalidArgumentError, match="rebatch: batch_size"):
        hr.Dataset.range(8).batch(4).rebatch([-1])


@pytest.mark.parametrize("case", sorted(CARDINALITY))
def test_kernel_cardinality_matches_tf(case: str) -> None:
    build = CARDINALITY[case]
    expected = int(build(tf.data.Dataset).cardinality())
    assert build(hr.Dataset).cardinality() == expected


def test_the_port_has_the_size_reported() -> None:
    """How many cases were carried over (the report and the README quote this)."""
    assert (len(CASES), len(CARDINALITY)) == (215, 29)
