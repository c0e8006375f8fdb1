"""TFRecord reader and writer: batching, resume, errors, skipping, atomicity, fuzzing."""

from __future__ import annotations

import contextlib
import io
import struct
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from headrace._errors import DataLossError, HeadraceError, InvalidArgumentError, RecordTooLargeError
from headrace.io._crc32c import _crc32c_table, crc32c, mask_crc, masked_crc32c, unmask_crc
from headrace.io.tfrecord import (
    TFRecordReader,
    TFRecordWriter,
    encode_records,
    open_tfrecord,
    read_record_at,
    write_tfrecord,
)

pytestmark = pytest.mark.usefixtures("implementation")
RECORDS = [b"r%04d" % i * (i % 7) for i in range(300)]
FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def reader_over(data: bytes, **options: object) -> TFRecordReader:
    return TFRecordReader(io.BytesIO(data), path="mem.tfrecord", **options)  # type: ignore[arg-type]


def offsets_of(records: list[bytes]) -> list[int]:
    offsets, position = [], 0
    for record in records:
        offsets.append(position)
        position += 16 + len(record)
    return offsets


def test_crc32c_known_value_and_mask_roundtrip() -> None:
    assert crc32c(b"123456789") == 0xE3069283 == _crc32c_table(b"123456789")
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283
    assert unmask_crc(mask_crc(0xDEADBEEF)) == 0xDEADBEEF
    # TFRecord's framing of an empty record, as TensorFlow writes it.
    assert encode_records([b""]) == (
        b"\x00" * 8
        + struct.pack("<I", masked_crc32c(b"\x00" * 8))
        + struct.pack("<I", masked_crc32c(b""))
    )


def test_batches_respect_record_and_byte_limits() -> None:
    reader = reader_over(encode_records(RECORDS), buffer_size=100)
    first = reader.read_batch(max_records=7)
    assert first == RECORDS[:7]
    second = reader.read_batch(max_records=1000, max_bytes=50)
    assert (second and sum(map(len, second)) <= 50) or len(second) == 1
    rest = []
    while batch := reader.read_batch(max_records=64):
        rest.extend(batch)
    assert first + second + rest == RECORDS
    assert reader.read_batch() == []
    assert reader.read_record() is None


def test_one_record_bigger_than_max_bytes_is_still_returned() -> None:
    reader = reader_over(encode_records([b"x" * 1000, b"y"]))
    assert reader.read_batch(max_bytes=10) == [b"x" * 1000]
    assert reader.read_batch(max_bytes=10) == [b"y"]


def test_resume_from_next_offset(tmp_path: Path) -> None:
    path = tmp_path / "f.tfrecord"
    write_tfrecord(path, RECORDS)
    with open_tfrecord(path) as reader:
        head = reader.read_batch(max_records=123)
        offset = reader.next_offset
    assert offset == offsets_of(RECORDS)[123]
    with open_tfrecord(path, offset=offset) as reader:
        assert head + list(reader) == RECORDS


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_roundtrip_and_resume(tmp_path: Path, compression: str) -> None:
    path = tmp_path / "f.tfrecord.z"
    write_tfrecord(path, RECORDS, compression)
    assert path.read_bytes()[:2] != encode_records(RECORDS[:1])[:2]
    offset = offsets_of(RECORDS)[50]
    with open_tfrecord(path, compression_type=compression, offset=offset) as reader:
        assert list(reader) == RECORDS[50:]


def test_resume_past_end_is_data_loss(tmp_path: Path) -> None:
    path = tmp_path / "f.tfrecord"
    write_tfrecord(path, RECORDS[:2])
    with pytest.raises(DataLossError, match="cannot resume at offset 9999"):
        open_tfrecord(path, offset=9999)


@pytest.mark.parametrize(
    ("flip", "message"),
    [
        (3, "corrupted record at offset {} in file mem.tfrecord \\(bad length"),
        (13, "corrupted record at offset {} in file mem.tfrecord \\(bad data"),
        (-2, "corrupted record at offset {} in file mem.tfrecord \\(bad data"),
    ],
)
def test_corruption_names_file_and_offset(flip: int, message: str) -> None:
    records = [b"good", b"bad record", b"after"]
    data = bytearray(encode_records(records))
    second = offsets_of(records)[1]
    data[second + flip if flip >= 0 else offsets_of(records)[2] + flip] ^= 0x40
    reader = reader_over(bytes(data))
    assert reader.read_batch() == [b"good"]  # good records first, then the error
    with pytest.raises(DataLossError, match=message.format(second)) as error:
        reader.read_batch()
    assert (error.value.path, error.value.offset) == ("mem.tfrecord", second)


def test_truncation_names_offset() -> None:
    data = encode_records([b"one", b"two"])[:-3]
    reader = reader_over(data)
    assert reader.read_record() == b"one"
    with pytest.raises(DataLossError, match=r"truncated record at offset 19 in file mem\.tfrecord"):
        reader.read_record()


def test_compressed_offsets_say_they_count_decompressed_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f.gz"
    with TFRecordWriter(path, "GZIP") as writer:
        writer.write(b"abc")
    import gzip

    framed = bytearray(gzip.decompress(path.read_bytes()))
    framed[14] ^= 1
    path.write_bytes(gzip.compress(bytes(framed)))
    with (
        open_tfrecord(path, compression_type="GZIP") as reader,
        pytest.raises(DataLossError, match="decompressed bytes of the GZIP stream"),
    ):
        reader.read_batch()


def test_corrupt_gzip_stream_is_data_loss(tmp_path: Path) -> None:
    path = tmp_path / "f.gz"
    write_tfrecord(path, RECORDS, "GZIP")
    path.write_bytes(path.read_bytes()[:60])
    with (
        open_tfrecord(path, compression_type="GZIP") as reader,
        pytest.raises(DataLossError, match=r"(truncated|corrupted) GZIP stream"),
    ):
        list(reader)


def test_skip_corrupt_follows_g5_rules() -> None:
    records = [b"a", b"bad", b"c", b"d"]
    offsets = offsets_of(records)
    data = bytearray(encode_records(records))
    data[offsets[1] + 12] ^= 1  # payload of "bad"
    reader = reader_over(bytes(data), skip_corrupt=True)
    assert list(reader) == [b"a", b"c", b"d"]
    assert (reader.skipped_records, reader.skipped_bytes) == (1, 19)
    assert reader.skipped[0].offset == offsets[1]

    data[offsets[2] + 1] ^= 1  # length of "c": the rest of the file is untrustworthy
    reader = reader_over(bytes(data), skip_corrupt=True)
    assert list(reader) == [b"a"]
    assert reader.skipped_records == 2
    assert reader.skipped_bytes == len(data) - offsets[1]
    assert [span.offset for span in reader.skipped] == offsets[1:3]


def test_skip_corrupt_counts_truncated_tail() -> None:
    data = encode_records([b"a", b"bb"])[:-1]
    reader = reader_over(data, skip_corrupt=True)
    assert list(reader) == [b"a"]
    assert (reader.skipped_records, reader.skipped_bytes) == (1, len(data) - 17)
    assert "truncated" in reader.skipped[0].reason


def test_huge_declared_length_is_refused_before_allocation() -> None:
    length = struct.pack("<Q", 2**60)
    data = length + struct.pack("<I", masked_crc32c(length)) + b"tiny"
    tracemalloc.start()
    try:
        with pytest.raises(RecordTooLargeError, match="declares 1152921504606846976 bytes"):
            reader_over(data).read_batch()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024


def test_max_record_bytes_bound_without_crc_check() -> None:
    data = encode_records([b"x" * 100])
    with pytest.raises(RecordTooLargeError, match="above max_record_bytes=99"):
        reader_over(data, max_record_bytes=99, verify_crc=False).read_batch()


def test_verify_crc_off_reads_payloads_with_bad_checksums() -> None:
    data = bytearray(encode_records([b"payload"]))
    data[-1] ^= 0xFF
    assert reader_over(bytes(data), verify_crc=False).read_batch() == [b"payload"]


def test_read_record_at(tmp_path: Path) -> None:
    path = tmp_path / "f.tfrecord"
    write_tfrecord(path, RECORDS)
    with open(path, "rb") as file:
        assert read_record_at(file, offsets_of(RECORDS)[42]) == RECORDS[42]
        with pytest.raises(DataLossError, match="corrupted record at offset 1"):
            read_record_at(file, 1)


def test_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="compression_type"):
        open_tfrecord("x", compression_type="gzip")
    with pytest.raises(InvalidArgumentError):
        reader_over(b"").read_batch(max_records=0)


# --------------------------------------------------------------------------- writer


def test_writer_is_atomic_on_exception(tmp_path: Path) -> None:
    path = tmp_path / "out.tfrecord"
    with pytest.raises(RuntimeError), TFRecordWriter(path) as writer:
        writer.write(b"partial")
        raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_writer_keeps_previous_file_until_success(tmp_path: Path) -> None:
    path = tmp_path / "out.tfrecord"
    write_tfrecord(path, [b"old"])
    writer = TFRecordWriter(path)
    writer.write(b"new")
    with open_tfrecord(path) as reader:
        assert list(reader) == [b"old"]
    writer.close()
    with open_tfrecord(path) as reader:
        assert list(reader) == [b"new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.tfrecord"]


def test_abandoned_writer_leaves_no_file(tmp_path: Path) -> None:
    writer = TFRecordWriter(tmp_path / "out.tfrecord")
    writer.write(b"x")
    del writer
    assert list(tmp_path.iterdir()) == []


def test_write_after_close_is_an_error(tmp_path: Path) -> None:
    writer = TFRecordWriter(tmp_path / "out.tfrecord")
    writer.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        writer.write(b"x")


# --------------------------------------------------------------------------- fuzzing


def _read_everything(data: bytes, **options: object) -> None:
    reader = reader_over(data, **{"max_record_bytes": 1 << 20, "buffer_size": 64, **options})
    for _ in range(len(data) + 2):  # each call makes progress or ends: no hang
        if not reader.read_batch(max_records=3):
            return
    raise AssertionError("reader did not terminate")


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_headrace_errors(data: bytes) -> None:
    with contextlib.suppress(HeadraceError):
        _read_everything(data)
    _read_everything(data, skip_corrupt=True, max_record_bytes=2**62)


@FUZZ
@given(
    st.lists(st.binary(max_size=40), min_size=1, max_size=5),
    st.data(),
)
def test_damaged_files_raise_only_headrace_errors(
    records: list[bytes], data: st.DataObject
) -> None:
    framed = bytearray(encode_records(records))
    action = data.draw(st.sampled_from(["flip", "truncate", "huge"]))
    if action == "flip":
        framed[data.draw(st.integers(0, len(framed) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "truncate":
        boundaries = set(offsets_of(records))
        cut = data.draw(st.integers(1, len(framed) - 1).filter(lambda n: n not in boundaries))
        framed = framed[:cut]
    else:
        framed[0:8] = struct.pack("<Q", data.draw(st.integers(2**20, 2**64 - 1)))
        framed[8:12] = struct.pack("<I", masked_crc32c(bytes(framed[0:8])))
    with pytest.raises(HeadraceError):
        _read_everything(bytes(framed))
    if action != "huge":  # a genuine too-large length raises even when skipping
        _read_everything(bytes(framed), skip_corrupt=True)


class _CountingStream(io.BytesIO):
    """A stream that counts the bytes read from it."""

    delivered = 0

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        self.delivered += len(data)
        return data

    def readinto(self, buffer: object, /) -> int:  # the reader's path for plain streams
        count = super().readinto(buffer)  # type: ignore[arg-type]
        self.delivered += count
        return count


class _ReadOnlyStream:
    """A stream with ``read`` only (no ``readinto``): the reader joins what it reads."""

    def __init__(self, data: bytes) -> None:
        self.inner = io.BytesIO(data)

    def read(self, size: int = -1, /) -> bytes:
        return self.inner.read(size)


def test_a_file_smaller_than_the_buffer_makes_no_reused_buffer(tmp_path: Path) -> None:
    """A small file is read in one piece (and its end found with a read of nothing): a
    256 KiB buffer made, zeroed and first-touched per file cost an interleave over
    1,000 files of 40 KB a quarter of its records per second. A larger one gets one."""
    from headrace.io.filepool import get_default_pool

    records = [b"r" * 100] * 50
    for count, made in ((50, False), (5_000, True)):
        path = tmp_path / f"f{count}.tfrecord"
        path.write_bytes(encode_records(records[:1] * count))
        with get_default_pool().open(str(path), None, buffer_size=8192) as stream:
            reader = TFRecordReader(stream, buffer_size=8192)  # type: ignore[arg-type]
            got = []
            while batch := reader.read_batch(64):
                got += batch
            assert len(got) == count and (reader._area is not None) == made


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 700), min_size=0, max_size=30),
    limits=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 900)), min_size=1, max_size=8),
    buffer_size=st.integers(1, 300),
)
def test_refills_into_a_reused_buffer_read_what_joined_reads_read(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    limits: list[tuple[int, int]],
    buffer_size: int,
) -> None:
    """The same records, batches and offsets whether the reader refills a reused buffer
    (``readinto``: a BytesIO, a file through the pool) or joins reads (``read`` only),
    with records smaller and larger than the buffer; the reused buffer stays at
    ``buffer_size`` after a larger record (that one's buffer is not kept)."""
    from headrace.io.filepool import get_default_pool

    records = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    data = encode_records(records)
    path = tmp_path_factory.mktemp("refill") / "r.tfrecord"
    path.write_bytes(data)
    pooled = get_default_pool().open(str(path), None, buffer_size=buffer_size)
    streams = [io.BytesIO(data), _ReadOnlyStream(data), pooled]
    results = []
    with pooled:
        for stream in streams:
            reader = TFRecordReader(stream, buffer_size=buffer_size)  # type: ignore[arg-type]
            got, step = [], 0
            while True:
                count, bound = limits[step % len(limits)]
                step += 1
                before = reader.next_offset
                batch = reader.read_batch(count, max_bytes=bound)
                if not batch:
                    break
                got.append((before, batch))
                assert reader._area is None or len(reader._area) == buffer_size
            results.append(got)
    assert results[0] == results[1] == results[2]
    assert [r for _, batch in results[0] for r in batch] == records




@settings(max_examples=60, deadline=None)
@example(small=[0, 21, 18], big=5000, bound=17, verify_crc=False)  # header refilled mid-batch
@given(
    small=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    big=st.integers(5_000, 50_000),
    bound=st.integers(0, 2_000),
    verify_crc=st.booleans(),
)
def test_next_length_and_max_bytes_leave_an_over_bound_payload_unread(
    small: list[int], big: int, bound: int, verify_crc: bool
) -> None:
    records = [b"s" * size for size in small] + [b"B" * big, b"t"]
    stream = _CountingStream(encode_records(records))
    reader = TFRecordReader(stream, buffer_size=64, verify_crc=verify_crc)  # type: ignore[arg-type]
    served: list[bytes] = []
    while len(served) < len(small):
        assert reader.next_length() == len(records[len(served)])  # from the header alone
        batch = reader.read_batch(64, max_bytes=bound)
        assert batch and sum(map(len, batch[1:])) <= bound
        served += batch
    assert served == records[: len(small)]  # stopped before the big one, every time
    assert stream.delivered < 16 * len(records) + sum(small) + 2 * 64 + 12
    assert reader.next_length() == big  # its header is read; its payload still is not
    assert stream.delivered < big
    assert reader.read_batch(64, max_bytes=0) == [records[-2]]  # one record always comes
    assert reader.read_batch(64) == [b"t"]
    assert reader.next_length() is None and reader.read_batch(64) == []


def test_next_length_leaves_bad_headers_to_read_batch() -> None:
    data = bytearray(encode_records([b"abc"]))
    data[8] ^= 0xFF  # the length's checksum
    reader = reader_over(bytes(data))
    assert reader.next_length() is None
    with pytest.raises(DataLossError, match="offset 0"):
        reader.read_batch(1)
    assert reader_over(encode_records([b"x" * 100]), max_record_bytes=10).next_length() is None
