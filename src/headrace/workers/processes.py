"""A pool of worker processes that run a stage's function on chunks of elements.

Start method. Workers come from a ``forkserver`` (``spawn`` where there is
none), never from a plain ``fork``: forking a process that has TensorFlow,
JAX or any other threaded runtime loaded copies locks held by threads that do
not exist in the child, and the child hangs or crashes. The consequence: the
function is *pickled* — once per worker, when the worker starts, not per
element — so it must be picklable (a module-level function or class
instance, a ``functools.partial`` of one); a function that is not raises
:class:`~headrace.errors.InvalidArgumentError` naming the part that could not
be pickled.

Data. A chunk of inputs travels as one :class:`~headrace.workers.shm.Packet`,
its large buffers in one of the worker's pooled input segments (at most
:data:`INPUT_SEGMENTS` per worker, each booked from its creation until it is
dropped; a one-shot segment when none is free or the stage has no room to
book one); the worker reports an input segment free with the call's result.
The outputs come back the same way through the worker's pooled result
segments, and the consumer's arrays view the segment (no copy). Which result
segment is free again is told back to the worker with its next task.
Reusing segments saves creating, mapping and first-touching new pages on both
sides for every chunk: for a 1 MiB chunk that was ~4x the cost of the copy.

Failures. An exception raised by the function travels back in its element's
place, with the worker's traceback as its ``__cause__``. A worker that dies
(killed by a signal, ``os._exit``) is noticed by the collector thread within
a second, and every call in flight fails with :class:`WorkerError` naming the
worker and the signal; the pool is then broken and shuts its other workers
down. ``close`` stops every worker (they also exit on their own when the
consumer's end of their pipe closes, e.g. when it is SIGKILLed), and workers
ignore SIGINT, so a Ctrl-C reaches only the consumer, whose close stops them.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

from headrace.core.handoff import drop_frames
from headrace.errors import InvalidArgumentError, WorkerError, add_note
from headrace.workers.memory import WorkerMemory, worker_memory
from headrace.workers.shm import (
    Packet,
    SegmentMaps,
    SegmentPool,
    create_segment,
    loads,
    open_segment,
    pack,
    segment_name,
    sweep_stale,
    unlink_segment,
    unpack,
)

__all__ = [
    "INPUT_SEGMENTS",
    "WORKER_KINDS",
    "ChunkResult",
    "ProcessPool",
    "Traffic",
    "check_picklable",
    "check_workers",
    "start_method",
]

#: Where a parallel stage's calls may run (``map(..., workers=...)``).
WORKER_KINDS = ("threads", "processes", "auto")

#: How often the collector looks at the workers when no message comes (worker deaths are
#: also woken on at once through their sentinels; this only bounds a missed wake-up).
_POLL_SECONDS = 0.5
#: Idle result segments a worker keeps for reuse (each booked while it is kept), unless
#: its pool is told otherwise (an interleave's pool keeps enough for its slots' chunks).
IDLE_SEGMENTS = 2
#: Input segments pooled per worker (each booked for as long as it is pooled): a worker
#: has about two calls in flight (the map keeps 2 x workers calls going).
INPUT_SEGMENTS = 2

#: (outputs, errors by position, seconds the worker spent, bytes of the result segment
#: that no output array covers: alignment and the unused end of a reused segment)
ChunkResult = tuple[list[Any], dict[int, BaseException] | None, float, int]


def start_method() -> str:
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


#: What the forkserver imports before it forks any worker: each worker then starts with
#: NumPy and headrace's worker side already in memory, as pages it shares with the server
#: and its siblings (counted once between them, by PSS), instead of importing them anew
#: (~16 MiB of unique memory and a few hundred ms per worker).
FORKSERVER_PRELOAD = ("__main__", "numpy", "headrace.workers.processes")


def _preload_forkserver(context: Any) -> None:
    """Ask the forkserver (before it starts; later calls change nothing) to preload."""
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(list(FORKSERVER_PRELOAD))


def _find_unpicklable(obj: Any, path: str, depth: int = 0) -> str:
    """The deepest part of ``obj`` that pickle refuses, as a path like ``fn.__closure__[0]``."""
    if depth > 6:
        return path
    parts: list[tuple[str, Any]] = []
    if isinstance(obj, functools.partial):
        parts = [(f"{path}.func", obj.func)]
        parts += [(f"{path}.args[{i}]", arg) for i, arg in enumerate(obj.args)]
        parts += [(f"{path}.keywords[{k!r}]", v) for k, v in obj.keywords.items()]
    elif isinstance(obj, dict):
        parts = [(f"{path}[{key!r}]", value) for key, value in obj.items()]
    elif isinstance(obj, (list, tuple)):
        parts = [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not callable(getattr(obj, "__code__", None)):
        parts = [(f"{path}.{key}", value) for key, value in vars(obj).items()]
    for where, part in parts:
        try:
            pickle.dumps(part)
        except Exception:
            return _find_unpicklable(part, where, depth + 1)
    return path


def check_picklable(obj: Any, what: str, stage: str) -> bytes:
    """``obj`` pickled, or an :class:`InvalidArgumentError` naming what could not be."""
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception as error:
        where = _find_unpicklable(obj, what)
        raise InvalidArgumentError(
            f"{stage}: {where} cannot be sent to worker processes ({type(error).__name__}: "
            f"{error}). Process workers start by forkserver/spawn and receive the function "
            "pickled: define it at module level (not a lambda or a nested function), bind "
            "arguments with functools.partial, keep locks and open files out of it — or use "
            "workers='threads'."
        ) from error


def check_workers(workers: Any, num_parallel_calls: Any, fn: Any, stage: str) -> None:
    """Validate ``workers`` at build time; a process map's function must pickle."""
    if workers not in WORKER_KINDS:
        raise InvalidArgumentError(
            f"{stage}: workers must be one of {', '.join(map(repr, WORKER_KINDS))}, "
            f"got {workers!r}"
        )
    if num_parallel_calls is None:
        raise InvalidArgumentError(
            f"{stage}: workers={workers!r} needs num_parallel_calls (a number or AUTOTUNE)"
        )
    if workers == "processes":
        check_picklable(fn, "the map function", stage)


# -- the worker's side -------------------------------------------------------------------


def _apply_all(handler: Callable[[Any], Any], elements: list[Any]) -> tuple[list[Any], dict[int, Any]]:
    outputs: list[Any] = []
    errors: dict[int, Any] = {}
    for position, element in enumerate(elements):
        try:
            outputs.append(handler(element))
        except Exception as error:
            outputs.append(None)
            text = traceback.format_exc()
            # held until the chunk is sent: its frames would keep the input and the
            # function's temporaries alive meanwhile (the text has what they show)
            drop_frames(error)
            try:
                pickle.dumps(error)
                errors[position] = (error, text)
            except Exception:  # an exception that cannot travel: its text does
                errors[position] = (WorkerError(f"{type(error).__qualname__}: {error}"), text)
    return outputs, errors


#: Bytes glibc keeps at the top of a worker's heap when it grows or trims it (see
#: :func:`_keep_heap_top`); also what a worker's heap may hold unused past its peak.
HEAP_TOP_PAD = 4 << 20


def _keep_heap_top() -> None:
    """Keep a worker's chunk-to-chunk churn inside its heap (glibc; elsewhere nothing).

    A worker builds a chunk of outputs (a process interleave's are about a MiB,
    its CHUNK_BYTES), copies them into a segment and frees them; glibc then gives the
    top of the heap back to the kernel, and the next chunk faults the same pages
    in again. In benchmark 2 that was 2x the in-process pipeline's page faults
    and a quarter of a worker's CPU. A top pad of :data:`HEAP_TOP_PAD` keeps them.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS): its allocator decides
        return
    m_top_pad = -2  # glibc's M_TOP_PAD
    mallopt(m_top_pad, HEAP_TOP_PAD)


def _worker_main(
    tasks: Connection, results: Connection, handler_bytes: bytes, owner: int, index: int
) -> None:
    """Run in each worker: unpickle the handler once, then serve chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    _keep_heap_top()
    try:
        handler = pickle.loads(handler_bytes)
    except BaseException:
        results.send(("init_error", traceback.format_exc()))
        return
    pool = SegmentPool(owner, tag=f"w{index}-")
    evicted: list[int] = []  # idle segments dropped since the last result (see allocate)

    def allocate(nbytes: int) -> tuple[int, str, int, mmap.mmap]:
        evicted.extend(pool.evict_smaller(nbytes))
        return pool.allocate(nbytes)

    inputs = SegmentMaps()  # the consumer's pooled input segments, mapped here
    queued: deque[tuple[Any, ...]] = deque()
    try:
        while True:
            try:
                # Take in every message that has arrived: a task's news of segments the
                # consumer is done with applies at once, not after the tasks queued before
                # it (with several queued, those would each make a fresh segment).
                while not queued or tasks.poll():
                    message = tasks.recv()
                    if message[0] == "stop":
                        return
                    _, _, _, freed, dropped, dropped_inputs = message
                    for key in freed:
                        pool.free(key)
                    for key in dropped:
                        pool.drop(key)
                    for key in dropped_inputs:
                        inputs.forget(key)
                    queued.append(message)
            except (EOFError, OSError):  # the consumer is gone
                return
            _, call_id, packet, _, _, _ = queued.popleft()
            started = time.perf_counter()
            elements = _receive_inputs(packet, inputs)
            computing = time.perf_counter()
            outputs, errors = _apply_all(handler, elements)
            compute = time.perf_counter() - computing
            del elements
            try:
                result = pack(outputs, allocate)
            except Exception as error:  # an output that cannot be pickled: every position
                text = traceback.format_exc()
                failure = WorkerError(f"an output cannot be sent back: {type(error).__name__}: {error}")
                errors = {p: (failure, text) for p in range(len(outputs))}
                result = pack([None] * len(outputs), allocate)
            del outputs
            seconds = time.perf_counter() - started
            # input segments whose every view is gone (the outputs are copied out by now)
            free_inputs = inputs.released()
            results.send(
                ("done", call_id, result, errors or None, seconds, compute, free_inputs, evicted[:])
            )
            evicted.clear()
    finally:
        pool.close()
        inputs.close()


def _receive_inputs(packet: Packet, inputs: SegmentMaps) -> Any:
    if packet.segment is None:
        return loads(packet.payload)
    key, name, capacity = packet.segment
    if key:  # a pooled input segment: kept mapped, reported free when its views are gone
        return inputs.unpack(packet)
    return unpack(packet, open_segment(name, capacity), lambda view: None)


# -- the consumer's side -----------------------------------------------------------------


def _input_capacity(nbytes: int) -> int:
    """A new input segment's size: the next power of two (chunks vary in length, and a
    segment that fits only this one would be replaced at the next larger chunk)."""
    return max(1 << (max(nbytes, 1) - 1).bit_length(), mmap.PAGESIZE)


class _Worker:
    __slots__ = (
        "dropped", "dropped_inputs", "freed", "idle", "index", "input_bookings", "inputs",
        "pending", "process", "results", "tasks",
    )

    def __init__(
        self, index: int, process: Any, tasks: Connection, results: Connection, owner: int
    ) -> None:
        self.index, self.process, self.tasks, self.results = index, process, tasks, results
        self.pending: deque[tuple[int, Future[ChunkResult], list[str], int]] = deque()
        self.freed: list[int] = []  # segment keys to report free with the next task
        self.dropped: list[int] = []
        self.idle: dict[int, Any] = {}  # key -> the reservation booking it while idle
        self.inputs = SegmentPool(owner, tag=f"in{index}-")  # this worker's input segments
        self.input_bookings: dict[int, Any] = {}  # key -> its reservation (while pooled)
        self.dropped_inputs: list[int] = []  # input keys the worker should unmap


class Traffic:
    """Where a process pool's time goes: the function's own work in the workers against
    moving elements (pickling, shared-memory copies) both ways, and the bytes moved.

    ``compute_seconds`` is the function in the workers; ``transfer_seconds`` the rest of
    a chunk's time there (unpacking its inputs, packing its outputs) plus what this
    process spends packing inputs and unpacking outputs.
    """

    __slots__ = ("chunks", "compute_seconds", "elements", "lock", "received_bytes", "segments",
                 "sent_bytes", "transfer_seconds")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # tasks are packed on map threads, results unpacked
        self.chunks = self.elements = self.segments = 0
        self.sent_bytes = self.received_bytes = 0
        self.compute_seconds = self.transfer_seconds = 0.0

    def add_task(self, elements: int, seconds: float, nbytes: int, segments: int) -> None:
        with self.lock:
            self._add_task(elements, seconds, nbytes, segments)

    def _add_task(self, elements: int, seconds: float, nbytes: int, segments: int) -> None:
        self.chunks += 1
        self.elements += elements
        self.transfer_seconds += seconds
        self.sent_bytes += nbytes
        self.segments += segments

    def add_result(self, seconds: float, compute: float, unpacking: float, nbytes: int) -> None:
        with self.lock:
            self._add_result(seconds, compute, unpacking, nbytes)

    def _add_result(self, seconds: float, compute: float, unpacking: float, nbytes: int) -> None:
        self.compute_seconds += compute
        self.transfer_seconds += max(seconds - compute, 0.0) + unpacking
        self.received_bytes += nbytes


class ProcessPool:
    """``count`` worker processes running ``handler(element)`` over chunks, by futures.

    ``book_idle(nbytes)`` books a result segment kept idle for reuse and returns
    its reservation (or None: then the segment is dropped instead); each worker
    keeps up to ``idle_segments`` of them.
    """

    def __init__(
        self,
        handler: Any,
        count: int,
        stage: str,
        *,
        what: str = "the function",
        book_idle: Callable[[int], Any] | None = None,
        idle_segments: int = IDLE_SEGMENTS,
    ) -> None:
        self.stage, self.count, self.idle_segments = stage, count, idle_segments
        self.handler_bytes = check_picklable(handler, what, stage)
        self.book_idle = book_idle
        self.owner = os.getpid()
        self.broken: WorkerError | None = None
        self.closed = False
        self.workers: list[_Worker] = []
        self.maps: dict[int, SegmentMaps] = {}
        self.lock = threading.Lock()
        self._ids = 0
        self.traffic = Traffic()
        self.assigned = [0] * count  # callers bound to each worker (see assign)
        self._started = False
        self._collector: threading.Thread | None = None

    # -- starting ---------------------------------------------------------------------------
    def _start(self) -> None:
        self._started = True
        sweep_stale()
        context = multiprocessing.get_context(start_method())
        _preload_forkserver(context)
        for index in range(self.count):
            task_read, task_write = context.Pipe(duplex=False)
            result_read, result_write = context.Pipe(duplex=False)
            process = context.Process(  # type: ignore[attr-defined]
                target=_worker_main,
                args=(task_read, result_write, self.handler_bytes, self.owner, index),
                name=f"headrace-worker-{index}",
                daemon=True,
            )
            process.start()
            task_read.close()
            result_write.close()
            self.workers.append(_Worker(index, process, task_write, result_read, self.owner))
            self.maps[index] = SegmentMaps()
        self._collector = threading.Thread(
            target=_collect, args=(self,), name="headrace-collector", daemon=True
        )
        self._collector.start()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    def memory(self) -> tuple[WorkerMemory, ...]:
        found = (worker_memory(pid) for pid in self.pids)
        return tuple(m for m in found if m is not None)

    # -- work -------------------------------------------------------------------------------
    def assign(self, prefer: int | None = None) -> int:
        """A worker for a caller whose calls must run in order in one process (an
        interleave slot): the one with the fewest such callers, ``prefer`` (a worker
        about to lose one) on a tie with it counted one less; give it back with
        :meth:`unassign`."""
        with self.lock:
            def load(index: int) -> tuple[int, bool]:
                return self.assigned[index] - (index == prefer), index != prefer

            index = min(range(self.count), key=load)
            self.assigned[index] += 1
        return index

    def unassign(self, index: int) -> None:
        with self.lock:
            self.assigned[index] -= 1

    def submit(self, elements: list[Any], *, worker: int | None = None) -> Future[ChunkResult]:
        """Run the handler over ``elements`` in a worker (the least busy, or the one
        numbered ``worker``: its calls run in the order submitted); a future of the outputs."""
        if self.closed:
            raise WorkerError(f"{self.stage}: the worker pool is closed")
        if self.broken is not None:
            raise self.broken
        if not self._started:
            self._start()
        self.recycle()
        with self.lock:
            if worker is None:
                chosen = min(self.workers, key=lambda w: len(w.pending))
            else:
                chosen = self.workers[worker]
        return self._submit_to(chosen, elements)

    def _submit_to(self, worker: _Worker, elements: list[Any]) -> Future[ChunkResult]:
        names: list[str] = []
        packing = time.perf_counter()
        packet = pack(elements, functools.partial(self._allocate_input, worker, names))
        self.traffic.add_task(len(elements), time.perf_counter() - packing,
                              packet.shared_bytes + len(packet.payload), len(names))
        future: Future[ChunkResult] = Future()
        with self.lock:
            if self.broken is not None:
                for name in names:
                    unlink_segment(name)
                raise self.broken
            self._ids += 1
            call_id = self._ids
            worker.pending.append((call_id, future, names, len(elements)))
            freed, dropped, dropped_inputs = worker.freed, worker.dropped, worker.dropped_inputs
            worker.freed, worker.dropped, worker.dropped_inputs = [], [], []
        with contextlib.suppress(OSError):  # the worker is gone: the collector reports why
            worker.tasks.send(("task", call_id, packet, freed, dropped, dropped_inputs))
        return future

    def _allocate_input(
        self, worker: _Worker, names: list[str], nbytes: int
    ) -> tuple[int, str, int, Any]:
        """An input segment for ``worker``: a pooled one (booked while pooled) when one is
        free or may be made, else one-shot (key 0; its name is unlinked with the call)."""
        pooled = worker.inputs
        with self.lock:
            if pooled.has_idle(nbytes):
                return pooled.allocate(nbytes)
            if len(pooled.segments) >= INPUT_SEGMENTS and pooled.idle:
                # inputs outgrew the idle segment: make room for a larger one
                self._drop_input(worker, min(pooled.idle, key=lambda k: pooled.segments[k][1]))
            room = len(pooled.segments) < INPUT_SEGMENTS
        booking = None
        if room and self.book_idle is not None:
            booking = self.book_idle(_input_capacity(nbytes))
        if booking is None:
            return self._one_shot(names, nbytes)
        with self.lock:
            key, name, capacity, mapping = pooled.allocate(nbytes, _input_capacity(nbytes))
            if not name:  # one was freed meanwhile and is reused: booked already
                booking.release()
                return key, name, capacity, mapping
            worker.input_bookings[key] = booking
        names.append(name)  # it lives until the worker maps it, or the call ends
        return key, name, capacity, mapping

    def _drop_input(self, worker: _Worker, key: int) -> None:
        """Unpool an idle input segment here and, with the next task, in the worker."""
        worker.inputs.drop(key)
        booking = worker.input_bookings.pop(key, None)
        if booking is not None:
            booking.release()
        worker.dropped_inputs.append(key)

    def _one_shot(self, names: list[str], nbytes: int) -> tuple[int, str, int, Any]:
        name = segment_name(self.owner, "in-")
        size = max(nbytes, 1)
        mapping = create_segment(name, size)
        names.append(name)
        return 0, name, size, mapping

    def _inputs_free(self, worker: _Worker, keys: list[int]) -> None:
        """The worker is done with these input segments: idle again (collector thread)."""
        with self.lock:
            for key in keys:
                worker.inputs.free(key)

    def recycle(self) -> None:
        """Turn result segments whose views are all gone into idle ones (booked) or drop them."""
        for worker in self.workers:
            maps = self.maps[worker.index]
            for key in maps.released():
                capacity = maps.maps[key][1] if key in maps.maps else 0
                booking = None
                if self.book_idle is not None and len(worker.idle) < self.idle_segments:
                    booking = self.book_idle(capacity)
                with self.lock:
                    if booking is not None:
                        worker.idle[key] = booking
                        worker.freed.append(key)
                    else:
                        maps.forget(key)
                        worker.dropped.append(key)

    def _finish(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        """A ``done`` message: unpack it into its future (collector thread)."""
        _, call_id, packet, errors, seconds, compute, free_inputs, evicted = message
        received = time.perf_counter()
        self._inputs_free(worker, free_inputs)
        maps = self.maps[worker.index]
        with self.lock:
            entry = worker.pending.popleft()
            assert entry[0] == call_id, "results come back in the order sent"
            # idle segments the worker dropped (too small), and the one it used
            used = [] if packet.segment is None else [packet.segment[0]]
            for key in [*evicted, *used]:
                booking = worker.idle.pop(key, None)
                if booking is not None:
                    booking.release()
        for key in evicted:
            maps.forget(key)
        _, future, names, _ = entry
        for name in names:
            unlink_segment(name)
        if future.cancelled():
            if packet.segment is not None:  # never looked at: straight back to the worker
                key, name, capacity = packet.segment
                if name:
                    try:
                        maps.maps[key] = (open_segment(name, capacity), capacity)
                    except FileNotFoundError:  # the worker is closing and unlinked it
                        return  # (its pool drops names not reported mapped): nothing to give
                    maps.opened += 1
                with self.lock:
                    worker.freed.append(key)
            return
        try:
            outputs = maps.unpack(packet)
        except BaseException as unpack_error:
            future.set_exception(unpack_error)
            return
        self.traffic.add_result(seconds, compute, time.perf_counter() - received,
                                packet.shared_bytes + len(packet.payload))
        failed: dict[int, BaseException] | None = None
        if errors:
            failed = {}
            for position, (raised, text) in errors.items():
                raised.__cause__ = _RemoteTraceback(text)
                add_note(raised, f"headrace: raised in worker process {worker.process.pid}")
                failed[position] = raised
        # the segment's bytes that no output views: alignment, the unused end of a reused
        # segment, and buffers received as copies (large bytes, bytes columns); nothing
        # when no output views it (it is free again at once)
        viewed = packet.viewed_bytes
        slack = packet.shared_bytes - viewed if viewed else 0
        with contextlib.suppress(Exception):  # cancelled meanwhile
            future.set_result((outputs, failed, seconds, slack))

    def _fail(self, error: WorkerError) -> None:
        """Fail every call in flight and stop the workers (collector thread)."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            entries = [entry for worker in self.workers for entry in worker.pending]
            for worker in self.workers:
                worker.pending.clear()
        for _, future, names, _ in entries:
            for name in names:
                unlink_segment(name)
            with contextlib.suppress(Exception):
                future.set_exception(error)
        self._stop_workers()

    def _died(self, worker: _Worker) -> WorkerError:
        code = worker.process.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
            if code == _STATUS_LOST:
                how += " (or ended after the forkserver that started it failed)"
            if code == 1:
                how += (
                    " (if it failed while starting: workers start by forkserver and import "
                    "the main module, so a script must start its pipeline under "
                    "`if __name__ == '__main__':`)"
                )
        busy = sum(entry[3] for entry in worker.pending)
        return WorkerError(
            f"{self.stage}: worker process {worker.process.pid} {how} while {busy} elements "
            "were in flight; the stage's workers are shut down (create a new iterator, and "
            "restore a checkpoint, to go on)"
        )

    # -- stopping ---------------------------------------------------------------------------
    def _stop_workers(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(OSError, ValueError):
                worker.tasks.send(("stop",))
        deadline = time.monotonic() + 2.0
        for worker in self.workers:
            if not _wait_ended(worker.process, deadline):
                with contextlib.suppress(ProcessLookupError):  # (Process.kill does nothing
                    os.kill(worker.process.pid, signal.SIGKILL)  # once its status is lost)
                _wait_ended(worker.process, time.monotonic() + 1.0)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop every worker, return idle segments' bookings, free the pool's segments."""
        if self.closed:
            return
        self.closed = True
        if not self._started:
            return
        self._stop_workers()
        if self._collector is not None and self._collector is not threading.current_thread():
            self._collector.join(_POLL_SECONDS * 4)
        with self.lock:
            entries = [entry for worker in self.workers for entry in worker.pending]
            for worker in self.workers:
                worker.pending.clear()
                for booking in [*worker.idle.values(), *worker.input_bookings.values()]:
                    booking.release()
                worker.idle.clear()
                worker.input_bookings.clear()
                worker.inputs.close()
        for _, future, names, _ in entries:
            for name in names:
                unlink_segment(name)
            future.cancel()
        for worker in self.workers:
            for connection in (worker.tasks, worker.results):
                with contextlib.suppress(OSError):
                    connection.close()
            with contextlib.suppress(Exception):
                worker.process.close()
        for maps in self.maps.values():
            maps.close()


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (its ``__cause__``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\nTraceback in the worker process:\n{self.text}"


#: What ``Process.exitcode`` says where the forkserver could not tell a child's status.
_STATUS_LOST = 255


def _ended(process: Any) -> bool:
    """Whether a worker process has ended.

    A forkserver that fails (under load: CPython gh-140867; or killed) closes the
    status pipes of the children it started: their sentinels fire and ``exitcode``
    says 255 at once, while they still run and still serve their calls. Such a
    worker is judged by its pid. (A worker that really ended also closes its
    results pipe, which the collector sees.)
    """
    code = process.exitcode
    if code is None:
        return False
    if code != _STATUS_LOST:
        return True
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the pid was taken by another user's process
        return True
    return False


def _wait_ended(process: Any, deadline: float) -> bool:
    """Wait until ``process`` has ended (see :func:`_ended`) or ``deadline`` passes."""
    process.join(max(0.0, deadline - time.monotonic()))
    while not _ended(process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _collect(pool: ProcessPool) -> None:
    """The collector thread: results into futures, dead workers into WorkerError."""
    by_results = {id(worker.results): worker for worker in pool.workers}
    by_sentinel = {worker.process.sentinel: worker for worker in pool.workers}
    while not pool.closed and pool.broken is None:
        try:
            ready = wait([w.results for w in pool.workers] + list(by_sentinel), _POLL_SECONDS)
        except OSError:
            return
        dead: list[_Worker] = []
        for item in ready:
            if isinstance(item, int):
                if _ended(by_sentinel[item].process):
                    dead.append(by_sentinel[item])
                else:  # its status was lost: its results pipe still tells when it ends
                    del by_sentinel[item]
                continue
            assert isinstance(item, Connection)
            worker = by_results[id(item)]
            try:
                message = item.recv()
            except (EOFError, OSError):
                dead.append(worker)
                continue
            if message[0] == "done":
                pool._finish(worker, message)
            elif message[0] == "init_error":
                pool._fail(
                    WorkerError(
                        f"{pool.stage}: a worker process could not load the function it was "
                        f"sent:\n{message[1]}"
                    )
                )
                return
        for worker in dead:
            if pool.closed:
                return
            # Results it sent before dying are still in the pipe: deliver them first.
            with contextlib.suppress(EOFError, OSError):
                while worker.results.poll():
                    message = worker.results.recv()
                    if message[0] == "done":
                        pool._finish(worker, message)
            worker.process.join(1.0)
            # A worker leaves only when told to (close): any other exit breaks the pool.
            pool._fail(pool._died(worker))
            return
