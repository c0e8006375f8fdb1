"""``cache(filename="")``: read the input once, serve every later epoch from the cache.

tf.data's in-memory cache grows until the process dies. Here ``cache()`` keeps
elements in memory only while they fit in the stage's share of the budget
(G1): when the next one would not, it and every later element *spill* to an
on-disk cache in a temporary directory (one warning names the sizes and the
directory), so a dataset several times the budget caches without passing it.
As in tf.data, a complete cache belongs to the dataset, not to the iterator
that wrote it: the epochs of a ``repeat`` after it and every later ``iter()``
of the dataset (Keras makes one per epoch) read only the cache, never the
input. Its bytes stay booked while it lives — on the process-wide default
budget, and on the cache stage's share of each run with its own
``memory_budget`` that reads it (see :mod:`headrace._persist.kept`) — and it is
freed, spill files included, when the dataset is garbage-collected (or at
exit). A cache that is not complete is freed when its iterator closes (also
after an exception). Two iterators that start before either completes each
read the input; the first to complete is kept and both read it afterwards
(tf.data's rule).

``cache(filename)`` is tf.data's persistent cache: ``<filename>.hrcache``
(elements, TFRecord-framed, CRC-checked) and ``<filename>.hrcache.json``, the
manifest that marks it complete. Both are written atomically and only at the
end of the input (or once the input's cardinality is reached, as in tf.data),
so a crashed or interrupted writer never leaves a cache that looks complete.
The manifest records the *content* fingerprint of the pipeline above the cache
(:meth:`~headrace.core.node.Node.data_fingerprint`: its structure, a digest of its
in-memory arrays and of those its functions capture, the identity of its files):
a run of another pipeline, or of this one over changed data, rebuilds the cache
(with a warning) instead of reading stale data. It also vouches for the data
file: ``<filename>.hrcache.crc`` holds each record's data CRC as written (the
manifest holds its digest), and every record read is compared with it before it
is used, so a data file from another cache or changed since is refused with
:class:`~headrace._errors.DataLossError` naming it, at no extra read. The manifest
itself is sealed (a checksum over its fields, :func:`headrace.core.state.seal`): one
edited since is a DataLossError naming it, never believed nor silently rebuilt over
(an older headrace's unsealed manifest is rebuilt, as before). One writer at a time: ``<filename>.lockfile`` is held with
``flock`` (released by the kernel if the writer dies), and a second writer
gets tf.data's error naming it.

Memory of a read (G1). A complete ``cache(filename)`` read by ``batch``, with any
``skip`` and ``take`` between them, is batched column by column: the batch's rows are
booked first and large records are read straight into them. The pipeline then needs
what the uncached one needs (the batch's rows) plus what the reader holds beside
them: its index and the manifest's CRCs (at most 12 bytes a record), the frames and
skeletons of one batch's records, and, for records under 4 KiB (read in runs through
a buffer sized from the share the batch leaves), one record. A ``skip`` reads and
checks the elements it drops (a damaged one raises in its place), one at a time
before the batch's rows are booked: one element, which stays the stage's minimum.
Elements that need objects (strings, ragged values) are read one by one: one element
beside the batch, booked, where an uncached map's output waits unbooked.

``cache("s3://bucket/name")`` (``gs://``, ``az://``) is the same cache in a bucket:
written in a local staging directory, uploaded when the pass completes (the manifest
last, with a conditional PUT: no lockfile, the first writer to publish wins), and read
with ranged reads by later passes in any process (:mod:`headrace._persist.remote_store`).

As in tf.data, an iterator that stops before the end (``cache().take(k)``)
leaves a *partial* cache, which is discarded with a warning that says to
write ``take(k).cache()`` instead.

Elements on disk use :mod:`headrace.io.elements` (no pickle): arrays, numbers,
bytes, str, None and dicts/tuples/lists of them. Elements that stay in memory
are kept as they are, with their arrays made read-only views, so an in-place
edit by a consumer cannot change what the next epoch reads.

Checkpoints (G4) hold the mode (writing or reading), the position, and which
iterator wrote the cache (its repeat epochs and its number, which seed a
reshuffling shuffle above the cache), never cached data. A kept cache that
iterator wrote is read from the position; without one (a new process, or a
cache another iterator wrote) the cache is rebuilt by replaying the input as
that iterator read it — exact for a deterministic input, like any replay —
while a complete ``cache(filename)`` is simply read from the position.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from headrace._errors import (
    CheckpointError,
    DataLossError,
    HeadraceWarning,
    InvalidArgumentError,
)
from headrace._memory.buffer import Buffer, Reservation
from headrace._persist.file_store import FileReader, FileStore, find_complete
from headrace._persist.kept import kept_caches
from headrace._persist.memory_store import KeptStore, MemoryStore
from headrace._persist.remote_store import RemoteStore, check_url, find_complete_remote
from headrace._persist.stores import PassThrough, Store, StoreReader
from headrace._sources.files import file_limiter
from headrace._warn import warn_user
from headrace.core.element_errors import STREAM_ERRORS, RepeatCheck
from headrace.core.indexing import RandomAccess, Reach, Refusal
from headrace.core.iterator import Context, Iterator
from headrace.core.node import Node, ShardRole, Traits, UnaryNode
from headrace.core.state import ERRORS_MET, POSITION, StateReader, past_end
from headrace.io import objstore

__all__ = ["PARTIAL_CACHE_ADVICE", "CacheNode"]


#: tf.data's warning for a cache an iterator stopped reading before the end.
PARTIAL_CACHE_ADVICE = (
    "The calling iterator did not fully read the dataset being cached. In order to avoid "
    "unexpected truncation of the dataset, the partially cached contents of the dataset "
    "will be discarded. This can happen if you have an input pipeline similar to "
    "`dataset.cache().take(k).repeat()`. You should use `dataset.take(k).cache().repeat()` "
    "instead."
)

MODE = "mode"
WRITE = "write"
READ = "read"
EPOCHS = "epochs"
#: Which iterator of the dataset wrote the cache (seeds a reshuffling shuffle above it).
WRITER_ITERATION = "writer_iteration"
#: Errors the input raised in elements' places while the cache was written: they are
#: not cached, but a restore must pass them as the writing iterator did.
ERRORS = ERRORS_MET


class CacheNode(UnaryNode):
    """The recipe of ``cache(filename)``; ``filename=""`` caches in memory (and spills)."""

    stage = "cache"
    budget_weight = 1.0
    #: Whether an iterator that finds another one writing the file reads its input
    #: without writing (snapshot) instead of raising tf.data's lock error (cache).
    passthrough_when_locked = False
    #: Whether stopping before the end warns with tf.data's partial-cache advice.
    warns_partial = True
    #: How the file is compressed (:mod:`headrace.io.blocks`; None: not at all).
    compression: str | None = None
    shared_capabilities = ("cardinality", "shard_role", "element_access", "traits")

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()  # one element out per element in

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # a cache file holds one whole stream

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return reach(self.inputs[0])  # the same elements, read or replayed

    def traits(self) -> Traits:
        return Traits(caches_in_memory=not self.filename)

    def __init__(self, source: Node, filename: str | os.PathLike[str] = "") -> None:
        super().__init__(source)
        if not isinstance(filename, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"cache: filename must be a str or os.PathLike, got {type(filename).__name__}"
            )
        name = objstore.local_path(os.fspath(filename))
        if objstore.is_remote(name):
            check_url(name, "cache")
        elif name:
            directory = os.path.dirname(os.path.abspath(name))
            if not os.path.isdir(directory):
                raise InvalidArgumentError(
                    f"cache: the directory of filename {name!r} does not exist"
                )
        self.filename = name

    def params(self) -> tuple[Any, ...]:
        return (self.filename,)

    def reads_batches(self, ctx: Context) -> bool:
        """Whether its iterator may make whole batches itself (``pull_batch``): a cache
        file, outside a probe. A ``skip`` or ``take`` between it and a ``batch`` passes
        them through, so they keep the memory of ``cache(filename).batch(n)``."""
        return bool(self.filename) and not ctx.run.probe

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator | None:
        """``cache(filename).batch(n)``: once the cache file is complete, each batch is
        decoded column by column from runs of records (one copy per component, no
        element made), where the elements allow it; batched element by element
        otherwise. Its checkpoints are the plain batch's over the cache's."""
        if not self.reads_batches(ctx):
            return None
        from headrace._transforms.batch import ColumnarBatchIterator

        inner = self.make_iterator(ctx)
        fetch = inner.pull_batch  # type: ignore[attr-defined]
        return ColumnarBatchIterator(inner, ctx, account, batch_size, drop_remainder, fetch)

    def make_iterator(self, ctx: Context) -> Iterator:
        if ctx.run.probe:  # reading one element for a spec: neither cache nor warn,
            ctx.account(self)  # but split the budget as a real run does
            return self.inputs[0].make_iterator(ctx)
        return _CacheIterator(self, ctx)


class _CacheIterator(Iterator):
    stage = "cache"

    def __init__(self, node: CacheNode, ctx: Context) -> None:
        super().__init__()
        self.node, self.ctx = node, ctx
        self.account = ctx.account(node)
        self.upstream: Iterator | None = None
        self.store: Store | None = None
        self.source: StoreReader | None = None
        self.writing = False
        self.position = 0
        self.errors = 0  # raised by the input in elements' places while writing
        self.store_failed = False  # the last pull's error was the store's own (replays)
        #: Which iterator wrote (or writes) the cache read here: its epochs and number.
        self.writer: tuple[tuple[int, ...], int] = (ctx.epochs, ctx.run.iteration)
        self.cardinality = node.inputs[0].cardinality()
        complete = self._complete_store()
        if complete is not None:
            self._read(complete)
        else:
            self._write(ctx)

    # -- modes ---------------------------------------------------------------------------
    def _complete_store(
        self, writer: tuple[tuple[int, ...], int] | None = None
    ) -> Store | None:
        """The complete cache to read, if there is one; ``writer`` (a restored state's
        epochs and iteration): only an in-memory cache that iterator wrote."""
        if self.node.filename:
            if objstore.is_remote(self.node.filename):
                return find_complete_remote(self.node, self.ctx, self.account)
            return find_complete(self.node, self.ctx, self.account)
        data = kept_caches.get(self.node)
        if data is None or (writer is not None and writer != (data.epochs, data.iteration)):
            return None
        return KeptStore(data, self.ctx, self.account)

    def _read(self, store: Store) -> None:
        self.store, self.writing, self.position = store, False, 0
        self.source = store.reader()
        self.inputs = ()
        if isinstance(store, KeptStore):
            self.writer = (store.data.epochs, store.data.iteration)
        else:  # a cache file: any iterator rebuilds it alike
            self.writer = (self.ctx.epochs, self.ctx.run.iteration)

    def _write(self, ctx: Context) -> None:
        """Start writing a new cache, reading the input with ``ctx`` (the writer's epochs)."""
        epochs = ctx.epochs
        if self.node.filename:
            try:
                store: Store = (
                    RemoteStore(self.node, ctx, self.account, epochs)
                    if objstore.is_remote(self.node.filename)
                    else FileStore(self.node, ctx, self.account, epochs)
                )
            except FileExistsError:
                if not self.node.passthrough_when_locked:
                    raise
                store = PassThrough(epochs)
        else:
            store = MemoryStore(self.node, ctx, self.account, epochs)
        self.store, self.writing, self.position, self.errors = store, True, 0, 0
        self.writer = (epochs, ctx.run.iteration)
        try:
            self.upstream = self.node.inputs[0].make_iterator(ctx)
        except BaseException:
            store.discard()
            raise
        self.inputs = (self.upstream,)

    # -- elements -------------------------------------------------------------------------
    def pull(self) -> tuple[Any, Reservation]:
        if not self.writing:
            assert self.source is not None
            try:
                pair = self.source.pull()
            except DataLossError:
                self._past_damage()
                raise
            self.position += 1
            return pair
        store, upstream = self.store, self.upstream
        assert store is not None and upstream is not None
        if store.complete:
            raise StopIteration
        try:
            element, reservation = upstream.pull()
        except StopIteration:
            if self.errors:
                self._abandon()
            else:
                store.finish()
            raise
        except STREAM_ERRORS:
            raise
        except Exception:  # an element's error, handed out in its place (never cached)
            self.errors += 1
            raise
        try:
            pair = store.append(element, reservation)
        except Exception:
            self._store_failed(store)
            raise
        self.position += 1
        if store.count == self.cardinality and not self.errors:  # as tf.data: complete
            store.finish()  # without reading the end
        return pair

    def _store_failed(self, store: Store) -> None:
        """The store could not keep an element (a full disk, write buffers the budget
        refuses): it discarded what it wrote, its error stands in the element's place,
        and the rest of this pass goes on uncached (every later append would have failed
        on the closed store); the next pass reads the input again."""
        self.store = PassThrough(store.epochs)
        self.position += 1  # (a restore's replay goes on past it, whether or not it fails)
        self.store_failed = True

    def pull_batch(
        self, count: int, account: Buffer, *, whole: bool = False
    ) -> tuple[Any, Reservation, int] | None:
        """The next ``count`` elements (fewer at the end) as one batch decoded column by
        column from the cache file, booked on ``account``; None where that cannot be
        done (writing, a compressed or in-memory cache, elements that need objects, fewer
        than ``count`` left when ``whole``, a damaged record among them): then nothing was
        consumed, and the batch stage takes the elements one by one."""
        source = self.source
        if self.writing or not isinstance(source, FileReader):
            return None
        found = source.records.read_batch(count, account, whole=whole)
        if found is not None:
            self.position += found[2]
        return found

    def _past_damage(self) -> None:
        """A damaged record was raised and the file's reader went on after it (G5): the
        position follows, so a state taken now resumes after it too."""
        if isinstance(self.source, FileReader):
            self.position = self.source.records.next

    def _abandon(self) -> None:
        """The input raised in elements' places during this pass: the pass is not a
        complete copy of the input, so it is not kept (tf.data keeps it, and later
        epochs silently lack those elements, even where the error was transient). The
        next pass reads the input again."""
        store = self.store
        assert store is not None
        if store.partial:  # (a pass-through writes nothing: nothing to say)
            warn_user(
                f"{self.stage}: its input raised in the place of {self.errors} element(s) "
                "during this pass, so the pass is not kept as the cache (it would lack "
                "them in every later epoch); the next pass reads the input again. To cache "
                "a dataset whose elements fail every time, drop them before the cache: "
                ".ignore_errors().cache(...)",
                HeadraceWarning,
            )
        store.discard()
        ended = self.store = PassThrough(store.epochs)  # (nothing more to keep in this pass)
        ended.complete = True  # (its end was read: the next pull ends again)

    # -- checkpoints -----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        assert self.store is not None
        epochs, iteration = self.writer
        return {
            MODE: WRITE if self.writing else READ,
            POSITION: self.position,
            EPOCHS: list(epochs),
            WRITER_ITERATION: iteration,
            ERRORS: self.errors if self.writing else 0,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reader = StateReader(state, self.stage)
        mode = reader.raw(MODE)
        if mode not in (WRITE, READ):
            raise reader.error(MODE, f"must be {WRITE!r} or {READ!r}, got {mode!r:.40}")
        position = reader.integer(POSITION)
        epochs = tuple(reader.integers(EPOCHS, len(self.ctx.epochs)))
        iteration = reader.integer(WRITER_ITERATION)
        errors = reader.optional_integer(ERRORS) or 0
        self._stop(warn=False)
        complete = self._complete_store((epochs, iteration))
        if complete is not None:
            self._read(complete)
            self._skip(position)
            return
        # No complete cache here: rebuild it as the writing iterator read its input.
        self._write(self._writer_context(epochs, iteration))
        if mode == WRITE:  # the input as the writer read it: its elements and its errors
            self._replay(position, errors)
            return
        self._replay(None, None)  # the reading phase: the whole cache first, then the position
        store = self.store
        assert store is not None
        if not store.complete:
            raise CheckpointError(f"{self.stage}: the cache could not be rebuilt")
        if self.node.filename:
            self._read(self._complete_or_fail())
        else:
            assert isinstance(store, MemoryStore) and store.kept is not None
            self._read(KeptStore(store.kept, self.ctx, self.account))
        self._skip(position)

    def _replay(self, position: int | None, errors: int | None) -> None:
        """Write the cache again as the writing iterator did, up to ``position`` elements
        and ``errors`` errors of its input (None: to its end). The input's errors were
        handed out then and are never cached: they are passed here, except a stream's
        own errors and one the input raises again without moving."""
        assert self.upstream is not None
        repeats = RepeatCheck(self.upstream, self.stage)
        passed = 0
        while position is None or self.position < position or passed < (errors or 0):
            self.store_failed = False
            try:
                _, reservation = self.pull()
            except StopIteration:
                if position is None:
                    return
                raise past_end(self.stage, POSITION, position, self.position) from None
            except Exception as error:
                if self.store_failed:  # (the store's own failure, not the input's error)
                    continue
                if errors is not None and passed == errors:  # more than the writer met
                    raise
                repeats.check(error)
                passed += 1
                continue
            reservation.release()
            repeats.moved()
        self.errors = passed

    def _writer_context(self, epochs: tuple[int, ...], iteration: int) -> Context:
        """A context in which the input reads as it did for the iterator that wrote the
        cache: its repeat epochs, and its iterator number (what seeds a reshuffling
        shuffle above the cache), which may be an earlier iterator's than this run's."""
        ctx = copy.copy(self.ctx)
        ctx.epochs = epochs
        if iteration != ctx.run.iteration:
            file_limiter(ctx)  # made now, so the copy below shares the run's limiter
            ctx.run = copy.copy(ctx.run)
            ctx.run.iteration = iteration
        return ctx

    def _complete_or_fail(self) -> Store:
        complete = self._complete_store()
        if complete is None:
            raise CheckpointError(f"{self.stage}: the cache file could not be rebuilt")
        return complete

    def _skip(self, position: int) -> None:
        assert self.source is not None
        done = self.source.skip(position)
        if done < position:
            raise past_end(self.stage, POSITION, position, done)
        self.position = position

    # -- closing -----------------------------------------------------------------------------
    def _stop(self, *, warn: bool) -> None:
        store = self.store
        if self.writing and store is not None and not store.complete:
            if warn and self.position and self.node.warns_partial and store.partial:
                # (one that read nothing truncated nothing)
                warn_user(f"cache: {PARTIAL_CACHE_ADVICE}", UserWarning)
            store.discard()
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        if self.source is not None:
            self.source.close()
            self.source = None
        self.inputs = ()
        self.writing = False

    def close(self) -> None:
        self._stop(warn=True)
