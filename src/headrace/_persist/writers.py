"""Write a dataset of dicts as ``tf.train.Example`` TFRecord shards: fast, atomic, indexed.

:func:`save_tfrecords` is what ``Dataset.save_tfrecords`` calls. Decisions, and why:

* **One element = one Example** by default. With ``batched=True`` each element is a batch
  of rows (every value has the same leading dimension, as ``.batch()`` produces) and each
  row becomes one Example: the fastest way in, because columns arrive already stacked.
* **Shard assignment is deterministic.** The unit is the record (one Example). When the
  number of records is known up front (``batched=False`` and a known ``cardinality()``),
  shards hold *contiguous blocks* (the first ``n % num_shards`` shards one record more),
  written one after the other with one file open. Otherwise records go *round-robin*
  (record ``i`` to shard ``i % num_shards``) with ``num_shards`` writers open at once, so
  ``num_shards`` must not exceed the process's file cap
  (``headrace.io.filepool.get_default_pool().max_open_files``), nor the dataset's own
  ``Options(max_open_files=...)``.
* **All or nothing (G5).** Every shard is written to a hidden staging file (through
  :class:`~headrace.io.tfrecord.writer.TFRecordWriter`: temp file, fsync, rename) and indexed
  there; only when *every* shard is complete are they renamed to their final names. An
  exception anywhere before that - an element that cannot be serialized, a dataset that
  raises midway, a full disk - removes the staging files and propagates, so no file with
  a final name is left from this call (a previous run's shards are left untouched). A
  process killed mid-write can leave hidden ``.*.tmp`` / ``.*.staging`` files, never
  final names.
* **Indexes.** Each uncompressed shard gets its ``.hrx`` index
  (:func:`~headrace.io.tfrecord_index.build_index`), for random access and O(1) resume.
  Compressed (GZIP/ZLIB) shards cannot be indexed - a record cannot be reached without
  decompressing everything before it - so they get none, and a stale ``.hrx`` left under
  the same name by an earlier uncompressed run is removed.
* **Speed.** Rows are grouped in chunks and encoded *column by column* by
  :func:`headrace.io.example.encoding.encode_example_columns` (byte-identical to
  :func:`~headrace.io.example.encoding.serialize_example` row by row, many times faster);
  framing is the io layer's ``write_many`` (in C).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import IO, Any, Literal

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace.core.node import INFINITE, UNKNOWN
from headrace.io import objstore
from headrace.io.example.encoding import encode_example_columns, serialize_example
from headrace.io.filepool import borrowed_slot
from headrace.io.streams import normalize_compression_type
from headrace.io.tfrecord.framing import RECORD_OVERHEAD_BYTES
from headrace.io.tfrecord.writer import TFRecordWriter, fsync_directory
from headrace.io.tfrecord_index import build_index, index_path_for

__all__ = ["ProgressBar", "save_tfrecords", "shard_paths"]

ProgressSetting = bool | Literal["always"]

#: Elements encoded per chunk when ``batched=False``: large enough that NumPy's per-call
#: cost is amortized, small enough that a chunk of ~200-byte Examples stays ~200 KiB.
CHUNK_ELEMENTS = 1024
#: ... or fewer, so that a chunk and its records hold a few MiB whatever the elements'
#: sizes: the elements are the consumer's, outside the pipeline's budget.
CHUNK_BYTES = 4 << 20
_STAGING_SUFFIX = ".staging"
_DEFAULT_SHARD_NAME = "part-{shard:05d}-of-{num_shards:05d}.tfrecord"


# --------------------------------------------------------------------------- paths


def shard_paths(path: str | os.PathLike[str], num_shards: int) -> list[str]:
    """The shard file names :func:`save_tfrecords` writes for ``path``.

    ``path`` is a directory (shards named ``part-00000-of-00016.tfrecord``, ...) or a
    pattern containing ``{shard}`` and optionally ``{num_shards}``, with format specs
    allowed (``"train-{shard:03d}.tfrecord"``).
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise InvalidArgumentError(f"num_shards must be an int >= 1, got {num_shards!r}")
    text = os.fspath(path)
    if "{" not in text:
        if os.path.isfile(text):
            raise InvalidArgumentError(
                f"{text} is an existing file; pass a directory, or a pattern containing "
                "'{shard}' such as 'train-{shard:05d}-of-{num_shards:05d}.tfrecord'"
            )
        text = os.path.join(text, _DEFAULT_SHARD_NAME)
    elif "{shard" not in text:
        raise InvalidArgumentError(f"the pattern {text!r} must contain '{{shard}}'")
    try:
        paths = [text.format(shard=i, num_shards=num_shards) for i in range(num_shards)]
    except (KeyError, IndexError, ValueError) as error:
        raise InvalidArgumentError(
            f"bad shard pattern {text!r} ({error!r}): only '{{shard}}' and '{{num_shards}}' "
            "may be used"
        ) from None
    if len(set(paths)) != num_shards:
        raise InvalidArgumentError(f"the pattern {text!r} gives several shards the same name")
    return paths


# --------------------------------------------------------------------------- elements


def _element_mapping(element: Any, describe: str) -> Mapping[str, Any]:
    # ``type(...) is dict`` first: an ABC's isinstance costs as much as sizing an element
    if type(element) is not dict and not isinstance(element, Mapping):
        raise InvalidArgumentError(
            f"{describe}: save_tfrecords writes datasets of dicts {{feature name: value}}, "
            f"got {type(element).__name__}"
        )
    return element


def _payload_bytes_of(element: Any) -> int:
    """About what ``element``'s values hold: their arrays' bytes, or their own size.

    A few times cheaper than the budget's sizing, which cost half the write speed
    of small elements; enough to bound a chunk by what dominates its size. It runs
    once per element, so the common kinds are told apart without an ABC's isinstance
    or ``sys.getsizeof`` (which cost a fifth of the write speed of small dicts): a
    dict by its type, an int, a float or a NumPy scalar as :data:`_SCALAR_BYTES` (and
    the scalar's bytes: an ``np.bytes_`` holds its length).
    """
    if type(element) is not dict and not isinstance(element, Mapping):
        return 64
    total = 64
    for value in element.values():
        kind = type(value)
        if kind is _ndarray:
            total += value.nbytes
        elif kind is int or kind is float:
            total += _SCALAR_BYTES
        elif isinstance(value, _generic):  # a NumPy scalar (Dataset.range's np.int64)
            total += _SCALAR_BYTES + value.nbytes
        else:
            total += _getsizeof(value)
    return total


#: What a Python int or float holds (``sys.getsizeof(2**60)``: 32; an int wider than
#: 64 bits is refused by the encoder).
_SCALAR_BYTES = 32
_ndarray, _generic, _getsizeof = np.ndarray, np.generic, sys.getsizeof


def _encode_rows(elements: list[Any], first_index: int) -> list[bytes]:
    """Examples of ``elements`` (one dict each), as columns when they share their keys."""
    rows = elements
    for i, element in enumerate(elements):  # each is named only where it is refused
        if type(element) is not dict:
            _element_mapping(element, f"element {first_index + i}")

    def describe(row: int) -> str:
        return f"element {first_index + row} of the dataset"

    keys = rows[0].keys()
    if keys and all(row.keys() == keys for row in rows):
        columns = {key: [row[key] for row in rows] for key in keys}
        return encode_example_columns(columns, describe=describe)
    records = []
    for i, row in enumerate(rows):
        try:
            records.append(serialize_example(row))
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{describe(i)}: {error}") from error
    return records


def _encode_batch(element: Any, element_index: int) -> Generator[list[bytes], None, None]:
    """Examples of one batched element: row ``i`` of every value makes Example ``i``.

    The rows are encoded a slice at a time (views of the batch's values), each slice
    about :data:`CHUNK_BYTES`: a batch of large rows never has all its records in
    memory at once beside it. A batch is the caller's (a memory-mapped ``.npy`` read
    through ``headrace convert``, say), so its size says nothing of what fits.
    """
    batch = _element_mapping(element, f"element {element_index}")
    if not batch:
        raise InvalidArgumentError(f"element {element_index}: an empty dict has no rows")
    lengths = {}
    for name, value in batch.items():
        if (isinstance(value, np.ndarray) and value.ndim >= 1) or isinstance(value, list | tuple):
            lengths[name] = len(value)
        else:
            raise InvalidArgumentError(
                f"element {element_index}: with batched=True every value must be an array or "
                f"list with one entry per row; feature {name!r} is {type(value).__name__} "
                "(pass batched=False to write one Example per element)"
            )
    if len(set(lengths.values())) != 1:
        raise InvalidArgumentError(
            f"element {element_index}: with batched=True all values need the same leading "
            f"dimension, got {lengths}"
        )
    rows = next(iter(lengths.values()))
    step = _rows_per_chunk(batch, rows)
    for start in range(0, max(rows, 1), step):
        part = batch if step >= rows else {
            name: value[start : start + step] for name, value in batch.items()
        }
        yield encode_example_columns(part, describe=_row_namer(element_index, start))


def _row_namer(element_index: int, start: int) -> Callable[[int], str]:
    """How an error names row ``row`` of a slice starting at row ``start``."""
    return lambda row: f"row {start + row} of element {element_index} of the dataset"


def _rows_per_chunk(batch: Mapping[str, Any], rows: int) -> int:
    """How many rows of ``batch`` make about :data:`CHUNK_BYTES` (at least one)."""
    if rows == 0:
        return 1
    nbytes = sum(
        value.nbytes if isinstance(value, np.ndarray) else sys.getsizeof(value)
        + sum(sys.getsizeof(item) for item in value[:16]) * len(value) // min(len(value), 16)
        for value in batch.values()
    )
    return max(1, min(rows, CHUNK_BYTES * rows // max(nbytes, 1)))


# --------------------------------------------------------------------------- progress


def _format_count(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


class ProgressBar:
    """A one-line progress display on stderr: records, bytes, rates, percent when known.

    Redrawn at most ``1 / min_interval`` times a second so that it costs nothing next to
    the work. Shown only when ``enabled`` is ``"always"``, or True and the stream is a
    terminal (a log file should not fill with carriage returns). No dependency on tqdm.
    """

    def __init__(
        self,
        *,
        total: int | None = None,
        enabled: ProgressSetting = True,
        stream: IO[str] | None = None,
        label: str = "writing",
        min_interval: float = 0.2,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        is_tty = getattr(self._stream, "isatty", lambda: False)()
        self.enabled = enabled == "always" or (enabled is True and is_tty)
        self.total = total
        self.label = label
        self.records = 0
        self.nbytes = 0
        self._min_interval = min_interval
        self._started = time.perf_counter()
        self._last_draw = -math.inf
        self._width = 0

    def update(self, records: int, nbytes: int) -> None:
        """Count ``records`` more records of ``nbytes`` bytes; redraw if it is time."""
        self.records += records
        self.nbytes += nbytes
        if self.enabled and time.perf_counter() - self._last_draw >= self._min_interval:
            self._draw()

    def line(self) -> str:
        """The current text of the bar."""
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        done = f"{self.records:,}"
        if self.total is not None:
            share = self.records / self.total if self.total else 1.0
            done += f"/{self.total:,} records ({share:.0%})"
        else:
            done += " records"
        return (
            f"{self.label}: {done}, {_format_count(self.nbytes)}, "
            f"{self.records / elapsed:,.0f} records/s, {_format_count(self.nbytes / elapsed)}/s"
        )

    def _draw(self, end: str = "") -> None:
        text = self.line()
        padding = " " * max(0, self._width - len(text))
        self._width = len(text)
        self._stream.write(f"\r{text}{padding}{end}")
        self._stream.flush()
        self._last_draw = time.perf_counter()

    def close(self, suffix: str = "") -> None:
        """Draw the final state (with ``suffix``) and end the line."""
        if self.enabled:
            self._draw(end=f"{suffix}\n")


# --------------------------------------------------------------------------- writing


class _Shards:
    """The staging files of one save: opened lazily, finished, indexed, then published."""

    def __init__(self, finals: list[str], compression_type: str) -> None:
        self.finals = finals
        self.compression_type = compression_type
        token = secrets.token_hex(4)
        self.staging = [
            os.path.join(
                os.path.dirname(path), f".{os.path.basename(path)}.{token}{_STAGING_SUFFIX}"
            )
            for path in finals
        ]
        self.writers: dict[int, TFRecordWriter] = {}
        self.finished: set[int] = set()

    def writer(self, shard: int) -> TFRecordWriter:
        writer = self.writers.get(shard)
        if writer is None:
            writer = self.writers[shard] = TFRecordWriter(
                self.staging[shard], self.compression_type or None
            )
        return writer

    def finish(self, shard: int) -> None:
        """Complete one shard (an empty one if nothing was written) and index it."""
        self.writer(shard).close()
        del self.writers[shard]
        self.finished.add(shard)
        if not self.compression_type:
            build_index(self.staging[shard])

    def publish(self) -> None:
        """Rename every staged shard (and index) to its final name; fsync the directories."""
        for shard, final in enumerate(self.finals):
            os.replace(self.staging[shard], final)
            if self.compression_type:
                _remove_if_exists(index_path_for(final))  # a stale index of an older run
            else:
                os.replace(index_path_for(self.staging[shard]), index_path_for(final))
        for directory in sorted({os.path.dirname(os.path.abspath(p)) for p in self.finals}):
            fsync_directory(directory)

    def abort(self) -> None:
        """Discard everything this save wrote; final names are never touched."""
        for writer in self.writers.values():
            writer.abort()
        self.writers.clear()
        for staged in self.staging:
            _remove_if_exists(staged)
            _remove_if_exists(index_path_for(staged))


def _remove_if_exists(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _contiguous_sizes(total: int, num_shards: int) -> list[int]:
    base, extra = divmod(total, num_shards)
    return [base + (1 if shard < extra else 0) for shard in range(num_shards)]


def _record_chunks(dataset: Iterable[Any], *, batched: bool) -> Generator[list[bytes], None, None]:  # noqa: C901
    """Serialized Examples of the dataset, a chunk at a time, in order."""
    iterator = iter(dataset)
    try:
        if batched:
            for index, element in enumerate(iterator):
                yield from _encode_batch(element, index)
            return
        pending: list[Any] = []
        pending_bytes = 0
        first = 0
        for element in iterator:
            pending.append(element)
            if type(element) is dict:  # _payload_bytes_of, inlined (a call per element less)
                nbytes = 64
                for value in element.values():
                    kind = type(value)
                    if kind is _ndarray:
                        nbytes += value.nbytes
                    elif kind is int or kind is float:
                        nbytes += _SCALAR_BYTES
                    elif isinstance(value, _generic):
                        nbytes += _SCALAR_BYTES + value.nbytes
                    else:
                        nbytes += _getsizeof(value)
                pending_bytes += nbytes
            else:
                pending_bytes += _payload_bytes_of(element)
            if len(pending) == CHUNK_ELEMENTS or pending_bytes >= CHUNK_BYTES:
                yield _encode_rows(pending, first)
                first += len(pending)
                pending, pending_bytes = [], 0
        if pending:
            yield _encode_rows(pending, first)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _payload_bytes(records: list[bytes]) -> int:
    return sum(map(len, records)) + RECORD_OVERHEAD_BYTES * len(records)


def _write_contiguous(
    shards: _Shards, chunks: Iterable[list[bytes]], sizes: list[int], bar: ProgressBar
) -> None:
    shard = 0
    room = sizes[0]
    for records in chunks:
        position = 0
        while position < len(records):
            while room == 0:
                shards.finish(shard)
                shard += 1
                if shard == len(sizes):
                    raise InvalidArgumentError(
                        f"the dataset yielded more elements than its cardinality() "
                        f"({sum(sizes)}) promised; its size cannot be trusted for "
                        "contiguous sharding"
                    )
                room = sizes[shard]
            part = records[position : position + room]
            shards.writer(shard).write_many(part)
            position += len(part)
            room -= len(part)
        bar.update(len(records), _payload_bytes(records))
    # Fewer elements than promised leaves later shards short or empty, never missing.
    for rest in range(shard, len(sizes)):
        shards.finish(rest)


def _write_round_robin(
    shards: _Shards, chunks: Iterable[list[bytes]], num_shards: int, bar: ProgressBar
) -> None:
    for shard in range(num_shards):
        shards.writer(shard)  # open them all first: a failure to open shows up at once
    next_shard = 0
    for records in chunks:
        for step in range(min(num_shards, len(records))):
            shards.writer((next_shard + step) % num_shards).write_many(records[step::num_shards])
        next_shard = (next_shard + len(records)) % num_shards
        bar.update(len(records), _payload_bytes(records))
    for shard in range(num_shards):
        shards.finish(shard)


def _check_round_robin_fits(num_shards: int, dataset: Iterable[Any]) -> None:
    """Round-robin keeps every shard open: refuse more shards than the cap on open files
    allows, the process's or the dataset's own ``Options(max_open_files=...)``."""
    from headrace.io.filepool import get_default_pool

    cap = get_default_pool().max_open_files
    owner = "the process (headrace.io.filepool.set_max_open_files)"
    own = getattr(getattr(dataset, "options", None), "max_open_files", None)
    if isinstance(own, int) and own < cap:
        cap, owner = own, "the dataset's Options(max_open_files=...)"
    if num_shards > cap:
        raise InvalidArgumentError(
            f"num_shards={num_shards} shards written round-robin need {num_shards} files open "
            f"at once, above the cap of {cap} set by {owner}; round-robin is used because the number of "
            "records is not known up front. Use fewer shards, give the dataset a known "
            "cardinality (unbatched), or raise the cap"
        )


def _make_directories(directories: set[str]) -> list[str]:
    """Create ``directories`` (with their parents); return the ones this call created,
    deepest first, so that a failed write can remove exactly those."""
    created: list[str] = []
    for directory in sorted(directories):
        missing = []
        parent = directory
        while parent and not os.path.exists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(directory, exist_ok=True)
        created.extend(missing)
    return sorted(set(created), key=lambda path: -path.count(os.sep))


def _remove_empty_directories(directories: list[str]) -> None:
    """Remove ``directories`` (deepest first) that are still empty; keep any that is not."""
    for directory in directories:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def save_tfrecords(
    dataset: Iterable[Any],
    path: str | os.PathLike[str],
    *,
    num_shards: int = 1,
    compression_type: str | None = None,
    progress: ProgressSetting = True,
    batched: bool = False,
    num_records: int | None = None,
) -> list[str]:
    """Write a dataset of dicts as ``tf.train.Example`` records in ``num_shards`` TFRecord
    files that TensorFlow reads as its own; return the shard paths in order.

    ``path``: a directory (created if missing; shards ``part-00000-of-00016.tfrecord``...)
    or a pattern with ``{shard}`` / ``{num_shards}``. Values: NumPy arrays and scalars
    (float -> FloatList as float32, int/bool -> Int64List, bytes/str -> BytesList; arrays
    flattened row-major), bytes/str, Python scalars and lists (see
    :func:`headrace.io.example.serialize_example`). ``batched=True``: each element is a
    batch whose rows are the Examples (every value has the same leading dimension).

    Sharding is deterministic: contiguous blocks when the record count is known (unbatched
    with a known ``cardinality()``), else round-robin with all shards open (refused if
    ``num_shards`` exceeds the process's file cap). Shards appear under their final names
    only when all of them are complete; on any exception nothing with a final name is
    created and the error propagates. Uncompressed shards get a ``.hrx`` index; GZIP/ZLIB
    shards cannot be indexed. ``progress``: True shows a bar on stderr when it is a
    terminal, ``"always"`` forces it, False hides it. ``num_records``: with
    ``batched=True``, the number of rows when known up front (an array's length), so that
    shards hold contiguous blocks as for a dataset of known cardinality.
    """
    if progress not in (True, False, "always"):
        raise InvalidArgumentError(f"progress must be True, False or 'always', got {progress!r}")
    compression = normalize_compression_type(compression_type)
    if objstore.is_url(os.fspath(path)):
        if objstore.is_remote(os.fspath(path)):
            return _save_tfrecords_remote(
                dataset, os.fspath(path), num_shards=num_shards, compression_type=compression,
                progress=progress, batched=batched, num_records=num_records)
        path = objstore.local_path(os.fspath(path))
    finals = shard_paths(path, num_shards)
    cardinality = dataset.cardinality() if hasattr(dataset, "cardinality") else UNKNOWN
    if cardinality == INFINITE:
        raise InvalidArgumentError("cannot save an infinite dataset; apply .take(n) first")
    if num_records is not None:
        if not batched or isinstance(num_records, bool) or not isinstance(num_records, int) or (
                num_records < 0):
            raise InvalidArgumentError(
                f"num_records must be an int >= 0, and only with batched=True; got {num_records!r}"
            )
        cardinality = num_records
    contiguous = cardinality >= 0 and (not batched or num_records is not None)
    if not contiguous:
        _check_round_robin_fits(num_shards, dataset)
    created = _make_directories({os.path.dirname(os.path.abspath(p)) for p in finals})

    bar = ProgressBar(total=cardinality if contiguous else None, enabled=progress)
    shards = _Shards(finals, compression)
    chunks = _record_chunks(dataset, batched=batched)
    try:
        if contiguous:
            _write_contiguous(shards, chunks, _contiguous_sizes(cardinality, num_shards), bar)
        else:
            _write_round_robin(shards, chunks, num_shards, bar)
        shards.publish()
    except BaseException:
        shards.abort()
        _remove_empty_directories(created)  # a failed save leaves no empty directory behind
        bar.close(" - failed, nothing written")
        raise
    finally:
        chunks.close()  # closes the dataset's iterator now, not at garbage collection
    bar.close(f" -> {num_shards} shard{'s' if num_shards != 1 else ''}")
    return finals


def _save_tfrecords_remote(
    dataset: Iterable[Any], url: str, *, num_shards: int, compression_type: str,
    progress: ProgressSetting, batched: bool, num_records: int | None,
) -> list[str]:
    """:func:`save_tfrecords` to an object store, all or nothing.

    The shards (and their indexes) are written and indexed in a local temporary
    directory first (``TMPDIR``: it needs room for them), uploaded under staging keys
    (``.<name>.<token>.staging``; a multipart upload is only visible once complete),
    then copied server-side to their final keys once every upload succeeded, and the
    staging keys deleted. An error or a crash before the copies leaves no object under
    a final name; object stores have no rename of several objects at once, so a crash
    *during* the copies (seconds, no data moves through this process) can leave some
    final shards without the others.
    """
    finals = shard_paths(url, num_shards)
    token = secrets.token_hex(4)
    with tempfile.TemporaryDirectory(prefix="headrace-save-") as scratch:
        local = save_tfrecords(
            dataset, os.path.join(scratch, "{shard:06d}.tfrecord"), num_shards=num_shards,
            compression_type=compression_type or None, progress=progress, batched=batched,
            num_records=num_records,
        )
        pairs = list(zip(local, finals, strict=True))
        if not compression_type:
            pairs += [(index_path_for(a), index_path_for(b)) for a, b in zip(
                local, finals, strict=True)]
        staged: list[tuple[str, str, str]] = []
        for source, final in pairs:
            directory, name = final.rsplit("/", 1)
            staged.append((source, f"{directory}/.{name}.{token}{_STAGING_SUFFIX}", final))
        try:
            for source, staging, _ in staged:
                with borrowed_slot(), open(source, "rb") as file:  # (G2: see put_atomic)
                    objstore.put_atomic(staging, file)
            for _, staging, final in staged:
                objstore.copy_object(staging, final)
            if compression_type:  # a stale index of an older, uncompressed save
                for final in finals:
                    objstore.delete_object(index_path_for(final))
        finally:
            for _, staging, _ in staged:
                with contextlib.suppress(OSError):
                    objstore.delete_object(staging)
    return finals
