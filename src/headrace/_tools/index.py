"""``headrace index``: build ``.hrx`` indexes for shards anyone wrote, or check them.

Why a command: shards written by TensorFlow (or any other tool) have no index, and an
index is what gives random access (global shuffle, O(1) resume). Building one scans only
the framing. ``--check`` verifies that existing indexes still match their shards - a
rewritten, appended or truncated shard makes its index *stale*, and a stale index is
refused with the file and what changed, never used to read records at wrong offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from headrace._errors import DataLossError, InvalidArgumentError
from headrace.io.files import require_regular_file
from headrace.io.tfrecord_index import (
    StaleIndexError,
    build_index,
    index_path_for,
    load_index,
)

__all__ = ["IndexResult", "build_indexes", "check_indexes", "compression_hint", "sniff_compression"]

_GZIP_MAGIC = b"\x1f\x8b"
_ZLIB_HEADERS = (b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda")


@dataclass(frozen=True)
class IndexResult:
    """What happened to one file: ``status`` is ``"indexed"``, ``"ok"``, ``"stale"`` or
    ``"error"``; ``records`` is known for the first two; ``message`` explains the rest."""

    path: str
    status: str
    records: int | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("indexed", "ok")

    def format(self) -> str:
        if self.status == "indexed":
            return f"{self.path}: {self.records:,} records, index {index_path_for(self.path)}"
        if self.status == "ok":
            return f"{self.path}: index ok, {self.records:,} records"
        hint = f" (`headrace index {self.path}` rebuilds it)" if self.status == "stale" else ""
        return f"{self.path}: {self.status.upper()}: {self.message}{hint}"


def sniff_compression(path: str) -> str:
    """``"GZIP"`` or ``"ZLIB"`` if the file starts like one, else ``""``.

    Only a hint for error messages, used after a file failed to read as uncompressed:
    an uncompressed TFRecord can start with these bytes too (they are a length).
    """
    try:
        with open(path, "rb") as file:
            head = file.read(2)
    except OSError:
        return ""
    return "GZIP" if head == _GZIP_MAGIC else "ZLIB" if head in _ZLIB_HEADERS else ""


def compression_hint(path: str) -> str:
    """A sentence saying the file looks compressed (so it cannot be indexed), or ""."""
    kind = sniff_compression(path)
    if not kind:
        return ""
    return (
        f" (the file looks {kind}-compressed: compressed TFRecord files cannot be indexed, "
        "their records cannot be reached without decompressing everything before them)"
    )


def build_indexes(paths: list[str]) -> list[IndexResult]:
    """Build (and save) the index of every path; errors are reported per file."""
    results = []
    for path in paths:
        try:
            index = build_index(path)
        except DataLossError as error:
            results.append(IndexResult(path, "error", message=f"{error}{compression_hint(path)}"))
        except InvalidArgumentError as error:  # not a regular file: nothing written beside it
            results.append(IndexResult(path, "error", message=str(error)))
        except OSError as error:
            results.append(IndexResult(path, "error", message=f"cannot read: {error}"))
        else:
            results.append(IndexResult(path, "indexed", len(index)))
    return results


def _check_one(path: str) -> IndexResult:
    try:
        require_regular_file(path, "index --check")
    except FileNotFoundError:
        return IndexResult(path, "error", message="no such file")
    except (InvalidArgumentError, OSError) as error:
        return IndexResult(path, "error", message=str(error))
    try:
        index = load_index(path)
        # The fingerprint matched; also compare with the framing itself, so an index that
        # was corrupted or copied from another shard of the same size cannot pass.
        fresh = build_index(path, write=False)
    except StaleIndexError as error:
        return IndexResult(path, "stale", message=str(error))
    except DataLossError as error:
        return IndexResult(path, "error", message=f"{error}{compression_hint(path)}")
    if not np.array_equal(np.asarray(index.offsets), fresh.offsets):
        return IndexResult(
            path,
            "stale",
            message=(
                f"index file {index_path_for(path)} does not match the records of {path} "
                f"({len(index)} offsets indexed, {len(fresh)} records found); rebuild it "
                "with `headrace index`"
            ),
        )
    return IndexResult(path, "ok", len(index))


def check_indexes(paths: list[str]) -> list[IndexResult]:
    """Verify the existing index of every path without writing anything."""
    return [_check_one(path) for path in paths]
