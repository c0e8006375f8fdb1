"""Checking a run of alike records in one pass, and load().batch(n) reading into rows.

``check_alike_records`` replaces a CRC call (and a copied-out payload) per record by one
CRC32C pass over the whole run: it must refuse exactly what the per-record reader
refuses, at the same record, and pass what it passes. ``load().batch(n)`` reads large
records straight into the batch's rows and small ones through one reused buffer: the
batches must be the plain batch's, and a damaged record must stop them at an error that
names its file and offset.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import headrace as hr
from headrace._errors import DataLossError
from headrace._persist.records import EvenOffsets, check_alike_records, check_scattered, one_size
from headrace.io import _native
from headrace.io.tfrecord.framing import encode_records
from headrace.io.tfrecord.reader import records_in_spans


def _run(rows: int, payload: int, seed: int) -> tuple[bytes, list[bytes]]:
    rng = np.random.default_rng(seed)
    records = [rng.bytes(payload) for _ in range(rows)]
    return encode_records(records), records


@pytest.mark.parametrize(("rows", "payload"), [(1, 5), (7, 1), (300, 120), (40, 5000)])
def test_a_sound_run_passes_and_gives_each_records_footer(rows: int, payload: int) -> None:
    framed, _ = _run(rows, payload, rows)
    size = payload + 16
    buffer = bytearray(framed)
    footers = check_alike_records(memoryview(buffer), rows, size, 1000, "f")
    expected = [
        int.from_bytes(framed[row * size + size - 4 : (row + 1) * size], "little")
        for row in range(rows)
    ]
    assert footers.tolist() == expected
    for row in range(rows):  # the payloads are left as they were
        start = row * size + 12
        assert buffer[start : start + payload] == framed[start : start + payload]


@pytest.mark.parametrize("seed", range(12))
def test_any_flipped_bit_is_refused_at_its_record_as_the_reader_refuses_it(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, payload = int(rng.integers(2, 200)), int(rng.integers(1, 300))
    framed, _ = _run(rows, payload, seed)
    size = payload + 16
    damaged = bytearray(framed)
    where = int(rng.integers(len(damaged)))
    damaged[where] ^= 1 << int(rng.integers(8))
    start = 4096 * 3
    with pytest.raises(DataLossError) as reader:
        records_in_spans([bytes(damaged)], [rows], [start], path="data")
    with pytest.raises(DataLossError, match="in file data") as ours:
        check_alike_records(memoryview(damaged), rows, size, start, "data")
    assert ours.value.offset == start + where // size * size
    assert ours.value.path == "data"
    assert reader.value.offset == ours.value.offset  # the same record, named alike


def test_two_records_swapped_within_a_run_still_pass_each_their_own_check() -> None:
    """As with a CRC per record: each record is sound by itself (the cache's manifest,
    which lists each record's CRC, is what refuses them in the wrong place)."""
    framed, _ = _run(10, 30, 1)
    size = 46
    swapped = bytearray(framed)
    swapped[2 * size : 3 * size], swapped[5 * size : 6 * size] = (
        framed[5 * size : 6 * size], framed[2 * size : 3 * size]
    )
    footers = check_alike_records(memoryview(swapped), 10, size, 0, "f")
    original = check_alike_records(memoryview(bytearray(framed)), 10, size, 0, "f")
    assert footers[[2, 5]].tolist() == original[[5, 2]].tolist()


native = _native._loaded_extension


def _native_check(framed: bytes | bytearray, rows: int, size: int, head: bytes) -> tuple[int, list[int]]:
    assert native is not None, "build it: python setup.py build_ext --inplace"
    footers = np.zeros(rows, np.uint32)
    return native.check_alike(bytes(framed), rows, size, head, footers), footers.tolist()


# rows: 1, 2 (no group of three), 3, 4 and 7 (a group and a rest); payloads: a head and
# nothing more, a few bytes past it (not a whole word), long ones checked one by one
@pytest.mark.parametrize(("rows", "rest"), [(1, 0), (2, 5), (3, 8), (4, 13), (7, 120), (5, 5000)])
def test_the_c_run_check_passes_a_sound_run_and_gives_each_records_footer(
    rows: int, rest: int
) -> None:
    rng = np.random.default_rng(rows)
    head = b"\x05\x00\x00\x00skel!"
    framed = encode_records([head + rng.bytes(rest) for _ in range(rows)])
    size = len(framed) // rows
    wrong, footers = _native_check(framed, rows, size, head)
    assert wrong == -1
    assert footers == [
        int.from_bytes(framed[(row + 1) * size - 4 : (row + 1) * size], "little")
        for row in range(rows)
    ]


@pytest.mark.parametrize("seed", range(16))
def test_the_c_run_check_flags_the_record_with_a_flipped_bit(seed: int) -> None:
    """Any bit of any record — its frame, its skeleton, its data, its footer — makes
    that record the first one flagged (the reader then checks it alone for the error)."""
    rng = np.random.default_rng(seed)
    rows, rest = int(rng.integers(1, 40)), int(rng.integers(0, 300))
    head = b"\x09\x00\x00\x00skeleton!"
    framed = encode_records([head + rng.bytes(rest) for _ in range(rows)])
    size = len(framed) // rows
    damaged = bytearray(framed)
    where = int(rng.integers(len(damaged)))
    damaged[where] ^= 1 << int(rng.integers(8))
    assert _native_check(damaged, rows, size, head)[0] == where // size


def test_the_c_run_check_flags_a_sound_record_of_another_skeleton_and_refuses_short_buffers() -> None:
    head, other = b"\x03\x00\x00\x00abc", b"\x03\x00\x00\x00abd"
    framed = encode_records([head + bytes(50), head + bytes(50), head + bytes(50), other + bytes(50)])
    assert _native_check(framed, 4, 73, head)[0] == 3
    assert _native_check(framed, 3, 73, head)[0] == -1
    with pytest.raises(ValueError, match="smaller than rows"):
        _native_check(framed, 5, 73, head)


def _scattered(
    framed: bytes, rows: int, head: bytes, widths: list[int]
) -> tuple[bytearray, list[np.ndarray], int]:
    """Records laid out as a scattered read lays them: frame header and skeleton, then
    each leaf's bytes into its target's row, then the footer."""
    size = len(framed) // rows
    prefix = 12 + len(head)
    frames = bytearray(rows * (prefix + 4))
    targets = [np.zeros((rows, width), np.uint8) for width in widths]
    for row in range(rows):
        record = framed[row * size : (row + 1) * size]
        frames[row * (prefix + 4) : row * (prefix + 4) + prefix] = record[:prefix]
        at = prefix
        for target, width in zip(targets, widths, strict=True):
            target[row] = np.frombuffer(record[at : at + width], np.uint8)
            at += width
        frames[row * (prefix + 4) + prefix : (row + 1) * (prefix + 4)] = record[-4:]
    return frames, targets, prefix


@pytest.mark.parametrize("seed", range(10))
def test_records_read_into_rows_are_refused_at_the_record_that_changed(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, widths = int(rng.integers(1, 40)), [int(w) for w in rng.integers(0, 3000, 2)]
    head = b"\x09\x00\x00\x00skeleton!"
    payloads = [head + rng.bytes(sum(widths)) for _ in range(rows)]
    framed = encode_records(payloads)
    frames, targets, prefix = _scattered(framed, rows, head, widths)
    footers, wrong = check_scattered(memoryview(frames), prefix, head, targets, list(range(rows)))
    assert wrong == -1
    size = len(framed) // rows
    assert footers.tolist() == [
        int.from_bytes(framed[(row + 1) * size - 4 : (row + 1) * size], "little")
        for row in range(rows)
    ]
    damaged = bytearray(framed)
    where = int(rng.integers(len(damaged)))
    damaged[where] ^= 1 << int(rng.integers(8))
    frames, targets, prefix = _scattered(bytes(damaged), rows, head, widths)
    _, wrong = check_scattered(memoryview(frames), prefix, head, targets, list(range(rows)))
    assert wrong == where // size


def test_a_sound_record_of_another_skeleton_is_flagged() -> None:
    head, other = b"\x03\x00\x00\x00abc", b"\x03\x00\x00\x00abd"
    framed = encode_records([head + bytes(50), other + bytes(50), head + bytes(50)])
    frames, targets, prefix = _scattered(framed, 3, head, [50])
    assert check_scattered(memoryview(frames), prefix, head, targets, [0, 1, 2])[1] == 1


def _touch_like(path: Path, data: bytes) -> None:
    stat = os.stat(path)
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot: the mtime stays


@pytest.mark.parametrize("width", [3, 3000], ids=["in-pieces", "into-rows"])
@pytest.mark.parametrize("shards", [1, 3])
def test_loaded_batches_interleave_shards_as_the_plain_batch(
    tmp_path: Path, width: int, shards: int
) -> None:
    source = hr.Dataset.range(101).map(
        lambda i: {"v": np.full(width, i, np.int32), "i": i, "f": np.float32(i) / 2}
    )
    path = str(tmp_path / "saved")
    source.save(path, num_shards=shards)
    got = list(hr.Dataset.load(path).batch(16))
    assert len(got) == 7
    for number, batch in enumerate(got):
        rows = np.arange(number * 16, min(101, number * 16 + 16))
        assert batch["i"].dtype == np.int64 and batch["i"].tolist() == rows.tolist()
        assert batch["v"].shape == (len(rows), width)
        assert np.array_equal(batch["v"], np.repeat(rows[:, None], width, 1).astype(np.int32))
        assert batch["f"].dtype == np.float32
        assert batch["f"].tolist() == (rows.astype(np.float32) / 2).tolist()


@pytest.mark.parametrize("width", [3, 3000], ids=["in-pieces", "into-rows"])
@pytest.mark.parametrize("seed", range(3))
def test_a_flipped_byte_in_a_loaded_record_names_its_file_and_offset(
    tmp_path: Path, width: int, seed: int
) -> None:
    """The bytes rot after the first batch (``load`` checks its files, and an index
    checks its file, when first read): the batches' own reads must catch it, before
    any batch holding the changed record is handed out."""
    path = tmp_path / "saved"
    hr.Dataset.range(60).map(lambda i: np.full(width, i, np.int64)).save(
        str(path), num_shards=2
    )
    iterator = iter(hr.Dataset.load(str(path)).batch(8))
    assert next(iterator)[:, 0].tolist() == list(range(8))  # shard 1's records 0 to 3
    shard = sorted(path.glob("shard-00001-*.tfrecord"))[0]
    raw = bytearray(shard.read_bytes())
    record = len(raw) // 30
    rng = np.random.default_rng(seed)
    where = int(rng.integers(4 * record, len(raw)))
    raw[where] ^= 1 << int(rng.integers(8))
    _touch_like(shard, bytes(raw))
    served = []
    with pytest.raises(hr.DataLossError, match=f"in file {shard}") as raised:
        for batch in iterator:
            served.append(batch[:, 0].tolist())
    assert raised.value.path == str(shard)
    assert raised.value.offset == where // record * record
    damaged = 2 * (where // record) + 1  # the element shard 1's damaged record holds
    assert served == [list(range(k, k + 8)) for k in range(8, damaged // 8 * 8, 8)]


def test_one_size_is_the_shared_framed_size_or_zero() -> None:
    assert one_size(np.array([0, 10, 20], np.uint64), 30) == 10
    assert one_size(np.array([0], np.uint64), 7) == 7  # one record: the file's length
    assert one_size(np.array([0, 10, 20], np.uint64), 31) == 0  # the last one differs
    assert one_size(np.array([0, 10, 21], np.uint64), 31) == 0  # one in the middle
    assert one_size(np.array([], np.uint64), 0) == 0
    evenly = np.arange(0, 10 * 200_000, 10, dtype=np.uint64)  # past one slice of 65,536
    assert one_size(evenly, 10 * 200_000) == 10
    evenly[100_000] += 1
    assert one_size(evenly, 10 * 200_000) == 0


def test_even_offsets_index_as_the_array_they_replace() -> None:
    array = np.arange(0, 7 * 9, 7, dtype=np.uint64)
    even = EvenOffsets(7, 9)
    assert len(even) == 9 and even.nbytes == 0
    assert [even[i] for i in range(-9, 9)] == [int(x) for x in array[-9:]] + array.tolist()
    for key in (slice(2, 5), slice(None), slice(3, None, 2), slice(7, 20)):
        assert even[key].tolist() == array[key].tolist()
    with pytest.raises(IndexError, match="record 9 of 9"):
        even[9]
    with pytest.raises(IndexError):
        even[-10]
