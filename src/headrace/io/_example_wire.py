"""Protobuf wire format for tf.train.Example, in pure Python: encoding, decoding, and the
column scan that the C extension (``_hrio.parse_example_columns``) mirrors exactly.

Only what Example / SequenceExample need (``tensorflow/core/example/feature.proto``)::

    Example         { Features features = 1; }
    SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }
    Features        { map<string, Feature> feature = 1; }   entry: key = 1, value = 2
    FeatureLists    { map<string, FeatureList> feature_list = 1; }
    FeatureList     { repeated Feature feature = 1; }
    Feature         { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }   FloatList { repeated float value = 1 [packed]; }
    Int64List { repeated int64 value = 1 [packed]; }

Decoding rules (shared with the C twin, so both give identical results):

* Unknown fields, and known fields with an unexpected wire type, are skipped; wire types
  3/4 (groups) and 6/7 are malformed.
* Lists accept both packed and unpacked encodings, concatenated in order.
* In a Feature, the last ``kind`` field wins; a Feature without one counts as *missing*
  (as ``tf.io.parse_example`` does).
* A key repeated in one Features map: the last entry wins and earlier ones are ignored
  entirely, not even type-checked (as ``tf.io.parse_example``'s fast path does).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np

__all__ = [
    "KIND_BYTES",
    "KIND_FLOAT",
    "KIND_INT64",
    "KIND_NAMES",
    "KIND_NONE",
    "Malformed",
    "ParseFailure",
    "RawColumn",
    "decode_feature_list_map",
    "decode_features",
    "encode_feature",
    "encode_features",
    "encode_message_field",
    "scan_columns",
    "scan_columns_exact",
]

# Field numbers of Feature's oneof double as kind codes (also in the C extension).
KIND_NONE = 0
KIND_BYTES = 1
KIND_FLOAT = 2
KIND_INT64 = 3
KIND_NAMES = {KIND_NONE: "none", KIND_BYTES: "bytes", KIND_FLOAT: "float", KIND_INT64: "int64"}

# ParseFailure codes (also in the C extension).
FAILURE_MALFORMED = 1
FAILURE_KIND = 2

_WIRE_VARINT = 0
_WIRE_FIXED64 = 1
_WIRE_LEN = 2
_WIRE_FIXED32 = 5
_UINT64 = (1 << 64) - 1
_INT64_SIGN = 1 << 63


class ParseFailure(ValueError):
    """Internal, structured parse failure; :mod:`headrace.io.example` turns it into a
    :class:`~headrace._errors.ParseError` with a readable message.

    ``args`` = ``(code, record_index, key_index, position, found_kind)``; the C extension
    raises its own class with the same ``args``.
    """


# --------------------------------------------------------------------------- encoding


def encode_varint(value: int) -> bytes:
    """Protobuf base-128 varint of ``value`` taken as uint64 (negatives use 10 bytes)."""
    value &= _UINT64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_message_field(field_number: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return encode_varint(field_number << 3 | _WIRE_LEN) + encode_varint(len(payload)) + payload


def encode_feature(kind: int, payload: bytes) -> bytes:
    """A Feature holding one list whose packed/repeated ``payload`` is already encoded.

    An empty list is still written (as an empty sub-message): "present but empty" differs
    from "missing" for ``parse_example``.
    """
    return encode_message_field(kind, payload)


def encode_float_payload(raw_little_endian: bytes) -> bytes:
    return encode_message_field(1, raw_little_endian) if raw_little_endian else b""


def encode_int64_payload(values: Sequence[int]) -> bytes:
    if not values:
        return b""
    return encode_message_field(1, b"".join(encode_varint(value) for value in values))


def encode_bytes_payload(values: Sequence[bytes]) -> bytes:
    return b"".join(encode_message_field(1, value) for value in values)


def encode_features(encoded_features: dict[str, bytes]) -> bytes:
    """A Features message; keys sorted, as protobuf's deterministic serialization sorts
    map keys (TensorFlow's ``SerializeToString(deterministic=True)``)."""
    entries = []
    for key in sorted(encoded_features):
        entry = encode_message_field(1, key.encode("utf-8")) + encode_message_field(
            2, encoded_features[key]
        )
        entries.append(encode_message_field(1, entry))
    return b"".join(entries)


# --------------------------------------------------------------------------- decoding


class Malformed(Exception):
    """Raised at the byte position where decoding failed; converted by callers."""

    def __init__(self, position: int) -> None:
        super().__init__(position)
        self.position = position


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    start = pos
    result = 0
    shift = 0
    while True:
        if pos >= end or shift >= 70:
            raise Malformed(start)
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _UINT64, pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(field_number, wire_type, value_start, value_end)`` for each field.

    For varints the value range covers the varint bytes; for length-delimited fields it
    covers the payload. Malformed input raises ``Malformed`` at the field's start.
    """
    while pos < end:
        field_start = pos
        tag, pos = _read_varint(buf, pos, end)
        wire_type = tag & 7
        field_number = tag >> 3
        if wire_type == _WIRE_VARINT:
            value_start = pos
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == _WIRE_LEN:
            length, value_start = _read_varint(buf, pos, end)
            if length > end - value_start:
                raise Malformed(field_start)
            pos = value_start + length
        elif wire_type in (_WIRE_FIXED64, _WIRE_FIXED32):
            value_start = pos
            pos += 8 if wire_type == _WIRE_FIXED64 else 4
            if pos > end:
                raise Malformed(field_start)
        else:
            raise Malformed(field_start)
        if field_number == 0:
            raise Malformed(field_start)
        yield field_number, wire_type, value_start, pos


def _map_entries(buf: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """Yield ``(key, value_start, value_end)`` of each entry of a Features-like map.

    A missing key is ``b""``; a missing value is an empty range (a Feature with no kind).
    """
    for field_number, wire_type, entry_start, entry_end in _fields(buf, start, end):
        if field_number != 1 or wire_type != _WIRE_LEN:
            continue
        key = b""
        value_start = value_end = entry_end
        for sub_number, sub_wire, sub_start, sub_end in _fields(buf, entry_start, entry_end):
            if sub_wire != _WIRE_LEN:
                continue
            if sub_number == 1:
                key = buf[sub_start:sub_end]
            elif sub_number == 2:
                value_start, value_end = sub_start, sub_end
        yield key, value_start, value_end


def _example_entries(buf: bytes, map_field: int) -> list[tuple[bytes, int, int]]:
    """All map entries of every occurrence of message field ``map_field`` (merged, as
    protobuf merges repeated occurrences of a singular message field)."""
    entries: list[tuple[bytes, int, int]] = []
    for field_number, wire_type, start, end in _fields(buf, 0, len(buf)):
        if field_number == map_field and wire_type == _WIRE_LEN:
            entries.extend(_map_entries(buf, start, end))
    return entries


def _feature_kind(buf: bytes, start: int, end: int) -> tuple[int, int, int]:
    """Return ``(kind, list_start, list_end)`` of a Feature (last kind field wins)."""
    kind, list_start, list_end = KIND_NONE, start, start
    for field_number, wire_type, sub_start, sub_end in _fields(buf, start, end):
        if wire_type == _WIRE_LEN and field_number in (KIND_BYTES, KIND_FLOAT, KIND_INT64):
            kind, list_start, list_end = field_number, sub_start, sub_end
    return kind, list_start, list_end


def _append_list_values(
    buf: bytes, kind: int, start: int, end: int, out: bytearray | list[bytes]
) -> int:
    """Append a list's values to ``out`` (raw little-endian for numbers); return the count."""
    count = 0
    for field_number, wire_type, value_start, value_end in _fields(buf, start, end):
        if field_number != 1:
            continue
        if kind == KIND_BYTES:
            if wire_type == _WIRE_LEN:
                out.append(buf[value_start:value_end])  # type: ignore[arg-type]
                count += 1
        elif kind == KIND_FLOAT:
            if wire_type == _WIRE_FIXED32 or (
                wire_type == _WIRE_LEN and (value_end - value_start) % 4 == 0
            ):
                out.extend(buf[value_start:value_end])  # type: ignore[arg-type]
                count += (value_end - value_start) // 4
            elif wire_type == _WIRE_LEN:
                raise Malformed(value_start)
        elif wire_type in (_WIRE_VARINT, _WIRE_LEN):
            count += _append_varints(buf, value_start, value_end, out)  # type: ignore[arg-type]
    return count


_INT64 = struct.Struct("<q")


def _append_varints(buf: bytes, start: int, end: int, out: bytearray) -> int:
    count = 0
    pos = start
    while pos < end:
        value, pos = _read_varint(buf, pos, end)
        out.extend(_INT64.pack(value - (1 << 64) if value & _INT64_SIGN else value))
        count += 1
    return count


# --------------------------------------------------------------------------- columns

RawColumn = tuple[bytearray | list[bytes], bytearray]
"""``(values, counts)``: values as raw little-endian float32/int64 bytes or a list of
bytes; counts as little-endian int64 per record, -1 where the feature is missing."""


def scan_columns(
    serialized: Sequence[bytes], keys: Sequence[bytes], kinds: Sequence[int]
) -> list[RawColumn]:
    """Gather the values of features ``keys`` (expected ``kinds``) across a batch.

    Pure-Python twin of ``_hrio.parse_example_columns`` (same results, same
    :class:`ParseFailure`). Records in the layout every protobuf serializer writes take
    :func:`_scan_canonical`'s fast path; any other record, and any error, goes through
    :func:`scan_columns_exact`'s rules, so the two cannot disagree. A batch of canonical
    records is read with NumPy as a whole (:func:`_scan_vectorised`).
    """
    if len(serialized) >= _VECTOR_MIN_RECORDS and set(map(type, serialized)) == {bytes}:
        try:
            return _scan_vectorised_chunks(serialized, keys, kinds)
        except _NotCanonical:
            pass
    return _scan_canonical(serialized, keys, kinds)


def _scan_vectorised_chunks(
    records: Sequence[bytes], keys: Sequence[bytes], kinds: Sequence[int]
) -> list[RawColumn]:
    """:func:`_scan_vectorised` over chunks of at most :data:`_VECTOR_CHUNK_BYTES`: its
    working arrays (a few int64s per map entry, up to ~10 times the records' bytes) stay
    bounded however large the batch, as the C extension's do."""
    chunks: list[list[RawColumn]] = []
    start = 0
    size = 0
    for end, record in enumerate(records, 1):
        size += len(record)
        if size >= _VECTOR_CHUNK_BYTES or end == len(records):
            chunks.append(_scan_vectorised(records[start:end], keys, kinds))
            start, size = end, 0
    if len(chunks) == 1:
        return chunks[0]
    columns: list[RawColumn] = []
    for index in range(len(kinds)):
        parts = [chunk[index] for chunk in chunks]
        counts = bytearray(b"".join(counts for _, counts in parts))
        if kinds[index] == KIND_BYTES:
            listed: list[bytes] = []
            for values, _ in parts:
                listed.extend(cast(list[bytes], values))
            columns.append((listed, counts))
        else:
            joined = b"".join(cast(bytearray, values) for values, _ in parts)
            columns.append((bytearray(joined), counts))
    return columns


def scan_columns_exact(
    serialized: Sequence[bytes], keys: Sequence[bytes], kinds: Sequence[int]
) -> list[RawColumn]:
    """:func:`scan_columns` by the general field-by-field decoder alone (the reference
    that the fast path defers to; also what tests compare it with)."""
    key_index = {key: index for index, key in enumerate(keys)}
    columns: list[RawColumn] = [
        ([] if kind == KIND_BYTES else bytearray(), bytearray()) for kind in kinds
    ]
    for record_index, record in enumerate(serialized):
        try:
            found = _scan_record(bytes(record), key_index, kinds, columns, record_index)
        except Malformed as malformed:
            raise ParseFailure(
                FAILURE_MALFORMED, record_index, -1, malformed.position, KIND_NONE
            ) from None
        for index, count in enumerate(found):
            columns[index][1].extend(_INT64.pack(count))
    return columns


def _scan_record(
    record: bytes,
    key_index: dict[bytes, int],
    kinds: Sequence[int],
    columns: list[RawColumn],
    record_index: int,
) -> list[int]:
    counts = [-1] * len(kinds)
    entries = _example_entries(record, 1)
    for key, value_start, value_end in reversed(entries):
        index = key_index.get(key)
        if index is None or counts[index] != -1:
            continue
        kind, list_start, list_end = _feature_kind(record, value_start, value_end)
        if kind == KIND_NONE:
            continue
        if kind != kinds[index]:
            raise ParseFailure(FAILURE_KIND, record_index, index, value_start, kind)
        counts[index] = _append_list_values(record, kind, list_start, list_end, columns[index][0])
    return counts


# --------------------------------------------------------------------------- fast path
#
# Every protobuf serializer (TensorFlow's and upb's: see test_example_fast_scan_tf.py;
# this module's encode_*) writes an Example in one layout: one Features field spanning the record; each map entry as key
# then value; each Feature as one list; each list packed (float, int64) or as a run of
# value fields (bytes). _canonical_record reads that layout with slices and a few byte
# comparisons, and leaves int64 varints encoded, to be decoded for the whole batch by
# NumPy. Whatever it does not recognise (other layouts, unknown fields, a repeated key,
# a type mismatch, damage) it hands, record by record, to the general decoder, so
# results and errors are the general decoder's.

_HIGH_BYTES = bytes(range(0x80, 0x100))
_MISSING_NONE = -2  # a requested key seen with an empty Feature (missing, yet seen)

# What _canonical_record gathers from one record: per requested key, its count (-1 when
# missing), and (key index, data) pairs: data is the float list's little-endian bytes,
# the int64 list's packed varints, or the list of bytes values.
_Gathered = tuple[list[int], list[tuple[int, bytes | list[bytes]]]]


def _long_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A varint of two or more bytes at ``pos``. Past the buffer's end, or over 10 bytes:
    IndexError, which :func:`_canonical_record` takes as "not canonical" (its position
    checks catch a varint that runs past a sub-message's end)."""
    result = 0
    shift = 0
    while shift < 70:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _UINT64, pos
        shift += 7
    raise IndexError(pos)


def _canonical_record(  # noqa: C901
    buf: bytes, key_index: dict[bytes, int], kinds: Sequence[int]
) -> _Gathered | None:
    """One record in the canonical layout, or None when it is laid out otherwise."""
    found = [-1] * len(kinds)
    gathered: list[tuple[int, bytes | list[bytes]]] = []
    end = len(buf)
    if not end:
        return found, gathered
    try:
        if buf[0] != 0x0A:
            return None
        length = buf[1]
        pos = 2
        if length >= 0x80:
            length, pos = _long_varint(buf, 1)
        if pos + length != end:
            return None
        while pos < end:
            if buf[pos] != 0x0A:
                return None
            length = buf[pos + 1]
            pos += 2
            if length >= 0x80:
                length, pos = _long_varint(buf, pos - 1)
            entry_end = pos + length
            if buf[pos] != 0x0A:
                return None
            length = buf[pos + 1]
            pos += 2
            if length >= 0x80:
                length, pos = _long_varint(buf, pos - 1)
            key = buf[pos : pos + length]
            pos += length
            if buf[pos] != 0x12:
                return None
            length = buf[pos + 1]
            pos += 2
            if length >= 0x80:
                length, pos = _long_varint(buf, pos - 1)
            if pos + length != entry_end or entry_end > end:
                return None
            index = key_index.get(key)
            if index is None:
                pos = entry_end
                continue
            if found[index] != -1:
                return None  # a repeated key: the general decoder's rule decides
            if not length:
                found[index] = _MISSING_NONE
                continue
            tag = buf[pos]
            kind = tag >> 3
            if tag & 7 != _WIRE_LEN or kind != kinds[index]:
                return None
            length = buf[pos + 1]
            pos += 2
            if length >= 0x80:
                length, pos = _long_varint(buf, pos - 1)
            if pos + length != entry_end:
                return None
            if not length:
                found[index] = 0
                continue
            if kind == KIND_BYTES:
                values: list[bytes] = []
                while pos < entry_end:
                    if buf[pos] != 0x0A:
                        return None
                    length = buf[pos + 1]
                    pos += 2
                    if length >= 0x80:
                        length, pos = _long_varint(buf, pos - 1)
                    values.append(buf[pos : pos + length])
                    pos += length
                if pos != entry_end:
                    return None
                found[index] = len(values)
                gathered.append((index, values))
                continue
            if buf[pos] != 0x0A:
                return None
            length = buf[pos + 1]
            pos += 2
            if length >= 0x80:
                length, pos = _long_varint(buf, pos - 1)
            if pos + length != entry_end:
                return None
            payload = buf[pos:entry_end]
            if kind == KIND_FLOAT:
                if length & 3:
                    return None
                found[index] = length >> 2
            else:
                if buf[entry_end - 1] >= 0x80:
                    return None  # a cut varint
                found[index] = len(payload.translate(None, _HIGH_BYTES))
            gathered.append((index, payload))
            pos = entry_end
    except IndexError:
        return None
    if _MISSING_NONE in found:
        found = [-1 if count == _MISSING_NONE else count for count in found]
    return found, gathered


def _general_record(
    buf: bytes, key_index: dict[bytes, int], kinds: Sequence[int], record_index: int
) -> _Gathered:
    """One record by the general decoder, in :func:`_canonical_record`'s terms."""
    columns: list[RawColumn] = [
        ([] if kind == KIND_BYTES else bytearray(), bytearray()) for kind in kinds
    ]
    try:
        found = _scan_record(buf, key_index, kinds, columns, record_index)
    except Malformed as malformed:
        raise ParseFailure(
            FAILURE_MALFORMED, record_index, -1, malformed.position, KIND_NONE
        ) from None
    gathered: list[tuple[int, bytes | list[bytes]]] = []
    for index, (kind, (values, _)) in enumerate(zip(kinds, columns, strict=True)):
        if found[index] <= 0:
            continue
        if isinstance(values, list):
            gathered.append((index, values))
        elif kind == KIND_INT64:  # back to varints, as the batch decode expects them
            encoded = (encode_varint(value) for (value,) in _INT64.iter_unpack(values))
            gathered.append((index, b"".join(encoded)))
        else:
            gathered.append((index, bytes(values)))
    return found, gathered


def _decode_varints(data: bytes) -> bytearray | None:
    """Packed varints (each ending within ``data``) as little-endian int64 values, as
    protobuf reads them (bits past the 64th dropped); None if one is over 10 bytes."""
    if len(data) <= _SHORT_VARINTS:
        return _decode_short_varints(data)
    encoded = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(encoded < 0x80)
    if len(ends) == len(encoded):  # every value below 128: one byte each
        return bytearray(encoded.astype("<i8").tobytes())
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        return None
    values = (encoded[starts] & 0x7F).astype(np.uint64)
    for byte in range(1, int(lengths.max())):
        longer = np.flatnonzero(lengths > byte)
        values[longer] |= (encoded[starts[longer] + byte] & 0x7F).astype(np.uint64) << np.uint64(
            7 * byte
        )
    return bytearray(values.view("<i8").tobytes())


# Up to this many bytes a plain loop beats the NumPy decode's fixed cost (~15 calls).
_SHORT_VARINTS = 96


def _decode_short_varints(data: bytes) -> bytearray | None:
    """``_decode_varints`` for a few bytes, one byte at a time."""
    values: list[int] = []
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            values.append(value & 0xFFFFFFFFFFFFFFFF)
            value = shift = 0
        elif shift == 63:  # a tenth byte that is not the last: over 10 bytes
            return None
        else:
            shift += 7
    return bytearray(struct.pack(f"<{len(values)}Q", *values))


def _scan_canonical(
    serialized: Sequence[bytes], keys: Sequence[bytes], kinds: Sequence[int]
) -> list[RawColumn]:
    key_index = {key: index for index, key in enumerate(keys)}
    pieces: list[list[Any]] = [[] for _ in kinds]
    counts: list[int] = []
    for record_index, record in enumerate(serialized):
        buf = record if type(record) is bytes else bytes(record)
        result = _canonical_record(buf, key_index, kinds)
        if result is None:
            try:
                result = _general_record(buf, key_index, kinds, record_index)
            except ParseFailure:
                # An earlier record's int64 list may hold a varint over 10 bytes, which
                # the batch decode below has not checked yet: that error comes first.
                if _varint_too_long(pieces, kinds):
                    return scan_columns_exact(serialized, keys, kinds)
                raise
        found, gathered = result
        counts.extend(found)
        for index, data in gathered:
            if kinds[index] == KIND_BYTES:
                pieces[index].extend(data)
            else:
                pieces[index].append(data)
    columns = _joined_columns(pieces, counts, kinds)
    if columns is None:  # a varint over 10 bytes: the general decoder names the record
        return scan_columns_exact(serialized, keys, kinds)
    return columns


def _varint_too_long(pieces: list[list[Any]], kinds: Sequence[int]) -> bool:
    """Whether an int64 list gathered so far holds a varint over 10 bytes."""
    return any(kind == KIND_INT64 and _decode_varints(b"".join(pieces[index])) is None
               for index, kind in enumerate(kinds))


def _joined_columns(
    pieces: list[list[Any]], counts: list[int], kinds: Sequence[int]
) -> list[RawColumn] | None:
    """The batch's columns from what :func:`_scan_canonical` gathered: values joined
    (int64 varints decoded) and each record's count; None if a varint is over 10
    bytes."""
    table = np.array(counts, dtype="<i8").reshape(-1, len(kinds)) if kinds else None
    columns: list[RawColumn] = []
    for index, kind in enumerate(kinds):
        assert table is not None
        column_counts = bytearray(table[:, index].tobytes())
        if kind == KIND_BYTES:
            columns.append((pieces[index], column_counts))
            continue
        joined = b"".join(pieces[index])
        if kind == KIND_FLOAT:
            columns.append((bytearray(joined), column_counts))
            continue
        decoded = _decode_varints(joined)
        if decoded is None:
            return None
        columns.append((decoded, column_counts))
    return columns


# --------------------------------------------------------------------------- whole batch
#
# The canonical layout again, read for a whole batch at once with NumPy: the records'
# map entries are walked in lockstep (step k reads every record's k-th entry), so the
# Python work is per entry *position*, not per entry. Any record laid out otherwise
# sends the batch back to the record-by-record path.

# Below this many records the batch reader's fixed cost (~700 NumPy calls) outweighs
# its gain (measured: record by record wins at 128 records, loses at 256).
_VECTOR_MIN_RECORDS = 200
#: Records per whole-batch read, by size: its working arrays stay under ~10 times this.
_VECTOR_CHUNK_BYTES = 1 << 21
_SPREAD = np.arange(5)
_SHIFTS = 7 * np.arange(5, dtype=np.int64)


class _NotCanonical(Exception):
    """Some record of the batch is not in the canonical layout."""


def _lengths_at(data: Any, positions: Any) -> tuple[Any, Any]:
    """The varints (lengths: at most 5 bytes) starting at ``positions``, and the
    positions after them."""
    values = data[positions].astype(np.int64)
    after = positions + 1
    longer = np.flatnonzero(values >= 0x80)
    if len(longer):
        values[longer], after[longer] = _long_lengths_at(data, positions[longer])
    return values, after


def _long_lengths_at(data: Any, positions: Any) -> tuple[Any, Any]:
    window = data[positions[:, None] + _SPREAD]
    ends = window < 0x80
    if not ends.any(axis=1).all():
        raise _NotCanonical
    size = ends.argmax(axis=1)
    used = size[:, None] >= _SPREAD
    values = (((window & 0x7F).astype(np.int64) << _SHIFTS) * used).sum(axis=1)
    return values, positions + size + 1


def _expect(condition: Any) -> None:
    if not condition.all():
        raise _NotCanonical


def _ranges(data: Any, starts: Any, ends: Any) -> Any:
    """``data[starts[0]:ends[0]] + data[starts[1]:ends[1]] + ...`` as one array: rows
    of the widest range, copied from a sliding window view, where the ranges are of
    similar sizes (a fixed-length feature: one copy); else through an index per byte."""
    sizes = ends - starts
    total = int(sizes.sum())
    if not total:
        return data[:0]
    widest = int(sizes.max())
    if len(sizes) * widest <= 2 * total + 4096 and int(starts.max()) + widest <= len(data):
        rows = np.lib.stride_tricks.sliding_window_view(data, widest)[starts]
        if total == len(sizes) * widest:
            return rows.reshape(-1)
        return rows[np.arange(widest) < sizes[:, None]]
    offsets = np.cumsum(sizes) - sizes
    index = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, sizes)
    return data[index]


def _scan_vectorised(  # noqa: C901
    records: Sequence[bytes], keys: Sequence[bytes], kinds: Sequence[int]
) -> list[RawColumn]:
    count = len(records)
    joined = b"".join(records)
    total = len(joined)
    data = np.frombuffer(joined + bytes(16), dtype=np.uint8)
    record_lengths = np.fromiter(map(len, records), dtype=np.int64, count=count)
    record_ends = np.cumsum(record_lengths)
    record_starts = record_ends - record_lengths
    present = np.flatnonzero(record_ends > record_starts)

    def clipped(positions: Any) -> Any:
        _expect(positions <= total)
        return positions

    _expect(data[record_starts[present]] == 0x0A)
    length, position = _lengths_at(data, record_starts[present] + 1)
    _expect(position + length == record_ends[present])
    ends = record_ends[present]
    more = position < ends
    walking, position, ends = present[more], position[more], ends[more]
    # Entries: record, key start, key length, value start, value length.
    owners, key_starts, key_lengths, value_starts, value_lengths = [], [], [], [], []
    while len(walking):
        _expect(data[position] == 0x0A)
        length, position = _lengths_at(data, clipped(position + 1))
        entry_end = position + length
        _expect((entry_end <= ends) & (data[clipped(position)] == 0x0A))
        key_length, key_start = _lengths_at(data, clipped(position + 1))
        position = clipped(key_start + key_length)
        _expect(data[position] == 0x12)
        value_length, value_start = _lengths_at(data, clipped(position + 1))
        _expect(value_start + value_length == entry_end)
        owners.append(walking)
        key_starts.append(key_start)
        key_lengths.append(key_length)
        value_starts.append(value_start)
        value_lengths.append(value_length)
        more = entry_end < ends
        walking, position, ends = walking[more], entry_end[more], ends[more]
    if owners:
        owner = np.concatenate(owners)
        key_start = np.concatenate(key_starts)
        key_length = np.concatenate(key_lengths)
        value_start = np.concatenate(value_starts)
        value_length = np.concatenate(value_lengths)
    else:
        owner = key_start = key_length = value_start = value_length = np.empty(0, np.int64)
    columns: list[RawColumn] = []
    for key, kind in zip(keys, kinds, strict=True):
        found = np.full(count, -1, dtype="<i8")
        chosen = np.flatnonzero(key_length == len(key))
        if len(key) and len(chosen):
            window = data[key_start[chosen][:, None] + np.arange(len(key))]
            chosen = chosen[(window == np.frombuffer(key, dtype=np.uint8)).all(axis=1)]
        chosen = chosen[np.argsort(owner[chosen], kind="stable")]
        mine = owner[chosen]
        if len(mine) > 1 and (mine[1:] == mine[:-1]).any():
            raise _NotCanonical  # a repeated key
        chosen = chosen[value_length[chosen] > 0]  # an empty Feature: missing
        start = value_start[chosen]
        entry_end = start + value_length[chosen]
        _expect(data[start] == (kind << 3 | _WIRE_LEN))
        list_length, start = _lengths_at(data, start + 1)
        _expect(start + list_length == entry_end)
        found[owner[chosen]] = 0
        filled = list_length > 0
        chosen, start, entry_end = chosen[filled], start[filled], entry_end[filled]
        if kind == KIND_BYTES:
            values: bytearray | list[bytes] = []
            value_owner, value_starts_, value_ends_ = [], [], []
            walking = np.arange(len(chosen))
            while len(walking):
                _expect(data[start] == 0x0A)
                length, start = _lengths_at(data, start + 1)
                value_owner.append(walking)
                value_starts_.append(start)
                value_ends_.append(start + length)
                start = start + length
                limit = entry_end[walking]
                _expect(start <= limit)
                more = start < limit
                walking, start = walking[more], start[more]
            if value_owner:
                by_owner = np.concatenate(value_owner)
                order = np.argsort(by_owner, kind="stable")
                lows = np.concatenate(value_starts_)[order].tolist()
                highs = np.concatenate(value_ends_)[order].tolist()
                values = [joined[low:high] for low, high in zip(lows, highs, strict=True)]
                found[owner[chosen]] = np.bincount(by_owner, minlength=len(chosen))
        else:
            _expect(data[start] == 0x0A)
            payload_length, payload_start = _lengths_at(data, start + 1)
            _expect(payload_start + payload_length == entry_end)
            raw = _ranges(data, payload_start, entry_end).tobytes()
            if kind == KIND_FLOAT:
                _expect(payload_length % 4 == 0)
                found[owner[chosen]] = payload_length // 4
                values = bytearray(raw)
            else:
                _expect(data[entry_end - 1] < 0x80)  # (empty payloads end on their length)
                terminators = np.zeros(len(raw) + 1, dtype=np.int64)
                np.cumsum(np.frombuffer(raw, dtype=np.uint8) < 0x80, out=terminators[1:])
                ends_in_raw = np.cumsum(payload_length)
                found[owner[chosen]] = (
                    terminators[ends_in_raw] - terminators[ends_in_raw - payload_length]
                )
                decoded = _decode_varints(raw)
                if decoded is None:
                    raise _NotCanonical
                values = decoded
        columns.append((values, bytearray(found.tobytes())))
    return columns


# --------------------------------------------------------------------------- inspection

DecodedFeature = tuple[int, bytearray | list[bytes]]


def _decode_feature(buf: bytes, start: int, end: int) -> DecodedFeature:
    kind, list_start, list_end = _feature_kind(buf, start, end)
    values: bytearray | list[bytes] = [] if kind == KIND_BYTES else bytearray()
    if kind != KIND_NONE:
        _append_list_values(buf, kind, list_start, list_end, values)
    return kind, values


def decode_features(buf: bytes, map_field: int = 1) -> dict[bytes, DecodedFeature]:
    """Decode every feature of an Example (or a SequenceExample's context, field 1).

    Raises ``Malformed`` (caught by the public wrapper)."""
    decoded: dict[bytes, DecodedFeature] = {}
    for key, start, end in _example_entries(buf, map_field):
        decoded.pop(key, None)  # last entry wins, and takes its place in the order
        decoded[key] = _decode_feature(buf, start, end)
    return decoded


def decode_feature_list_map(buf: bytes) -> dict[bytes, list[DecodedFeature]]:
    """Decode a SequenceExample's feature_lists (field 2): key -> list of Features."""
    decoded: dict[bytes, list[DecodedFeature]] = {}
    for key, start, end in _example_entries(buf, 2):
        features = [
            _decode_feature(buf, sub_start, sub_end)
            for number, wire, sub_start, sub_end in _fields(buf, start, end)
            if number == 1 and wire == _WIRE_LEN
        ]
        decoded.pop(key, None)
        decoded[key] = features
    return decoded
