"""``map(fn, num_parallel_calls, workers="processes" | "auto")``: a map on worker processes.

Why processes: in CPython a pure-Python function holds the GIL, so threads run
it on one core whatever ``num_parallel_calls`` says. ``workers="processes"``
runs it in ``num_parallel_calls`` worker processes (``AUTOTUNE``: one per
CPU this process may use) started by forkserver/spawn (see
:mod:`headrace._workers.processes`), with NumPy payloads through shared memory
both ways (see :mod:`headrace._workers.shm`).

Everything else is the threaded map's (``ParallelMapIterator``): which
input elements go into which call, the bookings of work in flight, the
order (kept unless ``deterministic=False``), errors in their element's place,
and checkpoints — a checkpoint of a threaded map restores into a process map
and back (the fingerprint does not include ``workers``: the output is the same).
Only where a call runs differs: the input stays in this process (workers never
see the source, so they cannot grow a copy of it — no copy-on-read), a chunk
of inputs goes to the least busy worker, and its outputs come back as views
of a pooled shared-memory segment.

Memory. Outputs are booked as the threaded map books them (their arrays'
bytes, which now live in shared memory); the part of a segment that no array
covers is booked apart, from the call's end until the segment's last output is
gone, so that the estimate of the next outputs (learned from the outputs'
bookings) is what outputs cost, not what their segment held. Segments kept idle
for reuse (per worker at most two, or the segments of eight calls like its
last, when a call's outputs span several) are booked while idle, or dropped
(their pages freed at once) when the stage's share has no room for them; a
call's booking covers the idle segments of its worker that it is lent while it
runs (see ``ProcessPool._lend``), so they are not booked twice. A worker packs each output into shared memory as
it is made and stops a call right after the output that passes the call's
allowance (what the stage booked for it): the stage runs the rest in another
call. An output larger than the whole budget is refused in the worker, before
it is copied: its element's :class:`~headrace._errors.MemoryBudgetError`.
Each worker's own memory (its interpreter and imports, some
:data:`WORKER_BASELINE_BYTES` of PSS) is booked on the stage's share while the
pool runs, except the first worker's: like the forkserver, it is part of the
fixed cost of running processes at all, which the measured bound's fixed part
covers. The workers may take at most half the share, so that calls still have
room: a stage asked for more workers than that runs fewer, with a
:class:`~headrace._errors.HeadraceWarning` that names the stage and the sizes.
The function's temporaries in a worker are not booked: ``stats().workers``
reports each worker's memory (USS and PSS) and the measured bound counts it
(see ``headrace._workers.memory.tree_charged``).

``workers="auto"`` measures before it chooses: the first calls run on this
thread while a probe thread checks how long it waits for the GIL (and the
calls' CPU time is measured). A function that holds the GIL most of the time
and keeps a CPU busy (pure Python), costs at least
:data:`MIN_PROCESS_CALL_SECONDS` per element and can be pickled goes to
processes; anything else (NumPy, I/O, decoders that release the GIL, or
functions too quick to pay for the trip) to threads. ``AUTOTUNE`` then means
one worker per CPU, fewer when the budget cannot keep that many calls in
flight. The choice and why show in ``stats().workers``.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from sys import getsizeof
from typing import Any

from headrace._errors import FileLimitError, HeadraceWarning, InvalidArgumentError
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation
from headrace._memory.sizeof import FLAT_TYPES
from headrace._memory.units import format_bytes
from headrace._options import AUTOTUNE
from headrace._sources.files import file_limiter
from headrace._transforms import map as map_module
from headrace._transforms._map_calls import CallFuture, MapResult, apply_chunk
from headrace._transforms._map_chunks import TARGET_CALL_SECONDS
from headrace._transforms.map import MapNode, ParallelMapIterator, PositionedCall
from headrace._warn import warn_user
from headrace._workers.memory import WorkerStats
from headrace._workers.processes import ChunkResult, ProcessPool, check_picklable
from headrace.core.iterator import Context, Iterator

__all__ = ["MIN_PROCESS_CALL_SECONDS", "WORKER_BASELINE_BYTES", "book_workers", "cpu_count", "process_map_iterator", "restore_process_node"]

#: ``auto`` sends a function to processes only if one call takes at least this long: a
#: chunk's trip to a worker and back costs some 100 us, which quicker calls cannot repay.
MIN_PROCESS_CALL_SECONDS = 50e-6
#: How long a call to a worker process should run (a thread's call: 8 ms). A trip to a
#: process costs more than a hand-off to a thread (pickling the chunk, two pipe
#: messages, the collector's wake-up, some 100-300 us of CPU on the two sides
#: together): with 2 ms calls two workers ran a ~0.8 ms pure-Python map at 1.6-1.7x
#: one thread on 2 CPUs. With 10 ms calls the trips still cost ~0.1 s of the tree's
#: CPU over 2,000 elements of 1 ms, with 25 ms about 0.05 s, while the last call's
#: wait at the end of a stream stays under a few percent of a second's run
#: (benchmarks/bench_workers.py). The chunk's outputs are booked before the call
#: starts, as for threads, so the budget still bounds what is in flight.
PROCESS_CALL_SECONDS = 25e-3
#: What one worker process holds of its own before it runs the function: the PSS of
#: its interpreter and imports after copy-on-write from the forkserver (5-8 MiB
#: measured with NumPy loaded). Booked per worker past the first (see the module text).
WORKER_BASELINE_BYTES = 6 << 20
#: The part of the stage's share that its workers' own memory may take.
_WORKERS_SHARE = 0.5
#: ``auto`` samples calls on this thread for at least this long (or this many calls).
_SAMPLE_SECONDS = 0.05
_SAMPLE_CALLS = 64
#: Share of the sampled time spent waiting for the GIL above which the function is GIL-bound.
_GIL_BOUND = 0.5
#: ... and the share of its wall time the calling thread spent on a CPU (low on a
#: machine so busy that the probe is late for want of a core, not of the GIL).
_CPU_BOUND = 0.1


def book_workers(account: Buffer, wanted: int, stage: str) -> tuple[int, Reservation, str]:
    """Book worker processes' own memory on ``account``: how many to start, the booking
    (released when they stop), and a note for the stage's reason ("" if all start).

    The first worker is not booked (the fixed cost of processes, like the forkserver).
    Each other one costs :data:`WORKER_BASELINE_BYTES`. They may take half of what the
    share has room for: past that fewer workers start, with a warning, since a worker
    that is not booked breaks the budget.
    """
    room = int(max(account.room(), 0) * _WORKERS_SHARE)
    count = min(wanted, 1 + room // WORKER_BASELINE_BYTES)
    note = ""
    if count < wanted:
        warn_user(
            f"stage {stage!r} starts {count} worker process(es), not {wanted}: each worker "
            f"past the first holds about {format_bytes(WORKER_BASELINE_BYTES)} of its own, "
            f"booked on the stage's share of the budget ({format_bytes(account.share())}), "
            f"and the workers may take half of what it has free ({format_bytes(2 * room)}); "
            "a larger memory_budget runs more",
            HeadraceWarning,
        )
        note = f"; {count} of {wanted} workers fit the budget"
    booking = NO_RESERVATION
    if count > 1:
        booking = account.admit((count - 1) * WORKER_BASELINE_BYTES, elements=0)
    return count, booking, note


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def process_map_iterator(
    node: MapNode, inner: Iterator, ctx: Context, account: Buffer, deterministic: bool
) -> Iterator:
    """The iterator of a map whose ``workers`` is ``"processes"`` or ``"auto"``."""
    count = cpu_count() if node.num_parallel_calls == AUTOTUNE else int(node.num_parallel_calls or 1)
    args = (inner, node.fn, ctx, account, count, deterministic, node.stage, node.output_nbytes)
    if multiprocessing.current_process().daemon:
        # Inside a worker process (an inner pipeline of a process interleave): it may not
        # start processes of its own, and it is one of the parallel processes already.
        # Threads give the same elements, order and checkpoints.
        return ParallelMapIterator(*args)
    if node.workers == "auto":
        return _AutoMapIterator(*args)
    return ProcessMapIterator(*args)


class ProcessMapIterator(ParallelMapIterator):
    """The threaded map's iterator, its calls run by a :class:`ProcessPool`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ledger.packs = True  # a worker holds an output beside its copy while it packs it
        self.processes: ProcessPool | None = None
        self.kind = "processes"
        self.chunks.target_seconds = PROCESS_CALL_SECONDS
        self.reason = "workers='processes'"
        #: The booking of the workers' own memory (see :meth:`_book_workers`).
        self.workers_booking: Reservation = NO_RESERVATION

    def _book_workers(self) -> int:
        """Book the workers' own memory on the share (:func:`book_workers`); how many
        workers to start."""
        count, self.workers_booking, note = book_workers(self.account, self.threads, self.stage)
        if note:
            self.reason += note
        return count

    def _book_idle(self, nbytes: int) -> Reservation | None:
        """Book a segment kept idle for reuse, if the share has room for it (else None:
        the segment is dropped)."""
        if nbytes > self.account.room():
            return None
        return self.account.admit(nbytes)

    def _start_pool(self) -> None:
        """The worker processes, their own memory booked (G1) and their pipes held on
        the pipeline's file cap (G2)."""
        self.processes = ProcessPool(
            PositionedCall(self.fn),  # each element with its position (seeded ops)
            self._book_workers(),
            self.stage,
            what="the map function",
            book_idle=self._book_idle,
            # the segments' bytes no output views are booked with their segment, not on
            # the outputs: the ledger learns what the next outputs cost from the outputs
            book_slack=self.account.overdraw,
            lend_idle=True,  # a call's allowance covers the idle segments it writes into
            files=file_limiter(self.ctx),
        )

    def _start_call(self, elements: list[Any], progress: Any = None,
                    first: int = 0, allowance: int | None = None,
                    forced: bool = False) -> CallFuture:
        outer: Future[MapResult] = Future()
        if not elements:  # a chunk that is only an upstream error: nothing to compute
            outer.set_result(([], [], None, 0.0))
            return outer
        if self.processes is None:
            self._start_pool()
        assert self.processes is not None
        epochs = self.ctx.epochs
        reserve = self.ledger.pack_reserve()
        try:
            inner = self.processes.submit(
                [((*epochs, first + k), element) for k, element in enumerate(elements)],
                allowance=allowance, ceiling=self.account.ceiling())
        except BaseException:
            reserve.release()
            raise
        # Weakly: the callback of ``inner`` holds ``outer``, and a strong reference back
        # would make a cycle of the two futures and their callbacks that keeps a whole
        # chunk of outputs alive, unbooked, until the cyclic GC happens to run (large
        # outputs are few objects, so it runs late: seed 700 of the fuzzer).
        outer.add_done_callback(functools.partial(_cancel_inner, weakref.ref(inner)))
        inner.add_done_callback(functools.partial(_deliver, outer, reserve, self.ctx.admit))
        return outer

    def pull(self) -> tuple[Any, Reservation]:
        if self.processes is not None:  # segments whose outputs are gone: booked or freed
            self.processes.recycle()
        return super().pull()

    def worker_stats(self) -> WorkerStats:
        """What this stage runs on, and its worker processes' memory now."""
        if self.processes is None:
            return WorkerStats(self.stage, self.kind, self.threads, self.reason)
        traffic = self.processes.traffic
        with traffic.lock:
            return WorkerStats(
                self.stage, self.kind, self.processes.count, self.reason, self.processes.memory(),
                chunks=traffic.chunks, elements=traffic.elements,
                compute_seconds=traffic.compute_seconds,
                transfer_seconds=traffic.transfer_seconds, sent_bytes=traffic.sent_bytes,
                received_bytes=traffic.received_bytes, segments=traffic.segments,
            )

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.processes is not None:
                self.processes.shutdown()
            self.workers_booking.release()
            self.workers_booking = NO_RESERVATION


def _deliver(outer: Future[MapResult], reserve: Reservation,
             admit: Callable[[Any], tuple[Any, int]], done: Future[ChunkResult]) -> None:
    """A worker's chunk, done: its result costed into ``outer`` (the map's future), or
    its error; nothing for a call cancelled meanwhile. ``reserve``: the booking of the
    output a worker holds beside its copy while it packs, released now."""
    reserve.release()  # (the call's outputs are all packed)
    if done.cancelled():
        return
    error = done.exception()
    if error is not None:
        if not outer.done():
            outer.set_exception(error)
        return
    result = _costed(done.result(), admit)
    if not outer.done():
        outer.set_result(result)


def _cancel_inner(inner: weakref.ref[Future[ChunkResult]], done: Future[MapResult]) -> None:
    """The map's future was cancelled: so is the worker's chunk, if it still runs."""
    running = inner()
    if done.cancelled() and running is not None:
        running.cancel()


def _costed(result: ChunkResult, admit: Callable[[Any], tuple[Any, int]]) -> MapResult:
    """A worker's chunk result as the map's: each output admitted here (costed; copied
    out if it is a small view of a large temporary), the failed positions ``None``."""
    outputs, failed, seconds, _ = result  # (no slack: the pool books it, see _start_pool)
    sizes: list[int] = []
    kept: list[Any] = []
    for position, output in enumerate(outputs):
        if failed is not None and position in failed:
            kept.append(None)
            sizes.append(0)
            continue
        if type(output) in FLAT_TYPES:  # (admit's first case, inlined: per output)
            size = getsizeof(output)
        else:
            output, size = admit(output)
        kept.append(output)
        sizes.append(size)
    errors = None if failed is None else {p: e for p, e in failed.items() if isinstance(e, Exception)}
    return kept, sizes, errors, seconds


class _GilProbe:
    """How long a second thread waits for the GIL while ``fn`` runs on this one.

    The probe sleeps 0.2 ms at a time; waking, it must take the GIL back. If the
    function holds it, that takes up to the switch interval (5 ms); if the
    function released it (NumPy, I/O), microseconds. The share of the probe's
    time inside calls that it spent late is the share the function held the GIL.
    """

    _NAP = 0.0002

    def __init__(self) -> None:
        self.in_call = False
        self.late = 0.0  # of the naps that began and ended inside a call
        self.spent = 0.0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="headrace-gil-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        clock, nap = time.perf_counter, self._NAP
        while not self.stopped.is_set():
            started_in_call = self.in_call
            start = clock()
            time.sleep(nap)
            if started_in_call and self.in_call:
                took = clock() - start
                self.late += max(0.0, took - nap)
                self.spent += took

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class _AutoMapIterator(ProcessMapIterator):
    """``workers="auto"``: samples the first calls here, then threads or processes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ledger.packs = False  # (until processes are chosen)
        self.wanted = self.threads
        self.threads = 1  # while sampling: one call at a time, on this thread
        self.kind = "sampling"
        self.chunks.target_seconds = TARGET_CALL_SECONDS  # until processes are chosen
        self.reason = "not decided yet"
        self.sampled_seconds = 0.0
        self.sampled_cpu = 0.0  # of this thread, while in the sampled calls
        self.sampled_calls = 0
        self.probe: _GilProbe | None = None

    def _start_call(self, elements: list[Any], progress: Any = None,
                    first: int = 0, allowance: int | None = None,
                    forced: bool = False) -> CallFuture:
        if self.kind == "processes":
            return super()._start_call(elements, None, first, allowance)
        if self.kind == "threads":
            return ParallelMapIterator._start_call(self, elements, progress, first, allowance,
                                                    forced)
        if self.probe is None:
            self.probe = _GilProbe()
        self.probe.in_call = True
        cpu = time.thread_time()
        try:
            result = apply_chunk(self.fn, elements, self.ctx.admit, None, first,
                                  self.ctx.epochs, allowance)
        finally:
            self.probe.in_call = False
        self.sampled_cpu += time.thread_time() - cpu
        self.sampled_seconds += result[3]
        self.sampled_calls += len(elements)
        if self._sampled_enough():
            self._decide()
        done: Future[MapResult] = Future()
        done.set_result(result)
        return done

    def _sampled_enough(self) -> bool:
        """Enough calls sampled, and the probe watched most of their time: on a busy
        machine its thread may not run during the first calls at all, and a probe that
        saw nothing says nothing (it read as "releases the GIL"). Up to 4 times the
        sample, then decided on what it saw."""
        assert self.probe is not None
        seconds, calls = self.sampled_seconds, self.sampled_calls
        if seconds >= 4 * _SAMPLE_SECONDS or calls >= 4 * _SAMPLE_CALLS:
            return True
        return ((seconds >= _SAMPLE_SECONDS or calls >= _SAMPLE_CALLS)
                and self.probe.spent >= seconds / 2)

    def _decide(self) -> None:
        assert self.probe is not None
        self.probe.stop()
        probe = self.probe
        held = probe.late / probe.spent if probe.spent else 0.0
        self.probe = None
        per_call = self.sampled_seconds / max(self.sampled_calls, 1)
        busy = self.sampled_cpu / self.sampled_seconds if self.sampled_seconds else 0.0
        measured = (
            f"fn held the GIL {held:.0%} and a CPU {busy:.0%} of {self.sampled_calls} "
            f"sampled calls of {per_call * 1e3:.3f} ms"
        )
        count = self.wanted
        if self.output_estimate:  # AUTOTUNE: no more workers than the budget keeps busy
            count = max(1, min(count, self.account.share() // (2 * self.output_estimate)))
        kind, why = "threads", "it releases the GIL"
        # A probe kept late by a busy machine (not by the GIL) is told apart by the CPU
        # time of the calls: a function that waits (I/O, sleep) uses little of it.
        if held >= _GIL_BOUND and busy >= _CPU_BOUND:
            why = "calls are too quick to pay for a trip to a process"
            if per_call >= MIN_PROCESS_CALL_SECONDS:
                why = "only one CPU is available"
                if cpu_count() > 1 and count > 1:
                    try:
                        check_picklable(self.fn, "the map function", self.stage)
                        kind, why = "processes", "GIL-bound"
                    except InvalidArgumentError as error:
                        why = f"the function cannot be pickled ({error.__cause__})"
        self.kind, self.threads = kind, count
        if kind == "processes":
            try:  # (now: with no descriptors for workers' pipes, threads do the work)
                self._start_pool()
            except FileLimitError as error:
                kind, why = "threads", f"no descriptors for worker pipes: {error.strerror}"
                self.kind = kind
        if kind == "processes":
            self.chunks.target_seconds = PROCESS_CALL_SECONDS
        self.ledger.packs = kind == "processes"
        self.reason = f"{measured}: {kind} ({why})"

    def close(self) -> None:
        if self.probe is not None:
            self.probe.stop()
            self.probe = None
        super().close()


def restore_process_node(cls: type[MapNode], state: dict[str, Any]) -> MapNode:
    """A pickled map node on processes, rebuilt (see ``map.restore_process_node``)."""
    node = cls.__new__(cls)
    node.__dict__.update(state)
    return node


map_module.process_iterator = process_map_iterator
map_module.restore_process_node = restore_process_node
