"""The pickle-free element encoding of caches and saved datasets: exact round trips,
refusals that name the component, corruption that names the file and offset."""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import headrace as hr
from headrace.io.elements import decode_element, encode_element, spec_from_json, spec_to_json

Point = collections.namedtuple("Point", "x label")

DTYPES = st.sampled_from(
    ["<f4", ">f8", "<i2", ">i8", "|u1", "|b1", "<c8", "|S3", "<U2", "<M8[s]", "<m8[ms]", "<f2"]
)


def arrays() -> st.SearchStrategy[np.ndarray[Any, Any]]:
    return DTYPES.flatmap(
        lambda dtype: hnp.arrays(np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    )


def object_arrays() -> st.SearchStrategy[np.ndarray[Any, Any]]:
    def build(items: list[Any]) -> np.ndarray[Any, Any]:
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out

    return st.one_of(
        st.lists(st.binary(max_size=6), max_size=5).map(build),
        st.lists(st.text(max_size=6), max_size=5).map(build),  # surrogates included
    )


LEAVES = st.one_of(
    arrays(),
    object_arrays(),
    arrays().filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0]),  # NumPy scalars
    st.integers(),  # beyond int64 too
    st.floats(allow_nan=True),
    st.complex_numbers(allow_nan=False),
    st.booleans(),
    st.none(),
    st.binary(max_size=20),  # trailing NULs kept
    st.text(max_size=20),
)

ELEMENTS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.dictionaries(st.text(max_size=5), children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.lists(children, max_size=3),
        st.tuples(children, children).map(lambda pair: Point(*pair)),
    ),
    max_leaves=10,
)


def assert_identical(actual: Any, expected: Any, where: str = "element") -> None:
    """Same types, dtypes, shapes and values (NaN equal to NaN), recursively."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        if expected.dtype.hasobject:
            assert actual.tolist() == expected.tolist(), where
        else:  # the same bits: NaN payloads, -0.0 and NaT included
            assert actual.tobytes() == expected.tobytes(), where
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype, where
        assert actual.tobytes() == expected.tobytes(), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), where
        if hasattr(expected, "_fields"):
            assert actual._fields == expected._fields, where
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}/{k}")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), where
    else:
        assert actual == expected, where


@settings(max_examples=300, deadline=None)
@given(ELEMENTS)
def test_every_storable_element_round_trips_exactly(element: Any) -> None:
    assert_identical(decode_element(encode_element(element)), element)


def test_decoded_arrays_are_read_only_views_of_the_record() -> None:
    payload = encode_element({"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    decoded = decode_element(payload)["x"]
    assert not decoded.flags.writeable
    with pytest.raises(ValueError):
        decoded[0, 0] = 1


def test_namedtuple_is_the_users_class_in_this_process() -> None:
    decoded = decode_element(encode_element(Point(np.int64(1), "a")))
    assert type(decoded) is Point


@pytest.mark.parametrize(
    ("element", "named"),
    [
        ({"x": {1, 2}}, "'/x' of type set"),
        ({"x": np.array([1, "a"], dtype=object)}, "object array holding int"),
        ((1, object()), "'/1' of type object"),
        ({1: 2}, "dict key that is not a str"),
        (np.zeros(2, dtype=[("a", "<i4")]), "dtype"),
        (memoryview(b"ab"), "of type memoryview"),
    ],
)
def test_what_cannot_be_stored_is_refused_naming_the_component(element: Any, named: str) -> None:
    with pytest.raises(hr.ElementSpecError, match="cannot store") as raised:
        encode_element(element)
    assert named in str(raised.value)


@settings(max_examples=300, deadline=None)
@given(ELEMENTS, st.data())
def test_a_damaged_payload_decodes_or_raises_data_loss_never_anything_else(
    element: Any, data: st.DataObject
) -> None:
    payload = bytearray(encode_element(element))
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if kind == "flip":
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del payload[data.draw(st.integers(0, len(payload) - 1)) :]
    else:
        payload += b"\x00"
    try:
        decode_element(bytes(payload), path="f.hrcache", offset=40)
    except hr.DataLossError as error:
        assert "record at offset 40 in file f.hrcache" in str(error)
        assert (error.path, error.offset) == ("f.hrcache", 40)


def test_a_skeleton_naming_an_object_dtype_is_refused() -> None:
    # a hand-made payload asking for object pointers from raw bytes
    skeleton = b'["a","|O",[1]]'
    payload = len(skeleton).to_bytes(4, "little") + skeleton + b"\x00" * 8
    with pytest.raises(hr.DataLossError, match="not one this format writes"):
        decode_element(payload)


def test_no_pickle_anywhere_in_the_on_disk_formats() -> None:
    root = Path(hr.__file__).parent
    paths = [root / "io/elements.py", *sorted((root / "persist").glob("*.py"))]
    for name in paths:
        source = name.read_text()
        assert "pickle" not in source.replace("no pickle", "").replace("not pickle", "").replace(
            "Why not pickle", ""
        ).replace("unpickling", ""), name


@given(
    st.recursive(
        st.builds(
            hr.TensorSpec,
            st.lists(st.one_of(st.none(), st.integers(0, 5)), max_size=3),
            st.sampled_from([np.float32, np.int64, np.bool_, bytes, str]),
        ),
        lambda children: st.one_of(
            st.dictionaries(st.text(max_size=4), children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
        ),
        max_leaves=6,
    )
)
def test_element_specs_round_trip_through_json(spec: Any) -> None:
    assert spec_from_json(spec_to_json(spec)) == spec
