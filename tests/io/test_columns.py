"""Bytes columns (headrace.io.columns): a list of ``bytes`` as one buffer plus int64
offsets, and back — the C extension and its pure-Python twin give identical results,
and process hand-offs carry object arrays of bytes as such columns."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace._memory.sizeof import sizeof
from headrace._workers import shm
from headrace.io import columns
from headrace.io._native import native_module, set_native_enabled

items_lists = st.lists(st.binary(max_size=40), max_size=60)


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest) -> Any:
    if request.param == "native":
        assert native_module() is not None, "the C extension must be built (setup.py build_ext)"
    previous = set_native_enabled(request.param == "native")
    yield request.param
    set_native_enabled(previous)


@settings(max_examples=60, deadline=None)
@given(items=items_lists)
def test_join_then_split_gives_the_same_bytes_on_both_paths(items: list[bytes]) -> None:
    results = []
    for native in (True, False):
        previous = set_native_enabled(native)
        try:
            joined = columns.join_bytes(items)
            assert joined is not None
            values, offsets = joined
            back = columns.split_bytes(values, offsets)
            results.append((values, offsets, back, columns.bytes_total(items)))
        finally:
            set_native_enabled(previous)
        assert back == items and all(type(b) is bytes for b in back)
        assert np.frombuffer(offsets, np.int64).tolist() == [0, *np.cumsum([len(b) for b in items], dtype=np.int64).tolist()]
    assert results[0] == results[1]
    assert results[0][3] == sum(map(len, items))


@settings(max_examples=60, deadline=None)
@given(items=items_lists)
def test_lengths_are_the_items_lengths_on_both_paths(items: list[bytes]) -> None:
    """What an origin log keeps of a batch of records: 8 bytes per record, no Python int."""
    for native in (True, False):
        previous = set_native_enabled(native)
        try:
            got = columns.lengths(items)
        finally:
            set_native_enabled(previous)
        assert list(got) == [len(item) for item in items] and got.itemsize == 8
        assert sum(got[:3]) == sum(map(len, items[:3]))


def test_lengths_refuses_what_is_not_bytes() -> None:
    with pytest.raises(TypeError, match="item 1 is not bytes"):
        columns.lengths([b"a", bytearray(b"b")])


def test_an_origin_log_keeps_the_offsets_of_its_newest_records_only() -> None:
    """Bounded by records and by spans: whole batches of 1,024 logged for hours keep the
    offsets of the last ``_RECORDS_KEPT`` records (older ones: None), lines (a span
    each) of the last ``_SPANS_KEPT``: bounded memory either way."""
    from headrace._sources import files

    log = files.OriginLog()
    log.opened(0, 0, 0)
    batches = 3 * files._RECORDS_KEPT // 1024
    for b in range(batches):
        log.span(b * 1024, b * 1024 * 116, columns.lengths([b"x" * 100] * 1024), 16)
    assert log.records <= files._RECORDS_KEPT and len(log.spans) <= files._RECORDS_KEPT // 1024
    last = batches * 1024 - 1
    assert log.find(last) == (0, last, last * 116)
    assert log.find(last - files._RECORDS_KEPT + 1) is not None
    assert log.find(0) is None  # its span was dropped: no offset
    lines = files.OriginLog()  # one span per line: at most _SPANS_KEPT of them
    for serial in range(2 * files._SPANS_KEPT):
        lines.span(serial, serial * 10, None, 0)
    assert len(lines.spans) == files._SPANS_KEPT and lines.records == files._SPANS_KEPT


@pytest.mark.parametrize("odd", [bytearray(b"x"), memoryview(b"x"), np.bytes_(b"x"), "x", 1, None])
def test_anything_but_exact_bytes_is_left_to_pickle(path: str, odd: Any) -> None:
    items = [b"a", odd, b"c"]
    assert columns.join_bytes(items) is None
    assert columns.bytes_total(items) == -1


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([1, 2], "do not start at 0"),
        ([0, 3, 2], r"offset 2 \(2\) is out of order"),
        ([0, 2, 9], r"offset 2 \(9\) is out of order or past the data \(4 bytes\)"),
        ([], "offsets"),
    ],
)
def test_offsets_that_do_not_fit_the_values_are_refused(path: str, offsets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        columns.split_bytes(b"abcd", np.array(offsets, np.int64).tobytes())


def test_split_accepts_views_of_a_segment(path: str) -> None:
    buffer = np.frombuffer(b"..hello" + b"world", np.uint8)[2:]
    offsets = np.array([0, 5, 10], np.int64)
    assert columns.split_bytes(memoryview(buffer), offsets) == [b"hello", b"world"]


def _roundtrip(obj: Any) -> tuple[Any, shm.Packet]:
    mappings: list[Any] = []

    def allocate(nbytes: int) -> tuple[int, str, int, Any]:
        import mmap

        mappings.append(mmap.mmap(-1, max(nbytes, 1)))
        return 0, "", nbytes, mappings[-1]

    packet = shm.pack(obj, allocate)
    return shm.unpack(packet, mappings[-1] if mappings else None, lambda view: None), packet


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(st.binary(max_size=300), min_size=0, max_size=80),
    shape=st.sampled_from(["flat", "2d", "nested"]),
)
def test_object_arrays_of_bytes_cross_as_columns_equal_and_their_own(items: list[bytes], shape: str) -> None:
    array = np.empty(len(items), object)
    array[:] = items
    if shape == "2d" and len(items) % 2 == 0:
        array = array.reshape(2, -1)
    element = {"id": array, "again": array, "x": np.arange(3)} if shape == "nested" else array
    back, packet = _roundtrip([element])
    got = back[0]["id"] if shape == "nested" else back[0]
    assert got.dtype == object and got.shape == array.shape and got.base is None
    assert got.tolist() == array.tolist() and all(type(b) is bytes for b in got.ravel())
    if shape == "nested":
        assert back[0]["again"] is got  # one array sent once, received once
    # costed like the original: the same items, its own array
    assert sizeof(got) == sizeof(array.copy())
    # nothing per item in the pickle: the values travel as one buffer
    column = sum(map(len, items)) + 8 * (len(items) + 1)
    if column >= shm.COLUMN_SEGMENT_BYTES:
        assert len(packet.payload) < 1024


def test_object_arrays_of_other_things_pickle_as_before() -> None:
    mixed = np.array([b"a", "b", 3, None, bytearray(b"z")], dtype=object)
    back, _ = _roundtrip(mixed)
    assert back.tolist() == mixed.tolist() and type(back[4]) is bytearray


def test_no_segment_is_needed_for_a_small_column() -> None:
    small = np.array([b"a", b"bc"], dtype=object)
    back, packet = _roundtrip(small)
    assert packet.segment is None and back.tolist() == [b"a", b"bc"]
    assert shm.loads(packet.payload).tolist() == [b"a", b"bc"]


def _records_case(seed: int) -> Any:
    """A batch of records as a reader or a user hands it over: a list of ``bytes``
    mostly, sometimes with a bytearray, a memoryview, an ``np.bytes_`` or a ``bytes``
    subclass in it, sometimes a tuple."""
    rng = np.random.default_rng(seed)
    records: list[Any] = [bytes(rng.integers(0, 256, int(rng.integers(0, 300)), np.uint8))
                          for _ in range(int(rng.integers(10, 200)))]
    odd = int(rng.integers(0, 6))
    if odd < 4:
        at = int(rng.integers(0, len(records)))
        kinds = (bytearray, memoryview, np.bytes_, type("Sub", (bytes,), {}))
        records[at] = kinds[odd](records[at])
    return tuple(records) if odd == 4 else records


@pytest.mark.parametrize("seed", range(40))
def test_wire_bytes_is_the_sum_of_the_lengths_with_no_call_per_record(
    path: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle: ``sum(map(len, records))``. A list of exact ``bytes`` (a reader's
    batch) is summed in C where the extension is built: the parse stage's bound on a
    batch (``BatchParser.most_nbytes``) calls no ``len`` per record (one each cost a
    tenth of the read-and-parse speed of small records)."""
    from headrace.io.example import parsing

    records = _records_case(seed)
    calls: list[int] = []

    def counted_len(obj: Any) -> int:
        calls.append(1)
        return len(obj)

    parser = parsing.BatchParser({"x": parsing.FixedLenFeature((4,), np.float32)})
    monkeypatch.setattr(parsing, "len", counted_len, raising=False)
    parser.most_nbytes(records)
    monkeypatch.undo()
    exact = type(records) is list and all(type(r) is bytes for r in records)
    if path == "native" and exact:
        assert len(calls) <= 4, len(calls)  # of the batch and the spec, none per record
    assert columns.wire_bytes(records) == sum(map(len, records))
