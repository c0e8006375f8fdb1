"""``Dataset.save`` / ``Dataset.load``: a preprocessed dataset on disk, with tf.data's meaning.

A saved dataset is a directory of shards plus the element spec::

    headrace-dataset.json          the manifest: element spec, shards, counts, the
                                   digest of each part file (written last)
    shard-00000-00000.tfrecord     elements of shard 0, TFRecord-framed (CRCs), in parts
    shard-00000-00000.tfrecord.hrx its record index (uncompressed shards)
    ...

Elements are encoded with :mod:`headrace.io.elements` (no pickle: loading a
dataset someone sent you runs no code). Shards are written in parallel, each
by a writer thread, from batches booked on the budget. The manifest is
written last and atomically, so a save that stopped never looks complete;
``load`` says so. Every shard part appears under its name only when complete.

The shard files count against the caps on open files (G2): the save holds
slots of the file pool for them, at most half of the cap when there are more
shards than that, leaving the rest to the readers feeding it. With more
shards than slots, a shard's file is closed when another needs its slot: it
ends as a complete part, and the shard goes on in a new part (``load`` reads
a shard's parts in order). A cap below three is a FileLimitError naming the
stage.

As in tf.data, ``shard_func(element)`` picks each element's shard (default:
round robin), and ``load``'s default ``reader_func`` interleaves the shards
one element at a time — with the default sharding that is the original
order. ``load`` checks each part file against the digest the manifest recorded
(one sequential read): a part from another save, or two swapped by name, is a
DataLossError naming it, never served as this save's elements (a damaged record is
reported with its offset). Uncompressed, a loaded dataset is a *random-access* source (through
the ``.hrx`` indexes): ``global_shuffle``, ``shard`` and resume act on indices. A part
whose records all have one framed size records it in the manifest (``record_bytes``,
0 where they differ): ``load`` computes its offsets instead of holding its index, 8
bytes a record (a part that is not count x size bytes long is a DataLossError naming
it); saves made before that field load every index, as then.

Resumable while writing: with ``checkpoint_args={"checkpoint_interval": n}``
the writer closes its current parts every ``n`` elements and records the
input's iterator state beside them (``.save-progress.json``); calling
``save`` again with the same pipeline continues from the last checkpoint
instead of starting over.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import glob
import hashlib
import json
import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import DataLossError, ElementSpecError, FileLimitError, InvalidArgumentError
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation, release_all
from headrace._persist.columnar import layout_for
from headrace._persist.records import (
    BYTES_OVERHEAD,
    EvenOffsets,
    check_run,
    check_scattered,
    one_size,
)
from headrace._sources.files import file_limiter
from headrace._sources.tfrecord import IndexedTFRecordNode
from headrace._structure import TensorSpec, flatten, leaf_spec, map_structure, spec_of
from headrace.core.fingerprint import file_digest, function_fingerprint, object_digest
from headrace.core.handoff import unpin
from headrace.core.indexing import IndexStream, RandomAccess, take_all
from headrace.core.iterator import Context, Iterator
from headrace.core.node import (
    AccountStage,
    SourceNode,
    known_spec,
)
from headrace.io import objstore
from headrace.io.elements import (
    ELEMENTS_FORMAT,
    decode_element,
    encode_element,
    spec_from_json,
    spec_to_json,
)
from headrace.io.filepool import HeldSlots, borrowed_slot, get_default_pool
from headrace.io.streams import normalize_compression_type
from headrace.io.tfrecord.reader import open_tfrecord
from headrace.io.tfrecord.writer import TFRecordWriter
from headrace.io.tfrecord_index import TFRecordIndex, build_index, write_atomically

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = [
    "MANIFEST_NAME",
    "DecodeRecord",
    "LoadNode",
    "SavedEmpty",
    "ShardsAsDatasets",
    "SpecCheck",
    "load_plan",
    "save",
]

MANIFEST_NAME = "headrace-dataset.json"
PROGRESS_NAME = ".save-progress.json"
_FORMAT = "headrace.saved"
_VERSION = 2
#: Older versions load read as before (version 1 records no digests of its files).
_OLD_VERSIONS = (1,)
_PART = "shard-{shard:05d}-{part:05d}.tfrecord"
_BATCH_BYTES = 1 << 20
_CHECKPOINT_KEYS = frozenset({"checkpoint_interval"})
_NOTHING: Any = object()


# --------------------------------------------------------------------------- save


def _default_num_shards() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _check_checkpoint_args(checkpoint_args: Any) -> int | None:
    if checkpoint_args is None:
        return None
    if not isinstance(checkpoint_args, dict):
        raise InvalidArgumentError(
            f"save: checkpoint_args must be a dict, got {type(checkpoint_args).__name__}"
        )
    unknown = sorted(set(checkpoint_args) - _CHECKPOINT_KEYS)
    if unknown:
        raise InvalidArgumentError(
            f"save: checkpoint_args keys {unknown} are not supported; headrace takes "
            "{'checkpoint_interval': n} (a checkpoint every n elements)"
        )
    interval = checkpoint_args.get("checkpoint_interval")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise InvalidArgumentError(
            f"save: checkpoint_args['checkpoint_interval'] must be an int > 0, got {interval!r}"
        )
    return interval


class _ShardWriter:
    """One shard's current part: a TFRecordWriter under a temporary name until closed."""

    def __init__(self, directory: str, shard: int, compression: str, parts: list[int]) -> None:
        self.directory, self.shard, self.compression = directory, shard, compression
        #: element counts of the parts already complete (published under their names)
        self.parts = parts
        #: each complete part's digest (:func:`_file_digest`), recorded in the manifest
        self.digests: list[str] = []
        #: each complete part's framed record size where all its records share one (0
        #: where they differ, or compressed), recorded in the manifest: ``load`` then
        #: computes the part's offsets instead of holding its index (8 bytes a record)
        self.record_bytes: list[int] = []
        self.writer: TFRecordWriter | None = None
        self.count = 0

    def write(self, records: list[bytes]) -> None:
        if self.writer is None:
            name = os.path.join(self.directory, _PART.format(shard=self.shard, part=len(self.parts)))
            try:
                self.writer = TFRecordWriter(name, self.compression or None)
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise _out_of_descriptors(error, name) from None
        self.writer.write_many(records)
        self.count += len(records)

    def close_part(self, *, last: bool = False) -> None:
        """Publish the current part (and its index) under its name; the last close of a
        shard that got no element publishes an empty part (every shard has a file)."""
        if last and self.writer is None and not self.parts:
            self.write([])
        writer, self.writer = self.writer, None
        if writer is None:
            return
        writer.close()
        size = 0
        if not self.compression:
            index = build_index(writer.path)
            size = one_size(index.offsets, index.shard_size)
        self.digests.append(_file_digest(writer.path))
        self.record_bytes.append(size)
        self.parts.append(self.count)
        self.count = 0

    def abort(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.abort()
        self.count = 0


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _disk_error(error: OSError, writer: _ShardWriter) -> OSError:
    if error.errno not in _FULL:
        return error
    return OSError(
        error.errno,
        f"save: no space left on the device writing shard {writer.shard} in "
        f"{writer.directory} ({error.strerror}): the save is not complete (no "
        f"{MANIFEST_NAME} is written) and its partial files are removed",
        writer.directory,
    )


def _out_of_descriptors(error: OSError, path: str) -> FileLimitError:
    return FileLimitError(
        error.errno,
        f"save: cannot open {path!r} ({error.strerror}): the process has no descriptor "
        "left, used outside headrace's cap on open files. Lower that cap "
        "(Options(max_open_files=n) or headrace.io.filepool.set_max_open_files(n)): the "
        "save then keeps fewer shard files open at once. Or raise the process's limit "
        "(ulimit -n).",
    )


#: Descriptors a writer thread needs beside its open shard files: closing a part indexes
#: it, which reads the file through a memory map (two descriptors) after it is closed.
_CLOSING_FILES = 1
#: The fewest slots a save can work with: one shard file, and the one spare to close it.
_FEWEST_FILES = 1 + _CLOSING_FILES


class _OpenFiles:
    """The save's slots on the file pool (G2): its shard files count against the caps.

    Why: each shard's part is a file open from its first record to its close, so
    ``num_shards`` writers held that many descriptors beside the cap, and died with
    EMFILE under a low ``ulimit -n``. The save holds slots for all its shards (and one
    spare per writer thread to close a part) when the cap allows; else at most half the
    cap, and each thread keeps that many files open (the least recently written is
    closed as a part when another shard needs its slot).
    """

    def __init__(self, ctx: Context, shards: int) -> None:
        pool = get_default_pool()
        limiter = file_limiter(ctx)
        cap = pool.max_open_files
        if limiter is not None:
            cap = min(cap, limiter.max_open_files)
        threads = max(1, min(shards, 4))
        wanted = shards + threads * _CLOSING_FILES
        if wanted > cap - 1:  # (one is the reader's)
            wanted = max(_FEWEST_FILES, (cap - 1) // 2)
        self.slots: HeldSlots | None = None
        while self.slots is None and wanted >= _FEWEST_FILES:
            try:
                self.slots = pool.hold(
                    wanted, limiter=limiter, stage="save", what="the shard files it writes"
                )
            except InvalidArgumentError:
                wanted -= 1  # other writers (a cache's) hold slots of the cap too
        if self.slots is None:
            raise FileLimitError(
                errno.EMFILE,
                f"stage 'save' needs {_FEWEST_FILES} open files (a shard file, and one to "
                f"index it when it closes) beside one to read its input; max_open_files="
                f"{cap} (Options(max_open_files=...) or headrace.io.filepool."
                f"set_max_open_files), less what cache or snapshot writers hold, leaves "
                f"fewer. Raise that cap to at least {_FEWEST_FILES + 1}.",
            )
        #: writer threads, and how many shard files each keeps open at once
        self.threads = max(1, min(threads, wanted // (1 + _CLOSING_FILES)))
        self.per_thread = wanted // self.threads - _CLOSING_FILES

    def release(self) -> None:
        if self.slots is not None:
            self.slots.release()


class _Workers:
    """Writer threads, each owning the shards ``shard % threads``; batches booked until
    written, at most two queued per thread (backpressure on the reading loop). Each
    thread keeps at most ``files.per_thread`` shard files open (see :class:`_OpenFiles`)."""

    def __init__(self, writers: list[_ShardWriter], account: Buffer, files: _OpenFiles) -> None:
        self.writers = writers
        self.account = account
        self.per_thread = files.per_thread
        self.queues: list[queue.Queue[Any]] = [
            queue.Queue(maxsize=2) for _ in range(files.threads)
        ]
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._run, args=(q,), name="headrace-save", daemon=True)
            for q in self.queues
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, tasks: queue.Queue[Any]) -> None:  # noqa: C901
        #: this thread's shards with a file open, least recently written first
        open_shards: dict[int, None] = {}
        while True:
            task = tasks.get()
            try:
                if task is None:
                    return
                action, shard, records, booking = task
                if self.error is None:
                    writer = self.writers[shard]
                    open_shards.pop(shard, None)
                    if writer.writer is None and (action == "write" or not writer.parts):
                        # it opens a file (a "finish" of a shard with no part: an empty one)
                        while open_shards and len(open_shards) >= self.per_thread:
                            oldest = next(iter(open_shards))
                            del open_shards[oldest]
                            self._close(self.writers[oldest])
                    if action == "write":
                        try:
                            writer.write(records)
                        except OSError as error:
                            raise _disk_error(error, writer) from error
                        open_shards[shard] = None
                    else:
                        self._close(writer, last=action == "finish")
                if booking is not None:
                    booking.release()
            except BaseException as error:
                if self.error is None:
                    self.error = unpin(error)
                if task is not None and task[3] is not None:
                    task[3].release()
            finally:
                tasks.task_done()

    @staticmethod
    def _close(writer: _ShardWriter, *, last: bool = False) -> None:
        try:
            writer.close_part(last=last)
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE) and not isinstance(
                error, FileLimitError
            ):
                raise _out_of_descriptors(error, writer.directory) from None
            if error.errno in _FULL:
                raise _disk_error(error, writer) from error
            raise

    def submit(self, action: str, shard: int, records: list[bytes], booking: Any) -> None:
        self.check()
        self.queues[shard % len(self.queues)].put((action, shard, records, booking))

    def drain(self) -> None:
        for tasks in self.queues:
            tasks.join()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        for tasks in self.queues:
            tasks.put(None)
        for thread in self.threads:
            thread.join()


def _file_digest(path: str) -> str:
    """The digest of a part file (as written, compressed or not; whole if small, sampled
    blocks and the size if large, see :func:`~headrace.core.fingerprint.file_digest`):
    the manifest records it per part, so a part file from another save, or two parts
    swapped by name, is refused by ``load`` instead of served as this save's elements,
    without reading a large save whole before its first element."""
    with borrowed_slot():  # (a load inside a running pipeline: its cap counts it, G2)
        if objstore.is_remote(path):
            info = objstore.object_info(path)
            return f"{info.size} {object_digest(info)}"
        return f"{os.path.getsize(path)} {file_digest(path)}"


def _save_remote(
    dataset: Dataset, url: str, shard_func: Callable[..., Any] | None,
    compression: str | None, checkpoint_args: dict[str, Any] | None, *,
    num_shards: int | None,
) -> None:
    """``save`` to an object store: the save is made in a local temporary directory
    (``TMPDIR`` needs room for it), then its files are uploaded, the manifest last.
    ``load`` reads a saved dataset only through its manifest, so an upload that stops
    halfway is an incomplete save, never a complete-looking one: an older manifest
    under ``url`` is deleted before the first part is uploaded."""
    if checkpoint_args:
        raise InvalidArgumentError(
            f"save: checkpoint_args needs a local directory ({url} is an object-store URL): "
            "an interrupted save continues from files it keeps beside its parts"
        )
    import tempfile

    base = url.rstrip("/")
    with tempfile.TemporaryDirectory(prefix="headrace-save-") as scratch:
        save(dataset, scratch, shard_func, compression, None, num_shards=num_shards)
        names = sorted(name for name in os.listdir(scratch) if name != MANIFEST_NAME)
        objstore.delete_object(f"{base}/{MANIFEST_NAME}")
        for name in [*names, MANIFEST_NAME]:
            with borrowed_slot(), open(os.path.join(scratch, name), "rb") as file:
                objstore.put_atomic(f"{base}/{name}", file)  # (G2: see put_atomic)


def _our_files(path: str) -> list[str]:
    pattern = os.path.join(glob.escape(path), "shard-*-*.tfrecord")
    found = glob.glob(pattern) + glob.glob(pattern + ".hrx")
    found += glob.glob(os.path.join(glob.escape(path), ".shard-*.tmp"))
    return found


def _remove(paths: list[str]) -> None:
    for name in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _write_json(path: str, content: dict[str, Any]) -> None:
    write_atomically(path, [json.dumps(content).encode()])


def _save_identity(
    dataset: Dataset, shard_func: Callable[..., Any] | None, compression: str, num_shards: int
) -> str:
    digest = hashlib.sha256()
    digest.update(dataset.node.data_fingerprint().encode())  # a changed input starts over
    digest.update(repr((compression, num_shards)).encode())
    if shard_func is not None:
        digest.update(function_fingerprint(shard_func).encode())
    return digest.hexdigest()[:20]


#: Shard ids ``save``'s ``shard_func`` may return: each id up to the largest is a shard
#: with its own files, so an id of a million made a million files for a few elements.
MAX_SHARDS = 4096


def _shard_of(shard_func: Callable[..., Any], element: Any, index: int) -> int:
    value = shard_func(*element) if isinstance(element, tuple) else shard_func(element)
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(
            f"save: shard_func must return an int >= 0 for each element, got {value!r} "
            f"for element {index}"
        )
    if value >= MAX_SHARDS:  # shards are numbered files, made up to the largest id
        raise InvalidArgumentError(
            f"save: shard_func returned {value} for element {index}; shard ids number the "
            f"shard files, from 0 to {MAX_SHARDS - 1} (take the id modulo the number of "
            "shards you want)"
        )
    return int(value)


def save(
    dataset: Dataset,
    path: str | os.PathLike[str],
    shard_func: Callable[..., Any] | None = None,
    compression: str | None = None,
    checkpoint_args: dict[str, Any] | None = None,
    *,
    num_shards: int | None = None,
) -> None:
    """Write ``dataset`` to the directory ``path`` (see the module docstring)."""
    directory = os.fspath(path)
    if objstore.is_remote(directory):
        _save_remote(dataset, directory, shard_func, compression, checkpoint_args,
                     num_shards=num_shards)
        return
    codec = normalize_compression_type(compression)
    interval = _check_checkpoint_args(checkpoint_args)
    shards = _default_num_shards() if num_shards is None else num_shards
    if isinstance(shards, bool) or not isinstance(shards, int) or shards <= 0:
        raise InvalidArgumentError(f"save: num_shards must be an int > 0, got {num_shards!r}")
    os.makedirs(directory, exist_ok=True)
    identity = _save_identity(dataset, shard_func, codec, shards)
    progress_path = os.path.join(directory, PROGRESS_NAME)
    manifest_path = os.path.join(directory, MANIFEST_NAME)
    resumed = _read_progress(progress_path, identity) if interval is not None else None
    # never a complete-looking mix of old and new shards: the manifest goes first
    with contextlib.suppress(FileNotFoundError):
        os.unlink(manifest_path)
    parts: list[list[int]] = [[] for _ in range(shards)]
    digests: list[list[str]] = [[] for _ in range(shards)]
    sizes: list[list[int]] = [[] for _ in range(shards)]
    if resumed is not None:
        parts, digests, sizes = resumed["parts"], resumed["digests"], resumed["record_bytes"]
        keep = {
            os.path.join(directory, _PART.format(shard=s, part=p) + suffix)
            for s, counts in enumerate(parts)
            for p in range(len(counts))
            for suffix in ("", ".hrx")
        }
        _remove([name for name in _our_files(directory) if name not in keep])
    else:
        _remove([*_our_files(directory), progress_path])
    writers = [_ShardWriter(directory, s, codec, parts[s]) for s in range(len(parts))]
    for writer, done_digests, done_sizes in zip(writers, digests, sizes, strict=True):
        writer.digests, writer.record_bytes = list(done_digests), list(done_sizes)
    iterator = iter(dataset)
    try:
        if resumed is not None:
            iterator.set_state(resumed["state"])
        done = 0 if resumed is None else int(resumed["elements"])
        first = _write_all(iterator, writers, shard_func, interval, done, progress_path, identity,
                           known_spec(dataset.node))
        counts = [list(writer.parts) for writer in writers]
        file_digests = [list(writer.digests) for writer in writers]
        record_bytes = [list(writer.record_bytes) for writer in writers]
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        iterator.close()
    spec = _spec_json(dataset, first)
    _write_json(
        manifest_path,
        {
            "format": _FORMAT,
            "version": _VERSION,
            "elements_format": ELEMENTS_FORMAT,
            "element_spec": spec,
            "compression": codec,
            "num_shards": len(counts),
            "parts": counts,
            "digests": file_digests,
            "record_bytes": record_bytes,
            "elements": sum(sum(c) for c in counts),
            "fingerprint": dataset.node.data_fingerprint(),
        },
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(progress_path)


def _spec_json(dataset: Dataset, first: Any) -> Any:
    """The element spec to record: the pipeline's when known without data; else that of
    the first element written, sizes unknown (as map's sampled spec) — never a second
    read of the input; None for an empty dataset whose spec needs data."""
    spec = _recorded_spec(known_spec(dataset.node), first)
    return None if spec is None else spec_to_json(spec)


def _recorded_spec(known: Any, first: Any) -> Any:
    if known is not None or first is _NOTHING:
        return known
    return map_structure(
        lambda leaf: TensorSpec((None,) * len(leaf.shape), leaf.dtype, leaf.kind), spec_of(first)
    )


def _read_progress(path: str, identity: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as file:
            progress = json.load(file)
    except (OSError, ValueError):
        return None
    if not isinstance(progress, dict) or progress.get("identity") != identity:
        return None  # another pipeline's (or arguments'): start over
    parts, digests = progress.get("parts"), progress.get("digests")
    if not isinstance(parts, list) or not isinstance(digests, list) or [
        len(shard) for shard in parts
    ] != [len(shard) for shard in digests]:
        return None  # an older headrace's (no digests of its parts), or damaged: start over
    sizes = progress.get("record_bytes")
    if not isinstance(sizes, list) or [
        [type(n) is int and n >= 0 for n in shard] if isinstance(shard, list) else None
        for shard in sizes
    ] != [[True] * len(shard) for shard in parts]:
        # (parts an older headrace wrote: their sizes unknown, load reads their indexes)
        progress["record_bytes"] = [[0] * len(shard) for shard in parts]
    return progress


def _write_all(  # noqa: C901
    iterator: Any,
    writers: list[_ShardWriter],
    shard_func: Callable[..., Any] | None,
    interval: int | None,
    done: int,
    progress_path: str,
    identity: str,
    known: Any = None,
) -> Any:
    """Write every element; returns the first one written (``_NOTHING`` if none).

    Each element is checked against the spec the manifest will record (``known``, the
    pipeline's, else the first element's): one that differs (a map whose outputs
    change dtype mid-stream) would make a save that ``load`` refuses, so it is refused
    here, naming it, and nothing complete-looking is left."""
    first: Any = _NOTHING
    check: SpecCheck | None = None
    account = iterator.context.account(_SAVE_NODE)
    iterator.context.budget.allot()
    files = _OpenFiles(iterator.context, len(writers))
    try:
        workers = _Workers(writers, account, files)
    except BaseException:
        files.release()
        raise
    pending: dict[int, list[bytes]] = {}
    pending_bytes: dict[int, int] = {}
    #: Each shard's pending batch, booked as one (it moves to the writer thread with it).
    bookings: dict[int, Reservation] = {}
    limit = max(64 << 10, min(_BATCH_BYTES, account.share() // (2 * len(workers.queues) + 2)))

    def send(shard: int) -> None:
        records = pending.pop(shard, [])
        pending_bytes.pop(shard, 0)
        booking = bookings.pop(shard, NO_RESERVATION)
        if records:
            workers.submit("write", shard, records, booking)

    try:
        for element in iterator:
            if check is None:
                first = element
                check = SpecCheck(_recorded_spec(known, element), given=False)
            problem = check.problem(element)
            if problem:
                raise ElementSpecError(
                    f"save: element {done} does not match the element spec the saved "
                    f"dataset records ({problem}): load would refuse it. Make the "
                    "pipeline's elements agree (cast them in the map, or give the map an "
                    "output_signature)"
                )
            shard = (done % len(writers)) if shard_func is None else _shard_of(
                shard_func, element, done
            )
            while shard >= len(writers):  # custom sharding: shards appear as used
                writers.append(_ShardWriter(writers[0].directory, len(writers), writers[0].compression, []))
            record = encode_element(element)
            size = len(record) + 33
            if not account.fits(size):
                # Batches pending for many shards fill the share: hand them all to the
                # writers, and wait until they have written enough.
                for waiting in list(pending):
                    send(waiting)
                account.wait_for_room(size)
            bookings[shard] = bookings.get(shard, NO_RESERVATION).absorb(account.admit(size))
            pending.setdefault(shard, []).append(record)
            pending_bytes[shard] = pending_bytes.get(shard, 0) + size
            if pending_bytes[shard] >= limit:
                send(shard)
            done += 1
            if interval is not None and done % interval == 0:
                _checkpoint(iterator, writers, workers, send, pending, done, progress_path, identity)
        for shard in list(pending):
            send(shard)
        for shard in range(len(writers)):
            workers.submit("finish", shard, [], None)
        workers.drain()
    finally:
        release_all(bookings.values())
        bookings.clear()
        pending.clear()
        pending_bytes.clear()
        workers.stop()
        files.release()
    return first


def _checkpoint(
    iterator: Any,
    writers: list[_ShardWriter],
    workers: _Workers,
    send: Callable[[int], None],
    pending: dict[int, list[bytes]],
    done: int,
    progress_path: str,
    identity: str,
) -> None:
    """Publish every shard's current part and record where the input is."""
    for shard in list(pending):
        send(shard)
    for shard in range(len(writers)):
        workers.submit("close", shard, [], None)
    workers.drain()
    _write_json(
        progress_path,
        {
            "identity": identity,
            "elements": done,
            "parts": [list(writer.parts) for writer in writers],
            "digests": [list(writer.digests) for writer in writers],
            "record_bytes": [list(writer.record_bytes) for writer in writers],
            "state": iterator.get_state(),
        },
    )


class _SaveStage(AccountStage):
    """Stands for the save's writer in the budget's split (never iterated)."""

    stage = "save"
    budget_weight = 0.5


_SAVE_NODE = _SaveStage()


# --------------------------------------------------------------------------- load


def _read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST_NAME)
    remote = objstore.is_remote(directory)
    try:
        with borrowed_slot():
            if remote:
                manifest = json.loads(objstore.read_whole(objstore.object_info(path)))
            else:
                with open(path, encoding="utf-8") as file:
                    manifest = json.load(file)
    except FileNotFoundError:
        if remote:
            why = f"it has no {MANIFEST_NAME} (a save that did not finish leaves none)"
        elif os.path.exists(os.path.join(directory, PROGRESS_NAME)):
            why = (
                "a save into it stopped before the end (call save again with the same "
                "pipeline and checkpoint_args to finish it)"
            )
        elif os.path.isdir(directory):
            why = f"it has no {MANIFEST_NAME} (a save that did not finish leaves none)"
        else:
            why = "no such directory"
        raise FileNotFoundError(f"load: {directory} is not a complete saved dataset: {why}") from None
    except (ValueError, RecursionError) as error:  # (nested past what json can read)
        raise DataLossError(f"load: {path} is not valid JSON ({error})", path=path) from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        what = repr(manifest.get("format"))[:40] if isinstance(manifest, dict) else "none"
        raise DataLossError(
            f"load: {path} is not a headrace saved-dataset manifest ('format' {what}, "
            f"not {_FORMAT!r})",
            path=path,
        )
    version = manifest.get("version")
    if (
        version != _VERSION and version not in _OLD_VERSIONS
    ) or manifest.get("elements_format") != ELEMENTS_FORMAT:
        raise DataLossError(
            f"load: {path} has 'version' {manifest.get('version')!r:.20} and "
            f"'elements_format' {manifest.get('elements_format')!r:.40}; this headrace "
            f"reads version {_VERSION} ({ELEMENTS_FORMAT})",
            path=path,
        )
    _check_manifest(manifest, path)
    return manifest


def _check_manifest(manifest: dict[str, Any], path: str) -> None:
    """Every field ``load`` uses, of the type and range ``save`` writes: DataLossError
    naming the manifest otherwise (never a KeyError or TypeError further on)."""

    def bad(problem: str) -> DataLossError:
        return DataLossError(f"load: the manifest {path} is corrupted: {problem}", path=path)

    parts = manifest.get("parts")
    if not isinstance(parts, list) or not all(
        isinstance(shard, list) and all(type(n) is int and n >= 0 for n in shard)
        for shard in parts
    ):
        raise bad(f"'parts' must list each shard's part sizes, got {parts!r:.80}")
    elements = manifest.get("elements")
    if type(elements) is not int or elements != sum(sum(shard) for shard in parts):
        raise bad(f"'elements' = {elements!r:.40} is not the sum of its parts")
    if manifest.get("num_shards") != len(parts):
        raise bad(f"'num_shards' = {manifest.get('num_shards')!r:.40}, it lists {len(parts)}")
    problem = _identity_problem(manifest)
    if problem:
        raise bad(problem)
    if "element_spec" not in manifest:
        raise bad("it has no 'element_spec'")
    if manifest.get("version") in _OLD_VERSIONS:
        return  # saved before part digests were recorded: loaded as then
    digests = manifest.get("digests")
    if not isinstance(digests, list) or [
        [isinstance(d, str) for d in shard] if isinstance(shard, list) else None
        for shard in digests
    ] != [[True] * len(shard) for shard in parts]:
        raise bad(f"'digests' must list a digest per part of each shard, got {digests!r:.80}")
    sizes = manifest.get("record_bytes", _NOTHING)  # (saves before it was recorded: none)
    if sizes is not _NOTHING and (not isinstance(sizes, list) or [
        [type(n) is int and n >= 0 for n in shard] if isinstance(shard, list) else None
        for shard in sizes
    ] != [[True] * len(shard) for shard in parts]):
        raise bad(
            f"'record_bytes' must list an int >= 0 per part of each shard, got {sizes!r:.80}"
        )


def _identity_problem(manifest: dict[str, Any]) -> str:
    """What is wrong with the manifest's 'compression' and 'fingerprint', or "".

    Every save wrote both since version 1: one missing was removed by hand or damage,
    and guessing (no compression) read a GZIP save's parts as raw records."""
    if "compression" not in manifest:
        return "it has no 'compression' (save records '', 'GZIP' or 'ZLIB')"
    if manifest["compression"] not in ("", "GZIP", "ZLIB"):
        return f"unknown 'compression' {manifest['compression']!r:.40}"
    if not isinstance(manifest.get("fingerprint"), str):
        return ("'fingerprint' must be the saved pipeline's fingerprint (a string), got "
                f"{manifest.get('fingerprint')!r:.40}")
    return ""


def _find_damage(name: str, compression: str | None) -> None:
    """Raise the reader's DataLossError (file and offset) for the first record of ``name``
    whose framing or CRC fails; return if every record is sound (a foreign file)."""
    with borrowed_slot(), open_tfrecord(
        name, compression_type=compression, max_record_bytes=1 << 31
    ) as reader:
        while reader.read_batch():
            pass


def _check_part_files(directory: str, manifest: dict[str, Any], files: list[list[str]]) -> None:
    """Refuse a part file that is not the one this save wrote at its place (another save's,
    or two parts swapped by name): DataLossError naming it, before any element is read.

    At most about half a MiB read per part (see :func:`_file_digest`); a save of version 1
    recorded no digests and is loaded unchecked, as then. A damaged part (a record's CRC
    fails) is reported as such, with the record's offset."""
    if manifest.get("version") in _OLD_VERSIONS:
        return
    for shard_files, shard_digests in zip(files, manifest["digests"], strict=True):
        for name, digest in zip(shard_files, shard_digests, strict=True):
            try:
                actual = _file_digest(name)
            except FileNotFoundError:
                raise DataLossError(
                    f"load: {name}, a part file listed by the manifest of {directory}, is "
                    "missing",
                    path=name,
                ) from None
            if actual != digest:
                _find_damage(name, manifest.get("compression") or None)
                raise DataLossError(
                    f"load: {name} is not the part file this save wrote there (its digest "
                    f"{actual} differs from {digest} in {MANIFEST_NAME}): a file from another "
                    "save, two parts swapped, or a file changed since",
                    path=name,
                )


def _part_files(directory: str, parts: list[list[int]]) -> list[list[str]]:
    return [
        [os.path.join(directory, _PART.format(shard=s, part=p)) for p in range(len(counts))]
        for s, counts in enumerate(parts)
    ]


class SpecCheck:
    """Refuse a decoded element that does not have the element spec ``load`` promised
    (the manifest's, or the one given): a manifest that does not match its data is a
    DataLossError naming the file, never elements of another shape passed on."""

    def __init__(self, spec: Any, given: bool) -> None:
        self.spec = spec
        self.given = given
        self.skeleton = _skeleton(spec)
        self.leaves: list[TensorSpec] = flatten(spec)

    def problem(self, element: Any) -> str:
        """How ``element`` differs from the spec ("" where it does not)."""
        if _skeleton(element) != self.skeleton:
            return "its structure differs"
        for index, (want, leaf) in enumerate(zip(self.leaves, flatten(element), strict=True)):
            if not want.is_compatible_with(leaf):
                return f"component {index} is {leaf_spec(leaf)}, not {want}"
        return ""

    def __call__(self, element: Any, path: str, offset: int | None = None) -> Any:
        problem = self.problem(element)
        if problem:
            where = "" if offset is None else f" at offset {offset}"
            whose = "the element_spec given to load" if self.given else "its manifest's spec"
            raise DataLossError(
                f"load: the element{where} in {path} does not match {whose} ({problem})",
                path=path,
                offset=offset,
            )
        return element


def _skeleton(value: Any) -> Any:
    """The nesting of an element or spec, without its leaves."""
    if isinstance(value, dict):
        return ("dict", tuple((key, _skeleton(value[key])) for key in sorted(value)))
    if isinstance(value, tuple):
        return ("tuple", tuple(_skeleton(item) for item in value))
    return None


class DecodeRecord:
    """Record bytes to element (a map function, for compressed shards)."""

    def __init__(self, directory: str, check: SpecCheck | None = None) -> None:
        self.directory = directory
        self.check = check

    def __call__(self, record: bytes) -> Any:
        element = decode_element(record, path=self.directory)
        return element if self.check is None else self.check(element, self.directory)


class SavedEmpty:
    """The map function of a dataset saved empty (never called): asking its element spec
    raises :class:`~headrace._errors.EmptyInputError`, as for any empty pipeline whose
    spec must be learnt from an element; iterating it yields nothing, as in tf.data."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, element: Any) -> Any:
        raise AssertionError(f"{self.directory} was saved empty: nothing to map")

    def __repr__(self) -> str:
        return f"load({self.directory!r}, saved empty)"


class LoadNode(SourceNode):
    """An uncompressed saved dataset as a random-access source, in the default read order."""

    stage = "load"

    def __init__(
        self,
        directory: str,
        manifest: dict[str, Any],
        element_spec: Any,
        check: SpecCheck | None = None,
    ) -> None:
        super().__init__()
        self.directory = directory
        self.parts: list[list[int]] = manifest["parts"]
        self.spec = element_spec
        self.check = check
        files = [name for shard in _part_files(directory, self.parts) for name in shard]
        counts = [c for shard in self.parts for c in shard]
        #: By file: the framed size all its records share (the manifest's), 0 where
        #: they differ or it was not recorded (then the file's index is loaded).
        self.record_bytes: list[int] = [
            size for shard in manifest.get("record_bytes") or [] for size in shard
        ] or [0] * len(files)
        known = {
            name: _even_index(name, count, size)
            for name, count, size in zip(files, counts, self.record_bytes, strict=True)
            if size
        }
        self.records = IndexedTFRecordNode(
            files, build_missing=False, verify_crc=True, max_record_bytes=1 << 31, known=known
        )
        if counts != self.records.counts:
            raise DataLossError(
                f"load: the shards in {directory} hold {self.records.counts} records, the "
                f"manifest says {counts}",
                path=directory,
            )
        self.digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:20]

    def params(self) -> tuple[Any, ...]:
        return (self.directory, self.digest)

    def content(self) -> tuple[Any, ...]:
        return self.records.content()  # a directory saved again is another dataset

    @property
    def element_spec(self) -> Any:
        return self.spec

    def cardinality(self) -> int:
        return sum(sum(shard) for shard in self.parts)

    def random_access(self) -> RandomAccess:
        return _LoadedAccess(self)

    def batched_iterator(
        self, ctx: Context, batch_size: int, drop_remainder: bool, account: Buffer
    ) -> Iterator | None:
        """``load().batch(n)``: alike elements (one skeleton, fixed-size numeric leaves)
        batched column by column from the records read for the batch; others one by
        one, as the plain batch does (its checkpoints are the plain batch's)."""
        if ctx.run.probe:
            return None
        from headrace._transforms.batch import ColumnarBatchIterator

        gather = self.make_iterator(ctx)
        access = getattr(gather, "access", None)
        if not isinstance(access, _LoadedAccess):
            return None
        stream = gather.stream  # type: ignore[attr-defined]

        def fetch(
            count: int, out: Buffer, *, whole: bool = False
        ) -> tuple[Any, Reservation, int] | None:
            return access.read_batch(stream, count, out, whole=whole)

        return ColumnarBatchIterator(gather, ctx, account, batch_size, drop_remainder, fetch)


def _even_index(name: str, count: int, size: int) -> TFRecordIndex:
    """The index of a part whose ``count`` records are all ``size`` bytes framed (its
    manifest says so): offsets computed, not loaded. The part must be exactly that long
    (as a loaded index checks its shard's size), else a DataLossError names it; a
    record that is not where the offsets say fails its framing check when read."""
    try:
        with borrowed_slot():
            actual = (
                objstore.object_info(name).size if objstore.is_remote(name)
                else os.path.getsize(name)
            )
    except FileNotFoundError:
        raise DataLossError(
            f"load: {name}, a part file listed by its directory's {MANIFEST_NAME}, is missing",
            path=name,
        ) from None
    if actual != count * size:
        raise DataLossError(
            f"load: {name} holds {actual} bytes where {count} records of {size} bytes, as "
            f"{MANIFEST_NAME} records them, make {count * size}: it is not the part file "
            "this save wrote there, or the manifest was changed",
            path=name,
        )
    # (EvenOffsets answers every read an index's offsets get: a position, a slice, an
    # array of positions)
    offsets: Any = EvenOffsets(size, count)
    return TFRecordIndex(name, offsets, actual)


class _LoadedAccess(RandomAccess):
    """Element ``i`` of the shards interleaved one at a time: shard-major record ``order[i]``."""

    def __init__(self, node: LoadNode) -> None:
        self.node = node
        self.records = node.records.random_access()
        totals = [sum(shard) for shard in node.parts]
        self.shard_starts = np.cumsum([0, *totals])
        self.file_starts = np.cumsum([0, *node.records.counts]).tolist()
        self.totals = np.asarray(totals, dtype=np.int64)
        self._order: np.ndarray[Any, Any] | None = None
        #: The indexed shards' reader, whose indexes and streams the batches read through.
        self.shards: Any = self.records
        #: The framed size, skeleton and layout of the records last batched.
        self.plan: tuple[int, bytes, Any] | None = None
        #: By file: the framed size all its records share, 0 where they differ (the
        #: manifest's where it records it; else found from the file's index).
        self.one_size: dict[int, int] = {
            file: size for file, size in enumerate(node.record_bytes) if size
        }
        self.file_array = np.asarray(self.file_starts, dtype=np.int64)
        #: Whether :meth:`read_batch` may batch column by column (off once the elements
        #: turn out to need objects, or to mix skeletons).
        self.columnar = True

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def prepare(self, ctx: Context) -> None:
        self.records.prepare(ctx)

    def _record_numbers(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        totals = self.totals
        if _round_robin(totals):
            # round robin (the default sharding): element i is shard i % n, row i // n
            # (divmod: numpy's int64 // first touches 1 MiB of its code, divmod none)
            row, shard = np.divmod(indices, len(totals))
            return np.asarray(self.shard_starts[shard] + row, dtype=np.int64)
        if self._order is None:  # uneven shards: the interleave order, computed once
            keys = np.concatenate(
                [np.arange(t, dtype=np.int64) * len(totals) + s for s, t in enumerate(totals)]
            )
            keys.sort()
            shard, row = keys % len(totals), keys // len(totals)
            self._order = np.asarray(self.shard_starts[shard] + row, dtype=np.int64)
        order: np.ndarray[Any, Any] = self._order[indices]
        return order

    def get(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"element {index} of {len(self)}")
        (number,) = self._record_numbers(np.asarray([index], dtype=np.int64)).tolist()
        return self._decode(self.records.get(number), number)

    def _decode(self, record: bytes, number: int) -> Any:
        file_number = bisect.bisect_right(self.file_starts, number) - 1
        path = self.node.records.filenames[file_number]
        try:
            element = decode_element(record, path=path)
            return element if self.node.check is None else self.node.check(element, path)
        except DataLossError:
            local = number - self.file_starts[file_number]
            offset = int(self.records._index(file_number).offsets[local])  # type: ignore[attr-defined]
            element = decode_element(record, path=path, offset=offset)
            return element if self.node.check is None else self.node.check(element, path, offset)

    def read_batch(
        self, stream: IndexStream, count: int, account: Buffer, *, whole: bool = False
    ) -> tuple[Any, Reservation, int] | None:
        """The next ``count`` elements of ``stream`` (fewer at its end) batched column by
        column from their records (read and checked as :meth:`get` reads them), or None
        — the stream put back where it was — where they are not all alike or one is
        damaged. The records
        read (and their joined copy) are booked on ``account`` while they are used, the
        batch's columns before they are allocated."""
        if not self.columnar:
            return None
        saved = stream.get_state()
        indices = np.asarray(take_all(stream, count), dtype=np.int64)
        if not len(indices) or (whole and len(indices) < count):
            stream.set_state(saved)
            return None
        numbers = self._record_numbers(indices)
        try:
            found = self._columns(numbers, account)
        except DataLossError:
            # A bad record among them: batched one by one instead, so it raises in its
            # place as every element error does (the rows before it dropped with their
            # batch, the next batch after it), never again at every call.
            found = None
        except BaseException:  # (refused: the next call meets the same batch, as batch's)
            stream.set_state(saved)
            raise
        if found is None:
            stream.set_state(saved)
            return None
        return (*found, len(numbers))

    def _columns(
        self, numbers: np.ndarray[Any, Any], account: Buffer
    ) -> tuple[Any, Reservation] | None:
        """The batch of records ``numbers``, column by column, or None where they are not
        all alike. The batch's columns are booked before they are allocated, and the
        records are read into them: large ones straight into the rows (one ``preadv``
        per run of a file's consecutive records, the kernel's copy the only one), small
        ones a piece at a time into one reused buffer (booked before it is read) and
        copied out column by column. Every record is checked (framing, both CRCs) before
        the batch is handed on; a damaged one is a DataLossError naming its file and
        offset. So the batch costs what the element-by-element batch books, not that
        again for its records."""
        plan = self._plan(numbers)
        if plan is None:
            return None
        size, head, layout = plan
        runs = self._runs(numbers, size)
        if runs is None:
            return None
        rows = len(numbers)
        booking = account.admit(layout.output_bytes(rows), together=f"a batch of {rows} elements")
        try:
            outputs = layout.allocate(rows)
            into_rows = size >= _JOIN_BELOW and all(leaf.copy_bytes for leaf in layout.leaves)
            read = self._read_into_rows if into_rows else self._read_in_pieces
            if not read(runs, numbers, outputs, layout, head, size, account):
                booking.release()
                return None
        except BaseException:
            booking.release()
            raise
        return layout.build(iter(outputs)), booking

    def _plan(self, numbers: np.ndarray[Any, Any]) -> tuple[int, bytes, Any] | None:
        """The framed size, skeleton and layout of the records ``numbers`` must share
        (those of the first), or None where its elements are not batched column by column.
        A size met before reuses its plan (no read): the rows' skeletons are compared
        with it as they are read."""
        first = int(numbers[0])
        file = bisect.bisect_right(self.file_starts, first) - 1
        local = first - self.file_starts[file]
        offsets = self.shards._index(file).offsets
        end = int(offsets[local + 1]) if local + 1 < len(offsets) else None
        size = (end if end is not None else self.shards._index(file).shard_size) - int(
            offsets[local]
        )
        if self.plan is not None and self.plan[0] == size:
            return self.plan
        # (one record by get: get_many's np.unique would import numpy.ma, 1.2 MiB)
        record = self.records.get(first)
        if len(record) < 4:
            return None
        head = record[: 4 + int.from_bytes(record[:4], "little")]
        layout = layout_for(head)
        if layout is None or len(head) + layout.data_bytes != len(record):
            self.columnar = layout is not None  # (elements that need objects: one by one)
            return None
        self._decode(record, first)  # the spec check: every record has its skeleton
        self.plan = (size, head, layout)
        return self.plan

    def _runs(
        self, numbers: np.ndarray[Any, Any], size: int
    ) -> list[tuple[int, int, np.ndarray[Any, Any]]] | None:
        """The batch's records as runs of consecutive records of one file: (file, offset
        of the run's first record, the batch rows they fill, in file order); None where
        one is not ``size`` bytes framed."""
        order = np.argsort(numbers, kind="stable")
        ordered = numbers[order]
        files = np.searchsorted(self.file_array, ordered, side="right") - 1
        cuts = (np.diff(ordered) != 1) | (np.diff(files) != 0)
        breaks = (np.flatnonzero(cuts) + 1).tolist()
        runs = []
        for lo, hi in zip([0, *breaks], [*breaks, len(ordered)], strict=True):
            file = int(files[lo])
            first = int(ordered[lo]) - self.file_starts[file]
            count = hi - lo
            index = self.shards._index(file)
            if self._one_size(file) != size:  # sizes differ in this file: these records'?
                begins = index.offsets[first : first + count].tolist()
                # (the end of the file closes a run that reaches it; zip drops it otherwise)
                ends = [*index.offsets[first + 1 : first + count + 1].tolist(), index.shard_size]
                if any(end - begin != size for begin, end in zip(begins, ends, strict=False)):
                    return None
            runs.append((file, int(index.offsets[first]), order[lo:hi]))
        return runs

    def _one_size(self, file: int) -> int:
        """The framed size every record of ``file`` shares (0 where they differ), found
        once a file, a slice of its index at a time: a batch then need not compare its
        records' offsets."""
        known = self.one_size.get(file)
        if known is None:
            index = self.shards._index(file)
            offsets = index.offsets
            known = 0
            if len(offsets):
                known = (int(offsets[1]) if len(offsets) > 1 else index.shard_size) - int(
                    offsets[0]
                )
                if index.shard_size - int(offsets[-1]) != known:
                    known = 0
                for at in range(0, len(offsets), 1 << 16):
                    part = offsets[at : at + (1 << 16) + 1]
                    if known and len(part) > 1 and (np.diff(part) != known).any():
                        known = 0
            self.one_size[file] = known
        return known

    def _read_in_pieces(
        self, runs: list[tuple[int, int, np.ndarray[Any, Any]]], numbers: np.ndarray[Any, Any],
        outputs: list[Any], layout: Any, head: bytes, size: int, account: Buffer,
    ) -> bool:
        """Small records: each run read a piece at a time into one reused buffer, checked
        there, and copied into its rows column by column; False (nothing more batched
        column by column) where a record has another skeleton."""
        step = max(1, min(_PIECE_BYTES, account.share() // 8) // size)
        longest = max(len(positions) for *_, positions in runs)
        nbytes = min(step, longest) * size
        held = account.admit(nbytes + BYTES_OVERHEAD, together="a batch's records read")
        buffer = bytearray(nbytes)
        view, matrix = memoryview(buffer), np.frombuffer(buffer, np.uint8)
        try:
            for file, begin, positions in runs:
                path, stream = self.node.records.filenames[file], self.shards._stream(file)
                for at in range(0, len(positions), step):
                    rows = positions[at : at + step]
                    count, start = len(rows), begin + at * size
                    if stream.pread_into(start, view[: count * size]) < count * size:
                        self._check_alone(numbers[rows])  # a truncated file: names where
                        return False
                    if check_run(view[: count * size], count, size, start, path, head) is None:
                        self.columnar = False  # skeletons mixed: one by one from now
                        return False
                    records = matrix[: count * size].reshape(count, size)
                    layout.fill(outputs, _rows_at(rows), records[:, 12 + len(head) : size - 4])
        finally:
            del view, matrix
            held.release()
        return True

    def _read_into_rows(
        self, runs: list[tuple[int, int, np.ndarray[Any, Any]]], numbers: np.ndarray[Any, Any],
        outputs: list[Any], layout: Any, head: bytes, size: int, account: Buffer,
    ) -> bool:
        """Large records: each run read straight into the rows it fills (its frames and
        skeletons into a small scratch buffer), one ``preadv`` per run (up to the
        kernel's limit on pieces), then each record checked where it landed. A record
        that fails is read again alone, for the reader's error naming its offset; False
        (nothing more batched column by column) where it is sound but another skeleton."""
        prefix = 12 + len(head)
        rows = len(numbers)
        targets = [
            out.reshape(rows, -1).view(np.uint8)
            for out, leaf in zip(outputs, layout.leaves, strict=True) if leaf.nbytes
        ]
        per_call = max(1, 1024 // (2 + len(targets)))
        longest = max(len(positions) for *_, positions in runs)
        scratch = bytearray(min(per_call, longest) * (prefix + 4))
        held = account.admit(len(scratch) + BYTES_OVERHEAD, together="a batch's record frames")
        frames = memoryview(scratch)
        try:
            for file, begin, positions in runs:
                stream = self.shards._stream(file)
                for at in range(0, len(positions), per_call):
                    chunk = positions[at : at + per_call].tolist()
                    pieces: list[memoryview] = []
                    for number, row in enumerate(chunk):
                        mark = number * (prefix + 4)
                        pieces.append(frames[mark : mark + prefix])
                        pieces += [memoryview(target[row]) for target in targets]
                        pieces.append(frames[mark + prefix : mark + prefix + 4])
                    if stream.pread_scatter(begin + at * size, pieces) < len(chunk) * size:
                        self._check_alone(numbers[chunk])  # a truncated file: names where
                        return False
                    _, wrong = check_scattered(frames, prefix, head, targets, chunk)
                    if wrong >= 0:
                        row = chunk[wrong]
                        self._check_alone(numbers[row : row + 1])  # raises if damaged
                        self.columnar = False  # sound, but another skeleton
                        return False
        finally:
            del frames
            held.release()
        return True

    def _check_alone(self, numbers: np.ndarray[Any, Any]) -> None:
        """Read records ``numbers`` the checked way (raising the reader's DataLossError
        that names the file and the offset of one that is damaged or cut short)."""
        self.records.get_many(numbers)

    def close(self) -> None:
        self.records.close()


#: Records from this size on are read straight into the batch's rows (pieces of a few
#: bytes each would cost more than the copy out of a shared buffer they save).
_JOIN_BELOW = 4 << 10
#: At most this much of a batch's records is read (and held) at once.
_PIECE_BYTES = 4 << 20


def _rows_at(rows: np.ndarray[Any, Any]) -> slice | np.ndarray[Any, Any]:
    """Batch rows as a slice where they are evenly spaced (the shards' round robin), so
    that filling them is a strided copy, not a gather."""
    if len(rows) == 1:
        return slice(int(rows[0]), int(rows[0]) + 1)
    steps = np.diff(rows)
    if steps[0] > 0 and (steps == steps[0]).all():
        return slice(int(rows[0]), int(rows[-1]) + 1, int(steps[0]))
    return rows


def _round_robin(totals: np.ndarray[Any, Any]) -> bool:
    """Shard sizes round robin leaves: the first k shards one longer than the rest."""
    if not len(totals):
        return True
    high = totals[0]
    return bool(((totals == high) | (totals == high - 1)).all() and (np.diff(totals) <= 0).all())


class ShardsAsDatasets:
    """Shard index to that shard's dataset: the function that turns a dataset of shard
    indices into tf.data's input of ``reader_func``, a dataset of datasets."""

    def __init__(self, shards: list[Dataset]) -> None:
        self.shards = shards

    def __call__(self, index: Any) -> Dataset:
        return self.shards[int(index)]


def load_plan(
    path: str | os.PathLike[str], element_spec: Any
) -> tuple[str, dict[str, Any], Any, list[list[str]], str | None]:
    """What ``Dataset.load`` needs: the directory, its manifest, the element spec (given
    or recorded), each shard's part files and the compression."""
    directory = os.fspath(path)
    manifest = _read_manifest(directory)
    spec = element_spec
    if spec is None:
        raw = manifest.get("element_spec")
        if raw is None and manifest.get("elements") == 0:
            # saved empty: nothing to learn a spec from; it loads as an empty dataset
            return directory, manifest, None, [], manifest.get("compression") or None
        if raw is None:
            manifest_path = os.path.join(directory, MANIFEST_NAME)
            raise DataLossError(
                f"load: the manifest {manifest_path} records elements but no element spec "
                "('element_spec' is null)",
                path=manifest_path,
            )
        manifest_path = os.path.join(directory, MANIFEST_NAME)
        try:
            spec = spec_from_json(raw)
        except ValueError as error:
            raise DataLossError(
                f"load: the manifest {manifest_path} is corrupted: {error}", path=manifest_path
            ) from None
    files = _part_files(directory, manifest["parts"])
    _check_part_files(directory, manifest, files)
    return directory, manifest, spec, files, manifest.get("compression") or None
