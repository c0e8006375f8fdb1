"""The C extension and the pure-Python path give identical results, errors included."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from io_format_strategies import KINDS, NAMES, examples

from headrace.io import _example_wire as wire
from headrace.io import _native
from headrace.io._crc32c import _crc32c_table
from headrace.io.example import serialize_example
from headrace.io.tfrecord.framing import frame_record, scan_records_py

native = _native._loaded_extension
KIND_CODES = {
    "bytes_list": wire.KIND_BYTES,
    "float_list": wire.KIND_FLOAT,
    "int64_list": wire.KIND_INT64,
}


def test_extension_is_built() -> None:
    assert native is not None, "build it: python setup.py build_ext --inplace"


def test_environment_variable_forces_pure_python() -> None:
    code = "from headrace.io._native import native_module; print(native_module() is None)"
    env = {**os.environ, "HEADRACE_PURE_PYTHON": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "True"


def outcome(function: Any, *args: Any) -> Any:
    """The result, or the exception's type name and args, for comparison."""
    try:
        return ("ok", function(*args))
    except ValueError as error:
        return ("error", error.args)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.integers(0, 2**32 - 1))
def test_crc32c(data: bytes, start: int) -> None:
    assert native is not None
    assert native.crc32c(data, start) == _crc32c_table(data, start)


@pytest.mark.parametrize("backend", ["table", "sse4.2", "vpclmulqdq"])
@pytest.mark.parametrize(
    # around each path's edges: 256 bytes (folding starts), 64 (its tail), 3 x 256 and
    # 3 x 8192 (the three-stream blocks), and large runs
    "length", [0, 7, 63, 255, 256, 257, 319, 320, 767, 768, 1000, 24575, 24576, 24583, 100_003]
)
def test_every_crc32c_backend_gives_the_tables_crc(backend: str, length: int) -> None:
    assert native is not None
    data = np.random.default_rng(length).bytes(length)
    try:
        found = native.crc32c_using(backend, data, 0x12345678)
    except ValueError:
        pytest.skip(f"this CPU has no {backend}")
    assert found == _crc32c_table(data, 0x12345678)
    assert native.crc32c(data, 0x12345678) == found  # the one chosen agrees


@st.composite
def damaged_framing(draw: st.DrawFn) -> bytes:
    records = draw(st.lists(st.binary(max_size=30), max_size=6))
    framed = bytearray(b"".join(frame_record(record) for record in records))
    for _ in range(draw(st.integers(0, 2))):
        if framed:
            framed[draw(st.integers(0, len(framed) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(framed[: draw(st.integers(0, len(framed)))])


@settings(max_examples=400, deadline=None)
@given(
    damaged_framing(),
    st.integers(1, 8),
    st.integers(0, 100),
    st.booleans(),
    st.sampled_from([0, 5, 30, 2**62, 2**64 - 1]),
)
def test_scan_records(
    data: bytes, max_records: int, max_bytes: int, verify: bool, max_record_bytes: int
) -> None:
    assert native is not None
    bounded = min(max_record_bytes, 2**62)  # the C side caps the bound at 2**62
    expected = scan_records_py(data, 0, max_records, max_bytes, verify, bounded)
    assert (
        native.scan_records(data, 0, max_records, max_bytes, verify, max_record_bytes) == expected
    )


@st.composite
def damaged_large_framing(draw: st.DrawFn) -> bytes:
    """Runs past the size where the C scan checks and copies without the GIL (64 KB a
    call), and past its 64 frames kept on the stack."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = draw(st.one_of(
        st.lists(st.integers(8_000, 40_000), min_size=2, max_size=8),
        st.lists(st.integers(0, 1_500), min_size=60, max_size=200),
    ))
    framed = bytearray(b"".join(frame_record(rng.bytes(size)) for size in sizes))
    for _ in range(draw(st.integers(0, 2))):
        framed[draw(st.integers(0, len(framed) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(framed[: len(framed) - draw(st.integers(0, 50_000))])


@settings(max_examples=60, deadline=None)
@given(damaged_large_framing(), st.integers(1, 300), st.sampled_from([0, 100_000, 2**40]),
       st.booleans())
def test_scan_records_of_large_runs(
    data: bytes, max_records: int, max_bytes: int, verify: bool
) -> None:
    assert native is not None
    expected = scan_records_py(data, 0, max_records, max_bytes, verify, 2**62)
    assert native.scan_records(data, 0, max_records, max_bytes, verify, 2**62) == expected


@given(st.lists(st.binary(max_size=50), max_size=10))
def testframe_records(records: list[bytes]) -> None:
    assert native is not None
    assert native.frame_records(records) == b"".join(map(frame_record, records))


@st.composite
def damaged_examples(draw: st.DrawFn) -> bytes:
    serialized = bytearray(serialize_example(draw(examples)))
    action = draw(st.sampled_from(["none", "flip", "truncate", "insert"]))
    if serialized and action == "flip":
        serialized[draw(st.integers(0, len(serialized) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif action == "truncate":
        serialized = serialized[: draw(st.integers(0, len(serialized)))]
    elif action == "insert":
        position = draw(st.integers(0, len(serialized)))
        serialized[position:position] = draw(st.binary(min_size=1, max_size=4))
    return bytes(serialized)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(damaged_examples(), max_size=4),
    st.lists(
        st.tuples(st.sampled_from(NAMES), st.sampled_from(KINDS)),
        max_size=4,
        unique_by=lambda t: t[0],
    ),
)
def test_parse_example_columns(batch: list[bytes], wanted: list[tuple[str, str]]) -> None:
    assert native is not None
    keys = [name.encode() for name, _ in wanted]
    kinds = [KIND_CODES[kind] for _, kind in wanted]
    expected = outcome(wire.scan_columns, batch, keys, kinds)
    got = outcome(native.parse_example_columns, batch, keys, kinds)
    assert got == expected


@settings(max_examples=400, deadline=None)
@given(damaged_examples(), damaged_examples())
def test_decode_features(first: bytes, second: bytes) -> None:
    """decode_example's C walk: the same features in the same order, the same byte in a
    malformed record's error; two records concatenated are one merged Example whose
    later entry of a key replaces the earlier one at the end of the order."""
    from headrace.io.example.parsing import _decode_features

    assert native is not None

    def decoded(decode: Any, data: bytes) -> Any:
        try:
            return [(key, kind, values) for key, (kind, values) in decode(data, 1).items()]
        except wire.Malformed as malformed:
            return ("malformed at", malformed.position)

    for data in (first, first + second):
        assert decoded(_decode_features, data) == decoded(wire.decode_features, data)
