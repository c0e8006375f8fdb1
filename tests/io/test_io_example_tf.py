"""Examples are byte- and value-compatible with TensorFlow's protos and parse_example."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from io_format_strategies import batches_and_specs, examples, headrace_spec
from tf_specs import tf_spec

from headrace._errors import HeadraceError
from headrace.io import example as hx

pytestmark = pytest.mark.tf



def tf_example(features: dict[str, tuple[str, list[Any]]]) -> tf.train.Example:
    feature = {}
    for name, (kind, values) in features.items():
        list_type = {
            "float_list": tf.train.FloatList,
            "int64_list": tf.train.Int64List,
            "bytes_list": tf.train.BytesList,
        }[kind]
        feature[name] = tf.train.Feature(**{kind: list_type(value=values)})
    return tf.train.Example(features=tf.train.Features(feature=feature))


def assert_same_dense(ours: Any, theirs: tf.Tensor) -> None:
    expected = theirs.numpy()
    assert isinstance(ours, np.ndarray)
    assert ours.shape == expected.shape
    if theirs.dtype == tf.string:
        assert ours.dtype == object
        assert all(type(item) is bytes for item in ours.reshape(-1))
    else:
        assert ours.dtype == expected.dtype
    np.testing.assert_array_equal(ours, expected)


def assert_same_output(ours: Any, theirs: Any) -> None:
    if isinstance(theirs, tf.SparseTensor):
        indices, values, dense_shape = ours.to_sparse()
        np.testing.assert_array_equal(indices, theirs.indices.numpy())
        np.testing.assert_array_equal(dense_shape, theirs.dense_shape.numpy())
        assert_same_dense(values, theirs.values)
    elif isinstance(theirs, tf.RaggedTensor):
        assert ours.row_splits.dtype == theirs.row_splits.dtype.as_numpy_dtype
        np.testing.assert_array_equal(ours.row_splits, theirs.row_splits.numpy())
        assert_same_dense(ours.values, theirs.values)
    else:
        assert_same_dense(ours, theirs)


@settings(max_examples=150, deadline=None)
@given(examples)
def test_serialization_is_byte_identical_to_deterministic_tensorflow(
    features: dict[str, tuple[str, list[Any]]],
) -> None:
    expected = tf_example(features).SerializeToString(deterministic=True)
    assert hx.serialize_example(features) == expected


@settings(max_examples=150, deadline=None)
@given(examples)
def test_decodes_tensorflow_default_serialization(
    features: dict[str, tuple[str, list[Any]]],
) -> None:
    decoded = hx.decode_example(tf_example(features).SerializeToString())
    assert set(decoded) == set(features)
    for name, (kind, values) in features.items():
        assert decoded[name][0] == kind
        expected = np.asarray(values, dtype=np.float32) if kind == "float_list" else values
        assert decoded[name][1].tolist() == list(expected)


@settings(max_examples=100, deadline=None)
@given(examples)
def test_tensorflow_parses_headrace_examples(features: dict[str, tuple[str, list[Any]]]) -> None:
    parsed = tf.train.Example.FromString(hx.serialize_example(features))
    assert parsed == tf_example(features)


def test_numpy_and_python_values_match_tensorflow() -> None:
    features = {
        "x": np.arange(6, dtype=np.float64).reshape(2, 3),
        "y": np.int32(-7),
        "flag": True,
        "id": "héllo",
        "raw": [b"a\x00", b""],
        "mixed": [1, 2.5],
        "empty": ("bytes_list", []),
    }
    expected = tf.train.Example(
        features=tf.train.Features(
            feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=range(6))),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[-7])),
                "flag": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
                "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=["héllo".encode()])),
                "raw": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a\x00", b""])),
                "mixed": tf.train.Feature(float_list=tf.train.FloatList(value=[1, 2.5])),
                "empty": tf.train.Feature(bytes_list=tf.train.BytesList(value=[])),
            }
        )
    )
    assert hx.serialize_example(features) == expected.SerializeToString(deterministic=True)


def test_sequence_example_is_byte_identical() -> None:
    ours = hx.serialize_sequence_example(
        context={"label": 3},
        feature_lists={"tokens": [[1, 2], [3]], "words": [b"a", b"bc"]},
    )
    expected = tf.train.SequenceExample(
        context=tf.train.Features(
            feature={"label": tf.train.Feature(int64_list=tf.train.Int64List(value=[3]))}
        ),
        feature_lists=tf.train.FeatureLists(
            feature_list={
                "tokens": tf.train.FeatureList(
                    feature=[
                        tf.train.Feature(int64_list=tf.train.Int64List(value=[1, 2])),
                        tf.train.Feature(int64_list=tf.train.Int64List(value=[3])),
                    ]
                ),
                "words": tf.train.FeatureList(
                    feature=[
                        tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a"])),
                        tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"bc"])),
                    ]
                ),
            }
        ),
    )
    assert ours == expected.SerializeToString(deterministic=True)
    context, lists = hx.decode_sequence_example(expected.SerializeToString())
    assert context["label"][1].tolist() == [3]
    assert [values.tolist() for _, values in lists["tokens"]] == [[1, 2], [3]]


@pytest.mark.usefixtures("implementation")
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches_and_specs())
def test_parse_example_matches_tensorflow(
    batch_and_specs: tuple[list[dict[str, tuple[str, list[Any]]]], dict[str, Any]],
) -> None:
    batch, spec_args = batch_and_specs
    serialized = [hx.serialize_example(features) for features in batch]
    try:
        expected = tf.io.parse_example(
            serialized, {name: tf_spec(*args) for name, args in spec_args.items()}
        )
    except (tf.errors.InvalidArgumentError, ValueError):
        event("TensorFlow refused the batch")
        with pytest.raises(HeadraceError):
            hx.parse_example(
                serialized, {name: headrace_spec(*args) for name, args in spec_args.items()}
            )
        return
    event("TensorFlow parsed the batch")
    ours = hx.parse_example(
        serialized, {name: headrace_spec(*args) for name, args in spec_args.items()}
    )
    assert set(ours) == set(expected)
    for name in expected:
        assert_same_output(ours[name], expected[name])


def _lengths_batch() -> list[bytes]:
    return [
        hx.serialize_example({"v": [1, 2, 3, 4, 5, 6], "l": [2, 4]}),
        hx.serialize_example({"v": [7, 8], "l": [0, 2]}),
        hx.serialize_example({}),
    ]


@pytest.mark.usefixtures("implementation")
@pytest.mark.parametrize("splits_dtype", [tf.int32, tf.int64])
def test_ragged_partitions_match_tensorflow(splits_dtype: tf.DType) -> None:
    batch = _lengths_batch()
    expected = tf.io.parse_example(
        batch,
        {
            "rows": tf.io.RaggedFeature(
                tf.int64,
                value_key="v",
                partitions=[tf.io.RaggedFeature.RowLengths("l")],
                row_splits_dtype=splits_dtype,
            ),
            "pairs": tf.io.RaggedFeature(
                tf.int64,
                value_key="v",
                partitions=[tf.io.RaggedFeature.UniformRowLength(2)],
                row_splits_dtype=splits_dtype,
            ),
        },
    )
    ours = hx.parse_example(
        batch,
        {
            "rows": hx.RaggedFeature(
                np.int64,
                value_key="v",
                partitions=(hx.RaggedFeature.RowLengths("l"),),
                row_splits_dtype=splits_dtype.as_numpy_dtype,
            ),
            "pairs": hx.RaggedFeature(
                np.int64,
                value_key="v",
                partitions=(hx.RaggedFeature.UniformRowLength(2),),
                row_splits_dtype=splits_dtype.as_numpy_dtype,
            ),
        },
    )
    assert ours["rows"].to_list() == expected["rows"].to_list()
    assert ours["rows"].row_splits.dtype == splits_dtype.as_numpy_dtype
    assert ours["rows"].values.row_splits.dtype == splits_dtype.as_numpy_dtype
    np.testing.assert_array_equal(ours["rows"].to_dense(), expected["rows"].to_tensor().numpy())
    assert ours["pairs"].to_list() == expected["pairs"].to_list()
    np.testing.assert_array_equal(ours["pairs"].values, expected["pairs"].values.numpy())
    indices, values, shape = ours["rows"].to_sparse()
    sparse = expected["rows"].to_sparse()
    np.testing.assert_array_equal(indices, sparse.indices.numpy())
    np.testing.assert_array_equal(values, sparse.values.numpy())
    np.testing.assert_array_equal(shape, sparse.dense_shape.numpy())


def test_fixed_len_sequence_requires_allow_missing_like_tensorflow() -> None:
    batch = [hx.serialize_example({"v": [1]})]
    with pytest.raises(ValueError, match="requires allow_missing to be True") as tf_error:
        tf.io.parse_example(batch, {"v": tf.io.FixedLenSequenceFeature([], tf.int64)})
    with pytest.raises(ValueError) as our_error:
        hx.parse_example(batch, {"v": hx.FixedLenSequenceFeature([], np.int64)})
    assert str(our_error.value) == str(tf_error.value)


def test_accepts_tensorflow_dtypes_in_specs() -> None:
    batch = [hx.serialize_example({"v": [1.5]})]
    parsed = hx.parse_example(batch, {"v": hx.FixedLenFeature([], tf.float32)})
    assert parsed["v"].dtype == np.float32


# -- every RaggedFeature partition, nested, against tf.io.parse_example -----------------
PARTITIONS = ["RowLengths", "RowSplits", "RowStarts", "RowLimits", "ValueRowIds"]


def encode_partition(kind: str, lengths: list[int], draw: Any) -> list[int]:
    """One record's partition feature for rows of these lengths."""
    offsets = np.cumsum([0, *lengths]).tolist()
    if kind == "RowLengths":
        return list(lengths)
    if kind == "RowSplits":  # no rows: [0], or nothing at all (both mean zero rows)
        return offsets if lengths or draw(st.booleans()) else []
    if kind == "RowStarts":
        return offsets[:-1]
    if kind == "RowLimits":
        return offsets[1:]
    return [row for row, length in enumerate(lengths) for _ in range(length)]


@st.composite
def partitioned_batches(draw: Any) -> tuple[list[bytes], list[str]]:
    """Records of values split into rows (and rows into outer rows), with the partition
    features of randomly chosen kinds; the outermost partition comes first."""
    kinds = draw(st.lists(st.sampled_from(PARTITIONS), min_size=1, max_size=2))
    batch = []
    for record in range(draw(st.integers(0, 5))):
        features: dict[str, Any] = {}
        count = draw(st.integers(0, 6))  # values of the innermost level
        value_counts = count
        # innermost partition first: split `value_counts` items into rows
        for level in reversed(range(len(kinds))):
            cuts = sorted(draw(st.lists(st.integers(0, value_counts), max_size=3)))
            bounds = [0, *cuts, value_counts]
            lengths = [b - a for a, b in itertools.pairwise(bounds)]
            if not value_counts and draw(st.booleans()):
                lengths = []  # no rows at all, rather than one empty row
            if kinds[level] == "ValueRowIds":  # ids cannot express trailing empty rows
                while lengths and lengths[-1] == 0:
                    lengths.pop()
            features[f"p{level}"] = ("int64_list", encode_partition(kinds[level], lengths, draw))
            value_counts = len(lengths)
        features["v"] = ("int64_list", [record * 100 + i for i in range(count)])
        batch.append(tf_example(features).SerializeToString())
    return batch, kinds


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(partitioned_batches(), st.sampled_from([tf.int32, tf.int64]))
def test_every_ragged_partition_matches_tensorflow(
    batch_and_kinds: tuple[list[bytes], list[str]], splits_dtype: tf.DType
) -> None:
    batch, kinds = batch_and_kinds
    event(" > ".join(kinds))
    theirs = tf.io.parse_example(
        tf.constant(batch, dtype=tf.string, shape=[len(batch)]),
        {
            "f": tf.io.RaggedFeature(
                tf.int64,
                value_key="v",
                partitions=[getattr(tf.io.RaggedFeature, k)(f"p{i}") for i, k in enumerate(kinds)],
                row_splits_dtype=splits_dtype,
            )
        },
    )["f"]
    ours = hx.parse_example(
        batch,
        {
            "f": hx.RaggedFeature(
                np.int64,
                value_key="v",
                partitions=tuple(getattr(hx.RaggedFeature, k)(f"p{i}") for i, k in enumerate(kinds)),
                row_splits_dtype=splits_dtype.as_numpy_dtype,
            )
        },
    )["f"]
    assert ours.to_list() == theirs.to_list()
    for _ in range(len(kinds) + 1):  # the batch level, then each partition's
        assert ours.row_splits.dtype == splits_dtype.as_numpy_dtype
        np.testing.assert_array_equal(ours.row_splits, theirs.row_splits.numpy())
        ours, theirs = ours.values, theirs.values
    assert_same_dense(ours, theirs)
