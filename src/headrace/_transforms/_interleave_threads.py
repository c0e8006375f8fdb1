"""The interleave in this process: slots read in turn, or ahead on threads.

Sequential (no ``num_parallel_calls``): the cycle pulls each slot's inner
pipeline itself. With ``num_parallel_calls=k`` every slot reads ahead on its
own thread (a :class:`~headrace._transforms.prefetch.PrefetchIterator`, its
queue booked on the slot's budget), k reading at once. Elements still come out
in the sequential order; with ``deterministic=False`` the first slot with an
element ready wins (:class:`FirstReadyInterleaveIterator`).

Why AUTOTUNE starts sequential. In CPython, threads pay only when the inner
pipelines wait on I/O or run code that releases the GIL. headrace's TFRecord and
text readers reading from the page cache hold the GIL: for them the sequential
interleave is faster (about 2x tf.data's parallel interleave on 1,000 small
files, against half of it with threads; see benchmarks/results/tfrecord.md).
So AUTOTUNE watches its pulls (:class:`WaitWatch`). Once they spend most of
their time waiting (not on this thread's CPU, not for the GIL), every slot
starts reading ahead, up to ``cycle_length`` at once: waiting costs no core.
The switch is one-way and kept in checkpoints. It changes timing, not order.

With threads, a slot whose reader has read its last element opens the next input
element's slot ahead of its turn (:meth:`CycleIterator.open_ahead`), so a new
file's first records are read while the ending slot hands out what it has left.

Read-ahead is bounded by design. A slot's thread books each element on the
slot's queue before it reads the next. An element that does not fit waits
outside the queue until the consumer makes room. So each reader holds at most
one element beyond what it booked.
"""

from __future__ import annotations

import threading
from time import perf_counter
from typing import TYPE_CHECKING, Any

from headrace._memory.buffer import Buffer, Reservation
from headrace._options import AUTOTUNE
from headrace._sources.files import file_limiter
from headrace._transforms._interleave_cycle import CycleIterator, Slot
from headrace._transforms._wait_watch import WaitWatch
from headrace._transforms.prefetch import PrefetchIterator
from headrace.core.iterator import Context, Iterator, origin_probe
from headrace.core.state import mark_out_of_order
from headrace.io.filepool import opening_under

if TYPE_CHECKING:
    from headrace._transforms.interleave import InterleaveNode

__all__ = ["FirstReadyInterleaveIterator", "InterleaveIterator"]

#: Elements a slot reads ahead (tf.data: 2 * block_length + 1), bounded by the slot's
#: part of the budget; more per hand-off keeps thread switches off the per-element path.
_SLOT_DEPTH = 64


class InterleaveIterator(CycleIterator):
    """Slots in this process, in tf.data's order: read in turn, or ahead on threads."""

    #: Only "first ready wins" waits on all slots at once (one condition for them all);
    #: in order, each slot's own condition avoids waking them all.
    ready: threading.Condition | None = None

    def __init__(
        self, node: InterleaveNode, inner: Iterator, ctx: Context, account: Buffer
    ) -> None:
        super().__init__(node, inner, ctx, account)
        parallel = node.num_parallel_calls
        self.may_thread = parallel is not None
        #: AUTOTUNE's watch over its pulls, until it switches to threads.
        self.watch = WaitWatch(file_limiter(ctx)) if parallel == AUTOTUNE else None
        self.gate: threading.Semaphore | None = None
        if parallel is not None and parallel != AUTOTUNE:
            self.gate = threading.Semaphore(parallel)
        if self.watch is not None:
            self.pull_from = self._watched_pull

    @property
    def threaded(self) -> bool:
        """Whether slots read ahead on threads (now; AUTOTUNE may switch them on)."""
        return self.gate is not None

    def _open_slot(self, element: Any, input_before: dict[str, Any], *, start: bool) -> Slot:
        part = self.parts.open()
        inner_ctx = self.ctx.with_budget(part.budget)
        # the files the function opens to build its dataset (a manifest, a header, an
        # index) count against this pipeline's max_open_files like its readers (G2)
        with opening_under(file_limiter(self.ctx)):
            iterator = self.node.inner_node(element).make_iterator(inner_ctx)
        try:
            # Arrays the function made for this inner dataset live as long as the slot.
            part.own(inner_ctx.owned_bytes)
            # registered whenever threads may be used: the split never depends on timing
            queue = part.budget.account("interleave slot", weight=1) if self.may_thread else None
            part.budget.allot()
        except BaseException:
            part.close(then=iterator.close)
            raise
        if self.gate is not None:
            iterator = self._read_ahead(iterator, inner_ctx, queue, self.gate, start=start)
        slot = Slot(iterator, part, input_before, inner_ctx, queue)
        if self.tracking:
            slot.probe = origin_probe(iterator, self.origin_tokens)
        return slot

    def _read_ahead(
        self,
        iterator: Iterator,
        ctx: Context,
        queue: Buffer | None,
        gate: threading.Semaphore,
        *,
        start: bool = True,
    ) -> PrefetchIterator:
        """Wrap a slot's iterator so that it reads ahead on its own thread."""
        assert queue is not None  # registered whenever threads may be used
        depth = max(2 * self.node.block_length + 1, _SLOT_DEPTH)
        ahead = PrefetchIterator(iterator, ctx, queue, depth, gate=gate, ready=self.ready)
        if self.tracking:  # before its thread starts: each element read ahead has its token
            ahead.track_origins()
        if start:
            ahead.start()
        return ahead

    def pull(self) -> tuple[Any, Reservation]:
        pair = super().pull()
        self._maybe_open_ahead()
        return pair

    def _maybe_open_ahead(self) -> None:
        """Keep a slot opened ahead for each slot in the cycle that has read its whole
        inner pipeline (at most one opened per pull). Counted, not asked once per slot:
        while the cycle first fills, slots take the slots opened ahead at once."""
        slot = self.last_slot
        if slot is not None and not slot.ahead_asked:
            iterator = slot.iterator
            if isinstance(iterator, PrefetchIterator) and iterator.source_ended():
                slot.ahead_asked = True
                self.slots_ended += 1
        if self.slots_ended > len(self.ahead):
            self.open_ahead()

    def _reset(self) -> None:
        super()._reset()
        self.slots_ended = 0  # slots in the cycle whose reader has read its last element

    def _close_slot(self, index: int) -> None:
        slot = self.slots[index]
        if slot is not None and slot.ahead_asked:
            self.slots_ended -= 1
        super()._close_slot(index)

    # -- AUTOTUNE --------------------------------------------------------------------------
    def _watched_pull(self, slot: Slot) -> tuple[Any, Reservation]:
        """A slot's next element, timed for AUTOTUNE's watch (this runs per element)."""
        watch = self.watch
        assert watch is not None  # pull_from is this only while watching
        if watch.resting:
            watch.resting -= 1
            if not watch.resting:
                watch.rest_chunk_done()
            return slot.iterator.pull()
        watch.countdown -= 1
        if watch.countdown:
            started = perf_counter()
            try:
                pair = slot.iterator.pull()
            finally:
                watch.pull_wall += perf_counter() - started
        else:
            pair = watch.sampled_pull(slot.iterator.pull)
        if watch.pull_wall >= watch.WINDOW_SECONDS and watch.waiting_mostly():
            self._start_threads()
        return pair

    def _start_threads(self) -> None:
        """AUTOTUNE's switch: from now on every slot, open or not, reads ahead. The mode
        (``threaded``) changes only once every open slot is wrapped, so a failure on the
        way leaves a consistent sequential iterator."""
        gate = threading.Semaphore(self.node.cycle_length)
        for slot in self.slots:
            if slot is not None and not isinstance(slot.iterator, PrefetchIterator):
                slot.iterator = self._read_ahead(slot.iterator, slot.ctx, slot.queue, gate)
                if self.tracking:  # its source now runs ahead: the read-ahead keeps tokens
                    slot.probe = origin_probe(slot.iterator, self.origin_tokens)
        self.watch = None
        self.pull_from = None
        self.gate = gate

    # -- state -----------------------------------------------------------------------------
    def _restore_mode(self, saved_threaded: bool) -> None:
        if saved_threaded and not self.threaded:  # AUTOTUNE had switched: switch again
            self._start_threads()
        elif self.watch is not None:  # not switched: watch afresh from here
            self.watch = WaitWatch(file_limiter(self.ctx))

    def _slot_state(self, saved: dict[str, Any], saved_threaded: bool) -> dict[str, Any]:
        if self.threaded and not saved_threaded:  # saved before this iterator switched
            return PrefetchIterator.state_at(saved)
        return saved

    def _resume_slot(self, slot: Slot) -> None:
        if isinstance(slot.iterator, PrefetchIterator):
            slot.iterator.start()


class FirstReadyInterleaveIterator(InterleaveIterator):
    """``deterministic=False`` with threads: the first slot with an element ready wins.

    Until AUTOTUNE switches to threads it reads in order, as the sequential one.
    Its states are marked out of order (:func:`mark_out_of_order`).
    """

    def __init__(
        self, node: InterleaveNode, inner: Iterator, ctx: Context, account: Buffer
    ) -> None:
        self.ready = threading.Condition()
        self.handed = 0  # elements handed out: whether a state taken out of order is stale
        ctx.run.out_of_order.add(self)
        super().__init__(node, inner, ctx, account)

    def pull(self) -> tuple[Any, Reservation]:
        if not self.threaded:
            pair = super().pull()
            self.handed += 1
            return pair
        ready = self.ready
        assert ready is not None
        while True:
            for index, slot in enumerate(self.slots):
                if slot is None and not self.end_of_input:
                    opened = self._pull_input()
                    if opened is not None:
                        self.slots[index] = opened
                        self.num_open += 1
            if self.num_open == 0:
                raise StopIteration
            with ready:
                chosen = self._first_ready_slot()
                if chosen is None:
                    ready.wait()
                    continue
            slot = self.slots[chosen]
            assert slot is not None
            try:
                pair = slot.iterator.pull()
            except StopIteration:
                self._close_slot(chosen)
                continue
            self.last_slot = slot  # (whose element this is: its origin)
            self.cycle_index = (chosen + 1) % self.node.cycle_length
            self.handed += 1
            self._maybe_open_ahead()
            return pair

    def _first_ready_slot(self) -> int | None:
        length = self.node.cycle_length
        for step in range(length):
            index = (self.cycle_index + step) % length
            slot = self.slots[index]
            if (
                slot is not None
                and isinstance(slot.iterator, PrefetchIterator)
                and slot.iterator.has_output()
            ):
                return index
        return None

    def get_state(self) -> dict[str, Any]:
        return mark_out_of_order(super().get_state(), self)
