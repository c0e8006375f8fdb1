"""A pool of worker processes that run a stage's function on chunks of elements.

Start method. Workers come from a ``forkserver`` (``spawn`` where there is
none), never from a plain ``fork``: forking a process that has TensorFlow,
JAX or any other threaded runtime loaded copies locks held by threads that do
not exist in the child, and the child hangs or crashes. The consequence: the
function is *pickled* — once per worker, when the worker starts, not per
element — so it must be picklable (a module-level function or class
instance, a ``functools.partial`` of one); a function that is not raises
:class:`~headrace._errors.InvalidArgumentError` naming the part that could not
be pickled.

Data. A chunk of inputs travels as one :class:`~headrace._workers.shm.Packet`,
its large buffers in one of the worker's pooled input segments (at most
:data:`INPUT_SEGMENTS` per worker, each booked from its creation until it is
dropped; a one-shot segment when none is free or the stage has no room to
book one); the worker reports an input segment free with the call's result.
The outputs come back the same way through the worker's pooled result
segments, and the consumer's arrays view the segment (no copy). Which result
segment is free again is told back to the worker with its next task, or at once
while it has calls in flight (see :meth:`ProcessPool.recycle`).

Outputs in flight. A worker packs each output as soon as the function returns
it: pickled, its large buffers copied into the result segment, the object
dropped, before the next element runs (see :class:`~headrace._workers.shm.OutputWriter`).
So the segment is the only copy of a chunk's outputs, and an output and its
copy coexist for one pack only. A chunk carries an *allowance*: the bytes the
consumer booked for its outputs. The worker stops right after the output that
takes its outputs' cost past it, if elements remain, and sends the outputs so
far; the consumer runs the rest in another call. So a call's outputs pass their
booking by one output at most, whatever the sizes do. An output that costs
more than the whole budget (the chunk's *ceiling*) is not packed at all: it is
its element's :class:`~headrace._errors.MemoryBudgetError`.
Reusing segments saves creating, mapping and first-touching new pages on both
sides for every chunk: for a 1 MiB chunk that was ~4x the cost of the copy.

Failures. An exception raised by the function travels back in its element's
place, with the worker's traceback as its ``__cause__``; so does an output
that cannot be pickled back (a :class:`WorkerError` for that element alone,
not its chunk). A worker that dies (a signal, the OOM killer, ``os._exit``, a
crash in native code) is a fault of the machine, not of the data: the collector
thread notices it within a second, starts a successor (with a
:class:`~headrace._errors.HeadraceWarning`) and sends it the dead worker's calls
again, in their order, so nothing is lost and nothing comes twice. Each worker
writes which call and element it is running into a small shared cell, so the
element a worker died on is known: its chunk runs again in three parts (the
elements before it, it alone, the rest), and an element that ends a second
worker is dropped as its own :class:`WorkerError` (naming both workers and how
they ended), in its place, like any error of the function (``ignore_errors``
drops it). A chunk whose workers keep dying while none of its elements runs
(:data:`_MAX_TRIES` times) fails its elements the same way. A worker that dies
before it loaded the function, a successor that cannot start, or a function
that cannot be loaded break the pool: every call in flight and every later
``submit`` raise :class:`~headrace._errors.WorkerPoolError` (which ``ignore_errors``
does not swallow). Calls keep their elements until their results are in (for
the map they are booked on its share until then, as a thread's call holds them).
``close`` stops every worker (they also exit on their own when the
consumer's end of their pipe closes, e.g. when it is SIGKILLed), and workers
ignore SIGINT, so a Ctrl-C reaches only the consumer, whose close stops them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import multiprocessing
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from sys import getsizeof
from typing import TYPE_CHECKING, Any

from headrace._errors import (
    FileLimitError,
    HeadraceWarning,
    InvalidArgumentError,
    MemoryBudgetError,
    WorkerError,
    WorkerPoolError,
    add_note,
)
from headrace._memory.buffer import Reservation
from headrace._memory.sizeof import FLAT_TYPES, admit, sizeof
from headrace._memory.units import format_bytes
from headrace._warn import warn_user
from headrace._workers.memory import WorkerMemory, worker_memory
from headrace._workers.shm import (
    SEGMENT_BYTES,
    OutputWriter,
    Packet,
    Segment,
    SegmentMaps,
    SegmentPool,
    create_segment,
    loads,
    open_segment,
    pack,
    segment_name,
    sweep_process,
    sweep_stale,
    unlink_segment,
    unpack,
)
from headrace.core.handoff import drop_frames

if TYPE_CHECKING:
    from headrace.io.filepool import FileLimiter, HeldSlots

__all__ = [
    "INPUT_SEGMENTS",
    "WORKER_KINDS",
    "ChunkResult",
    "ProcessPool",
    "Traffic",
    "check_picklable",
    "check_workers",
    "start_method",
    "unsendable",
]

#: Where a parallel stage's calls may run (``map(..., workers=...)``).
WORKER_KINDS = ("threads", "processes", "auto")

#: How often the collector looks at the workers when no message comes (worker deaths are
#: also woken on at once through their sentinels; this only bounds a missed wake-up).
_POLL_SECONDS = 0.5
#: Idle result segments a worker keeps for reuse (each booked while it is kept), unless
#: its pool is told otherwise (an interleave's pool keeps enough for its slots' chunks).
IDLE_SEGMENTS = 2
#: ... or enough for this many calls like its last one, when that call's outputs took
#: several segments (a segment holds at most ``SEGMENT_BYTES``; each large output has
#: its own). With two kept for such calls, each call after the first made segments
#: afresh, and a fresh segment costs a page fault per page on both sides. With four
#: calls' worth, an image map's outputs (one segment each, released as the batch
#: copies them while the next calls run) still outran the cap: 600 of 4,000 outputs
#: went into fresh segments (25 faults per image in the workers; 1-2 with eight).
#: Idle segments are lent to the calls that fill them (see ``ProcessPool._lend``).
IDLE_CALLS = 8
#: Descriptors the consumer keeps open for each live worker, whatever the start method:
#: the task pipe's write end, the result pipe's read end, and the two ends the
#: ``Process`` object keeps (its sentinel, and the pipe that tells the worker its parent
#: lives). ``tests/workers/test_process_fds.py`` counts them in ``/proc/self/fd``.
DESCRIPTORS_PER_WORKER = 4
#: More, for a moment: while a worker starts (workers start one at a time), the
#: child's ends of its pipes until it has them and the forkserver connection (three);
#: and one while a new result segment is mapped (opened, mapped, closed).
SPAWN_DESCRIPTORS = 4
#: In ``_Worker.idle`` in place of a booking: the idle segment is lent to a call in
#: flight, whose allowance covers it (see ``ProcessPool._lend``).
_LENT: Any = object()
#: Input segments pooled per worker (each booked for as long as it is pooled): a worker
#: has about two calls in flight (the map keeps 2 x workers calls going).
INPUT_SEGMENTS = 2

#: (outputs, errors by position, seconds the worker spent, bytes of the result segments
#: that no output array covers: alignment and the unused end of a reused segment).
#: Fewer outputs than elements when the worker stopped at the chunk's allowance.
ChunkResult = tuple[list[Any], dict[int, BaseException] | None, float, int]


def start_method() -> str:
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


#: What the forkserver imports before it forks any worker: each worker then starts with
#: NumPy and headrace's worker side already in memory, as pages it shares with the server
#: and its siblings (counted once between them, by PSS), instead of importing them anew
#: (~16 MiB of unique memory and a few hundred ms per worker).
FORKSERVER_PRELOAD = ("__main__", "numpy", "headrace._workers.processes")


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


def _in_ray_worker() -> bool:
    """Whether this process is a Ray task's or actor's worker (not a driver)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        worker = ray._private.worker
        return bool(worker.global_worker.mode == worker.WORKER_MODE)
    except AttributeError:
        return False


def _pickle_by_value(obj: Any) -> bytes:
    """``obj`` pickled with Ray's cloudpickle, which sends functions of ``__main__`` and
    lambdas by value (their code), as Ray itself sent them to this worker."""
    from ray import cloudpickle

    dumps: Any = cloudpickle.dumps  # untyped
    return bytes(dumps(obj, protocol=5))


def check_picklable(obj: Any, what: str, stage: str) -> bytes:
    """``obj`` pickled, or an :class:`InvalidArgumentError` naming what could not be.

    Inside a Ray worker a function the user defined in the driver script arrives by
    value (Ray cloudpickles it): its ``__main__`` is not the worker's, so plain pickle
    cannot name it. There it is pickled by value the same way, so a pipeline built in a
    Ray task runs process workers exactly as it does in the driver.
    """
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception as error:
        if _in_ray_worker():
            with contextlib.suppress(Exception):
                return _pickle_by_value(obj)
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


#: The progress cell's layout: the call being run and the position in its chunk (the
#: chunk's length while its outputs are sent). Read by the consumer when the worker died.
_PROGRESS = struct.Struct("qq")


def _failure(error: Exception) -> tuple[BaseException, str]:
    """An error of the function, as it travels back: itself (or its text, where it
    cannot be pickled) and the worker's traceback."""
    text = traceback.format_exc()
    # held until the chunk is sent: its frames would keep the input and the function's
    # temporaries alive meanwhile (the text has what they show)
    drop_frames(error)
    return portable(error), text


#: How deep a chain of causes and contexts travels with an error (the rest is cut).
_CHAIN_DEPTH = 64


def portable(error: BaseException) -> BaseException:
    """``error`` in a form that unpickles in the consumer (see :func:`_portable_one`),
    with its chain: its ``__cause__`` and ``__context__`` (each portable too) are set
    on it again there, as a thread map leaves them. Pickle keeps neither."""
    return _portable_chain(error, {}, 0)


def _portable_chain(
    error: BaseException, made: dict[int, BaseException], depth: int
) -> BaseException:
    known = made.get(id(error))
    if known is not None:  # met before in the chain (a cause that is also the context)
        return known
    one = made[id(error)] = _portable_one(error)
    cause, context = error.__cause__, error.__context__
    if (cause is None and context is None) or depth >= _CHAIN_DEPTH:
        return one
    chained = made[id(error)] = _Chained(one, None, None, error.__suppress_context__)
    if cause is not None:
        chained.cause = _portable_chain(cause, made, depth + 1)
    if context is not None:
        chained.context = _portable_chain(context, made, depth + 1)
    return chained


class _Chained(Exception):
    """An error with its cause and context, as it travels: it unpickles as the error
    with both set again (:func:`_rechain`). Its parts are attributes, so the cost
    model sizes them all."""

    def __init__(self, error: BaseException, cause: BaseException | None,
                 context: BaseException | None, suppress: bool) -> None:
        super().__init__()
        self.error, self.cause, self.context, self.suppress = error, cause, context, suppress

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        return _rechain, (self.error, self.cause, self.context, self.suppress)


def _rechain(error: BaseException, cause: Any, context: Any, suppress: bool) -> BaseException:
    """``error`` with its chain set again (parts that did not come back as errors
    are left out)."""
    if isinstance(cause, BaseException) and cause is not error:
        error.__cause__ = cause
    if isinstance(context, BaseException) and context is not error:
        error.__context__ = context
    error.__suppress_context__ = bool(suppress)
    return error


def _portable_one(error: BaseException) -> BaseException:
    """``error`` in a form that unpickles in the consumer: itself where pickle can
    rebuild it; else a stand-in that rebuilds the user's type without calling its
    ``__init__`` (one that takes other arguments than its message), or a
    :class:`WorkerError` naming the type and message where even that fails.

    Pickle rebuilds an exception as ``type(*args)``. A class whose ``__init__``
    takes two arguments and passes one message up cannot be rebuilt so: it fails,
    or (the arguments fit another way) says something else. Such an error would
    fail in the consumer's process, away from its element.
    """
    name, message = type(error).__qualname__, _text_of(error)
    try:
        # Out of band: the rebuilt copy views the error's own buffers. In band, an error
        # carrying an array of N bytes cost 2N more in the worker for this check alone.
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(error, protocol=5, buffer_callback=buffers.append)
        back = pickle.loads(data, buffers=buffers)
        del data, buffers
        if type(back) is type(error) and _text_of(back) == message:
            return error
    except Exception:
        pass
    whole = getattr(error, "__dict__", {})
    notes = {"__notes__": whole["__notes__"]} if "__notes__" in whole else {}
    for state in (whole, notes, {}):  # what travels of its attributes: all, its notes, none
        try:
            # Its arrays' buffers out of band: they travel as the error's own (into shared
            # memory where it is packed like an output), not inside the blob, which held
            # each array in band: 2 copies in the worker, 3 in the consumer (seen: +24 MiB
            # per held error that carried 8 MiB).
            carried: list[pickle.PickleBuffer] = []
            blob = pickle.dumps((type(error), error.args, state), protocol=5,
                                buffer_callback=carried.append)
            if not isinstance(_rebuild_error(blob, carried, name, message), WorkerError):
                return _Carried(blob, carried, name, message)
        except Exception:
            continue
    return WorkerError(f"{name}: {message}")


def _text_of(error: BaseException) -> str:
    """``str(error)``, or a placeholder where the user's ``__str__`` raises."""
    try:
        return str(error)
    except Exception:
        return "<its str() raised>"


class _Carried(Exception):
    """An error that pickle cannot rebuild as ``type(*args)``; it unpickles as
    :func:`_rebuild_error` makes it. ``buffers``: the large buffers of its pickle
    ``blob`` (its arrays' data), pickled out of band with protocol 5 (so packed into
    shared memory, and viewed there by the rebuilt error), as copies below it."""

    def __init__(self, blob: bytes, buffers: list[Any], name: str, message: str) -> None:
        super().__init__(name, message)
        self.blob, self.buffers, self.name, self.message = blob, buffers, name, message

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        buffers = self.buffers
        if not isinstance(protocol, int) or protocol < 5:  # no PickleBuffer below 5
            buffers = [bytearray(buffer) for buffer in buffers]  # (writable, as in band)
        return _rebuild_error, (self.blob, buffers, self.name, self.message)


def _rebuild_error(blob: bytes, buffers: list[Any], name: str, message: str) -> BaseException:
    """The user's error rebuilt without its ``__init__``: its type, ``args`` (so its
    message) and attributes (notes included); a :class:`WorkerError` with the type's
    name and the message where the type cannot be loaded here. ``buffers``: the
    pickle's out-of-band buffers (its arrays view them: no copy)."""
    try:
        kind, args, state = pickle.loads(blob, buffers=buffers)
        error: BaseException = kind.__new__(kind, *args)
        # the nearest built-in class's __init__ (OSError's reads errno from the args)
        builtin = next(c for c in kind.__mro__ if c.__module__ == "builtins")
        builtin.__init__(error, *args)
        if state:
            error.__dict__.update(state)
        str(error)  # its __str__ may need what __init__ would have set
    except Exception:
        return WorkerError(f"{name}: {message}")
    return error


def unsendable(refused: Exception) -> tuple[Exception, str]:
    """The error in the place of an output that cannot be packed (pickle refuses a part
    of it): it fails its own element, not the chunk."""
    return (
        WorkerError(
            f"the function's output cannot be sent back from the worker process "
            f"({type(refused).__name__}: {refused}); return NumPy arrays, bytes, "
            "numbers, strings or containers of them"
        ),
        "".join(traceback.format_exception(refused)),
    )


#: In an error's place in a result's ``errors``: the error itself travels in its output's
#: place, packed like an output (see :func:`_pack_failure`).
_PACKED = None


def _pack_failure(
    writer: OutputWriter, raised: BaseException, text: str, left: int
) -> tuple[BaseException | None, str]:
    """``raised`` packed in its output's place; what goes in ``errors`` for it.

    An error may carry large data (the rows it refused). Packed like an output, its
    buffers go once into the result segment and the consumer's copy views them, held
    and booked until its turn like an output. Through the pipe it was pickled whole: a
    copy in the worker while it was sent, the message and the rebuilt error in the
    consumer (two copies of the data there, with no booking until the call was
    collected). One that cannot be packed travels through the pipe as before.
    """
    try:
        writer.add(raised, left)
    except Exception:
        writer.add(None)
        return raised, text
    # its pickle may be small while it holds much (its cause, attributes that its
    # __reduce__ leaves out): the run's memo must not keep it alive
    writer.end_run()
    return _PACKED, text


def _run_chunk(  # noqa: C901
    handler: Callable[[Any], Any],
    elements: list[Any],
    mark: Callable[[int], None],
    writer: OutputWriter,
    allowance: int | None,
    ceiling: int | None,
    stage: str = "",
) -> dict[int, Any]:
    """Run ``handler`` over ``elements`` in order, each output packed by ``writer`` before
    the next element runs; the errors by position.

    The call stops after the output (or error: it may carry arrays) whose cost takes
    the outputs past ``allowance`` (what the consumer booked for them), if elements remain: the outputs so far go
    back, and the consumer runs the rest in another call. So a call's outputs pass
    their booking by one output at most. An output larger than ``ceiling`` (the
    whole budget) is refused here, before it is packed: its pack would double it.
    A death while an output is packed is blamed on its element (the progress cell
    still names it).
    """
    if getattr(handler, "streams", False):
        return _run_streaming(handler, elements, mark, writer)
    errors: dict[int, Any] = {}
    spent = 0
    count = len(elements)
    costed = allowance is not None or ceiling is not None
    # (per element, so the checks are inlined: ``spent > limit >= 0`` is "past the
    # allowance", ``cost > top >= 0`` "past the ceiling"; -1 where there is none)
    limit = -1 if allowance is None else allowance
    top = -1 if ceiling is None else ceiling
    add = writer.add
    for position in range(count):
        mark(position)
        element = elements[position]
        elements[position] = None  # the input goes with it
        try:
            output = handler(element)
        except Exception as error:
            del element
            raised, text = _failure(error)
            del error
            if costed:  # it goes back and is held like an output: it may carry arrays
                spent += sizeof(raised)
            errors[position] = _pack_failure(writer, raised, text, count - position)
            del raised
            if spent > limit >= 0 and position + 1 < count:
                break
            continue
        del element
        cost = 0
        if costed:  # what the consumer books for it (a view of a large temporary compacted)
            if type(output) in FLAT_TYPES:  # (admit's first case, inlined: a scalar output)
                cost = getsizeof(output)
            else:
                try:
                    output, cost = admit(output)
                except Exception as error:  # it cannot be costed (nested too deep): its error
                    del output
                    raised, text = _failure(error)
                    del error
                    errors[position] = _pack_failure(writer, raised, text, count - position)
                    del raised
                    continue
            if cost > top >= 0:
                del output
                refused = MemoryBudgetError(
                    f"{stage}: an output of {format_bytes(cost)} is larger than the whole "
                    f"memory budget ({format_bytes(top)}); it was dropped in the worker "
                    "process, before it was sent back")
                errors[position] = (refused, f"{type(refused).__name__}: {refused}\n")
                add(None)
                continue
        try:
            add(output, count - position)
        except Exception as refused:  # a failed element costs nothing
            errors[position] = unsendable(refused)
            add(None)
        else:
            spent += cost
        del output
        if spent > limit >= 0 and position + 1 < count:
            break
    return errors


def _run_streaming(
    handler: Callable[..., Any], elements: list[Any], mark: Callable[[int], None],
    writer: OutputWriter,
) -> dict[int, Any]:
    """Run a handler that answers an input with several outputs (``handler.streams``:
    a process interleave's chunk of a slot's elements).

    It is called as ``handler(element, emit)`` and passes each output to ``emit`` as
    it makes it, which packs it at once: so the worker holds one output at a time,
    never a chunk's list of them beside the segment they are copied into. Its return
    value is packed after them. It reports its own errors in that value; one it
    raises fails the call (the consumer gets it at the position of that value).
    """
    errors: dict[int, Any] = {}
    for position in range(len(elements)):
        mark(position)
        element = elements[position]
        elements[position] = None
        try:
            answer = handler(element, writer.add)
        except Exception as error:
            del element
            raised, text = _failure(error)
            del error
            errors[writer.count] = _pack_failure(writer, raised, text, 1)
            del raised
            continue
        del element
        try:
            writer.add(answer)
        except Exception as refused:
            errors[writer.count] = unsendable(refused)
            writer.add(None)
        del answer
    return errors


#: Deaths by a signal while starting, in a row, after which a pool whose function
#: loaded before gives up (each costs a start: a machine killing every new worker).
_START_DEATHS = 3

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


#: Blocks up to this size come from a map worker's heap (see :func:`_scratch_on_heap`).
SCRATCH_BYTES = 4 << 20


def _scratch_on_heap() -> None:
    """Serve a map function's large temporaries from the worker's heap (glibc).

    Setting the heap's top pad (:func:`_keep_heap_top`) also turns off glibc's
    dynamic mmap threshold, which would otherwise rise to the size of the blocks
    the process frees: every block over 128 KiB was then mapped afresh and
    unmapped when freed. An image map's 600 KB arrays cost some 250 page faults
    per element that way, more CPU than the copy of its output. Blocks up to
    :data:`SCRATCH_BYTES` come from the heap again, as in a process whose
    threshold adjusts itself. Not for a process interleave's workers: they copy
    records straight into segments, and a heap holding its records' blocks kept
    ~5 MiB more per worker (tests/workers/test_process_held_bytes.py).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    mallopt(m_mmap_threshold, SCRATCH_BYTES)


def _worker_main(  # noqa: C901
    tasks: Connection,
    results: Connection,
    handler_bytes: bytes,
    owner: int,
    index: int,
    progress_name: str,
    stage: str = "",
) -> None:
    """Run in each worker: unpickle the handler once, then serve chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    _keep_heap_top()
    # where this worker is: which call, which element (see ProcessPool._replace)
    progress = open_segment(progress_name, _PROGRESS.size)
    try:
        handler = pickle.loads(handler_bytes)
    except BaseException:
        results.send(("init_error", traceback.format_exc()))
        return
    if not getattr(handler, "streams", False):  # a map's function (see _run_chunk)
        _scratch_on_heap()
    # What exists now (the modules imported, the handler and what it holds) lives as long
    # as the worker: out of the collector's reach. A full collection writes to every
    # object it visits, and the pages the worker shares with the forkserver it was
    # forked from become its own copies: +5.8 MiB of unique memory per worker, at once,
    # mid-stream, when a full collection first ran.
    gc.freeze()
    # From here on a death is blamed on the calls it ran, not on starting (see _replace).
    results.send(("ready",))
    pool = SegmentPool(owner, tag=f"w{index}-")
    evicted: list[int] = []  # idle segments dropped since the last result (see allocate)

    def allocate(nbytes: int, capacity: int) -> tuple[int, str, int, Segment]:
        if pool.has_idle(capacity):  # one idle segment for the chunk's rest
            return pool.allocate(capacity)
        if pool.has_idle(nbytes):
            # A smaller idle segment still holds this output: reused, since a fresh one
            # costs a page fault per page on both sides, more than the copy itself.
            return pool.allocate(nbytes)
        # None holds even this output: outputs grew past them, dropped for good
        evicted.extend(pool.evict_smaller(nbytes))
        return pool.allocate(nbytes, capacity)

    expect = 0  # segment bytes the previous chunk took: a chunk's first segment's size

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
                    if message[0] == "free":  # segments released while calls ran
                        for key in message[1]:
                            pool.free(key)
                        for key in message[2]:
                            pool.drop(key)
                        continue
                    _, _, _, freed, dropped, dropped_inputs, _, _ = message
                    for key in freed:
                        pool.free(key)
                    for key in dropped:
                        pool.drop(key)
                    for key in dropped_inputs:
                        inputs.forget(key)
                    queued.append(message)
            except (EOFError, OSError):  # the consumer is gone
                return
            _, call_id, packet, _, _, _, allowance, ceiling = queued.popleft()
            started = time.perf_counter()
            elements = _receive_inputs(packet, inputs)
            computing = time.perf_counter()
            mark = functools.partial(_PROGRESS.pack_into, progress, 0, call_id)
            # a segment is at most a 16th of the budget: what one half handed out may
            # hold past its outputs' bookings
            most = SEGMENT_BYTES if ceiling is None else min(SEGMENT_BYTES, ceiling // 16)
            writer = OutputWriter(allocate, expect, allowance, max(most, 1))
            errors = _run_chunk(handler, elements, mark, writer, allowance, ceiling, stage)
            mark(len(elements))  # sending: no element's fault
            compute = time.perf_counter() - computing - writer.seconds
            del elements
            result = writer.finish()
            expect = writer.shared
            del writer
            seconds = time.perf_counter() - started
            # input segments whose every view is gone (the outputs are copied out by now)
            free_inputs = inputs.released()
            results.send(
                ("done", call_id, result, errors or None, seconds, compute, free_inputs, evicted[:])
            )
            del result
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
    """A new input segment's size: the chunk's bytes and a quarter more, in whole pages.

    Chunks vary in length, so a segment that fits only this one would be replaced at
    the next larger chunk; the quarter lets the next few reuse it. The next power of
    two (as before) booked up to twice what the chunks carried, for as long as the
    segment was pooled: an image map's two workers held 4.5-7 MB of input segments
    on a 33 MB share, for chunks of about 0.5 MB.
    """
    nbytes = max(nbytes, 1)
    return SegmentPool.capacity_for(nbytes + nbytes // 4)


#: An idle input segment more than this many times a new one's size (:func:`_input_capacity`
#: of the largest of a worker's last :data:`_INPUT_HISTORY` chunks) is replaced by one that
#: size: chunks that shrank (the room for calls did) no longer keep the booking of the
#: largest chunk ever sent. Sized by the last few chunks, not the one at hand, because
#: a map's chunks vary 2-4x from call to call with the room left: sized by each one,
#: half the calls made a fresh segment.
_INPUT_SHRINK = 2
_INPUT_HISTORY = 8


class _Rejoin:
    """The parts a chunk was split into, after a worker died running it, joined back
    into the chunk's own future (in the chunk's order).

    A part that stopped at its allowance ends the chunk there: the outputs of the
    parts after it are dropped, and the caller runs those elements again."""

    __slots__ = ("end", "errors", "left", "lock", "outputs", "owner", "seconds", "slack")

    def __init__(self, owner: _Task, parts: int) -> None:
        self.owner, self.left = owner, parts
        self.outputs: list[Any] = [None] * len(owner.elements)
        self.end = len(owner.elements)  # where the first part that stopped short stopped
        self.errors: dict[int, BaseException] = {}
        self.seconds, self.slack = 0.0, 0
        self.lock = threading.Lock()

    def part(self, start: int, stop: int, done: Future[ChunkResult]) -> None:
        """The part of positions ``start:stop`` is done (a callback, on the collector
        thread)."""
        if done.cancelled():
            return
        future = self.owner.future
        error = done.exception()
        if error is not None:
            with contextlib.suppress(Exception):  # (done already)
                future.set_exception(error)
            return
        outputs, failed, seconds, slack = done.result()
        with self.lock:
            self.outputs[start : start + len(outputs)] = outputs
            if start + len(outputs) < stop:
                self.end = min(self.end, start + len(outputs))
            for position, raised in (failed or {}).items():
                self.errors[start + position] = raised
            self.seconds += seconds
            self.slack += slack
            self.left -= 1
            finished = self.left == 0
        if finished:
            end = self.end
            errors = {p: e for p, e in self.errors.items() if p < end}
            outputs, self.outputs = self.outputs[:end], []
            with contextlib.suppress(Exception):  # cancelled meanwhile
                future.set_result((outputs, errors or None, self.seconds, self.slack))


class _Task:
    """A chunk in a worker's hands, kept with its elements until its result is in: the
    calls of a worker that dies run again on its successor.

    ``blame`` is ``(pid, how)`` of a worker that died running this task's one element
    (the worker says which element it is on: see ``_PROGRESS``); such a task that
    kills a worker again is that element's error. A chunk whose element killed a
    worker runs again in parts (``rejoin`` joins them): the elements before it, it
    alone (blamed), the elements after it. ``tries`` counts deaths while this task
    was sent but no element of it was running (its outputs being sent).
    """

    __slots__ = ("allowance", "blame", "call_id", "ceiling", "elements", "future", "lent",
                 "names", "rejoin", "tries")

    def __init__(
        self,
        future: Future[ChunkResult],
        elements: list[Any],
        blame: tuple[int, str] | None = None,
        rejoin: _Rejoin | None = None,
        *,
        allowance: int | None = None,
        ceiling: int | None = None,
    ) -> None:
        self.future, self.elements, self.blame, self.rejoin = future, elements, blame, rejoin
        #: Bytes of outputs after which the worker stops and hands the rest back, and the
        #: largest output it may send (see ``_run_chunk``).
        self.allowance, self.ceiling = allowance, ceiling
        self.call_id = 0
        self.tries = 0
        self.names: list[str] = []  # segments made for it, unlinked when it ends
        self.lent: list[int] = []  # idle result segments its allowance covers (see _lend)

    def cancelled(self) -> bool:
        """Whether nobody waits for the result any more."""
        return self.future.cancelled() or (
            self.rejoin is not None and self.rejoin.owner.cancelled())

    def cancel(self) -> None:
        self.future.cancel()
        if self.rejoin is not None:
            self.rejoin.owner.cancel()


class _Worker:
    __slots__ = (
        "backlog", "dropped", "dropped_inputs", "freed", "idle", "index", "input_bookings",
        "inputs", "owner", "pending", "process", "progress", "ready", "recent_inputs",
        "results", "send_lock", "spread", "tasks", "watched",
    )

    def __init__(self, index: int, owner: int) -> None:
        self.index, self.owner = index, owner
        self.process: Any = None
        #: A small segment the worker writes (call id, position) into before each element.
        self.progress: Segment | None = None
        self.tasks: Connection | None = None
        self.results: Connection | None = None
        #: The worker loaded the function: a death from now on is blamed on its calls.
        self.ready = False
        #: Its sentinel tells its death (False once the forkserver lost its status).
        self.watched = True
        #: Held while a task is packed, queued and sent (and while the worker is replaced):
        #: tasks reach the worker in the order of ``pending``.
        self.send_lock = threading.RLock()
        self.pending: deque[_Task] = deque()
        #: A dead predecessor's tasks, to be sent before any other (see ProcessPool._send).
        self.backlog: deque[_Task] = deque()
        self.freed: list[int] = []  # segment keys to report free with the next task
        self.dropped: list[int] = []
        #: key -> the reservation booking it while idle, or _LENT (see ProcessPool._lend)
        self.idle: dict[int, Any] = {}
        self.inputs = SegmentPool(owner, tag=f"in{index}-")  # this worker's input segments
        self.input_bookings: dict[int, Any] = {}  # key -> its reservation (while pooled)
        self.dropped_inputs: list[int] = []  # input keys the worker should unmap
        #: Bytes of its last chunks' inputs in segments (see ``_INPUT_HISTORY``).
        self.recent_inputs: deque[int] = deque(maxlen=_INPUT_HISTORY)
        #: Result segments its last call's outputs took (a chunk of large outputs spans
        #: several: see ``IDLE_SEGMENTS``).
        self.spread = 1

    def forget_segments(self) -> list[Any]:
        """Forget every segment shared with this worker (it died); the bookings to release."""
        bookings = [*self.idle.values(), *self.input_bookings.values()]
        bookings = [booking for booking in bookings if booking is not _LENT]
        self.idle.clear()
        self.input_bookings.clear()
        self.freed, self.dropped, self.dropped_inputs = [], [], []
        self.inputs.close()
        self.inputs = SegmentPool(self.owner, tag=f"in{self.index}-")
        return bookings


class Traffic:
    """Where a process pool's time goes: the function's own work in the workers against
    moving elements (pickling, shared-memory copies) both ways, and the bytes moved.

    ``compute_seconds`` is the function in the workers; ``transfer_seconds`` the rest of
    a chunk's time there (unpacking its inputs, copying its outputs' buffers into
    shared memory, sending them) plus what this process spends packing inputs and
    unpacking outputs. Pickling an output as it is made is not timed apart (timing
    each would cost about as much as pickling a small one): it counts as compute.
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

    ``book_slack(nbytes)``, where given, books the bytes of a result segment that
    no output views (alignment, the unused end of a reused segment) for as long as
    its outputs keep it, and returns the reservation; results then report no slack.
    Without it the caller gets the slack with each result and books it on the
    outputs, which makes them look larger than they are: a map learns its
    estimate of the next outputs from them (a segment reused for a chunk of three
    600 KB images booked each at 1.2-1.5 MB, and calls took half the images).

    ``lend_idle`` (with ``book_slack``, for a caller whose ``allowance`` is booked for
    the outputs): a call's allowance covers idle segments of its worker, their own
    bookings released while it runs (see :meth:`_lend`).

    ``files``: the pipeline's cap on descriptors. The workers' pipes hold slots of it
    and of the process-wide cap until :meth:`shutdown`; ``count`` is lowered (with a
    warning) to the workers they have room for (see :meth:`_hold_descriptors`).
    """

    def __init__(
        self,
        handler: Any,
        count: int,
        stage: str,
        *,
        what: str = "the function",
        book_idle: Callable[[int], Any] | None = None,
        book_slack: Callable[[int], Any] | None = None,
        lend_idle: bool = False,
        idle_segments: int = IDLE_SEGMENTS,
        files: FileLimiter | None = None,
    ) -> None:
        self.stage, self.idle_segments = stage, idle_segments
        self.book_slack, self.lend_idle = book_slack, lend_idle
        self.handler_bytes = check_picklable(handler, what, stage)
        #: Slots of the file pool for the workers' pipes (G2), held while the pool lives.
        self.slots: HeldSlots | None = None
        self.count = count = self._hold_descriptors(count, files)
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
        self._context: Any = None
        #: Held while a dead worker is replaced: ``shutdown`` waits for it (and then stops
        #: the new worker too) rather than racing it.
        self._restart_lock = threading.RLock()
        #: Workers that died while serving and were replaced (see :meth:`_replace`).
        self.restarts = 0
        #: A worker of this pool has loaded the function (so a death while starting is
        #: the machine's fault, not the function's), and deaths while starting since.
        self.loaded = False
        self.start_deaths = 0
        #: The receiving side of replaced workers' segments: views of them may live on
        #: (outputs handed out); each is unmapped once its views are gone, never reused.
        self.retired: list[SegmentMaps] = []
        self._progress_names: list[str] = []  # unlinked at shutdown, if a worker did not

    # -- starting ---------------------------------------------------------------------------
    def _hold_descriptors(self, count: int, files: FileLimiter | None) -> int:
        """Hold file-pool slots for ``count`` workers' pipes; how many workers got them.

        Why: each worker keeps :data:`DESCRIPTORS_PER_WORKER` descriptors open in this
        process, and they count against the caps like a reader's file (G2). When the
        caps cannot hold them all, fewer workers start (with a warning): the stage
        runs slower, but it runs. When not even one fits, a :class:`FileLimitError`
        names the stage and the caps to change.
        """
        from headrace.io.filepool import get_default_pool

        pool = get_default_pool()
        cap = pool.max_open_files if files is None else min(
            pool.max_open_files, files.max_open_files)
        fewest = DESCRIPTORS_PER_WORKER + SPAWN_DESCRIPTORS + 1  # (one is the reader's)
        for workers in range(count, 0, -1):
            try:
                self.slots = pool.hold(
                    workers * DESCRIPTORS_PER_WORKER + SPAWN_DESCRIPTORS, limiter=files,
                    stage=self.stage,
                    what=f"the pipes of {workers} worker process(es)",
                )
            except InvalidArgumentError:
                continue  # others (a cache's writer, another pool) hold slots too
            if workers < count:
                warn_user(
                    f"{self.stage}: {workers} worker process(es) instead of {count}: each "
                    f"keeps {DESCRIPTORS_PER_WORKER} descriptors open here ({SPAWN_DESCRIPTORS} "
                    f"more while one starts), and max_open_files={cap}, less the slots "
                    f"others hold and one to read input, has room for {workers}. Lower "
                    f"num_parallel_calls to {workers}, or raise max_open_files "
                    f"(Options(max_open_files=...) or headrace.io.filepool."
                    f"set_max_open_files) to at least "
                    f"{count * DESCRIPTORS_PER_WORKER + SPAWN_DESCRIPTORS + 1}.",
                    HeadraceWarning,
                )
            return workers
        raise FileLimitError(
            errno.EMFILE,
            f"{self.stage}: a worker process keeps {DESCRIPTORS_PER_WORKER} descriptors "
            f"open here (its pipes; {SPAWN_DESCRIPTORS} more while it starts), and "
            f"max_open_files={cap}, less the slots others hold (cache or snapshot "
            f"writers, other worker pools), leaves fewer beside one to read input. Raise max_open_files (Options(max_open_files=...) or "
            f"headrace.io.filepool.set_max_open_files) to at least {fewest}, or use "
            f"workers='threads'.",
        )

    def _start(self) -> None:
        self._started = True
        sweep_stale()
        self._context = multiprocessing.get_context(start_method())
        _preload_forkserver(self._context)
        for index in range(self.count):
            worker = _Worker(index, self.owner)
            self._spawn(worker)
            self.workers.append(worker)
            self.maps[index] = SegmentMaps()
        self._collector = threading.Thread(
            target=_collect, args=(self,), name="headrace-collector", daemon=True
        )
        self._collector.start()

    def _spawn(self, worker: _Worker) -> None:
        """Start ``worker``'s process (again, for one that died) with fresh pipes."""
        context = self._context
        progress_name = segment_name(self.owner, f"p{worker.index}-")
        progress = create_segment(progress_name, _PROGRESS.size)
        _PROGRESS.pack_into(progress, 0, 0, -1)
        task_read, task_write = context.Pipe(duplex=False)
        result_read, result_write = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main,
            args=(task_read, result_write, self.handler_bytes, self.owner, worker.index,
                  progress_name, self.stage),
            name=f"headrace-worker-{worker.index}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            task_write.close()
            result_read.close()
            progress.close()
            raise
        finally:
            task_read.close()
            result_write.close()
            # the worker unlinks it once it mapped it; one that never did leaves it here
            self._progress_names.append(progress_name)
        worker.process, worker.tasks, worker.results = process, task_write, result_read
        worker.progress = progress
        worker.ready, worker.watched = False, True

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

    def submit(
        self,
        elements: list[Any],
        *,
        worker: int | None = None,
        allowance: int | None = None,
        ceiling: int | None = None,
    ) -> Future[ChunkResult]:
        """Run the handler over ``elements`` in a worker (the least busy, or the one
        numbered ``worker``: its calls run in the order submitted); a future of the outputs.

        ``allowance``: the bytes booked for the outputs. The worker stops after the
        output that passes it, if elements remain, and the future has fewer outputs
        than ``elements``: the caller runs the rest again. ``ceiling``: an output that
        costs more (the whole budget) is its element's :class:`MemoryBudgetError`.
        """
        if self.closed:
            raise WorkerPoolError(f"{self.stage}: the worker pool is closed")
        if self.broken is not None:
            raise self.broken
        if not self._started:
            self._start()
        self.recycle()
        with self.lock:
            if worker is None:
                chosen = min(self.workers, key=lambda w: len(w.pending) + len(w.backlog))
            else:
                chosen = self.workers[worker]
        return self._submit_to(chosen, elements, allowance, ceiling)

    def _submit_to(
        self, worker: _Worker, elements: list[Any], allowance: int | None, ceiling: int | None
    ) -> Future[ChunkResult]:
        task = _Task(Future(), elements, allowance=allowance, ceiling=ceiling)
        self._send(worker, task)
        return task.future

    def _send(self, worker: _Worker, task: _Task | None) -> None:
        """Pack ``task``'s elements for ``worker``, queue the task there and send it,
        after the tasks of a dead predecessor still waiting in ``worker.backlog``.

        Its elements stay with the task until its result is in: a worker that dies
        meanwhile has its tasks sent again to its successor (see :meth:`_replace`).
        Never on the collector thread: a send may wait for the worker to read, which
        may wait for the collector to read its results."""
        with worker.send_lock:
            while True:
                with self.lock:
                    queued = worker.backlog.popleft() if worker.backlog else None
                if queued is None:
                    break
                try:
                    self._send_now(worker, queued)
                except Exception as error:  # broken or closed meanwhile
                    with contextlib.suppress(Exception):
                        queued.future.set_exception(error)
            if task is not None:
                self._send_now(worker, task)

    def _send_now(self, worker: _Worker, task: _Task) -> None:
        with worker.send_lock:
            names: list[str] = []
            packing = time.perf_counter()
            packet = pack(task.elements, functools.partial(self._allocate_input, worker, names))
            self.traffic.add_task(len(task.elements), time.perf_counter() - packing,
                                  packet.shared_bytes + len(packet.payload), len(names))
            with self.lock:
                if self.broken is not None or self.closed:
                    for name in names:
                        unlink_segment(name)
                    raise self.broken or WorkerPoolError(f"{self.stage}: the worker pool is closed")
                self._ids += 1
                task.call_id, task.names = self._ids, names
                task.lent = self._lend(worker, task.allowance)
                worker.pending.append(task)
                freed, dropped, dropped_inputs = (
                    worker.freed, worker.dropped, worker.dropped_inputs)
                worker.freed, worker.dropped, worker.dropped_inputs = [], [], []
            assert worker.tasks is not None
            with contextlib.suppress(OSError):  # the worker is gone: the collector replaces it
                worker.tasks.send(("task", task.call_id, packet, freed, dropped, dropped_inputs,
                                   task.allowance, task.ceiling))

    def _lend(self, worker: _Worker, allowance: int | None) -> list[int]:
        """Idle result segments of ``worker`` that a call's ``allowance`` covers: their
        bookings released, marked lent, the smallest first (holding ``self.lock``).

        Why: the stage booked the call's outputs ahead (its allowance), and the worker
        writes them into its idle segments, which were booked too: each byte twice
        while the call ran. A stream of 600 KB images kept its idle segments (a
        few calls' worth) on top of its calls in flight, and a 33 MB share had room
        for calls of 3-4 images only; without idle segments, each output was a fresh
        segment. Lent, an idle segment costs the share nothing more while the call
        runs: whatever the worker writes into it is an output that the allowance
        covers. The worker takes the smallest idle segment that fits, so the smallest
        are lent; a segment it drops as too small has its pages freed at once (see
        :meth:`SegmentPool.evict_smaller`). When the call ends, a lent segment still
        idle is booked again (:meth:`_take_back`).
        """
        if not self.lend_idle or not allowance:
            return []
        sizes = self.maps[worker.index].maps
        idle = sorted((sizes[key][1], key) for key, booking in worker.idle.items()
                      if booking is not _LENT and key in sizes)
        lent: list[int] = []
        for capacity, key in idle:
            if capacity > allowance:
                break
            allowance -= capacity
            worker.idle[key].release()
            worker.idle[key] = _LENT
            lent.append(key)
        return lent

    def _take_back(self, worker: _Worker, maps: SegmentMaps, keys: list[int]) -> None:
        """The segments a finished call was lent that are still idle: booked again (past
        the share, as an overdraft, where it has no room: the worker may be filling
        one for its next call already, so it cannot be freed from here)."""
        with self.lock:
            keys = [key for key in keys if worker.idle.get(key) is _LENT and key in maps.maps]
        for key in keys:
            capacity = maps.maps[key][1]
            booking = self.book_idle(capacity) if self.book_idle is not None else None
            if booking is None and self.book_slack is not None:
                booking = self.book_slack(capacity)
            with self.lock:
                if worker.idle.get(key) is _LENT and booking is not None:
                    worker.idle[key] = booking
                elif booking is not None:  # taken by a call meanwhile: it is that call's
                    booking.release()

    def _allocate_input(
        self, worker: _Worker, names: list[str], nbytes: int
    ) -> tuple[int, str, int, Any]:
        """An input segment for ``worker``: a pooled one (booked while pooled) when one is
        free or may be made, else one-shot (key 0; its name is unlinked with the call)."""
        pooled = worker.inputs
        worker.recent_inputs.append(nbytes)
        wanted = _input_capacity(max(worker.recent_inputs))
        booking = None
        outgrown = None
        with self.lock:
            fitting = pooled.smallest_idle(nbytes)
            if fitting is not None and fitting[0] <= _INPUT_SHRINK * wanted:
                return pooled.allocate(nbytes)
            if fitting is not None:  # far larger than the chunks now: one their size,
                # booked by part of its booking (booked anew, the room it freed was
                # often taken by a call first, and the chunk went into a one-shot segment)
                booking = self._drop_input(worker, fitting[1], keep=wanted)
            elif len(pooled.segments) >= INPUT_SEGMENTS and pooled.idle:
                outgrown = min(pooled.idle, key=lambda k: pooled.segments[k][1])
            room = len(pooled.segments) < INPUT_SEGMENTS
        if outgrown is not None:
            booking = self._grow_input(worker, outgrown, wanted)
        elif booking is None and room and self.book_idle is not None:
            booking = self.book_idle(wanted)
        if booking is None:
            return self._one_shot(names, nbytes)
        with self.lock:
            key, name, capacity, mapping = pooled.allocate(nbytes, wanted)
            if not name:  # one was freed meanwhile and is reused: booked already
                booking.release()
                return key, name, capacity, mapping
            worker.input_bookings[key] = booking
        names.append(name)  # it lives until the worker maps it, or the call ends
        return key, name, capacity, mapping

    def _grow_input(self, worker: _Worker, key: int, wanted: int) -> Reservation | None:
        """The booking for a segment of ``wanted`` bytes that replaces the idle input
        segment ``key``, which the chunks outgrew: its own booking and the difference
        (None, the segment kept, where the share has no room for the difference: the
        chunk goes into a one-shot segment). Booked before the small one is let go,
        so the room it frees cannot go to a call meanwhile."""
        held = worker.input_bookings.get(key)
        if self.book_idle is None or held is None or type(held) is not Reservation:
            with self.lock:
                self._drop_input(worker, key)
            return self.book_idle(wanted) if self.book_idle is not None else None
        extra = self.book_idle(max(wanted - held.nbytes, 0))
        if extra is None:
            return None
        with self.lock:
            booking = self._drop_input(worker, key, keep=held.nbytes)
        if booking is None or type(extra) is not Reservation:  # not to be joined (the
            # worker's segments were forgotten meanwhile, or an overdraft): booked whole
            extra.release()
            if booking is not None:
                booking.release()
            whole: Reservation | None = self.book_idle(wanted)
            return whole
        return booking.absorb(extra)

    def _drop_input(self, worker: _Worker, key: int, keep: int = 0) -> Reservation | None:
        """Unpool an idle input segment here and, with the next task, in the worker: its
        pages are freed now, as its booking is released (the worker's mapping would
        keep them until it hears of it). ``keep``: bytes of its booking to keep, for
        the smaller segment that replaces it (returned; None where it cannot be split)."""
        worker.inputs.discard(key)
        worker.dropped_inputs.append(key)
        booking = worker.input_bookings.pop(key, None)
        if booking is None:
            return None
        if keep and type(booking) is Reservation and booking.nbytes >= keep:
            Reservation(booking.account, booking.nbytes - keep).release()
            booking.nbytes = keep
            return booking
        booking.release()
        return None

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

    def recycle(self) -> None:  # noqa: C901
        """Turn result segments whose views are all gone into idle ones (booked) or drop them.

        Called before each submit, and by a stage for each element it hands out: a
        segment whose outputs are gone holds memory no booking covers until then.
        """
        if not self.retired:  # (per element: most calls find nothing, and return here)
            for maps in self.maps.values():
                if maps.dead:  # (any_released, inlined)
                    break
            else:
                return
        for retired in self.retired:  # a dead worker's: never reused
            for key in retired.released():
                retired.unhold(key)
                retired.forget(key)
        for worker in self.workers:
            maps = self.maps[worker.index]
            for key in maps.released():
                maps.unhold(key)  # its slack: the segment is booked whole below, or freed
                capacity = maps.maps[key][1] if key in maps.maps else 0
                booking = None
                if self.book_idle is not None and len(worker.idle) < max(
                        self.idle_segments, IDLE_CALLS * worker.spread):
                    booking = self.book_idle(capacity)
                with self.lock:
                    if self.maps[worker.index] is not maps:
                        # its worker died meanwhile: the key means nothing to the successor
                        # (whose own segment of that key may be busy), so nothing is told
                        maps.forget(key)
                        if booking is not None:
                            booking.release()
                    elif booking is not None:
                        worker.idle[key] = booking
                        worker.freed.append(key)
                    else:
                        maps.discard(key)
                        worker.dropped.append(key)
            if worker.pending and (worker.freed or worker.dropped):
                self._tell(worker)

    def _tell(self, worker: _Worker) -> None:
        """Tell a worker with calls in flight which of its segments are free (or dropped)
        now, not with its next task: the calls queued before that task (a map keeps two
        per worker) would make fresh segments meanwhile."""
        with worker.send_lock:
            with self.lock:
                freed, dropped = worker.freed, worker.dropped
                worker.freed, worker.dropped = [], []
            if (freed or dropped) and worker.tasks is not None:
                with contextlib.suppress(OSError):  # gone: the collector replaces it
                    worker.tasks.send(("free", freed, dropped))

    def _finish(self, worker: _Worker, message: tuple[Any, ...]) -> None:  # noqa: C901
        """A ``done`` message: unpack it into its future (collector thread)."""
        _, call_id, result, errors, seconds, compute, free_inputs, evicted = message
        received = time.perf_counter()
        self._inputs_free(worker, free_inputs)
        maps = self.maps[worker.index]
        with self.lock:
            task = worker.pending.popleft()
            assert task.call_id == call_id, "results come back in the order sent"
            # idle segments the worker dropped (too small), and the ones it used
            used = [key for key, _, _ in result.segments]
            worker.spread = max(len(used), 1)
            for key in [*evicted, *used]:
                booking = worker.idle.pop(key, None)
                if booking is not None and booking is not _LENT:
                    booking.release()
        if task.lent:
            self._take_back(worker, maps, task.lent)
            task.lent = []
        for key in evicted:
            maps.forget(key)
        future = task.future
        for name in task.names:
            unlink_segment(name)
        if task.cancelled():
            for key, name, capacity in result.segments:  # never looked at: straight back
                if name:
                    try:
                        maps.maps[key] = (open_segment(name, capacity), capacity)
                    except FileNotFoundError:  # the worker is closing and unlinked it
                        continue  # (its pool drops names not reported mapped): nothing to give
                    maps.opened += 1
                with self.lock:
                    worker.freed.append(key)
            return
        slack = result.slack()
        if self.book_slack is not None:  # booked per segment, released with it (recycle)
            for key, nbytes in result.slack_by_segment():
                maps.hold(key, self.book_slack(nbytes))
            slack = 0
        try:
            outputs, unreadable = maps.unpack_outputs(result)
        except Exception as unpack_error:  # a segment gone: the pool's failure, not an element's
            for key, _, _ in result.segments:
                maps.unhold(key)
            failure = WorkerPoolError(f"the outputs of worker process {worker.process.pid}'s "
                                      f"call could not be read: {unpack_error}")
            failure.__cause__ = unpack_error
            future.set_exception(failure)
            return
        self.traffic.add_result(seconds, compute, time.perf_counter() - received,
                                result.shared_bytes + len(result.payload))
        failed: dict[int, BaseException] | None = dict(unreadable) if unreadable else None
        if errors:
            failed = failed or {}
            for position, (raised, text) in errors.items():
                if raised is _PACKED:  # in its output's place (see _pack_failure)
                    raised, outputs[position] = outputs[position], None
                    if position in failed:  # it could not be rebuilt here: that error
                        raised = failed[position]
                    elif not isinstance(raised, BaseException):
                        raised = WorkerError(f"the error of element {position} of a worker's "
                                             f"call came back as {type(raised).__name__}")
                # the user's chain is kept (as on threads); the worker's traceback is a note
                add_note(raised, f"headrace: raised in worker process {worker.process.pid}; "
                                 f"its traceback there:\n{text}")
                failed[position] = raised
        # the segments' bytes that no output views: alignment, the unused end of a reused
        # segment, and buffers received as copies (large bytes, bytes columns); nothing
        # for a segment no output views (it is free again at once)
        with contextlib.suppress(Exception):  # cancelled meanwhile
            future.set_result((outputs, failed, seconds, slack))

    def _fail(self, error: WorkerError) -> None:
        """Fail every call in flight and stop the workers (collector thread)."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            tasks = [task for worker in self.workers
                     for task in (*worker.pending, *worker.backlog)]
            for worker in self.workers:
                worker.pending.clear()
                worker.backlog.clear()
        for task in tasks:
            for name in task.names:
                unlink_segment(name)
            with contextlib.suppress(Exception):
                task.future.set_exception(error)
        self._stop_workers()

    @staticmethod
    def _how(worker: _Worker) -> str:
        """How a worker's process ended: "killed by SIGKILL", "exited with status 3"."""
        code = worker.process.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        how = f"exited with status {code}"
        if code == _STATUS_LOST:
            how += " (or ended after the forkserver that started it failed)"
        return how

    def _replace(self, worker: _Worker) -> None:  # noqa: C901
        """A worker died (collector thread): start its successor and send it the calls the
        dead one had (in their order: an interleave slot's calls must stay on one worker).

        A death is a fault of the machine (a signal, the OOM killer, a crash in a
        native library), not of the data: the calls run again and nothing is lost. The
        element it was running (told by its progress cell) is blamed: its chunk runs
        again as three calls (the elements before it, it alone, the rest), and a
        one-element call blamed before that kills again becomes its element's
        :class:`WorkerError` — so one poisonous element costs two restarts and its
        own place, never the stream. The calls are sent by a short-lived thread, not
        the collector (see :meth:`_send`). A worker that
        dies before it loaded the function (it cannot start) breaks the pool
        (:class:`WorkerPoolError`), as does failing to start a successor, unless it was
        killed by a signal after another worker of the pool had loaded the function
        (up to :data:`_START_DEATHS` such deaths in a row).
        """
        pid, how = worker.process.pid, self._how(worker)
        if not worker.ready:
            self.start_deaths += 1
        code = worker.process.exitcode
        if not worker.ready and not (
            # killed while starting (the OOM killer, a kill of a fresh pid) after another
            # worker loaded the function: replaced like any other death, a few times
            self.loaded and code is not None and code < 0
            and self.start_deaths <= _START_DEATHS
        ):
            hint = ""
            if worker.process.exitcode == 1:
                hint = (
                    " (workers start by forkserver and import the main module, so a script "
                    "must start its pipeline under `if __name__ == '__main__':`)"
                )
            self._fail(WorkerPoolError(
                f"{self.stage}: worker process {pid} {how} while starting{hint}; the "
                "stage's workers are shut down (create a new iterator, and restore a "
                "checkpoint, to go on)"
            ))
            return
        failure: WorkerPoolError | None = None
        with self._restart_lock, worker.send_lock:
            if self.closed:
                return
            where: tuple[int, int] = (0, -1)
            if worker.progress is not None:
                where = _PROGRESS.unpack_from(worker.progress, 0)
                worker.progress.close()
                worker.progress = None
            with self.lock:
                tasks = list(worker.pending)
                worker.pending.clear()
                for task in tasks:  # (the dead worker's segments: nothing lent is left)
                    task.lent = []
                bookings = worker.forget_segments()
                self.retired.append(self.maps[worker.index])
                self.maps[worker.index] = SegmentMaps()
            for booking in bookings:
                booking.release()
            for task in tasks:
                for name in task.names:
                    unlink_segment(name)
                task.names = []
            for connection in (worker.tasks, worker.results):
                with contextlib.suppress(OSError):
                    assert connection is not None
                    connection.close()
            dead = worker.process
            sweep_process(self.owner, pid)  # a result segment it was filling
            try:
                self._spawn(worker)
                with contextlib.suppress(Exception):
                    dead.close()
            except Exception as error:
                failure = WorkerPoolError(
                    f"{self.stage}: worker process {pid} {how}, and a worker to replace it "
                    f"could not start ({type(error).__name__}: {error})"
                )
            if failure is None:
                self.restarts += 1
                again = self._blame(tasks, pid, how, where)
                warn_user(
                    f"{self.stage}: worker process {pid} {how}; it was replaced by "
                    f"{worker.process.pid}, which runs its {len(again)} calls again",
                    HeadraceWarning,
                )
                with self.lock:  # sent before anything else to this worker (see _send)
                    worker.backlog.extend(again)
                if again:  # (not from here: see _send)
                    threading.Thread(target=self._send, args=(worker, None),
                                     name="headrace-resend", daemon=True).start()
            else:
                with self.lock:
                    worker.pending.extend(tasks)
        if failure is not None:
            self._fail(failure)

    def _blame(
        self, tasks: list[_Task], pid: int, how: str, where: tuple[int, int]
    ) -> list[_Task]:
        """The tasks to send again after worker ``pid`` died; ``where`` is the call and
        position it said it was running (see ``_PROGRESS``)."""
        if not tasks:
            return []
        head, rest = tasks[0], [task for task in tasks[1:] if not task.cancelled()]
        if head.cancelled():
            return rest
        call_id, position = where
        count = len(head.elements)
        if call_id != head.call_id or not 0 <= position < count:
            # between elements (sending the outputs, or the call not begun): no element
            # is to blame, but a chunk that keeps ending workers there fails at last
            head.tries += 1
            if head.tries <= _MAX_TRIES:
                return [head, *rest]
            self._drop_task(head, WorkerError(
                f"{self.stage}: {head.tries} worker processes ended while this element's "
                f"chunk or its outputs were sent (the last, {pid}, {how}); its "
                f"{count} elements are dropped as their errors"))
            return rest
        if head.blame is not None and count == 1:  # it killed a worker before, and now this one
            first_pid, first_how = head.blame
            self._drop_task(head, WorkerError(
                f"{self.stage}: the call on this element ended worker process {first_pid} "
                f"({first_how}) and, run again, worker process {pid} ({how}); the element "
                "is dropped as its own error, and the stage goes on with the next"))
            return rest
        blame = (pid, how)
        if count == 1:
            head.blame = blame
            return [head, *rest]
        spans = [(a, b) for a, b in ((0, position), (position, position + 1),
                                     (position + 1, count)) if a < b]
        rejoin = _Rejoin(head, len(spans))
        parts = []
        for start, stop in spans:
            part = _Task(Future(), head.elements[start:stop],
                         blame if start == position else None, rejoin,
                         allowance=head.allowance, ceiling=head.ceiling)
            part.future.add_done_callback(functools.partial(rejoin.part, start, stop))
            parts.append(part)
        return [*parts, *rest]

    @staticmethod
    def _drop_task(task: _Task, error: WorkerError) -> None:
        """Complete ``task`` with ``error`` in each of its elements' places."""
        count = len(task.elements)
        with contextlib.suppress(Exception):  # cancelled meanwhile
            task.future.set_result(([None] * count, dict.fromkeys(range(count), error), 0.0, 0))

    # -- stopping ---------------------------------------------------------------------------
    def _stop_workers(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(OSError, ValueError):
                if worker.tasks is not None:
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
        with self._restart_lock:  # a worker being replaced is started first, then stopped
            self.closed = True
        try:
            if self._started:
                self._shutdown_started()
        finally:
            if self.slots is not None:  # the workers' pipes are closed (or never opened)
                self.slots.release()

    def _shutdown_started(self) -> None:  # noqa: C901
        self._stop_workers()
        if self._collector is not None and self._collector is not threading.current_thread():
            self._collector.join(_POLL_SECONDS * 4)
        with self.lock:
            tasks = [task for worker in self.workers
                     for task in (*worker.pending, *worker.backlog)]
            for worker in self.workers:
                worker.pending.clear()
                worker.backlog.clear()
                for booking in [*worker.idle.values(), *worker.input_bookings.values()]:
                    if booking is not _LENT:
                        booking.release()
                worker.idle.clear()
                worker.input_bookings.clear()
                worker.inputs.close()
        for task in tasks:
            for name in task.names:
                unlink_segment(name)
            task.cancel()
        for worker in self.workers:
            for connection in (worker.tasks, worker.results):
                with contextlib.suppress(OSError):
                    if connection is not None:
                        connection.close()
            with contextlib.suppress(Exception):
                worker.process.close()
        for maps in [*self.maps.values(), *self.retired]:
            maps.close()
        for worker in self.workers:
            if worker.progress is not None:
                worker.progress.close()
                worker.progress = None
        for name in self._progress_names:  # (a worker that never mapped its cell)
            unlink_segment(name)


#: Times a chunk is sent again after workers died while no element of it was running
#: (killed from outside between calls, or while packing its outputs).
_MAX_TRIES = 3
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
    """The collector thread: results into futures; a dead worker is replaced.

    Any error here fails the pool: every call in flight and every later ``submit``
    raise :class:`WorkerPoolError`. A collector that died quietly would leave the
    consumer waiting for results forever.
    """
    try:
        _collect_results(pool)
    except BaseException as error:  # reported to the consumer, never lost
        text = "".join(traceback.format_exception(error))
        failure = WorkerPoolError(
            f"{pool.stage}: the thread that receives the worker processes' results "
            f"failed ({type(error).__name__}: {_text_of(error)}); the stage's workers are "
            "shut down (create a new iterator, and restore a checkpoint, to go on)"
        )
        add_note(failure, f"headrace: the collector's traceback:\n{text}")
        with contextlib.suppress(BaseException):
            pool._fail(failure)
        if pool.broken is None:  # (_fail itself failed)
            pool.broken = failure


def _collect_results(pool: ProcessPool) -> None:  # noqa: C901
    """The collector's loop (see :func:`_collect`)."""
    while not pool.closed and pool.broken is None:
        workers = list(pool.workers)
        by_results = {id(worker.results): worker for worker in workers}
        by_sentinel = {worker.process.sentinel: worker for worker in workers if worker.watched}
        try:
            ready = wait([w.results for w in workers] + list(by_sentinel), _POLL_SECONDS)
        except OSError:
            return
        dead: dict[_Worker, None] = {}  # (in order, once: its sentinel and its pipe both tell)
        for item in ready:
            if isinstance(item, int):
                worker = by_sentinel[item]
                if _ended(worker.process):
                    dead[worker] = None
                else:  # its status was lost: its results pipe still tells when it ends
                    worker.watched = False
                continue
            assert isinstance(item, Connection)
            worker = by_results[id(item)]
            try:
                message = item.recv()
            except (EOFError, OSError):
                dead[worker] = None
                continue
            proceed = _dispatch(pool, worker, message)
            # Hold no message across the next wait: its errors are the ones the consumer
            # raises, whose tracebacks reach the iterator's frames, so this thread's frame
            # would keep an abandoned iterator (and so this pool and thread) alive for good.
            del message
            if not proceed:
                return
        for worker in dead:
            if pool.closed:
                return
            # Results it sent before dying are still in the pipe: deliver them first.
            assert worker.results is not None
            with contextlib.suppress(EOFError, OSError):
                while worker.results.poll():
                    if not _dispatch(pool, worker, worker.results.recv()):
                        return
            worker.process.join(1.0)
            # A worker leaves only when told to (close): any other exit is replaced.
            pool._replace(worker)
            if pool.broken is not None:
                return


def _dispatch(pool: ProcessPool, worker: _Worker, message: tuple[Any, ...]) -> bool:
    """Act on a worker's message; False when the pool cannot go on."""
    if message[0] == "done":
        pool._finish(worker, message)
    elif message[0] == "ready":
        worker.ready = True
        pool.loaded, pool.start_deaths = True, 0
    elif message[0] == "init_error":
        pool._fail(
            WorkerPoolError(
                f"{pool.stage}: a worker process could not load the function it was "
                f"sent:\n{message[1]}"
            )
        )
        return False
    return True
