"""The pure-Python Example scan's fast path (canonical layouts, batch-decoded varints)
gives exactly what the C extension gives, on records built field by field: every
encoding protobuf accepts (packed, unpacked, merged, padded varints, unknown fields) and
damaged ones, where the error (class, record, key, byte position) must match too."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from io_format_strategies import examples

from headrace.io import _example_wire as wire
from headrace.io import _native
from headrace.io.example import serialize_example

native = _native._loaded_extension
NAMES = [b"a", b"b", b"c", b""]
KIND_OF_LIST = {"bytes": wire.KIND_BYTES, "float": wire.KIND_FLOAT, "int64": wire.KIND_INT64}
# Each name's usual kind, so that most batches parse (a mismatch is an error).
NAME_KIND = {b"a": "float", b"b": "int64", b"c": "bytes", b"": "float"}


def varint(value: int, padding: int = 0) -> bytes:
    """``value`` as a varint, with ``padding`` redundant continuation bytes (protobuf
    reads them; past 10 bytes in all the varint is malformed)."""
    encoded = bytearray(wire.encode_varint(value))
    for _ in range(padding):
        encoded[-1] |= 0x80
        encoded.append(0)
    return bytes(encoded)


def field(number: int, wire_type: int, payload: bytes, padding: int = 0) -> bytes:
    tag = varint(number << 3 | wire_type)
    if wire_type == 2:
        return tag + varint(len(payload), padding) + payload
    return tag + payload


paddings = st.sampled_from([0] * 20 + [1, 9])


@st.composite
def unknown_field(draw: st.DrawFn) -> bytes:
    """A field the parser does not know here (or knows with another wire type)."""
    number = draw(st.sampled_from([1, 2, 3, 4, 15, 16, 2000]))
    wire_type = draw(st.sampled_from([0, 1, 2, 5, 3]))
    if wire_type == 0:
        return field(number, 0, varint(draw(st.integers(0, 2**64 - 1))))
    if wire_type == 1:
        return field(number, 1, draw(st.binary(min_size=8, max_size=8)))
    if wire_type == 5:
        return field(number, 5, draw(st.binary(min_size=4, max_size=4)))
    if wire_type == 2:
        return field(number, 2, draw(st.binary(max_size=5)))
    return varint(number << 3 | 3) + varint(number << 3 | 4)  # an empty group


def extra(draw: st.DrawFn) -> bytes:
    return draw(unknown_field()) if draw(st.integers(0, 40)) == 0 else b""


@st.composite
def number_list(draw: st.DrawFn, kind: str) -> bytes:
    """A FloatList / Int64List: packed runs, single unpacked values, mixed."""
    parts = []
    for _ in range(draw(st.sampled_from([1] * 8 + [0, 2, 3]))):
        if kind == "float":
            values = draw(st.lists(st.floats(width=32), max_size=5))
            raw = b"".join(struct.pack("<f", value) for value in values)
            if draw(st.integers(0, 5)):
                parts.append(field(1, 2, raw, draw(paddings)))
            else:
                parts.extend(field(1, 5, raw[i : i + 4]) for i in range(0, len(raw), 4))
        else:
            values = draw(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=5))
            encoded = [varint(value, draw(paddings)) for value in values]
            if draw(st.integers(0, 5)):
                parts.append(field(1, 2, b"".join(encoded), draw(paddings)))
            else:
                parts.extend(field(1, 0, value) for value in encoded)
        parts.append(extra(draw))
    return b"".join(parts)


@st.composite
def feature(draw: st.DrawFn, usual: str) -> bytes:
    """A Feature: usually one list of the name's usual kind, sometimes another kind, none,
    or several lists (the last one counts)."""
    kinds = [usual]
    if draw(st.integers(0, 10)) == 0:
        kinds = [draw(st.sampled_from(list(KIND_OF_LIST)))]
    if draw(st.integers(0, 10)) == 0:
        kinds = draw(st.lists(st.sampled_from(list(KIND_OF_LIST)), max_size=3))
    parts = []
    for kind in kinds:
        if kind == "bytes":
            values = draw(st.lists(st.binary(max_size=4), max_size=4))
            body = b"".join(field(1, 2, value, draw(paddings)) for value in values)
        else:
            body = draw(number_list(kind))
        parts.append(field(KIND_OF_LIST[kind], 2, body, draw(paddings)) + extra(draw))
    return b"".join(parts)


@st.composite
def entry(draw: st.DrawFn) -> bytes:
    layout = draw(st.sampled_from(["kv"] * 30 + ["vk", "k", "v", "kvv", "kkv", ""]))
    key = draw(st.sampled_from(NAMES))
    parts = []
    for part in layout:
        if part == "k":
            parts.append(field(1, 2, key, draw(paddings)))
        else:
            parts.append(field(2, 2, draw(feature(NAME_KIND[key])), draw(paddings)))
        parts.append(extra(draw))
    return field(1, 2, b"".join(parts), draw(paddings)) + extra(draw)


@st.composite
def record(draw: st.DrawFn) -> bytes:
    parts = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 1, 0, 2]))):
        entries = b"".join(draw(st.lists(entry(), max_size=5)))
        parts.append(field(1, 2, entries, draw(paddings)) + extra(draw))
    serialized = bytearray(b"".join(parts))
    action = draw(st.sampled_from(["none"] * 12 + ["flip", "truncate", "insert"]))
    if serialized and action == "flip":
        serialized[draw(st.integers(0, len(serialized) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif action == "truncate":
        serialized = serialized[: draw(st.integers(0, len(serialized)))]
    elif action == "insert":
        position = draw(st.integers(0, len(serialized)))
        serialized[position:position] = draw(st.binary(min_size=1, max_size=3))
    return bytes(serialized)


@st.composite
def wanted_key(draw: st.DrawFn) -> tuple[bytes, int]:
    key = draw(st.sampled_from(NAMES))
    kind = NAME_KIND[key] if draw(st.integers(0, 8)) else draw(st.sampled_from(list(KIND_OF_LIST)))
    return key, KIND_OF_LIST[kind]


wanted_keys = st.lists(wanted_key(), max_size=4, unique_by=lambda pair: pair[0])


@contextlib.contextmanager
def vector_threshold(records: int) -> Iterator[None]:
    """Batches from ``records`` records up take the whole-batch NumPy reader."""
    previous, wire._VECTOR_MIN_RECORDS = wire._VECTOR_MIN_RECORDS, records
    try:
        yield
    finally:
        wire._VECTOR_MIN_RECORDS = previous


@contextlib.contextmanager
def refused(name: str) -> Iterator[None]:
    """``wire.<name>`` fails the test if called."""

    def refuse(*args: Any) -> Any:
        raise AssertionError(f"a canonical batch reached {name}")

    previous = getattr(wire, name)
    setattr(wire, name, refuse)
    try:
        yield
    finally:
        setattr(wire, name, previous)


def outcome(function: Any, *args: Any) -> Any:
    try:
        return ("ok", function(*args))
    except ValueError as error:
        return ("error", type(error).__name__, error.args)


def test_extension_is_built() -> None:
    assert native is not None, "build it: python setup.py build_ext --inplace"


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(st.lists(record(), max_size=4), wanted_keys)
def test_scan_matches_the_extension(batch: list[bytes], wanted: list[tuple[bytes, int]]) -> None:
    assert native is not None
    keys = [key for key, _ in wanted]
    kinds = [kind for _, kind in wanted]
    expected = outcome(native.parse_example_columns, batch, keys, kinds)
    for whole_batch in (False, True):  # record by record, and NumPy over the batch
        with vector_threshold(1 if whole_batch else 10**9):
            got = outcome(wire.scan_columns, batch, keys, kinds)
        if expected[0] == "error":
            assert got[0] == "error" and got[2] == expected[2]
            assert got[1] == "ParseFailure"  # both raise their own class of that name
        else:
            assert got == expected
    assert outcome(wire.scan_columns_exact, batch, keys, kinds)[-1] == expected[-1]


@settings(max_examples=200, deadline=None)
@given(st.lists(examples, min_size=1, max_size=4), st.booleans())
def test_serialized_records_take_the_fast_path(
    batch: list[dict[str, Any]], with_unrequested: bool
) -> None:
    """What a serializer writes never needs the general decoder."""
    assert native is not None
    kind_of: dict[str, str] = {}
    for example in batch:  # one kind per name across the batch (else: a type error)
        for name, (kind, _) in list(example.items()):
            if kind_of.setdefault(name, kind) != kind:
                del example[name]
    records = [serialize_example(example) for example in batch]
    names = sorted(kind_of)[: len(kind_of) - 1 if with_unrequested else None]
    keys = [name.encode() for name in names]
    kinds = [KIND_OF_LIST[kind_of[name].removesuffix("_list")] for name in names]

    with refused("_general_record"), vector_threshold(10**9):
        got = wire.scan_columns(records, keys, kinds)
    assert got == native.parse_example_columns(records, keys, kinds)
    with refused("_scan_canonical"), vector_threshold(1):
        got = wire.scan_columns(records, keys, kinds)
    assert got == native.parse_example_columns(records, keys, kinds)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([b"a", b"b", b"k" * 130]), min_size=1, max_size=3, unique=True),
    st.integers(16, 40),
    st.data(),
)
def test_a_large_batch_is_read_whole(keys: list[bytes], size: int, data: st.DataObject) -> None:
    """With long keys and lists (two-byte lengths), empty records and lists, 10-byte
    varints."""
    assert native is not None
    kinds = [wire.KIND_FLOAT, wire.KIND_INT64, wire.KIND_BYTES][: len(keys)]
    value_of = {
        wire.KIND_FLOAT: st.floats(width=32),
        wire.KIND_INT64: st.integers(-(2**63), 2**63 - 1),
        wire.KIND_BYTES: st.binary(max_size=140),
    }
    name_of = {wire.KIND_FLOAT: "float_list", wire.KIND_INT64: "int64_list",
               wire.KIND_BYTES: "bytes_list"}  # fmt: skip
    records = []
    for _ in range(size):
        example = {}
        for key, kind in zip(keys, kinds, strict=True):
            if data.draw(st.integers(0, 5)):
                values = data.draw(
                    st.lists(value_of[kind], max_size=data.draw(st.sampled_from([0, 3, 40])))
                )
                example[key.decode()] = (name_of[kind], values)
        records.append(serialize_example(example))
    chunk = data.draw(st.sampled_from([1, 300, 1 << 21]))  # bytes per whole-batch read
    with refused("_scan_canonical"), vector_threshold(16), vector_chunk(chunk):
        got = wire.scan_columns(records, keys, kinds)
    assert got == native.parse_example_columns(records, keys, kinds)


def test_batches_from_the_threshold_up_are_read_whole() -> None:
    assert native is not None
    rng = np.random.default_rng(0)
    records = [
        serialize_example({"x": rng.random(3, dtype=np.float32), "n": rng.integers(0, 9, i % 4)})
        for i in range(wire._VECTOR_MIN_RECORDS)
    ]
    keys, kinds = [b"x", b"n"], [wire.KIND_FLOAT, wire.KIND_INT64]
    expected = native.parse_example_columns(records, keys, kinds)
    with refused("_scan_canonical"):
        assert wire.scan_columns(records, keys, kinds) == expected
    with refused("_scan_vectorised"):
        assert wire.scan_columns(records[:-1], keys, kinds) == expected_prefix(expected, 1)


def expected_prefix(columns: list[Any], dropped: int) -> list[Any]:
    """The C extension's columns without the last ``dropped`` record(s) (rebuilt by
    counts: a float32 column here, then an int64 one)."""
    out = []
    for (values, raw_counts), width in zip(columns, (4, 8), strict=True):
        counts = np.frombuffer(bytes(raw_counts), dtype="<i8")[:-dropped]
        kept = int(np.maximum(counts, 0).sum()) * width
        out.append((bytearray(values[:kept]), bytearray(counts.tobytes())))
    return out


def test_long_varints_in_an_int64_list() -> None:
    """Ten-byte varints (negative values) decode; an eleven-byte one is malformed, at
    its record and byte, as the extension says."""
    assert native is not None
    values = [-1, -(2**63), 2**63 - 1, 0, 127, 128, 2**35]
    good = serialize_example({"n": ("int64_list", values)})
    long_value = field(1, 2, varint(5, padding=10))
    bad = field(1, 2, field(1, 2, b"\x0a\x01n" + field(2, 2, field(3, 2, long_value))))
    batch = [good, good, bad]
    for threshold in (1, 10**9):
        with vector_threshold(threshold):
            assert outcome(wire.scan_columns, batch[:2], [b"n"], [wire.KIND_INT64]) == outcome(
                native.parse_example_columns, batch[:2], [b"n"], [wire.KIND_INT64]
            )
            got = outcome(wire.scan_columns, batch, [b"n"], [wire.KIND_INT64])
        assert got[0] == "error"
        expected = outcome(native.parse_example_columns, batch, [b"n"], [wire.KIND_INT64])
        assert got[2] == expected[2]
        assert got[2][:2] == (wire.FAILURE_MALFORMED, 2)
        # Its record comes first: its error wins over a later record's type mismatch.
        mismatch = serialize_example({"n": ("float_list", [1.0])})
        got = outcome(wire.scan_columns, [bad, mismatch], [b"n"], [wire.KIND_INT64])
        assert got[2][:2] == (wire.FAILURE_MALFORMED, 0)


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=6000), st.data())
def test_ranges_are_concatenated_in_order(blob: bytes, data: st.DataObject) -> None:
    """Both ways of gathering byte ranges (rows of a window view; an index per byte, for
    ranges of very different sizes) give the slices joined."""
    bounds = data.draw(
        st.lists(st.tuples(st.integers(0, len(blob)), st.integers(0, 5000)), max_size=12)
    )
    starts = [start for start, _ in bounds]
    ends = [min(len(blob), start + size) for start, size in bounds]
    padded = np.frombuffer(blob + bytes(16), dtype=np.uint8)
    got = wire._ranges(padded, np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64))
    assert got.tobytes() == b"".join(blob[a:b] for a, b in zip(starts, ends, strict=True))


@contextlib.contextmanager
def vector_chunk(size: int) -> Iterator[None]:
    previous, wire._VECTOR_CHUNK_BYTES = wire._VECTOR_CHUNK_BYTES, size
    try:
        yield
    finally:
        wire._VECTOR_CHUNK_BYTES = previous


def test_the_whole_batch_readers_memory_does_not_grow_with_the_batch() -> None:
    """Its working arrays take ~10 bytes per record byte, so it reads a large batch in
    chunks: beyond what it returns, it holds under 14 chunks' worth, however large the
    batch, and returns what the C extension does."""
    assert native is not None
    record = serialize_example({f"f{i}": ("int64_list", [i]) for i in range(40)})
    keys = [f"f{i}".encode() for i in range(0, 40, 4)]
    kinds = [wire.KIND_INT64] * len(keys)
    chunk = 1 << 18
    for size in (1 << 20, 1 << 22):
        records = [record] * (size // len(record))
        with vector_chunk(chunk), refused("_scan_canonical"):
            tracemalloc.start()
            try:
                got = wire.scan_columns(records, keys, kinds)
                kept, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        assert peak - kept < 14 * chunk, (size, peak - kept)
        assert got == native.parse_example_columns(records, keys, kinds)
