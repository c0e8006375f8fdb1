"""``snapshot(path)``: tf.data's snapshot — the first complete pass is saved, later
passes (in this process or any other) read it.

It falls out of ``cache(filename)``: a snapshot is a persistent cache whose file
lives in a directory named by the *content* fingerprint of the pipeline above it
(:meth:`~headrace.core.node.Node.data_fingerprint`: its structure, a digest of its
in-memory arrays and of those its functions capture, the identity of its files),
``<path>/<fingerprint>/snapshot.hrcache`` (plus its ``.hrx`` index, the records'
checksums and the manifest that marks it complete). So, as in tf.data, one
``path`` holds the snapshots of several pipelines side by side, and editing the
pipeline or changing its input makes a new snapshot instead of reading a stale
one; a data file that is not the one written there is refused (DataLossError). The first iterator writes while it
passes the elements on; the snapshot is complete only at the end of the input
(a pass stopped early leaves nothing that counts, and the next pass writes
again); a complete one is read with positioned reads, never the input.

Differences from tf.data, on purpose: one file per snapshot (tf.data writes
shards, in parallel, and its ``reader_func``/``shard_func`` pick them); an
iterator that finds another one writing the same snapshot reads its input and
passes the elements on without writing (tf.data's *passthrough*), instead of the
lock error ``cache(filename)`` gives.

``path`` may be an ``s3://``, ``gs://`` or ``az://`` URL: the snapshot is
``<path>/<fingerprint>/snapshot.hrcache...`` objects, written locally and uploaded
when the first pass completes, the manifest last
(:mod:`headrace._persist.remote_store`). An object store has no lock, so there is no
pass-through there: every iterator that starts before the snapshot is complete writes
one, and the first to publish its manifest is kept.

Compression: ``"GZIP"``, ``"ZLIB"`` or ``"SNAPPY"`` (with the ``snappy`` extra) write
the snapshot as compressed *blocks* (:mod:`headrace.io.blocks`: a chunk of records
each, or one large record), so that it is still read by positioned reads and a
checkpoint still skips to its position without decompressing what comes before.
Readers detect the compression from the snapshot's manifest — a pipeline reads a
snapshot whatever compression it would have written — and check every block (its
CRCs, its codec's magic bytes, its decompressed size) before using it. ``"AUTO"``
(the default), ``None`` and ``"NONE"`` write it uncompressed: tf.data's ``AUTO``
picks SNAPPY, but headrace's uncompressed snapshot is read with no decompression and
no copy, which is what a local disk favours; ask for a codec to trade CPU for disk.
"""

from __future__ import annotations

import os
from typing import Any

from headrace._errors import InvalidArgumentError
from headrace._persist.cache import CacheNode
from headrace._persist.remote_store import check_url
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node
from headrace.io import objstore
from headrace.io.blocks import BLOCK_CODECS, block_codec

__all__ = ["SnapshotNode"]

_UNCOMPRESSED = (None, "AUTO", "NONE", "")


class SnapshotNode(CacheNode):
    """The recipe of ``snapshot(path)`` (a persistent cache keyed by fingerprint)."""

    stage = "snapshot"
    passthrough_when_locked = True
    warns_partial = False

    def __init__(
        self, source: Node, path: str | os.PathLike[str], compression: str | None = "AUTO"
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(
                f"snapshot: path must be a non-empty str or os.PathLike, got {path!r:.80}"
            )
        if compression not in _UNCOMPRESSED and compression not in BLOCK_CODECS:
            raise InvalidArgumentError(
                f"snapshot: compression {compression!r} is not supported: use None, 'AUTO', "
                f"'NONE' or one of {', '.join(map(repr, BLOCK_CODECS))}"
            )
        codec = block_codec(None if compression in _UNCOMPRESSED else compression)
        self.path = objstore.local_path(os.fspath(path))
        parent = os.path.dirname(os.path.abspath(self.path))
        if objstore.is_remote(self.path):
            check_url(self.path, "snapshot", folder=True)
        elif not os.path.isdir(parent):
            raise InvalidArgumentError(
                f"snapshot: the directory of path {self.path!r} does not exist"
            )
        super().__init__(source)  # its directory is made by the first iterator
        self.compression = None if codec is None else codec.name

    @property  # type: ignore[override]
    def filename(self) -> str:
        """``<path>/<content fingerprint of the input>/snapshot``: found when first asked
        (the input's arrays are hashed once, not when the recipe is built)."""
        if objstore.is_remote(self.path):  # (a key: '/' whatever the OS)
            return f"{self.path.rstrip('/')}/{self.inputs[0].data_fingerprint()}/snapshot"
        return os.path.join(self.path, self.inputs[0].data_fingerprint(), "snapshot")

    @filename.setter
    def filename(self, value: str) -> None:
        """(CacheNode's constructor sets the in-memory cache's ``""``: derived here.)"""

    def params(self) -> tuple[Any, ...]:
        return (self.path,)

    def make_iterator(self, ctx: Context) -> Iterator:
        if not ctx.run.probe and not objstore.is_remote(self.path):
            os.makedirs(os.path.dirname(self.filename), exist_ok=True)
        return super().make_iterator(ctx)
