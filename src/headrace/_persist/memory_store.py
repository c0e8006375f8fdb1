"""``cache()`` in memory: elements kept while they fit the stage's share, then spilled.

The in-memory part takes at most :func:`in_memory_room` of the share. The rest
stays free for the spill file's writer now and its reader later, so reading the
cache back never needs more than the share.
"""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import DataLossError, HeadraceWarning
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.units import format_bytes
from headrace._persist.kept import (
    KeptMemory,
    book_for_run,
    drawn_from_default,
    keeper,
    kept_caches,
    kept_lock,
    report_kept,
    run_bookings,
)
from headrace._persist.records import RecordReader, RecordWriter, chunk_bytes
from headrace._persist.stores import Store, StoreReader
from headrace._sources.files import file_limiter
from headrace._warn import warn_user
from headrace.core.iterator import Context
from headrace.core.run import default_budget
from headrace.io.elements import encode_element_parts
from headrace.io.streams import DEFAULT_BUFFER_SIZE
from headrace.io.tfrecord_index import StaleIndexError

if TYPE_CHECKING:
    from headrace._persist.cache import CacheNode


__all__ = ["KeptStore", "MemoryStore", "in_memory_room"]


def _read_only(value: Any) -> Any:
    """``value`` with every array a read-only view (cheap: no data is copied)."""
    if isinstance(value, np.ndarray):
        if not value.flags.writeable:
            return value
        view = value.view()
        view.flags.writeable = False
        return view
    if isinstance(value, dict):
        return {key: _read_only(item) for key, item in value.items()}
    if isinstance(value, tuple):
        items = [_read_only(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_read_only(item) for item in value]
    return value


def in_memory_room(share: int) -> int:
    """Bytes of elements a cache with this share keeps in memory before it spills.

    The rest stays free for the spill writer's buffers now, and for the spill
    reader's buffer and one element later: at least a quarter of the share.
    Lint predicts the spill from it.
    """
    reserve = max(share // 4, DEFAULT_BUFFER_SIZE + 3 * chunk_bytes(share))
    return max(share - reserve, 0)


class MemoryStore(Store):
    """Writes a :class:`KeptMemory`: elements in memory while they fit three quarters
    of the share, then a spill file; kept by the node once complete.

    The last quarter of the share stays free for reading the spill file back (its
    buffer and one element at a time), so reading never needs more than the share.
    """

    def __init__(
        self, node: CacheNode, ctx: Context, account: Buffer, epochs: tuple[int, ...]
    ) -> None:
        super().__init__(epochs)
        self.node, self.ctx, self.account = node, ctx, account
        self.data = KeptMemory(epochs, ctx.run.iteration)
        #: The in-memory elements' booking (``data.booked`` bytes), one for all.
        self.booking: Reservation = NO_RESERVATION
        self.spill: RecordWriter | None = None
        self.lock = threading.Lock()
        self.discarded = False
        #: The cache later epochs read: this one, or one another iterator completed first.
        self.kept: KeptMemory | None = None

    def _fits_in_memory(self, cost: int) -> bool:
        account = self.account
        room = in_memory_room(account.share())
        return self.data.booked + cost <= room and not account.budget.over_shared_cap(cost)

    def append(self, element: Any, upstream: Reservation) -> tuple[Any, Reservation]:
        element, cost = self.ctx.admit(element)
        data = self.data
        if self.spill is None and self._fits_in_memory(cost):
            element = _read_only(element)
            self.booking = self.booking.absorb(self.account.admit(cost, upstream))
            data.booked += cost
            data.items.append(element)
            data.count = self.count = self.count + 1
            return element, NO_RESERVATION
        if self.spill is None:
            self._start_spill(cost)
        assert self.spill is not None
        try:
            self.spill.append(encode_element_parts(element))
        except BaseException:
            self.fail()  # a full disk or an element it cannot store: no files left
            raise
        data.count = self.count = self.count + 1
        return element, upstream

    def _start_spill(self, cost: int) -> None:
        directory = tempfile.mkdtemp(prefix=f"headrace-cache-{os.getpid()}-")
        self.data.resources.directory = directory
        self.data.spill_path = os.path.join(directory, "spill.hrcache")
        account = self.account
        warn_user(
            f"cache: the elements cached so far ({self.count} elements, "
            f"{format_bytes(self.data.booked)}) fill the in-memory part of the stage's share "
            f"of the memory budget ({format_bytes(account.share())}); the next element "
            f"({format_bytes(cost)}) and all later ones "
            f"spill to an on-disk cache in {directory} (removed with the dataset, or at "
            "exit)",
            HeadraceWarning,
        )
        try:
            self.spill = RecordWriter(
                self.data.spill_path, account,
                limiter=file_limiter(self.ctx), stage=f"{self.node.stage}() spilling to disk",
            )
        except BaseException:
            self.fail()
            raise

    def finish(self) -> None:
        if self.spill is not None:
            try:
                self.spill.finish()
            except BaseException:
                self.fail()
                raise
            self.data.spill_bytes = self.spill.nbytes
        self.complete = True
        self.kept = self._publish()
        report_kept(self.kept, self.ctx, self.account)

    def _publish(self) -> KeptMemory:
        """Give the complete cache to the node, and move its booking where a kept cache's
        goes (see above); if another iterator completed one first, read that one (as
        tf.data does) and free this one."""
        data, account = self.data, self.account
        with kept_lock:
            kept = kept_caches.get(self.node)
            if kept is None:
                kept_caches[self.node] = data
        if kept is not None:
            self.discard()
            return kept
        data.resources.kept = keeper(default_budget()).admit(data.booked)
        held, self.booking = self.booking, NO_RESERVATION
        if drawn_from_default(account):
            held.release()  # booked on the default budget above instead
        else:
            run_bookings[account] = (weakref.ref(data), held)
            self.ctx.budget.on_close(held.release)
        return data

    def discard(self) -> None:
        with self.lock:
            if self.discarded or self.kept is not None:
                return
            self.discarded = True
        if self.spill is not None:
            self.spill.abort()
        data = self.data
        booking, self.booking = self.booking, NO_RESERVATION
        booking.release()
        data.booked = 0
        data.free()

    def reader(self) -> StoreReader:
        assert self.kept is not None
        return _MemoryReader(self.kept, self.ctx, self.account)


class KeptStore(Store):
    """A kept in-memory cache, as a later iterator of the dataset finds it."""

    def __init__(self, data: KeptMemory, ctx: Context, account: Buffer) -> None:
        super().__init__(data.epochs)
        self.data, self.ctx, self.account = data, ctx, account
        self.complete = True
        self.count = data.count
        book_for_run(data, ctx, account)
        report_kept(data, ctx, account)

    def reader(self) -> StoreReader:
        return _MemoryReader(self.data, self.ctx, self.account)

    def discard(self) -> None:
        """A kept cache lives as long as its node."""


class _MemoryReader(StoreReader):
    def __init__(self, data: KeptMemory, ctx: Context, account: Buffer) -> None:
        self.data, self.ctx, self.account = data, ctx, account
        self.next = 0
        self.spill: RecordReader | None = None

    def _spill(self) -> RecordReader:
        if self.spill is None:
            path = self.data.spill_path
            assert path is not None
            try:
                self.spill = RecordReader(path, self.ctx, self.account)
            except StaleIndexError as error:  # (its advice, to rebuild the index, is not
                # for a file the user never made)
                raise DataLossError(
                    f"cache: the part of an in-memory cache spilled to {path} (a temporary "
                    f"file headrace wrote) changed on disk since it was written: "
                    f"{str(error).split('; rebuild')[0]}",
                    path=path,
                ) from None
        return self.spill

    def pull(self) -> tuple[Any, Reservation]:
        items = self.data.items
        if self.next < len(items):
            element = items[self.next]
            self.next += 1
            return element, NO_RESERVATION  # booked with the cache
        if self.data.spill_path is None:
            raise StopIteration
        pair = self._spill().pull()
        self.next += 1
        return pair

    def skip(self, count: int) -> int:
        in_memory = min(count, max(0, len(self.data.items) - self.next))
        self.next += in_memory
        if in_memory == count or self.data.spill_path is None:
            return in_memory
        skipped = self._spill().skip(count - in_memory)
        self.next += skipped
        return in_memory + skipped

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
