"""``cache(url)`` and ``snapshot(url)`` on object storage (``s3://``, ``gs://``, ``az://``).

Why not write the objects as the pipeline runs: an object cannot be appended to, nor
locked, and an upload that is cut off must never look like a cache. So the first
complete pass writes the cache *locally*, exactly as ``cache(filename)`` does (in a
temporary directory under ``TMPDIR``, with the same booked, bounded buffers), and only
when the pass completes are its files uploaded: the data, its ``.hrx`` index and its
records' checksums first, the manifest **last**. A reader trusts only a manifest, so a
pass stopped early (``take(k)``, an exception, a killed process) uploads nothing, and an
upload cut off midway leaves objects no manifest names, never a cache that looks
complete. Later passes, in this process or any other, read the cache from the store
with ranged reads, through the streams every object reader uses (a file-pool slot
each, G2; the range read ahead booked on the stage, G1); every record is checked
against the checksums the manifest vouches for, so a damaged or foreign object is
:class:`~headrace._errors.DataLossError` naming its URL.

The objects of a cache named ``<url>``: ``<url>.hrcache.json`` (the sealed manifest)
and, for the writer that published it, ``<url>.hrcache.<token>`` (the records),
``<url>.hrcache.<token>.hrx`` and ``<url>.hrcache.<token>.crc``; the manifest names
the token. Each writer uploads under a token of its own, so two processes racing to
write the same cache never overwrite each other's data: the manifest is published
with a conditional PUT (``If-None-Match: *``), the first one wins, and the loser
deletes its own objects and reads the winner's afterwards. There is no lockfile (a
store has no ``flock``): tf.data's "concurrent caching iterator" error is not raised
for a URL; both writers read their input once, and one copy is kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import DataLossError, InvalidArgumentError
from headrace._memory.buffer import Buffer, Reservation
from headrace._memory.units import format_bytes
from headrace._persist.file_store import (
    CompleteFile,
    FileStore,
    manifest_codec,
    usable_manifest,
)
from headrace._persist.records import Expected, checksums_digest
from headrace._sources.files import file_limiter
from headrace.core.iterator import Context
from headrace.io import objstore
from headrace.io.filepool import get_default_pool
from headrace.io.tfrecord_index import index_path_for

if TYPE_CHECKING:
    from headrace._persist.cache import CacheNode

__all__ = ["RemoteStore", "check_url", "find_complete_remote"]

LOG = logging.getLogger("headrace.cache")

#: The manifest's field naming the writer's objects.
DATA_TOKEN = "data_token"
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
#: The staged size from which the upload's minimum is declared (then in doublings).
_FIRST_UPLOAD_MINIMUM = 64 * 1024


def check_url(url: str, what: str, *, folder: bool = False) -> None:
    """Refuse, where the dataset is built, a URL that a cache cannot be uploaded to: a web
    server's (read-only), or for a cache's name (``folder=False``) one naming no object
    (``s3://bucket``, ``s3://bucket/dir/``: its objects would be named after the bucket)."""
    root, key = objstore.split_url(url)  # (a malformed URL: InvalidArgumentError naming it)
    if root.startswith("http"):
        raise InvalidArgumentError(
            f"{what}: {url} is a web server's URL, which headrace only reads; give an "
            "s3://, gs:// or az:// URL (or a local path)"
        )
    if not folder and (not key or key.endswith("/")):
        raise InvalidArgumentError(
            f"{what}: {url} names a bucket or a folder, not a cache: its objects are "
            f"named <filename>.hrcache...; add a name ({url.rstrip('/')}/name)"
        )


class _RemoteNames:
    """The URLs of the cache ``url``'s objects (the data ones, for ``token``)."""

    def __init__(self, url: str, token: str) -> None:
        self.manifest = f"{url}.hrcache.json"
        self.data = f"{url}.hrcache.{token}"
        self.index = index_path_for(self.data)
        self.checksums = f"{self.data}.crc"


class RemoteStore(FileStore):
    """A cache written in a local staging directory and uploaded when it completes."""

    def __init__(
        self, node: CacheNode, ctx: Context, account: Buffer, epochs: tuple[int, ...]
    ) -> None:
        self.url = node.filename
        self.token = uuid.uuid4().hex
        self.names = _RemoteNames(self.url, self.token)
        # A missing bucket or denied access is said now, not after a whole pass
        # (FileNotFoundError / PermissionError naming the URL): one listing page.
        with get_default_pool().transient(limiter=file_limiter(ctx)):
            next(iter(objstore.list_objects(self.url.rsplit("/", 1)[0] + "/")), None)
        self.upload_minimum = 0
        self.staging = tempfile.mkdtemp(prefix="headrace-cache-")
        # (removed when the pass ends, or at exit if the process ends first)
        self.remove_staging = weakref.finalize(self, shutil.rmtree, self.staging, True)
        try:
            super().__init__(node, ctx, account, epochs, os.path.join(self.staging, "cache"))
        except BaseException:
            self.remove_staging()
            raise

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        result = super().append(element, upstream)
        writer = self.writer
        if writer is not None and self.upload_minimum < objstore.MIN_UPLOAD_PART:
            # The upload at the pass's end holds the staged file whole, or one part of
            # it at least (the least an object store takes but the last): declare that
            # minimum as the staged data grows (in doublings), so that a budget that
            # cannot give it is refused now, not after the whole pass.
            need = min(writer.nbytes + writer.batch_bytes, objstore.MIN_UPLOAD_PART)
            if need >= max(2 * self.upload_minimum, _FIRST_UPLOAD_MINIMUM) or (
                need == objstore.MIN_UPLOAD_PART
            ):
                try:
                    self.account.require(need, what=(
                        f"the upload of {self.url} (the staged cache whole, or one part of "
                        f"{format_bytes(objstore.MIN_UPLOAD_PART)}: the least an object "
                        "store takes)"))
                except BaseException:
                    self.fail()
                    raise
                self.upload_minimum = need
        return result

    def manifest_fields(self) -> dict[str, Any]:
        return {DATA_TOKEN: self.token}

    def finish(self) -> None:
        if self.writer is None:
            return
        try:
            super().finish()  # the local copy, complete, its manifest written last
            try:
                self._upload()
            except BaseException:
                # nothing of it is kept (the next pass writes again), and the pass was
                # not stopped early: no advice about take(k) when it closes
                self.complete, self.partial = False, False
                raise
        finally:
            self.remove_staging()

    def _upload(self) -> None:
        """The data objects, then the manifest, only if no manifest is there; a manifest
        another writer published first is kept, and this writer's objects go."""
        local, names = self.paths, self.names
        uploads = [
            (local.data, names.data),
            (index_path_for(local.data), names.index),
            (local.checksums, names.checksums),
        ]
        limiter = file_limiter(self.ctx)
        pool = get_default_pool()
        try:
            for path, url in uploads:
                # G1: what the client holds while it uploads (a small file whole, else
                # up to a few parts of 5 MiB, fewer where the share is small)
                part = objstore.MIN_UPLOAD_PART
                parts = max(1, min(4, self.account.room() // part))
                in_flight = min(os.path.getsize(path), parts * part)
                booking = self.account.admit(
                    in_flight, together=f"the upload of {url}", elements=0
                )
                try:
                    with pool.transient(limiter=limiter), open(path, "rb") as file:
                        objstore.put_atomic(url, file, parts_in_flight=parts,
                                            limiter=limiter)
                finally:
                    booking.release()
            with open(local.manifest, "rb") as file:
                manifest = file.read()
            with pool.transient(limiter=limiter):
                published = _publish(names.manifest, manifest, self.token)
        except BaseException:
            _delete_quietly(url for _, url in uploads)
            raise
        if not published:  # another writer's cache is the one kept
            LOG.info("cache: %s was published by another writer first; keeping it and "
                     "deleting this writer's copy", names.manifest)
            _delete_quietly(url for _, url in uploads)

    def discard(self) -> None:
        try:
            super().discard()
        finally:
            self.remove_staging()


def _publish(manifest_url: str, manifest: bytes, token: str) -> bool:
    """Publish ``manifest`` unless a manifest of this pipeline is there already: whether
    this writer's was. A manifest there that is not this pipeline's complete cache (an
    older format's, another pipeline's) is replaced, its data objects deleted, as a
    local cache's files are."""
    if objstore.put_if_absent(manifest_url, manifest):
        return True
    try:
        existing = json.loads(objstore.read_whole(objstore.object_info(manifest_url)))
    except FileNotFoundError:  # deleted meanwhile: try once more
        return objstore.put_if_absent(manifest_url, manifest)
    except ValueError:
        existing = None
    if isinstance(existing, dict) and existing.get(DATA_TOKEN) == token:
        return True  # (our own, from a retried PUT whose answer was lost)
    ours = json.loads(manifest)
    if isinstance(existing, dict) and all(
        existing.get(key) == ours.get(key)
        for key in ("format", "version", "elements_format", "fingerprint")
    ):
        return False  # the same pipeline's cache, published first: it wins
    objstore.delete_object(manifest_url)  # stale (or damaged): rebuilt, as on disk
    stale = existing.get(DATA_TOKEN) if isinstance(existing, dict) else None
    if isinstance(stale, str) and _TOKEN.match(stale):
        old = _RemoteNames(manifest_url[: -len(".hrcache.json")], stale)
        _delete_quietly([old.data, old.index, old.checksums])
    return objstore.put_if_absent(manifest_url, manifest)


def _delete_quietly(urls: Any) -> None:
    for url in urls:
        with contextlib.suppress(OSError), get_default_pool().borrow():
            objstore.delete_object(url)


def _read_object(url: str, ctx: Context) -> bytes | None:
    """The bytes of a small object, on a file-pool slot (G2); None if it is missing."""
    with get_default_pool().transient(limiter=file_limiter(ctx)):
        try:
            return objstore.read_whole(objstore.object_info(url))
        except FileNotFoundError:
            return None


def _size(url: str, ctx: Context) -> int | None:
    with get_default_pool().transient(limiter=file_limiter(ctx)):
        try:
            return objstore.object_info(url).size
        except FileNotFoundError:
            return None


def find_complete_remote(
    node: CacheNode, ctx: Context, account: Buffer
) -> CompleteFile | None:
    """The complete cache under ``node.filename`` (a URL) for this pipeline, or None.

    A manifest that cannot be parsed or was edited, a data object it names that is
    missing or not of the size it records, or checksums that are not the ones it
    vouches for: DataLossError naming the URL (never silently rebuilt over)."""
    url = node.filename
    manifest_url = f"{url}.hrcache.json"
    body = _read_object(manifest_url, ctx)
    if body is None:
        return None
    try:
        manifest = json.loads(body)
    except ValueError as error:  # (uploaded whole: never half written)
        raise DataLossError(
            f"cache: the manifest {manifest_url} cannot be read ({error}): it was damaged "
            "after this cache was written; delete the cache's objects to rebuild it",
            path=manifest_url,
        ) from None
    if not usable_manifest(manifest, manifest_url, node):
        return None
    token, count, nbytes = (manifest.get(key) for key in (DATA_TOKEN, "elements", "bytes"))
    if not isinstance(token, str) or not _TOKEN.match(token) or not isinstance(count, int):
        raise DataLossError(
            f"cache: the manifest {manifest_url} names no data object: it was not written "
            "by a remote cache; delete the cache's objects to rebuild it",
            path=manifest_url,
        )
    names = _RemoteNames(url, token)
    size = _size(names.data, ctx)
    if size != nbytes:
        held = "is missing" if size is None else f"holds {size} bytes"
        raise DataLossError(
            f"cache: {names.data} {held} where its manifest {manifest_url} recorded "
            f"{nbytes} bytes: it was truncated, replaced or deleted after the cache was "
            "complete; delete the cache's objects to rebuild it",
            path=names.data,
        )
    if _size(names.index, ctx) is None:
        raise DataLossError(
            f"cache: {names.index}, the index of the complete cache {names.data}, is "
            "missing; delete the cache's objects to rebuild it",
            path=names.index,
        )
    checksums = _read_object(names.checksums, ctx)
    if checksums is None or len(checksums) % 4 or (
        checksums_digest(checksums) != manifest.get("checksums")
    ):
        problem = "is missing" if checksums is None else (
            f"is not the checksum file its manifest {manifest_url} describes (it belongs "
            "to another cache or was changed)")
        raise DataLossError(
            f"cache: {names.checksums}, the record checksums of the complete cache "
            f"{names.data}, {problem}; delete the cache's objects to rebuild it",
            path=names.checksums,
        )
    expected = Expected(np.frombuffer(checksums, dtype="<u4"), manifest_url)
    codec, blocks = manifest_codec(manifest, manifest_url)
    return CompleteFile(names.data, ctx, account, count, codec, blocks, expected)
