"""Shared-memory segments that carry NumPy payloads between processes, and their sweep.

Why not pickled bytes: pickling a 1 GB array copies it four times (pickle,
pipe write, pipe read, unpickle) and ``multiprocessing`` connections refuse
messages over 2 GiB. Here a message is pickled with protocol 5: every large
buffer (a NumPy array's data) goes *out of band* into a shared-memory segment,
only the small pickle travels through the pipe, and the receiver's arrays are
views of the segment — one copy in all, any size.

Segments. A segment is a file in ``/dev/shm`` created with owner-only
permissions (0600) under a recognizable name,
``headrace-<owner pid>-<creator pid>-<n>``, where the owner is the process
that runs the pipeline. The receiver unlinks the name as soon as it has mapped
the segment, so the kernel frees the memory with the last mapping and a name
exists only between creation and the receiver's first look. If the owner is
SIGKILLed in that window the name is left behind: :func:`sweep_stale` (run by
every pool that starts) removes segments whose owner process is dead.

Pooling. Result segments are reused: a worker writes a chunk of outputs into
one of its idle segments (each output as it is made: :class:`OutputWriter`),
the consumer maps it once (:class:`SegmentMaps`) and reports it idle again
when the last array viewing it is gone (a finalizer on the views), so a steady
stream maps no new memory. A segment not kept idle has its pages freed at once
(:meth:`SegmentMaps.discard`), before its worker hears that it may unmap it. Input segments (large
inputs sent to a worker) are pooled the same way, the other way round (see
:mod:`headrace._workers.processes`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import gc
import io
import itertools
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import add_note
from headrace.io.columns import join_bytes, split_bytes

__all__ = [
    "COLUMN_SEGMENT_BYTES",
    "OUT_OF_BAND_BYTES",
    "OWN_SEGMENT_BYTES",
    "RUN_BYTES",
    "RUN_OUTPUTS",
    "SEGMENT_BYTES",
    "SHM_DIR",
    "OutputWriter",
    "Outputs",
    "Packet",
    "Segment",
    "SegmentMaps",
    "SegmentPool",
    "create_segment",
    "loads",
    "open_segment",
    "pack",
    "pack_error",
    "segment_name",
    "sweep_process",
    "sweep_stale",
    "unpack",
]

#: Where POSIX shared memory lives on Linux (``shm_open`` creates its files here).
SHM_DIR = "/dev/shm"
#: Buffers at least this large travel through shared memory; smaller ones in the pickle
#: (a segment costs a page at least, and a system call or two).
OUT_OF_BAND_BYTES = 32 << 10

#: Consecutive small outputs share one pickle memo (see :class:`OutputWriter`) for at
#: most this many outputs, or pickle bytes: the memo keeps the run's objects alive.
RUN_OUTPUTS = 128
RUN_BYTES = 64 << 10
_PREFIX = "headrace-"
#: Frees a shared mapping's pages (Linux); None where the platform has no such advice.
_MADV_REMOVE: int | None = getattr(mmap, "MADV_REMOVE", None)
_ALIGN = 64  # each buffer starts on a cache line: NumPy's SIMD loops prefer it
_counter = itertools.count()


def segment_name(owner: int, tag: str = "") -> str:
    """A fresh name for a segment of ``owner``'s pipeline, made by this process."""
    return f"{_PREFIX}{owner}-{os.getpid()}-{tag}{next(_counter)}"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapped:
    """The owner of one shared mapping: unmapped when the last array over it goes."""

    __slots__ = ("__array_interface__", "address", "size")

    def __init__(self, fd: int, size: int) -> None:
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            number = ctypes.get_errno()
            raise OSError(number, f"mmap of a shared-memory segment: {os.strerror(number)}")
        self.address, self.size = address, size
        self.__array_interface__ = {
            "data": (address, False), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self, munmap: Any = _libc.munmap) -> None:  # (bound now: usable at exit)
        munmap(self.address, self.size)


class Segment(np.ndarray):  # type: ignore[type-arg]
    """A shared-memory segment's bytes, mapped without a descriptor left open.

    :class:`Segment` keeps a duplicate of the file's descriptor for as long as
    the mapping lives (until Python 3.13's ``trackfd``). A pool keeps dozens of
    segments mapped: that many descriptors, uncounted by ``max_open_files``, and
    ``EMFILE`` under a low ``ulimit -n``. This array maps the file itself and
    closes its descriptor at once. The mapping goes when the last view of it
    goes (every view keeps it alive), so a view never outlives its memory.
    """

    if TYPE_CHECKING:  # (NumPy declares the buffer protocol to typing from Python 3.12)

        def __buffer__(self, flags: int) -> memoryview: ...

    def close(self) -> None:
        """Nothing to do: the mapping is unmapped when its last view goes."""

    def madvise(self, advice: int) -> None:
        """Advise the kernel on the whole mapping (``MADV_REMOVE`` frees its pages)."""
        owner: Any = self.base
        while not isinstance(owner, _Mapped):
            owner = owner.base
        if _libc.madvise(owner.address, owner.size, advice) != 0:
            number = ctypes.get_errno()
            raise OSError(number, os.strerror(number))


def _map(fd: int, size: int) -> Segment:
    """``size`` bytes of the file ``fd`` mapped shared, read-write."""
    return np.asarray(_Mapped(fd, size)).view(Segment)


def create_segment(name: str, size: int) -> Segment:
    """A new owner-only segment of ``size`` bytes, mapped read-write."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return _map(fd, size)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_segment(name: str, size: int) -> Segment:
    """Map the segment ``name`` made by another process, and unlink its name.

    From here on the memory lives exactly as long as some process maps it.
    """
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        return _map(fd, size)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def unlink_segment(name: str) -> None:
    """Remove a segment's name if it is still there (its receiver never mapped it)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove headrace segments whose owner process is dead; returns their names.

    Only this user's segments are touched (the files are 0600 anyway), and only
    when the owner PID named in the file name no longer exists.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        owner = name[len(_PREFIX) :].split("-", 1)[0]
        if not owner.isdigit() or _alive(int(owner)):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


# -- messages -------------------------------------------------------------------------------


@dataclass
class Packet:
    """An object on its way to another process: a small pickle plus where its buffers lie.

    ``segment`` is ``(key, name, capacity)`` of the segment holding the large
    buffers (``name`` is empty when the receiver has it mapped already), and
    ``spans`` the ``(offset, length)`` of each buffer in it, in pickle order.
    """

    payload: bytes
    segment: tuple[int, str, int] | None = None
    spans: tuple[tuple[int, int], ...] = ()
    copied: tuple[int, ...] = ()  # positions in ``spans`` of bytes received as copies

    @property
    def viewed_bytes(self) -> int:
        """Bytes of the segment that the receiver's objects keep viewing."""
        copied = set(self.copied)
        return sum(length for i, (_, length) in enumerate(self.spans) if i not in copied)

    @property
    def shared_bytes(self) -> int:
        """Bytes of the segment this packet occupies (its capacity)."""
        return 0 if self.segment is None else self.segment[2]


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


Allocate = Callable[[int], tuple[int, str, int, Segment]]


#: A column of bytes (see :func:`_column_id`) whose values and offsets take at least
#: this many bytes goes into the segment; a smaller one travels in the pickle.
COLUMN_SEGMENT_BYTES = 4 << 10


class _Pickler(pickle.Pickler):
    """Pickle, plus memoryviews (which pickle refuses), large ``bytes`` out of band and
    object arrays of ``bytes`` as columns.

    A memoryview is sent as a buffer and received as a memoryview of the segment
    (or of bytes, when small). Large ``bytes`` go into the segment too and are
    received as a copy out of it: in band, a chunk of records would cost a pickle
    of its size on each side (and one more inside the pipe's message) besides the
    records themselves — copies that no booking covers. They are diverted by
    ``persistent_id``, the only hook the C pickler consults before its fast path
    for ``bytes`` (``reducer_override`` never sees them).

    An object array whose items are all exactly ``bytes`` (a batch of records or
    ids) travels as one column, values end to end plus int64 offsets
    (:mod:`headrace.io.columns`), rebuilt by the receiver at C speed: pickling
    it item by item cost more than parsing the records (each item passes this
    class's ``persistent_id``, then the unpickler makes it again).
    """

    def __init__(
        self,
        stream: io.BytesIO,
        out_of_band: Callable[[pickle.PickleBuffer], bool],
        divert: Callable[[bytes], int],
    ) -> None:
        super().__init__(stream, protocol=5, buffer_callback=out_of_band)
        self._divert = divert
        # id -> (the array, its column number): an array met again is sent as its number
        # (``persistent_id`` comes before pickle's memo), so it arrives as one object
        self._columns: dict[int, tuple[Any, int]] = {}

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is bytes:
            return self._divert(obj) if len(obj) >= OUT_OF_BAND_BYTES else None
        if cls is np.ndarray and obj.dtype.kind == "O":
            seen = self._columns.get(id(obj))
            if seen is not None:
                return (seen[1],)
            pid = _column_id(obj, len(self._columns), self._divert)
            if pid is not None:
                self._columns[id(obj)] = (obj, pid[0])
            return pid
        return None

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is np.ndarray:
            # A plain array as its buffer, dtype string and shape: NumPy's own reduce also
            # pickles its dtype object field by field, ~25 objects that each pass
            # persistent_id (half the cost of packing a parsed batch).
            dtype = obj.dtype
            if dtype.kind in _PLAIN_KINDS and dtype.fields is None and dtype.metadata is None \
                    and obj.flags.c_contiguous:
                return _array, (pickle.PickleBuffer(obj), dtype.str, obj.shape)
            return NotImplemented
        if cls is memoryview:
            if obj.contiguous:
                return memoryview, (pickle.PickleBuffer(obj),)
            return memoryview, (obj.tobytes(),)
        return NotImplemented


#: Kinds of the dtypes :class:`_Pickler` sends as a string: booleans and numbers (times
#: export no buffer).
_PLAIN_KINDS = frozenset("biufc")


def _array(buffer: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """An array :class:`_Pickler` sent: over its buffer, as NumPy's own reduce makes it
    (writable when the buffer is: a segment's view, or a bytearray sent in band)."""
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def pack(obj: Any, allocate: Allocate) -> Packet:
    """Pickle ``obj`` with its large buffers written into a segment from ``allocate``.

    ``allocate(nbytes)`` returns ``(key, name, capacity, mapping)`` of a segment of
    at least ``nbytes`` (``name`` empty if the receiver knows it already).
    """
    buffers: list[memoryview] = []
    copied: list[int] = []  # positions in ``buffers`` of diverted bytes

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True  # in band
        buffers.append(raw)
        return False

    def divert(data: bytes) -> int:
        copied.append(len(buffers))
        buffers.append(memoryview(data))
        return len(buffers) - 1

    stream = io.BytesIO()
    _Pickler(stream, out_of_band, divert).dump(obj)
    payload = stream.getvalue()
    if not buffers:
        return Packet(payload)
    total = sum(_aligned(raw.nbytes) for raw in buffers)
    key, name, capacity, mapping = allocate(total)
    spans: list[tuple[int, int]] = []
    offset = 0
    with memoryview(mapping) as target:
        for raw in buffers:
            length = raw.nbytes
            target[offset : offset + length] = raw
            spans.append((offset, length))
            offset += _aligned(length)
            raw.release()
    return Packet(payload, (key, name, capacity), tuple(spans), tuple(copied))


def pack_error(obj: Any) -> Exception | None:
    """Why ``obj`` cannot be packed (a part of it that pickle refuses), or None.

    Large buffers are not copied (they would go out of band): a worker asks this of
    each output of a chunk that failed to pack, to fail only the outputs at fault.
    """
    try:
        _Pickler(io.BytesIO(), lambda buffer: False, lambda data: 0).dump(obj)
    except Exception as error:
        return error
    return None


@dataclass
class Outputs:
    """A chunk's outputs on their way back: ``count`` pickles end to end in ``payload``,
    and where their large buffers lie.

    ``segments`` are ``(key, name, capacity)`` (``name`` empty when the receiver has
    it mapped already); ``spans`` are ``(segment, offset, length)`` of each buffer,
    ``segment`` an index into ``segments``, in pickle order. A chunk's outputs
    usually share one segment; one whose buffers do not fit in what is left of it
    starts the next.
    """

    payload: bytes
    count: int
    segments: tuple[tuple[int, str, int], ...] = ()
    spans: tuple[tuple[int, int, int], ...] = ()
    copied: tuple[int, ...] = ()  # positions in ``spans`` of bytes received as copies
    #: Per output: where it ends in ``payload`` and in ``spans``, and whether it starts
    #: a run (outputs pickled with one memo: see :class:`OutputWriter`).
    ends: tuple[tuple[int, int, bool], ...] = ()

    @property
    def shared_bytes(self) -> int:
        """Bytes of the segments these outputs occupy (their capacities)."""
        return sum(capacity for _, _, capacity in self.segments)

    def slack(self) -> int:
        """Bytes of the segments that no received view covers (alignment, the unused end
        of a reused segment, buffers received as copies). A segment that no view covers
        is free again at once: it counts nothing."""
        return sum(nbytes for _, nbytes in self.slack_by_segment())

    def slack_by_segment(self) -> list[tuple[int, int]]:
        """:meth:`slack` per segment that some view covers: ``(key, bytes)``."""
        viewed = [0] * len(self.segments)
        copied = set(self.copied)
        for position, (segment, _, length) in enumerate(self.spans):
            if position not in copied:
                viewed[segment] += length
        return [(key, capacity - seen)
                for (key, _, capacity), seen in zip(self.segments, viewed, strict=True) if seen]


#: The most bytes of outputs a result segment holds together (see :class:`OutputWriter`).
SEGMENT_BYTES = 4 << 20
#: An output whose buffers take at least this many bytes gets a segment of its own (see
#: :class:`OutputWriter`); smaller ones share their chunk's segments.
OWN_SEGMENT_BYTES = 256 << 10

#: ``allocate(nbytes, capacity)``: a segment for at least ``nbytes``, of ``capacity``
#: bytes if it is made new (see :meth:`SegmentPool.allocate`).
AllocateAtLeast = Callable[[int, int], tuple[int, str, int, Segment]]


class OutputWriter:
    """Packs a chunk's outputs one at a time, as the worker makes them.

    Each output is pickled at once and its large buffers are copied into a
    segment; the caller then drops the object. So a worker never holds a chunk
    of outputs as objects: the segment is their only copy, and the object and
    its copy coexist for one output's pack only. Small outputs are pickled end
    to end into one payload (no segment at all).

    Consecutive small outputs share the pickler's memo (a *run*): what they have
    in common (a class, a dtype, a string) is written once, as a reference, the
    way a whole chunk pickled as one list would be. An output with large buffers,
    one that fails, or a run past :data:`RUN_BYTES` or :data:`RUN_OUTPUTS` ends
    the run and clears the memo (which holds the run's objects alive). The
    receiver reads each run with its own unpickler (an unpickler's memo must
    match the pickler's: see :meth:`SegmentMaps.unpack_outputs`).

    ``expect``: the segment bytes the worker's previous chunk took, the size a
    chunk's first segment is made with (so one segment, reused from the pool,
    usually takes a whole chunk). ``allowance``: no segment is made larger than
    what is left of the chunk's allowance, unless one output needs more.

    ``most``: nor larger than this. A segment's memory lives until its last
    output is gone, while each output's booking goes with the output: a large
    segment half handed out would hold more than its outputs' bookings say. An
    output larger than ``most`` gets a segment of its own, freed with it.

    So does an output of :data:`OWN_SEGMENT_BYTES` or more. A segment several
    outputs share is reused only for a chunk whose outputs fit it, and chunks vary
    in length (sized by time and by the room left): a stream of 600 KB images made
    a fresh segment for every other call (each page faulted in by the worker,
    zeroed, and read in anew by the consumer), and a reused one's unused end was
    booked on top. A large output alone in its segment fits any idle segment made
    for an output its size, and its memory goes with it. Smaller outputs still
    share segments: one each would be a mapping (and a file) per output.
    """

    def __init__(self, allocate: AllocateAtLeast, expect: int = 0,
                 allowance: int | None = None, most: int = SEGMENT_BYTES) -> None:
        self._allocate = allocate
        self.expect, self.allowance, self.most = expect, allowance, most
        self._stream = io.BytesIO()
        self._pending: list[memoryview] = []  # buffers of the output being packed
        self._diverted: list[int] = []  # their positions that are diverted bytes
        self._pickler = _Pickler(self._stream, self._out_of_band, self._divert)
        self.segments: list[tuple[int, str, int]] = []
        self.spans: list[tuple[int, int, int]] = []
        self.copied: list[int] = []
        self._mapping: Segment | None = None
        self._offset = self._capacity = 0
        self._largest = 0  # segment bytes of the largest output so far
        self.count = 0
        self._ends: list[tuple[int, int, bool]] = []
        self._run = 0  # outputs in the current run (0: the next output starts one)
        self._run_start = 0  # where the current run began in the stream
        self._end = 0  # where the stream ends (where the next output begins)
        #: Segment bytes the outputs so far took (aligned).
        self.shared = 0
        #: Time spent copying buffers into segments (the worker tells it apart from the
        #: function's). Pickling a small output is not timed: timing it would cost
        #: about as much as the pickle, so it counts as the function's time.
        self.seconds = 0.0

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True  # in band
        self._pending.append(raw)
        return False

    def _divert(self, data: bytes) -> int:
        self._diverted.append(len(self._pending))
        self._pending.append(memoryview(data))
        return len(self.spans) + len(self._pending) - 1

    def add(self, obj: Any, left: int = 1) -> int:
        """Pack ``obj`` after the outputs so far; the bytes it took (pickle and segment).

        ``left``: outputs still to come, this one included (a new segment is made
        for at most that many outputs like the largest so far). An object that
        cannot be packed raises, and leaves nothing behind: the caller puts its
        error in the output's place and goes on.
        """
        # Per output: a small one (the common case) is one dump and a few checks.
        start, run = self._end, self._run
        if not run:
            self._run_start = start
        try:
            self._pickler.dump(obj)
            if self._pending:
                return self._add_buffers(start, left, not run)
        except BaseException:
            self._stream.seek(start)
            self._stream.truncate()
            self._end_run()
            raise
        self._end = end = self._stream.tell()
        if run + 1 >= RUN_OUTPUTS or end - self._run_start >= RUN_BYTES:
            self._end_run()
        else:
            self._run = run + 1
        self.count += 1
        self._ends.append((end, len(self.spans), not run))
        return end - start

    def _add_buffers(self, start: int, left: int, fresh: bool) -> int:
        """The rest of :meth:`add` for an output with large buffers: they are copied into
        a segment (timed: :attr:`seconds`), and the run ends."""
        began = perf_counter()
        need = sum(_aligned(raw.nbytes) for raw in self._pending)
        if need > self._largest:
            self._largest = need
        self._copy(need, left)
        self._end = end = self._stream.tell()
        self._end_run()  # the memos hold the run's objects (and arrays): gone with it
        self.seconds += perf_counter() - began
        self.count += 1
        self.shared += need
        self._ends.append((end, len(self.spans), fresh))
        return end - start + need

    def _end_run(self) -> None:
        """Close the current run: clear the memos (they hold its objects) and drop the
        views of the buffers just packed."""
        self._pickler.clear_memo()
        self._pickler._columns.clear()
        self._run = 0
        for raw in self._pending:
            raw.release()
        self._pending.clear()
        self._diverted.clear()

    def _copy(self, need: int, left: int) -> None:
        """The pending buffers into the segment (a new one when they do not fit)."""
        alone = need >= OWN_SEGMENT_BYTES
        if alone or self._mapping is None or self._capacity - self._offset < need:
            used = self.shared
            # What the chunk's rest may take: what the previous chunk took, or (outputs
            # outgrew it) as much again as this one so far; never more than its outputs
            # at the largest so far, nor (the allowance) what is left of its booking.
            wanted = min(max(self.expect - used, used), left * self._largest, self.most)
            if self.allowance is not None:
                wanted = min(wanted, self.allowance - used)
            if alone:
                wanted = need
            key, name, capacity, mapping = self._allocate(need, max(need, wanted))
            self.segments.append((key, name, capacity))
            self._mapping, self._offset, self._capacity = mapping, 0, capacity
        segment, offset = len(self.segments) - 1, self._offset
        diverted = set(self._diverted)
        with memoryview(self._mapping) as target:
            for position, raw in enumerate(self._pending):
                length = raw.nbytes
                target[offset : offset + length] = raw
                if position in diverted:
                    self.copied.append(len(self.spans))
                self.spans.append((segment, offset, length))
                offset += _aligned(length)
        self._offset = offset

    def end_run(self) -> None:
        """End the current run after the output just packed: the memo lets go of it.
        For an output whose pickle is small while the object holds much more (an
        error: its ``__cause__``, its traceback, attributes its ``__reduce__``
        leaves out), which the memo would keep alive in the worker until the run
        ends."""
        self._end_run()

    def finish(self) -> Outputs:
        """The outputs packed, as the message that carries them. The writer is done:
        its memo is cleared and its pickler dropped (the pickler holds the writer's
        methods: a cycle, which kept the last run's objects alive in the worker until
        the cycle collector ran; each failed call's error and all it held, seen:
        +300 MiB over 45 errors of 8 MiB)."""
        self._end_run()
        self._pickler = None  # type: ignore[assignment]
        return Outputs(self._stream.getvalue(), self.count, tuple(self.segments),
                       tuple(self.spans), tuple(self.copied), tuple(self._ends))


def sweep_process(owner: int, pid: int) -> list[str]:
    """Remove the segments that process ``pid`` made for ``owner``'s pipeline and that
    nobody mapped yet (``pid`` died: a killed worker's result segment in the making)."""
    prefix = f"{_PREFIX}{owner}-{pid}-"
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            unlink_segment(name)
            removed.append(name)
    return removed


def _column_id(
    array: np.ndarray[Any, Any], number: int, divert: Callable[[bytes], int]
) -> tuple[Any, ...] | None:
    """The persistent id of an object array of exactly-``bytes`` items: ``(number,
    shape, values, offsets)``, each of the two buffers inline or, when the column is
    large, the index of its diverted copy in the segment; None (pickle it as usual)
    for any other object array."""
    joined = join_bytes(array.ravel().tolist())
    if joined is None:
        return None
    values, offsets = joined
    if len(values) + len(offsets) >= COLUMN_SEGMENT_BYTES:
        return (number, array.shape, divert(values), divert(offsets))
    return (number, array.shape, values, offsets)


def _column(shape: tuple[int, ...], values: Any, offsets: Any) -> np.ndarray[Any, Any]:
    """The object array a column id stands for: its own (not a view: it is costed and
    kept as the owner of its items)."""
    items = split_bytes(values, offsets)
    if len(shape) == 1 and shape[0] == len(items):
        return np.fromiter(items, object, len(items))  # ~1.5x faster than out[:] = items
    out = np.empty(shape, dtype=object)
    if out.size != len(items):
        raise ValueError(f"a bytes column of {len(items)} items cannot fill shape {shape}")
    out.reshape(-1)[:] = items
    return out


class _Missing:
    """Stands in for a class (or function) this process cannot import, so the rest of a
    run of outputs still reads with the memo the writer had (see
    :meth:`_Unpickler.find_class`). Accepts whatever rebuilding an object does; made,
    it marks the output being read as failed with the import error."""

    _error: Exception
    _reader: _Unpickler

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        cls._reader.touched = cls._error
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class _Unpickler(pickle.Unpickler):
    """Reads what :class:`_Pickler` wrote: diverted ``bytes`` come back as copies, bytes
    columns as object arrays."""

    def __init__(self, stream: io.BytesIO, buffers: list[Any], views: list[Any]) -> None:
        super().__init__(stream, buffers=buffers)
        self._views = views
        self._columns: list[np.ndarray[Any, Any]] = []
        #: Stand-ins for what could not be imported, in this run (see find_class).
        self.missing: list[type[_Missing]] = []
        #: The import error of a stand-in used by the output being read.
        self.touched: Exception | None = None

    def find_class(self, module: str, name: str) -> Any:
        """The class or function, or where this process cannot import it, a stand-in:
        the output that needs it fails (with the import error), and the rest of its
        run is read as written (failing there would leave the memo short of the
        entries that output made, and later references would resolve to the wrong
        objects)."""
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as error:
            missing = type(name, (_Missing,), {"_error": error, "_reader": self})
            self.missing.append(missing)
            self.touched = error
            return missing

    def load_output(self) -> tuple[Any, Exception | None]:
        """The next output, or ``None`` and the import error of a class it needs that
        this process cannot import (also one an earlier output of the run met first).
        Any other error is raised: the stream is not where the next output begins."""
        self.touched = None
        obj = self.load()
        error = self.touched
        if error is None and self.missing:
            error = _uses_missing(obj, self.missing)
        return (obj, None) if error is None else (None, error)


    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is int:
            return self._views[pid].tobytes()
        if len(pid) == 1:  # a column met before in this message: the same array
            return self._columns[pid[0]]
        _, shape, values, offsets = pid
        if type(values) is int:
            values, offsets = self._views[values], self._views[offsets]
        column = _column(tuple(shape), values, offsets)
        self._columns.append(column)
        return column


def _uses_missing(obj: Any, missing: list[type[_Missing]]) -> Exception | None:
    """The error of the first stand-in ``obj`` holds (a class object, or an instance made
    while an earlier output was read, reached through the memo), else None."""
    stack, seen = [obj], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _Missing):
            return type(current)._error
        if isinstance(current, type) and issubclass(current, _Missing):
            return current._error
        stack.extend(gc.get_referents(current))
    return None


def loads(payload: bytes) -> Any:
    """The object of a packet without a segment (its small bytes columns inline)."""
    return _Unpickler(io.BytesIO(payload), [], []).load()


def unpack(packet: Packet, mapping: Segment | None, on_view: Callable[[Any], None]) -> Any:
    """The object of ``packet``, its arrays viewing ``mapping`` (no copy).

    ``on_view`` is called with each view handed to the unpickler: a view lives
    exactly as long as the arrays made from it, so a finalizer on it tells
    when the segment is free again. Diverted ``bytes`` are copied out (a
    ``bytes`` owns its memory), so no view of them outlives this call.
    """
    if not packet.spans:
        return loads(packet.payload)
    assert mapping is not None
    # Each view over a memoryview of its own span, not of the whole mapping: an array
    # made from it then pins (and is costed at, see memory/sizeof.py) its own bytes; a
    # view of the mapping made every output of a chunk cost the whole segment.
    with memoryview(mapping) as whole:
        views = [np.frombuffer(whole[offset : offset + length], np.uint8)
                 for offset, length in packet.spans]
    copied = set(packet.copied)
    handed = [view for position, view in enumerate(views) if position not in copied]
    for view in handed:
        on_view(view)
    return _Unpickler(io.BytesIO(packet.payload), handed, views).load()


class SegmentPool:
    """The segments one process writes packets into, reused once the receiver is done.

    ``owner`` is the pipeline's process (named in the segments). A segment
    handed out is busy until :meth:`free` (the receiver dropped every view);
    :meth:`drop` unmaps it for good. Names not yet reported mapped are
    unlinked by :meth:`close`, so nothing is left if the receiver died.
    """

    def __init__(self, owner: int, *, tag: str = "") -> None:
        self.owner, self.tag = owner, tag
        self.segments: dict[int, tuple[Segment, int, str]] = {}  # key -> mapping, size, name
        self.idle: set[int] = set()
        self.announced: set[int] = set()  # keys whose name the receiver has seen
        self._keys = itertools.count(1)

    def has_idle(self, nbytes: int) -> bool:
        """Whether an idle segment of at least ``nbytes`` is there to reuse."""
        return any(self.segments[key][1] >= nbytes for key in self.idle)

    @staticmethod
    def capacity_for(nbytes: int) -> int:
        """The size a new segment for ``nbytes`` gets (whole pages)."""
        return max(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)

    def allocate(self, nbytes: int, capacity: int = 0) -> tuple[int, str, int, Segment]:
        """The smallest idle segment of at least ``nbytes``, or a new one (of ``capacity``
        bytes if that is more)."""
        fitting = [key for key in self.idle if self.segments[key][1] >= nbytes]
        if fitting:
            key = min(fitting, key=lambda k: self.segments[k][1])
            self.idle.discard(key)
            mapping, size, _ = self.segments[key]
            return key, "", size, mapping
        size = self.capacity_for(max(nbytes, capacity))
        key = next(self._keys)
        name = segment_name(self.owner, self.tag)
        mapping = create_segment(name, size)
        self.segments[key] = (mapping, size, name)
        self.announced.add(key)
        return key, name, size, mapping

    def evict_smaller(self, nbytes: int) -> list[int]:
        """Drop the idle segments, when none holds ``nbytes``; their keys.

        Outputs grew past them (a map's chunks lengthen as it tunes them; a slot's
        first chunk is one element). Kept, they would fill the receiver's quota of
        idle segments for good, and every later chunk would go into a fresh segment
        (a process map made one per chunk). The receiver must be told, to unbook them.
        Their pages are freed here and now, not when the receiver hears of it: one
        may be lent to a call (booked only by its allowance), which now makes a new
        segment beside it.
        """
        if any(self.segments[key][1] >= nbytes for key in self.idle):
            return []
        evicted = list(self.idle)
        for key in evicted:
            if _MADV_REMOVE is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.segments[key][0].madvise(_MADV_REMOVE)
            self.drop(key)
        return evicted

    def smallest_idle(self, nbytes: int) -> tuple[int, int] | None:
        """``(capacity, key)`` of the smallest idle segment of at least ``nbytes``, or None."""
        segments = self.segments
        return min(((segments[key][1], key) for key in self.idle
                    if segments[key][1] >= nbytes), default=None)

    def free(self, key: int) -> None:
        if key in self.segments:
            self.idle.add(key)

    def discard(self, key: int) -> None:
        """Drop an idle segment and free its pages now: the receiver keeps its mapping
        until it is told, and a mapping keeps the pages (unbooked once the sender
        has let go of the segment's booking)."""
        entry = self.segments.get(key)
        if entry is not None and _MADV_REMOVE is not None:
            with contextlib.suppress(OSError, ValueError):
                entry[0].madvise(_MADV_REMOVE)
        self.drop(key)

    def drop(self, key: int) -> None:
        entry = self.segments.pop(key, None)
        self.idle.discard(key)
        if entry is not None:
            unlink_segment(entry[2])  # normally gone: the receiver unlinked it
            with contextlib.suppress(BufferError):
                entry[0].close()

    def close(self) -> None:
        for key in list(self.segments):
            self.drop(key)


class SegmentMaps:
    """The receiver's side of a :class:`SegmentPool`: mappings by key, and which are free.

    ``live`` counts the views of each segment still alive; finalizers (which may
    run on any thread) queue a key whenever one dies, and :meth:`released` turns
    the queue into the keys whose last view is gone.
    """

    def __init__(self) -> None:
        self.maps: dict[int, tuple[Segment, int]] = {}
        self.opened = 0  # segments mapped by name: the sender made each one afresh
        self.live: dict[int, int] = {}
        self._dead: collections.deque[int] = collections.deque()
        #: The same deque: keys of segments whose views are gone, not yet :meth:`released`
        #: (read per element by a stage that polls for them: see ``ProcessPool.recycle``).
        self.dead = self._dead
        self._lock = threading.Lock()
        #: Bookings the receiver made for a segment beyond its outputs' own (the bytes no
        #: output views: see :meth:`Outputs.slack_by_segment`), by key: released when the
        #: segment is released (:meth:`unhold`) or these maps close.
        self.held: dict[int, Any] = {}

    def hold(self, key: int, booking: Any) -> None:
        """Keep ``booking`` (anything with ``release()``) until segment ``key`` is released."""
        previous = self.held.pop(key, None)
        if previous is not None:  # (a segment is handed out once between releases)
            previous.release()
        self.held[key] = booking

    def unhold(self, key: int) -> None:
        """Release what was held for segment ``key`` (its last view is gone)."""
        booking = self.held.pop(key, None)
        if booking is not None:
            booking.release()

    def unpack(self, packet: Packet) -> Any:
        return self.decode(packet.segment, lambda mapping, on_view: (
            loads(packet.payload) if mapping is None else unpack(packet, mapping, on_view)))

    def decode(
        self,
        segment: tuple[int, str, int] | None,
        build: Callable[[Segment | None, Callable[[Any], None]], Any],
    ) -> Any:
        """``build(mapping, on_view)``: an object made over ``segment`` (mapped by name
        when new), each view of it passed to ``on_view`` watched, so that the segment is
        reported free when the last is gone (at once when ``build`` made none)."""
        if segment is None:
            return build(None, lambda view: None)
        key, name, capacity = segment
        if name:
            self.maps[key] = (open_segment(name, capacity), capacity)
            self.opened += 1
        mapping = self.maps[key][0]
        dead = self._dead
        viewed = [False]

        def on_view(view: Any) -> None:
            viewed[0] = True
            with self._lock:
                self.live[key] = self.live.get(key, 0) + 1
            weakref.finalize(view, dead.append, key)

        obj = build(mapping, on_view)
        if not viewed[0]:  # only copies came out (bytes): the segment is free at once
            with self._lock:
                self.live[key] = self.live.get(key, 0) + 1
            dead.append(key)
        return obj

    def unpack_outputs(self, outputs: Outputs) -> tuple[list[Any], dict[int, Exception]]:  # noqa: C901
        """The objects of ``outputs`` (see :class:`OutputWriter`), their arrays viewing the
        segments (each mapped by name when new); a segment is reported free when the
        last view of it is gone (at once when none views it).

        Each run of outputs (see :class:`OutputWriter`) is read by its own unpickler:
        the writer clears its memo when a run ends, and an unpickler keeps its memo
        across loads, so one unpickler for all would resolve a run's memo references
        into an earlier run's objects. An output that cannot be rebuilt here is
        ``None`` in the list, its error by position: where its class (or function)
        is not importable in this process, that output alone (the import error; see
        :meth:`_Unpickler.find_class`); where rebuilding it raised, it and the rest
        of its run, whose pickles may refer into it (each error says so).
        """
        mappings = []
        for key, name, capacity in outputs.segments:
            if name:
                self.maps[key] = (open_segment(name, capacity), capacity)
                self.opened += 1
            mappings.append(self.maps[key][0])
        copied = set(outputs.copied)
        views: list[Any] = []
        handed: list[Any] = []  # per span: its view, None where received as a copy
        viewed: set[int] = set()
        dead = self._dead
        for position, (segment, offset, length) in enumerate(outputs.spans):
            with memoryview(mappings[segment]) as whole:
                view = np.frombuffer(whole[offset : offset + length], np.uint8)
            views.append(view)
            if position in copied:
                handed.append(None)
                continue
            key = outputs.segments[segment][0]
            handed.append(view)
            viewed.add(key)
            with self._lock:
                self.live[key] = self.live.get(key, 0) + 1
            weakref.finalize(view, dead.append, key)
        stream = io.BytesIO(outputs.payload)
        objects: list[Any] = []
        failed: dict[int, Exception] = {}
        ends = outputs.ends
        total = len(ends)
        position = spans_from = 0
        while position < total:  # run by run
            last = position  # the run's last output: its buffers are the run's
            while last + 1 < total and not ends[last + 1][2]:
                last += 1
            spans_end = ends[last][1]
            buffers = [view for view in handed[spans_from:spans_end] if view is not None]
            spans_from = spans_end
            begin = stream.tell()
            # Most runs read whole: one load per output, each ending where the next
            # begins. A run that meets a class this process lacks, or that raises, is
            # read again output by output, to fail only the outputs at fault.
            unpickler = _Unpickler(stream, buffers, views)
            load = unpickler.load
            try:
                run = [load() for _ in range(last + 1 - position)]
            except Exception:
                run = None
            if run is None or unpickler.missing:
                stream.seek(begin)
                run = self._read_run(stream, _Unpickler(stream, buffers, views), ends,
                                     position, last, failed)
            objects.extend(run)
            stream.seek(ends[last][0])
            position = last + 1
        # A segment only copies came out of is free once they are made, not before: the
        # worker reuses a segment reported free (the copies once read what it wrote next).
        for key, _, _ in outputs.segments:
            if key not in viewed:
                with self._lock:
                    self.live[key] = self.live.get(key, 0) + 1
                dead.append(key)
        return objects, failed

    @staticmethod
    def _read_run(stream: io.BytesIO, unpickler: _Unpickler, ends: tuple[tuple[int, int, bool], ...],
                  first: int, last: int, failed: dict[int, Exception]) -> list[Any]:
        """The outputs ``first..last`` (one run) read one by one: ``None`` for those
        that cannot be rebuilt here, their errors put in ``failed`` by position (see
        :meth:`unpack_outputs`)."""
        objects: list[Any] = []
        broken: int | None = None  # the output of this run that could not be rebuilt
        for position in range(first, last + 1):
            if broken is not None:
                error: Exception = pickle.UnpicklingError(
                    f"output {position} of a worker's call could not be rebuilt in this "
                    f"process: it was pickled after output {broken}, which could not be, "
                    "and may refer to it")
                failed[position] = error
                objects.append(None)
                continue
            try:
                obj, missing = unpickler.load_output()
            except Exception as error:  # the rest of the run cannot be read
                obj, missing, broken = None, error, position
            if missing is not None:  # (one import error may fail several outputs)
                missing = copy.copy(missing)
                add_note(missing, f"headrace: output {position} of a worker's call "
                                  "could not be rebuilt in this process")
                failed[position] = missing
            objects.append(obj)
            stream.seek(ends[position][0])
        return objects

    @property
    def any_released(self) -> bool:
        """Whether :meth:`released` has keys to give (a check without the lock)."""
        return bool(self._dead)

    def released(self) -> list[int]:
        """Keys whose views are all gone since the last call (their segment may be reused)."""
        done: list[int] = []
        if not self._dead:  # (per element: no lock when nothing died)
            return done
        with self._lock:
            while self._dead:
                key = self._dead.popleft()
                left = self.live[key] - 1
                if left:
                    self.live[key] = left
                else:
                    del self.live[key]
                    done.append(key)
        return done

    def forget(self, key: int) -> None:
        """Drop the mapping (views still alive keep the memory until they go)."""
        self.maps.pop(key, None)

    def discard(self, key: int) -> None:
        """Drop a segment no view uses, and free its memory now.

        The sender keeps its mapping until it is told (with its next task), and
        a mapping keeps a segment's pages: they are punched out here, so that a
        segment handed out and released costs nothing unbooked meanwhile.
        """
        entry = self.maps.pop(key, None)
        if entry is not None and _MADV_REMOVE is not None:
            with contextlib.suppress(OSError, ValueError):
                entry[0].madvise(_MADV_REMOVE)

    def close(self) -> None:
        for key in list(self.held):
            self.unhold(key)
        self.maps.clear()
