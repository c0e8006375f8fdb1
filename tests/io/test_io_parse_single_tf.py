"""parse_single_example, SparseFeature, parse_sequence_example and decode_raw against
TensorFlow itself, on generated records."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from io_format_strategies import VALUE_STRATEGY, conforming_example, headrace_spec, specs
from tf_specs import TF_DTYPE, tf_spec

from headrace._errors import HeadraceError, InvalidArgumentError, ParseError
from headrace.io import example as hx
from headrace.io.raw import decode_raw

pytestmark = pytest.mark.tf

SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def tf_message(error: Exception) -> str:
    text = str(error).split("\n")[0]
    return text.split("}} ", 1)[-1].split(" [Op:")[0]


def same(ours: Any, theirs: Any) -> None:
    if isinstance(theirs, tf.SparseTensor):
        if isinstance(ours, hx.SparseColumn):
            indices, values, shape = ours.indices, ours.values, ours.dense_shape
        elif isinstance(ours, hx.RaggedColumn):
            indices, values, shape = ours.to_sparse()
        else:  # a VarLen feature of one record: its values at 0..n-1
            values = ours
            indices = np.arange(len(ours), dtype=np.int64)[:, None]
            shape = np.array([len(ours)])
        np.testing.assert_array_equal(indices, theirs.indices.numpy().reshape(indices.shape))
        np.testing.assert_array_equal(shape, theirs.dense_shape.numpy())
        same(values, theirs.values)
    elif isinstance(theirs, tf.RaggedTensor):
        assert ours.to_list() == theirs.to_list()
    else:
        expected = np.asarray(theirs.numpy(), dtype=object if theirs.dtype == tf.string else None)
        assert np.shape(ours) == expected.shape
        if theirs.dtype == tf.string:
            assert all(type(item) is bytes for item in np.asarray(ours, dtype=object).reshape(-1))
        else:
            assert np.asarray(ours).dtype == expected.dtype
        np.testing.assert_array_equal(ours, expected)


@SETTINGS
@given(st.data())
def test_parse_single_example_matches_tensorflow(data: st.DataObject) -> None:
    spec_args = data.draw(specs())
    record = hx.serialize_example(data.draw(conforming_example(spec_args)))
    theirs_spec = {name: tf_spec(*args) for name, args in spec_args.items()}
    ours_spec = {name: headrace_spec(*args) for name, args in spec_args.items()}
    try:
        expected = tf.io.parse_single_example(record, theirs_spec)
    except (tf.errors.InvalidArgumentError, ValueError) as error:
        event("TensorFlow refused the record")
        with pytest.raises(ParseError) as ours_error:
            hx.parse_single_example(record, ours_spec)
        if len(spec_args) == 1:  # one feature, one fault: the same words
            assert ours_error.value.args[0].split(" (")[0] in tf_message(error) or (
                "Can't parse serialized Example" in tf_message(error)
            ), (str(ours_error.value), tf_message(error))
        return
    event("TensorFlow parsed the record")
    ours = hx.parse_single_example(record, ours_spec)
    assert set(ours) == set(expected)
    for name in expected:
        same(ours[name], expected[name])


# TensorFlow's single-record wording for a wrong count is "Can't parse serialized
# Example"; headrace uses its batched path's wording, which names the sizes.
ERRORS = [
    ({"b": ("float_list", [1.0])}, ("fixed", "float_list", (), None),
     "Feature: a (data type: float) is required but could not be found."),
    ({"a": ("int64_list", [1])}, ("fixed", "float_list", (), None),
     "Key: a.  Data types don't match. Data type: int64 but expected type: float"),
    ({"a": ("int64_list", [1])}, ("varlen", "float_list", (), None),
     "Key: a.  Data types don't match. Expected type: float, Actual type: int64"),
    ({"a": ("float_list", [1.0, 2.0])}, ("fixed", "float_list", (3,), None),
     "Key: a.  Number of float values != expected.  Values size: 2 but output shape: [3]"),
]


@pytest.mark.parametrize(("features", "args", "message"), ERRORS)
def test_error_messages_are_tensorflows(features: Any, args: Any, message: str) -> None:
    record = hx.serialize_example(features)
    with pytest.raises(tf.errors.InvalidArgumentError) as theirs:
        tf.io.parse_example([record], {"a": tf_spec(*args)})
    assert message.split("Values size")[0].split(".  ")[-1] in tf_message(theirs.value)
    with pytest.raises(ParseError) as ours:
        hx.parse_single_example(record, {"a": headrace_spec(*args)})
    assert str(ours.value) == message
    with pytest.raises(ParseError, match=r"^Name: rec7, "):
        hx.parse_single_example(record, {"a": headrace_spec(*args)}, example_names=["rec7"])


def test_malformed_record_names_the_byte() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError, match="Could not parse example input"):
        tf.io.parse_single_example(b"garbage!", {"a": tf.io.VarLenFeature(tf.float32)})
    with pytest.raises(ParseError, match=r"^Could not parse example input, value: b'garbage!' "
                                         r"\(truncated or malformed protobuf at byte 0 of 8\)"):
        hx.parse_single_example(b"garbage!", {"a": hx.VarLenFeature(np.float32)})
    with pytest.raises(InvalidArgumentError, match="one serialized record"):
        hx.parse_single_example([b""], {"a": hx.VarLenFeature(np.float32)})


@st.composite
def sparse_records(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    size = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    kind = draw(st.sampled_from(["float_list", "int64_list", "bytes_list"]))
    records = []
    for _ in range(draw(st.integers(1, 4))):
        count = draw(st.integers(0, 4))
        features: dict[str, Any] = {
            "v": (kind, draw(st.lists(VALUE_STRATEGY[kind], min_size=count, max_size=count)))}
        for axis, extent in enumerate(size):
            if count or draw(st.booleans()):
                features[f"i{axis}"] = ("int64_list", draw(
                    st.lists(st.integers(0, extent - 1), min_size=count, max_size=count)))
        records.append(hx.serialize_example(features))
    return records, [kind == "float_list", kind == "int64_list", *size]


@SETTINGS
@given(sparse_records(), st.booleans())
def test_sparse_feature_matches_tensorflow(
    batch: tuple[list[bytes], list[Any]], already_sorted: bool
) -> None:
    records, (is_float, is_int, *size) = batch
    dtype = np.float32 if is_float else np.int64 if is_int else bytes
    tf_dtype = tf.float32 if is_float else tf.int64 if is_int else tf.string
    keys = [f"i{axis}" for axis in range(len(size))]
    index_key: Any = keys[0] if len(keys) == 1 else keys
    size_arg: Any = size[0] if len(size) == 1 else size
    theirs = tf.io.parse_example(records, {"s": tf.io.SparseFeature(
        index_key, "v", tf_dtype, size_arg, already_sorted=already_sorted)})["s"]
    ours = hx.parse_example(records, {"s": hx.SparseFeature(
        index_key, "v", dtype, size_arg, already_sorted=already_sorted)})["s"]
    same(ours, theirs)
    try:
        dense = tf.sparse.to_dense(theirs).numpy()
    except tf.errors.InvalidArgumentError as error:  # an index named twice (or, already
        # sorted but not in order, which TensorFlow refuses and headrace need not)
        if "is repeated" in tf_message(error):
            with pytest.raises(InvalidArgumentError) as ours_error:
                ours.to_dense()
            if not already_sorted:
                assert str(ours_error.value) == tf_message(error)
    else:
        np.testing.assert_array_equal(ours.to_dense(), dense)
    for row, record in enumerate(records):
        single = tf.io.parse_single_example(record, {"s": tf.io.SparseFeature(
            index_key, "v", tf_dtype, size_arg, already_sorted=already_sorted)})["s"]
        same(hx.parse_single_example(record, {"s": hx.SparseFeature(
            index_key, "v", dtype, size_arg, already_sorted=already_sorted)})["s"], single)
        assert ours[row].indices.shape[1] == len(size)


def test_sparse_feature_with_unequal_counts_is_refused_on_both() -> None:
    record = hx.serialize_example({"ix": [1, 2], "v": [1.0]})
    with pytest.raises(ValueError):
        tf.io.parse_single_example(record, {"s": tf.io.SparseFeature("ix", "v", tf.float32, 5)})
    with pytest.raises(ParseError, match="index feature 'ix' has 2 values but value feature 'v'"):
        hx.parse_single_example(record, {"s": hx.SparseFeature("ix", "v", np.float32, 5)})


@st.composite
def sequence_batches(draw: st.DrawFn) -> tuple[list[bytes], dict[str, Any]]:
    kinds = {"s": draw(st.sampled_from(["float_list", "int64_list", "bytes_list"])),
             "v": draw(st.sampled_from(["float_list", "int64_list"]))}
    width = draw(st.integers(1, 2))
    records = []
    for _ in range(draw(st.integers(1, 3))):
        lists: dict[str, Any] = {}
        if draw(st.booleans()):
            lists["s"] = [(kinds["s"], draw(st.lists(VALUE_STRATEGY[kinds["s"]], min_size=width,
                                                       max_size=width)))
                          for _ in range(draw(st.integers(0, 3)))]
        lists["v"] = [(kinds["v"], draw(st.lists(VALUE_STRATEGY[kinds["v"]], max_size=3)))
                      for _ in range(draw(st.integers(0, 3)))]
        context = {"c": ("int64_list", [draw(st.integers(-5, 5))])}
        records.append(hx.serialize_sequence_example(context, lists))
    return records, {"kinds": kinds, "width": width}


@SETTINGS
@given(sequence_batches())
def test_parse_sequence_example_matches_tensorflow(batch: tuple[list[bytes], Any]) -> None:
    records, info = batch
    kinds, width = info["kinds"], info["width"]
    dtypes = {"float_list": np.float32, "int64_list": np.int64, "bytes_list": bytes}
    theirs = tf.io.parse_sequence_example(
        records, context_features={"c": tf.io.FixedLenFeature([], tf.int64)},
        sequence_features={
            "s": tf.io.FixedLenSequenceFeature([width], TF_DTYPE[kinds["s"]], allow_missing=True),
            "v": tf.io.VarLenFeature(TF_DTYPE[kinds["v"]]),
        })
    ours = hx.parse_sequence_example(
        records, {"c": hx.FixedLenFeature([], np.int64)},
        {"s": hx.FixedLenSequenceFeature([width], dtypes[kinds["s"]], allow_missing=True),
         "v": hx.VarLenFeature(dtypes[kinds["v"]])})
    same(ours[0]["c"], theirs[0]["c"])
    for name in ("s", "v"):
        same(ours[1][name], theirs[1][name])
    same(ours[2]["s"], theirs[2]["s"])
    ragged_theirs = tf.io.parse_sequence_example(
        records, sequence_features={"v": tf.io.RaggedFeature(TF_DTYPE[kinds["v"]])})[1]["v"]
    ragged_ours = hx.parse_sequence_example(
        records, sequence_features={"v": hx.RaggedFeature(dtypes[kinds["v"]])})[1]["v"]
    assert ragged_ours.to_list() == ragged_theirs.to_list()
    for record in records:
        single_theirs = tf.io.parse_single_sequence_example(
            record, sequence_features={"v": tf.io.RaggedFeature(TF_DTYPE[kinds["v"]])})[1]["v"]
        single_ours = hx.parse_single_sequence_example(
            record, sequence_features={"v": hx.RaggedFeature(dtypes[kinds["v"]])})[1]["v"]
        assert single_ours.to_list() == single_theirs.to_list()


def test_sequence_errors_are_tensorflows() -> None:
    record = hx.serialize_sequence_example({}, {"s": [np.array([1.0, 2.0], np.float32)] * 2})
    cases = [
        ({"x": (tf.io.FixedLenSequenceFeature([1], tf.float32),
                hx.FixedLenSequenceFeature([1], np.float32))},
         "Feature list 'x' is required but could not be found"),
        ({"s": (tf.io.FixedLenSequenceFeature([3], tf.float32),
                hx.FixedLenSequenceFeature([3], np.float32))},
         "Feature list 's' has an unexpected number of values.  Total values size: 4 is not "
         "consistent with output shape: [?,3]"),
        ({"s": (tf.io.VarLenFeature(tf.int64), hx.VarLenFeature(np.int64))},
         "Feature list: s, Index: 0.  Data types don't match. Expected type: int64"),
    ]
    for specs_pair, message in cases:
        with pytest.raises(tf.errors.InvalidArgumentError) as theirs:
            tf.io.parse_sequence_example(
                [record], sequence_features={k: v[0] for k, v in specs_pair.items()})
        assert message in tf_message(theirs.value)
        with pytest.raises(HeadraceError) as ours:
            hx.parse_sequence_example(
                [record], sequence_features={k: v[1] for k, v in specs_pair.items()})
        assert message in str(ours.value)


DTYPES = [np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(0, 3), st.integers(0, 4), st.booleans(),
       st.data())
def test_decode_raw_matches_tensorflow(
    dtype: Any, count: int, items: int, little: bool, data: st.DataObject
) -> None:
    size = np.dtype(dtype).itemsize
    lengths = data.draw(st.sampled_from(["same", "ragged", "odd"]))
    strings = []
    for _ in range(items):
        length = count * size + (1 if lengths == "odd" else 0)
        if lengths == "ragged":
            length = data.draw(st.integers(0, 3)) * size
        strings.append(data.draw(st.binary(min_size=length, max_size=length)))
    # TensorFlow has no float16 kernel for fixed_length
    fixed = None if dtype == np.float16 else data.draw(
        st.sampled_from([None, size * 2, size * 2 + 1]))
    try:
        expected = tf.io.decode_raw(strings, tf.as_dtype(dtype), little_endian=little,
                                    fixed_length=fixed).numpy()
    except tf.errors.InvalidArgumentError as error:
        with pytest.raises(InvalidArgumentError) as ours:
            decode_raw(strings, dtype, little_endian=little, fixed_length=fixed)
        assert str(ours.value) == tf_message(error)
        return
    ours_array = decode_raw(strings, dtype, little_endian=little, fixed_length=fixed)
    assert ours_array.shape == expected.shape and ours_array.dtype == expected.dtype
    np.testing.assert_array_equal(ours_array, expected)


@pytest.mark.parametrize("kind", ["fixed", "sequence", "varlen"])
@pytest.mark.parametrize("values", [[], [1.0], [1.0, 2.0]])
def test_a_type_mismatch_is_worded_as_tensorflow_words_it(kind: str, values: list[float]) -> None:
    """Dense features (FixedLen and FixedLenSequence) say "Data type: X but expected type:
    Y"; sparse ones "Expected type: Y, Actual type: X" (hypothesis found the sequence
    case worded as a sparse one)."""
    ours, theirs = {
        "fixed": (hx.FixedLenFeature((), np.int64), tf.io.FixedLenFeature([], tf.int64)),
        "sequence": (
            hx.FixedLenSequenceFeature((), np.int64, allow_missing=True),
            tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True),
        ),
        "varlen": (hx.VarLenFeature(np.int64), tf.io.VarLenFeature(tf.int64)),
    }[kind]
    record = hx.serialize_example({"a": np.asarray(values, np.float32)})
    with pytest.raises(tf.errors.InvalidArgumentError) as expected:
        tf.io.parse_single_example(record, {"a": theirs})
    with pytest.raises(ParseError) as got:
        hx.parse_single_example(record, {"a": ours})
    message = str(expected.value)
    wanted = message[message.index("Key:") : message.index(" [Op")]
    assert wanted in str(got.value)
