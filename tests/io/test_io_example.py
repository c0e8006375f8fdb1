"""Example serialization, decoding and batched parsing: behaviour and error messages."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from io_format_strategies import examples, headrace_spec, specs

from headrace._errors import HeadraceError, InvalidArgumentError, ParseError
from headrace.io import example as hx

pytestmark = pytest.mark.usefixtures("implementation")
FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

BATCH = [
    hx.serialize_example({"x": np.arange(4, dtype=np.float32), "y": 1, "id": b"a\x00"}),
    hx.serialize_example({"x": np.ones(4, dtype=np.float32), "y": 2, "id": b"bb"}),
    hx.serialize_example({"x": [1.0, 2.0], "id": [b"c", b"d"]}),
]


def test_fixed_len_columns_are_dense_and_bytes_keep_trailing_nuls() -> None:
    parsed = hx.parse_example(
        BATCH[:2],
        {
            "x": hx.FixedLenFeature([2, 2], np.float32),
            "y": hx.FixedLenFeature([], np.int64),
            "id": hx.FixedLenFeature([], bytes),
        },
    )
    assert parsed["x"].shape == (2, 2, 2) and parsed["x"].dtype == np.float32
    np.testing.assert_array_equal(parsed["x"][0].reshape(-1), np.arange(4))
    assert parsed["y"].tolist() == [1, 2] and parsed["y"].dtype == np.int64
    assert parsed["id"].dtype == object and parsed["id"].tolist() == [b"a\x00", b"bb"]


def test_missing_required_feature_names_feature_and_record() -> None:
    with pytest.raises(
        ParseError, match=r"feature 'y' \(data type: int64\) is required but missing in record 2"
    ):
        hx.parse_example(BATCH, {"y": hx.FixedLenFeature([], np.int64)})


def test_default_fills_missing_records_only() -> None:
    parsed = hx.parse_example(BATCH, {"y": hx.FixedLenFeature([1], np.int64, default_value=[-1])})
    assert parsed["y"].tolist() == [[1], [2], [-1]]


def test_default_is_reshaped_not_broadcast() -> None:
    with pytest.raises(InvalidArgumentError, match="reshaped, not broadcast"):
        hx.parse_example(BATCH, {"y": hx.FixedLenFeature([2], np.int64, default_value=0)})


def test_wrong_count_names_feature_record_expected_and_got() -> None:
    with pytest.raises(
        ParseError, match="feature 'x' in record 2 of the batch has 2 float values, expected 4"
    ):
        hx.parse_example(BATCH, {"x": hx.FixedLenFeature([4], np.float32)})


@pytest.mark.parametrize("records", [3, 16384, 16385, 40000])
@pytest.mark.parametrize("bad", [None, 0, -1])
def test_a_planned_parser_checks_every_record_of_any_batch_size(records: int, bad: int | None) -> None:
    """The dataset's parser, planned once and pickled to workers, gives parse_example's
    columns, and its fast "every record has it at its size" check (a cached pattern up
    to 16,384 records, NumPy past it) still finds the one record that differs."""
    import pickle

    from headrace.io.example.parsing import BatchParser

    spec = {"x": hx.FixedLenFeature([2], np.float32), "id": hx.FixedLenFeature([], bytes)}
    batch = [hx.serialize_example({"x": ("float_list", [i, -i]), "id": ("bytes_list", [b"%d" % i])})
             for i in range(records)]
    if bad is not None:
        batch[bad] = hx.serialize_example({"x": ("float_list", [1.0]), "id": ("bytes_list", [b""])})
    parser = pickle.loads(pickle.dumps(BatchParser(spec)))
    for _ in range(2):  # the second batch meets the cached pattern
        if bad is not None:
            row = bad % records
            with pytest.raises(ParseError, match=f"feature 'x' in record {row} of the batch has 1"):
                parser(batch)
            continue
        parsed = parser(batch)
        assert parsed["x"].shape == (records, 2)
        np.testing.assert_array_equal(parsed["x"][:, 0], np.arange(records, dtype=np.float32))
        assert parsed["id"].tolist() == [b"%d" % i for i in range(records)]
        np.testing.assert_array_equal(parsed["x"], hx.parse_example(batch, spec)["x"])


def test_wrong_kind_names_feature_record_and_types() -> None:
    with pytest.raises(
        ParseError,
        match="feature 'x' in record 0 of the batch: data types don't match, found float",
    ):
        hx.parse_example(BATCH, {"x": hx.VarLenFeature(np.int64)})


def test_garbled_record_names_record_and_byte() -> None:
    batch = [BATCH[0], BATCH[1][:-3]]
    with pytest.raises(ParseError, match=r"record 1 of the batch \(2 records\) .* at byte \d+"):
        hx.parse_example(batch, {"x": hx.VarLenFeature(np.float32)})


def test_var_len_is_ragged_and_converts_like_sparse_tensor() -> None:
    parsed = hx.parse_example(
        BATCH, {"id": hx.VarLenFeature(bytes), "y": hx.VarLenFeature(np.int64)}
    )
    ids = parsed["id"]
    assert isinstance(ids, hx.RaggedColumn)
    assert ids.to_list() == [[b"a\x00"], [b"bb"], [b"c", b"d"]]
    indices, _, dense_shape = ids.to_sparse()
    assert indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]]
    assert dense_shape.tolist() == [3, 2]
    assert ids.to_dense().tolist() == [[b"a\x00", b""], [b"bb", b""], [b"c", b"d"]]
    assert parsed["y"].to_dense(default_value=-1).tolist() == [[1], [2], [-1]]
    assert parsed["y"].row_splits.tolist() == [0, 1, 2, 2]


def test_fixed_len_sequence_pads_rows() -> None:
    parsed = hx.parse_example(
        BATCH,
        {"x": hx.FixedLenSequenceFeature([2], np.float32, allow_missing=True, default_value=-1.0)},
    )
    assert parsed["x"].shape == (3, 2, 2)
    assert parsed["x"][2].tolist() == [[1.0, 2.0], [-1.0, -1.0]]


def test_spec_mistakes_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported feature dtype"):
        hx.parse_example(BATCH, {"x": hx.VarLenFeature(np.float64)})
    with pytest.raises(InvalidArgumentError, match="requested as float and as int64"):
        hx.parse_example(
            BATCH,
            {"x": hx.VarLenFeature(np.float32), "r": hx.RaggedFeature(np.int64, value_key="x")},
        )
    with pytest.raises(InvalidArgumentError, match="a batch"):
        hx.parse_example(BATCH[0], {"x": hx.VarLenFeature(np.float32)})


def test_serialize_rejects_ambiguous_or_unsupported_values() -> None:
    with pytest.raises(InvalidArgumentError, match="empty list has no type"):
        hx.serialize_example({"a": []})
    with pytest.raises(InvalidArgumentError, match="mix bytes and numbers"):
        hx.serialize_example({"a": [1, b"x"]})
    with pytest.raises(InvalidArgumentError, match="above int64 range"):
        hx.serialize_example({"a": np.array([2**64 - 1], dtype=np.uint64)})


def test_serialization_is_deterministic_and_decodes_back() -> None:
    features = {"b": np.array([[1, 2], [3, 4]]), "a": "text", "c": np.float64(0.5)}
    assert hx.serialize_example(features) == hx.serialize_example(dict(reversed(features.items())))
    decoded = hx.decode_example(hx.serialize_example(features))
    assert decoded["b"][0] == "int64_list" and decoded["b"][1].tolist() == [1, 2, 3, 4]
    assert decoded["a"][1].tolist() == [b"text"]
    assert decoded["c"] == ("float_list", decoded["c"][1]) and decoded["c"][1].tolist() == [0.5]


def test_decode_garbled_raises_parse_error_with_position() -> None:
    with pytest.raises(ParseError, match="bad protobuf at byte 0 of 4"):
        hx.decode_example(b"\x0a\x05ab")


@FUZZ
@given(st.lists(st.binary(max_size=60), min_size=1, max_size=3), specs())
def test_random_bytes_raise_only_headrace_errors(batch: list[bytes], spec_args: dict) -> None:
    with contextlib.suppress(HeadraceError):
        hx.parse_example(batch, {name: headrace_spec(*args) for name, args in spec_args.items()})
    for record in batch:
        with contextlib.suppress(HeadraceError):
            hx.decode_example(record)


@FUZZ
@given(examples, st.data())
def test_damaged_examples_raise_only_headrace_errors(features: dict, data: st.DataObject) -> None:
    serialized = bytearray(hx.serialize_example(features))
    position = data.draw(st.integers(0, len(serialized) - 1))
    serialized[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):  # a huge declared length must not be allocated
        serialized[position:position] = b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\x7f"
    spec_args = data.draw(specs())
    with contextlib.suppress(HeadraceError):
        hx.parse_example([bytes(serialized)], {n: headrace_spec(*a) for n, a in spec_args.items()})


@pytest.mark.parametrize(
    ("kind", "partition", "message"),
    [
        ("RowSplits", [1, 3], r"RowSplits\(key='p'\) must start at 0"),
        ("RowSplits", [0, 2], r"describes 2 values but the record has 3"),
        ("RowSplits", [0, 2, 1, 3], r"gives a row a negative length"),
        ("RowStarts", [2], r"RowStarts\(key='p'\) must start at 0"),
        ("RowStarts", [0, 2, 1], r"gives a row a negative length"),
        ("RowLimits", [1, 4], r"describes 4 values but the record has 3"),
        ("RowLengths", [2, -1, 2], r"gives a row a negative length"),
        ("ValueRowIds", [0, 1, 0], r"must not decrease"),
        ("ValueRowIds", [-1, 0, 0], r"has a negative row id"),
        ("ValueRowIds", [0, 1], r"describes 2 values but the record has 3"),
        ("ValueRowIds", [0, 0, 1 << 40], r"implies more than 16,777,216 rows"),
        ("ValueRowIds", [0, 0, (1 << 63) - 1], r"implies more than 16,777,216 rows"),
    ],
)
def test_bad_ragged_partitions_name_feature_partition_and_record(
    kind: str, partition: list[int], message: str
) -> None:
    good = hx.serialize_example({"v": [7], "p": {"RowSplits": [0, 1], "RowStarts": [0],
                                                 "RowLimits": [1], "RowLengths": [1],
                                                 "ValueRowIds": [0]}[kind]})
    bad = hx.serialize_example({"v": [1, 2, 3], "p": partition})
    spec = {"f": hx.RaggedFeature(np.int64, value_key="v",
                                  partitions=(getattr(hx.RaggedFeature, kind)("p"),))}
    assert hx.parse_example([good], spec)["f"].to_list() == [[[7]]]
    with pytest.raises(ParseError, match=r"feature 'f' in record 1 of the batch: .*" + message):
        hx.parse_example([good, bad], spec)


def test_unknown_partition_is_an_invalid_argument() -> None:
    spec = {"f": hx.RaggedFeature(np.int64, partitions=("RowSplits",))}
    with pytest.raises(InvalidArgumentError, match=r"not one of RaggedFeature\.RowLengths"):
        hx.parse_example([hx.serialize_example({"f": [1]})], spec)
