"""``cache(filename)`` on disk: written under a lock, published atomically, found again.

The files of a cache named ``<filename>``: ``.hrcache`` (the records, see
:mod:`headrace._persist.records`), its ``.hrx`` index, ``.hrcache.crc`` (each
record's data CRC) and ``.hrcache.json``, the sealed manifest (version 3) that
marks the cache complete. ``.lockfile`` is held with ``flock`` while one writer
writes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import DataLossError
from headrace._memory.buffer import Buffer, Reservation
from headrace._persist.records import (
    BlockReader,
    Expected,
    RecordReader,
    RecordWriter,
    checksums_digest,
)
from headrace._persist.stores import Store, StoreReader
from headrace._sources.files import file_limiter
from headrace.core.iterator import Context
from headrace.core.state import is_sealed, seal
from headrace.io.blocks import BLOCK_CODECS, BlockCodec, block_codec
from headrace.io.elements import ELEMENTS_FORMAT, encode_element_parts
from headrace.io.filepool import HeldSlots, get_default_pool
from headrace.io.tfrecord_index import index_path_for, write_atomically

if TYPE_CHECKING:
    from headrace._persist.cache import CacheNode

LOG = logging.getLogger("headrace.cache")


__all__ = ["CompleteFile", "FileStore", "find_complete", "manifest_codec", "usable_manifest"]


_MANIFEST_FORMAT = "headrace.cache"
#: 2: content fingerprints, and each record's CRC recorded (``<file>.crc``).
_MANIFEST_VERSION = 3  # 3: sealed (a checksum over its fields); older ones are rebuilt


class FileStore(Store):
    """tf.data's persistent cache: written under a lock, published atomically at the end."""

    def __init__(
        self, node: CacheNode, ctx: Context, account: Buffer, epochs: tuple[int, ...],
        filename: str | None = None,
    ) -> None:
        """``filename``: where to write, when not the node's (a remote cache's staging)."""
        super().__init__(epochs)
        self.ctx, self.account = ctx, account
        self.paths = _CachePaths(node.filename if filename is None else filename)
        self.fingerprint = node.inputs[0].data_fingerprint()
        self.expected: Expected | None = None
        self.codec = block_codec(node.compression)
        self.blocks: list[tuple[int, int]] = []
        limiter, stage = file_limiter(ctx), f"{node.stage}({node.filename!r})"
        self.lock_slot = get_default_pool().hold(
            1, limiter=limiter, stage=stage, what=f"its lock ({self.paths.lock!r})"
        )
        try:
            self.lock_fd = _acquire_lock(self.paths)
        except BaseException:
            self.lock_slot.release()
            raise
        try:
            _remove_leftovers(self.paths)
            self.writer: RecordWriter | None = RecordWriter(
                self.paths.data, account, self.codec, limiter=limiter, stage=stage
            )
        except BaseException:
            _release_lock(self.paths, self.lock_fd, self.lock_slot)
            raise

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        assert self.writer is not None
        try:
            self.writer.append(encode_element_parts(element))
        except BaseException:
            self.fail()
            raise
        self.count += 1
        return element, upstream

    def finish(self) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            writer.finish()
            self.blocks = writer.blocks
            checksums = np.asarray(writer.final_crcs, dtype="<u4").tobytes()
            write_atomically(self.paths.checksums, [checksums])
            self.expected = Expected(
                writer.final_crcs, self.paths.manifest, writer.record_bytes
            )
            manifest: dict[str, Any] = {
                "format": _MANIFEST_FORMAT,
                "version": _MANIFEST_VERSION,
                "elements_format": ELEMENTS_FORMAT,
                "fingerprint": self.fingerprint,
                "elements": self.count,
                "bytes": os.path.getsize(self.paths.data),
                "checksums": checksums_digest(checksums),
                "created": time.time(),
            }
            if writer.record_bytes:  # (readers then need not load the index)
                manifest["record_bytes"] = writer.record_bytes
            if self.codec is not None:  # what a reader needs to find and check each block
                manifest["compression"] = self.codec.name
                manifest["blocks"] = [list(block) for block in self.blocks]
            manifest.update(self.manifest_fields())
            seal(manifest)  # an edited manifest is refused, never believed or rebuilt over
            write_atomically(self.paths.manifest, [json.dumps(manifest).encode()])
        except BaseException:
            self.partial = False  # (it failed at the end: no advice about take(k))
            for path in (self.paths.data, self.paths.checksums):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            _release_lock(self.paths, self.lock_fd, self.lock_slot)
            raise
        _release_lock(self.paths, self.lock_fd, self.lock_slot)
        self.complete = True

    def manifest_fields(self) -> dict[str, Any]:
        """More fields for the manifest (a remote cache names its data object)."""
        return {}

    def discard(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.abort()
            _release_lock(self.paths, self.lock_fd, self.lock_slot)

    def reader(self) -> StoreReader:
        return FileReader(
            self.paths.data, self.ctx, self.account, self.codec, self.blocks, self.expected
        )


class FileReader(StoreReader):
    """A cache file's elements in order (internal; ``records`` also reads batches)."""

    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        codec: BlockCodec | None = None,
        blocks: list[tuple[int, int]] | None = None,
        expected: Expected | None = None,
    ) -> None:
        self.records = (
            RecordReader(path, ctx, account, expected)
            if codec is None
            else BlockReader(path, ctx, account, codec, blocks or [], expected)
        )

    def pull(self) -> tuple[Any, Reservation]:
        return self.records.pull()

    def skip(self, count: int) -> int:
        return self.records.skip(count)

    def close(self) -> None:
        self.records.close()


class CompleteFile(Store):
    """A complete ``cache(filename)`` found on disk."""

    def __init__(
        self,
        path: str,
        ctx: Context,
        account: Buffer,
        count: int,
        codec: BlockCodec | None,
        blocks: list[tuple[int, int]],
        expected: Expected,
    ) -> None:
        super().__init__(())
        self.path, self.ctx, self.account = path, ctx, account
        self.complete = True
        self.count = count
        self.codec, self.blocks = codec, blocks
        self.expected = expected

    def reader(self) -> StoreReader:
        return FileReader(
            self.path, self.ctx, self.account, self.codec, self.blocks, self.expected
        )

    def discard(self) -> None:
        """A complete cache stays on disk."""


class _CachePaths:
    def __init__(self, filename: str) -> None:
        self.prefix = filename
        self.data = f"{filename}.hrcache"
        self.manifest = f"{filename}.hrcache.json"
        #: Each record's data CRC, as written (its digest is in the manifest).
        self.checksums = f"{filename}.hrcache.crc"
        self.lock = f"{filename}.lockfile"


def _acquire_lock(paths: _CachePaths) -> int:
    """Hold ``<filename>.lockfile`` (flock: a dead writer's lock is released by the kernel)."""
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        raise FileExistsError(
            errno.EEXIST,
            "cache: there appears to be a concurrent caching iterator running - cache "
            f"lockfile already exists ({paths.lock!r}; {holder or 'holder unknown'}). If you "
            "are sure no other running process is using this cache prefix, delete the "
            "lockfile and re-initialize the iterator.",
            paths.lock,
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"Created at: {int(time.time())} by pid {os.getpid()}\n".encode(), 0)
    return fd


def _release_lock(paths: _CachePaths, fd: int, slot: HeldSlots) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.lock)  # while still holding it: no one can take a stale copy
    try:
        os.close(fd)
    finally:
        slot.release()  # its descriptor is gone: a reader may take the slot


def _remove_leftovers(paths: _CachePaths) -> None:
    """Under the lock: what a crashed writer left (temporary files, a manifest-less data
    file) is never complete, so it goes; so does a manifest that is about to be stale."""
    directory, name = os.path.split(os.path.abspath(paths.data))
    pattern = f".{glob.escape(name)}*.tmp"  # the data file's, its index's, its checksums'
    for leftover in glob.glob(os.path.join(glob.escape(directory), pattern)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    for path in (paths.manifest, paths.data, index_path_for(paths.data), paths.checksums):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def find_complete(node: CacheNode, ctx: Context, account: Buffer) -> CompleteFile | None:
    """The complete cache on disk for this pipeline, or None (warning if it is another's)."""
    paths = _CachePaths(node.filename)
    try:
        with open(paths.manifest, encoding="utf-8") as file:
            manifest = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:  # (written atomically: never half written)
        raise DataLossError(
            f"cache: the manifest {paths.manifest} cannot be read ({error}): it was "
            "damaged after this cache was written; delete the cache's files to rebuild it",
            path=paths.manifest,
        ) from None
    if not usable_manifest(manifest, paths.manifest, node):
        return None
    count, nbytes = manifest.get("elements"), manifest.get("bytes")
    try:
        size = os.path.getsize(paths.data)
    except OSError:
        return None
    if not isinstance(count, int) or size != nbytes:
        raise DataLossError(
            f"cache: {paths.data} holds {size} bytes where its manifest {paths.manifest} "
            f"recorded {nbytes}: it was truncated or written to after the cache was "
            "complete; delete the cache's files to rebuild it",
            path=paths.data,
        )
    if not os.path.exists(index_path_for(paths.data)):  # written before the manifest
        return None
    expected = _read_checksums(paths, manifest)
    codec, blocks = manifest_codec(manifest, paths.manifest)
    return CompleteFile(paths.data, ctx, account, count, codec, blocks, expected)


def usable_manifest(manifest: Any, where: str, node: CacheNode) -> bool:
    """Whether a cache's parsed manifest (read from ``where``) describes this pipeline's
    complete cache; False for one to rebuild (an older format, another pipeline's);
    DataLossError naming ``where`` for one changed since it was written."""
    # (this version always seals: one without its checksum had it removed, and its
    # other fields cannot be believed either)
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT or (
        ("checksum" in manifest or manifest.get("version") == _MANIFEST_VERSION)
        and not is_sealed(manifest)
    ):
        raise DataLossError(
            f"cache: the manifest {where} was changed after this cache was written "
            "(it is not a cache manifest, or its fields do not match its checksum): its "
            "counts and checksums cannot be believed; delete the cache's files to rebuild it",
            path=where,
        )
    if manifest.get("version") != _MANIFEST_VERSION:
        return False  # an older headrace's (keyed by structure only, unsealed): rebuilt
    if manifest.get("elements_format") != ELEMENTS_FORMAT:
        return False  # sealed by a headrace that encodes elements otherwise: rebuilt
    fingerprint = node.inputs[0].data_fingerprint()
    if manifest.get("fingerprint") != fingerprint:
        # (what headrace does, not a hazard: the cache is rebuilt for this pipeline)
        LOG.info("cache: %s was written by a different pipeline (fingerprint %r; the "
                 "pipeline above this cache is %r): rebuilding it", where,
                 manifest.get("fingerprint"), fingerprint)
        return False
    return True


def manifest_codec(
    manifest: dict[str, Any], where: str
) -> tuple[BlockCodec | None, list[tuple[int, int]]]:
    """The compression a complete cache's manifest records and its blocks (detected:
    whatever this run would write); DataLossError naming ``where`` if they do not add up."""
    count = manifest.get("elements")
    compression = manifest.get("compression")
    if compression is None:
        return None, []
    blocks = manifest.get("blocks")
    if (
        compression not in BLOCK_CODECS
        or not isinstance(blocks, list)
        or not all(
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(n, int) and n >= 0 for n in block)
            for block in blocks
        )
        or sum(block[0] for block in blocks) != count
    ):
        raise DataLossError(
            f"cache: the manifest {where} is corrupted (compression "
            f"{compression!r:.40} with blocks that do not add up to its {count} elements)",
            path=where,
        )
    codec = block_codec(compression)  # SNAPPY without cramjam: says what to install
    return codec, [(int(n), int(raw)) for n, raw in blocks]


def _read_checksums(paths: _CachePaths, manifest: dict[str, Any]) -> Expected:
    """The records' CRCs a complete cache's manifest vouches for (``<file>.crc``, checked
    against the digest the manifest holds); DataLossError naming the file otherwise."""
    try:
        with open(paths.checksums, "rb") as file:
            checksums = file.read()
    except OSError as error:
        raise DataLossError(
            f"cache: {paths.checksums}, the record checksums of the complete cache "
            f"{paths.data}, cannot be read ({error.strerror}); delete the cache's files "
            "to rebuild it",
            path=paths.checksums,
        ) from None
    if len(checksums) % 4 or checksums_digest(checksums) != manifest.get("checksums"):
        raise DataLossError(
            f"cache: {paths.checksums} is not the checksum file its manifest "
            f"{paths.manifest} describes (it belongs to another cache or was changed); "
            "delete the cache's files to rebuild it",
            path=paths.checksums,
        )
    record_bytes = manifest.get("record_bytes", 0)
    if not isinstance(record_bytes, int) or record_bytes < 0:
        raise DataLossError(
            f"cache: the manifest {paths.manifest} is corrupted (record_bytes "
            f"{record_bytes!r:.40})",
            path=paths.manifest,
        )
    return Expected(np.frombuffer(checksums, dtype="<u4"), paths.manifest, record_bytes)
