"""Type stub of the optional C extension built from ``_ext/hrio.c``."""

from collections.abc import Sequence
from typing import Any

class ParseFailure(ValueError):
    """args = (code, record_index, key_index, position, found_kind)."""

def crc32c(data: bytes | bytearray | memoryview, crc: int = 0, /) -> int: ...
def crc32c_using(backend: str, data: bytes | bytearray | memoryview, crc: int = 0, /) -> int: ...
def check_alike(buf: Any, rows: int, size: int, head: bytes, footers: Any, /) -> int: ...
def scan_records(
    buf: bytes | memoryview,
    pos: int,
    max_records: int,
    max_bytes: int,
    verify_crc: bool,
    max_record_bytes: int,
    /,
) -> tuple[list[bytes], int, int, int]: ...
def frame_records(records: list[bytes], /) -> bytes: ...
def parse_example_columns(
    serialized: Sequence[bytes], keys: Sequence[bytes], kinds: Sequence[int], /
) -> list[tuple[bytearray | list[bytes], bytearray]]: ...
def decode_features(
    serialized: bytes, map_field: int, /
) -> dict[bytes, tuple[int, bytearray | list[bytes]]]: ...
def shuffle_draw(
    ring: Any,
    capacity: int,
    start: int,
    end: int,
    incoming: Any,
    draws: Any,
    out: Any,
    /,
) -> tuple[int, int, int, int]: ...
def bytes_total(items: list[Any], /) -> int: ...
def join_bytes(items: list[Any], /) -> tuple[bytes, bytes] | None: ...
def lengths(items: list[bytes], /) -> bytes: ...
def split_bytes(data: Any, offsets: Any, /) -> list[bytes]: ...
