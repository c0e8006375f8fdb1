"""Suspendable streams: exact bytes through suspension, for plain, GZIP and ZLIB files."""

from __future__ import annotations

import gzip
import random
import zlib
from pathlib import Path

import pytest
from descriptors import open_descriptors
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace._errors import DataLossError, InvalidArgumentError
from headrace.io.streams import (
    ZLIB_STATE_NBYTES,
    SuspendableStream,
    make_stream,
    normalize_compression_type,
    open_stream,
)

SMALL_BUFFER = 512  # many refills per file, so suspensions land inside and between chunks


def sample_bytes(nbytes: int, seed: int) -> bytes:
    """Half-compressible bytes: runs of a letter with random bytes in between."""
    rng = random.Random(seed)
    return bytes(rng.randrange(256) if rng.random() < 0.3 else 97 for _ in range(nbytes))


def compress(data: bytes, compression_type: str) -> bytes:
    """The file content for ``data``; GZIP is written as three concatenated members."""
    if compression_type == "GZIP":
        third = len(data) // 3
        members = (data[:third], data[third : 2 * third], data[2 * third :])
        return b"".join(gzip.compress(member) for member in members)
    if compression_type == "ZLIB":
        return zlib.compress(data)
    return data


def write_sample(directory: Path, compression_type: str, data: bytes, name: str = "f") -> Path:
    path = directory / f"{name}.{compression_type or 'raw'}"
    path.write_bytes(compress(data, compression_type))
    return path


COMPRESSION_TYPES = ["", "GZIP", "ZLIB"]
DATA = sample_bytes(40_000, seed=1)


@pytest.fixture(scope="module")
def sample_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("streams")
    return {kind: write_sample(directory, kind, DATA) for kind in COMPRESSION_TYPES}


def read_all(stream: SuspendableStream, size: int) -> bytes:
    pieces = []
    while piece := stream.read(size):
        pieces.append(piece)
    return b"".join(pieces)


@pytest.mark.parametrize("compression_type", COMPRESSION_TYPES)
@pytest.mark.parametrize("size", [1, 7, SMALL_BUFFER, 10_000, 100_000])
def test_read_returns_the_decompressed_bytes(
    sample_files: dict[str, Path], compression_type: str, size: int
) -> None:
    path = sample_files[compression_type]
    with open_stream(path, compression_type, buffer_size=SMALL_BUFFER) as stream:
        assert read_all(stream, size) == DATA
        assert stream.tell() == len(DATA)


@pytest.mark.parametrize("compression_type", COMPRESSION_TYPES)
def test_read_is_short_only_at_the_end(
    sample_files: dict[str, Path], compression_type: str
) -> None:
    with open_stream(sample_files[compression_type], compression_type, buffer_size=100) as stream:
        sizes = [len(stream.read(3_000)) for _ in range(15)]
    assert sizes[:13] == [3_000] * 13
    assert sizes[13] == len(DATA) - 13 * 3_000
    assert sizes[14] == 0


@pytest.mark.parametrize("compression_type", COMPRESSION_TYPES)
def test_read_minus_one_reads_to_the_end(
    sample_files: dict[str, Path], compression_type: str
) -> None:
    with open_stream(sample_files[compression_type], compression_type) as stream:
        stream.read(10)
        assert stream.read() == DATA[10:]


@pytest.mark.parametrize("compression_type", COMPRESSION_TYPES)
def test_seek_forward_and_back(sample_files: dict[str, Path], compression_type: str) -> None:
    with open_stream(sample_files[compression_type], compression_type, buffer_size=64) as stream:
        for offset in [30_000, 5, 5, 39_999, 0, 20_000]:
            assert stream.seek(offset) == offset
            assert stream.tell() == offset
            assert stream.read(100) == DATA[offset : offset + 100]


def test_seek_past_the_end() -> None:
    """Plain files seek anywhere (like io); compressed ones stop at the end they find."""
    with open_stream(__file__) as stream:
        assert stream.seek(10**9) == 10**9
        assert stream.read(10) == b""


def test_compressed_seek_past_the_end_stops_at_the_end(sample_files: dict[str, Path]) -> None:
    with open_stream(sample_files["GZIP"], "GZIP") as stream:
        assert stream.seek(10**9) == len(DATA)


@settings(max_examples=40, deadline=None)
@given(
    compression_type=st.sampled_from(COMPRESSION_TYPES),
    steps=st.lists(
        st.tuples(st.integers(min_value=1, max_value=5_000), st.booleans()),
        min_size=1,
        max_size=40,
    ),
)
def test_suspending_anywhere_yields_the_same_bytes(
    sample_files: dict[str, Path], compression_type: str, steps: list[tuple[int, bool]]
) -> None:
    stream = open_stream(sample_files[compression_type], compression_type, buffer_size=SMALL_BUFFER)
    pieces = []
    with stream:
        for size, suspend_first in steps:
            if suspend_first:
                stream.suspend()
                assert not stream.holds_descriptor
                stream.resume()
            pieces.append(stream.read(size))
        pieces.append(read_all(stream, 4_096))
    assert b"".join(pieces) == DATA


@settings(max_examples=60, deadline=None)
@given(
    compression_type=st.sampled_from(COMPRESSION_TYPES),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["read", "readinto", "seek", "suspend"]),
            st.integers(min_value=0, max_value=3 * SMALL_BUFFER),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_readinto_mixed_with_reads_seeks_and_suspensions_yields_the_same_bytes(
    sample_files: dict[str, Path], compression_type: str, steps: list[tuple[str, int]]
) -> None:
    """``readinto`` (which a TFRecord reader refills its reused buffer with) continues
    exactly where ``read`` left off — its read-ahead first — and ``read`` after it, across
    seeks and suspensions; it is short only at the end of the stream."""
    stream = open_stream(sample_files[compression_type], compression_type, buffer_size=SMALL_BUFFER)
    position = 0
    with stream:
        for kind, size in steps:
            if kind == "seek":
                position = stream.seek(size * 7 % (len(DATA) + 10))
                assert position == min(size * 7 % (len(DATA) + 10), len(DATA))
                continue
            if kind == "suspend":
                stream.suspend()
                stream.resume()
                continue
            if kind == "read":
                got = stream.read(size)
            else:
                area = bytearray(b"\xff" * (size + 3))
                count = stream.readinto(memoryview(area)[:size])
                assert area[size:] == b"\xff" * 3  # nothing written past the view
                got = bytes(area[:count])
            expected = DATA[position : position + size]
            assert got == expected, (kind, position, size)
            position += len(got)
            assert stream.tell() == position


def test_suspended_stream_holds_no_descriptor(sample_files: dict[str, Path]) -> None:
    before = open_descriptors(sample_files["GZIP"].parent)
    stream = open_stream(sample_files["GZIP"], "GZIP")
    assert open_descriptors(sample_files["GZIP"].parent) == before + 1
    stream.read(10)
    stream.suspend()
    assert open_descriptors(sample_files["GZIP"].parent) == before
    stream.resume()
    assert stream.read(10) == DATA[10:20]
    stream.close()
    assert open_descriptors(sample_files["GZIP"].parent) == before


def test_read_on_a_suspended_stream_asks_for_resume(sample_files: dict[str, Path]) -> None:
    stream = make_stream(sample_files[""])
    with pytest.raises(ValueError, match="suspended"):
        stream.read(1)
    stream.close()
    with pytest.raises(ValueError, match="closed"):
        stream.read(1)


def test_suspended_nbytes(sample_files: dict[str, Path]) -> None:
    """Plain streams keep nothing; compressed ones keep the zlib state and unread output."""
    with open_stream(sample_files[""], buffer_size=SMALL_BUFFER) as plain:
        plain.read(10)
        plain.suspend()
        assert plain.suspended_nbytes == 0
    with open_stream(sample_files["ZLIB"], "ZLIB", buffer_size=SMALL_BUFFER) as compressed:
        assert compressed.suspended_nbytes == 0  # open: nothing is *suspended*
        compressed.read(10)
        compressed.suspend()
        unread_output = SMALL_BUFFER - 10
        assert compressed.suspended_nbytes >= ZLIB_STATE_NBYTES + unread_output
        compressed.resume()
        assert compressed.suspended_nbytes == 0
        compressed.suspend()
    assert compressed.suspended_nbytes == 0  # closed


@pytest.mark.parametrize("compression_type", ["GZIP", "ZLIB"])
def test_truncated_compressed_file_is_data_loss(tmp_path: Path, compression_type: str) -> None:
    content = compress(DATA, compression_type)
    path = tmp_path / "truncated"
    path.write_bytes(content[: len(content) - 20])
    with open_stream(path, compression_type) as stream, pytest.raises(DataLossError) as raised:
        read_all(stream, 1_000)
    assert raised.value.path == str(path)
    assert raised.value.offset is not None and raised.value.offset <= len(DATA)
    assert "truncated" in str(raised.value)
    assert "decompressed" in str(raised.value)


def test_corrupt_compressed_file_is_data_loss(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.gz"
    path.write_bytes(gzip.compress(DATA) + b"not gzip")
    with open_stream(path, "GZIP") as stream, pytest.raises(DataLossError, match="corrupt GZIP"):
        read_all(stream, 1_000)


@pytest.mark.parametrize("compression_type", COMPRESSION_TYPES)
def test_empty_file_is_an_empty_stream(tmp_path: Path, compression_type: str) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    with open_stream(path, compression_type) as stream:
        assert stream.read(10) == b""


def test_empty_gzip_members_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "members.gz"
    path.write_bytes(
        gzip.compress(b"") + gzip.compress(b"ab") + gzip.compress(b"") + gzip.compress(b"c")
    )
    with open_stream(path, "GZIP") as stream:
        assert stream.read(10) == b"abc"


def test_compression_type_is_validated() -> None:
    assert normalize_compression_type(None) == ""
    assert normalize_compression_type("GZIP") == "GZIP"
    with pytest.raises(InvalidArgumentError, match="'GZIP' or 'ZLIB'"):
        make_stream("x", "gzip")


def test_missing_file_raises_when_opened(tmp_path: Path) -> None:
    stream = make_stream(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        stream.resume()
