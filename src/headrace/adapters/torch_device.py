"""``to_torch(device=..., pin_memory=True)``: batches gathered into reused pinned buffers.

A plain ``torch.from_numpy(batch).to("cuda")`` copies every batch twice on
the consumer's thread: once into a page-locked staging buffer the driver
allocates, once over PCIe, and the training step waits for both. Here a few
worker threads gather each batch straight into one of a small **ring of
reused pinned host buffers** (NumPy copies and gathers release the GIL), issue
the host-to-device copy on a dedicated stream, and record an event; the
consumer's stream waits on that event (``wait_event``, ``record_stream``), so
the copy of batch ``i + 1`` overlaps the step on batch ``i``.

Invariants, all proven on CPU by the tests through :class:`CpuBackend` and
slow or failing test backends:

- **A buffer is reused only after its copy completed**: batch ``t`` uses slot
  ``t % depth``, and its worker waits until the consumer took batch
  ``t - depth`` *and* that batch's transfer finished before writing.
- **Order is kept**: batches are numbered when drawn from the pipeline and
  handed over by number, whatever the threads' timing.
- **Errors re-raise at their batch**: an exception in the pipeline, in the
  gather or in the copy is handed over in place of that batch; iteration can
  go on after it, as with headrace's other threads.
- **The budget holds the ring** (G1): each slot is booked on the stage's
  share before it is allocated; a ring that cannot fit raises
  :class:`~headrace._errors.MemoryBudgetError` naming the stage.
- **Checkpoints are unaffected** (G4): the state is the pipeline's position
  after the last batch *handed over*, not after the ones gathered ahead.
- **Closing** (G6) stops and joins the threads and returns the bookings; an
  iterator dropped without ``close()`` is closed by garbage collection (the
  threads hold no reference to it).

Random-access pipelines of arrays ending in ``batch`` (``from_tensor_slices(...)
.shuffle(...).repeat().batch(n)``: take/skip/shard/repeat/shuffle below the
batch, a ``prefetch`` after it) take the fast route: the pipeline hands out
only the batch's *indices*, and the workers gather the rows with
``np.take(..., out=pinned)`` — one copy from the source into pinned memory,
on several threads. Other pipelines (a ``map``, a file reader, a ``repeat``
*after* the batch) hand out NumPy batches, made on one thread at a time, which
the workers copy into the ring.

torch's caching host allocator keeps a closed ring's pinned blocks for the
next iterator (the next epoch reuses them instead of pinning memory again).

The CUDA backend is a thin layer over :class:`TransferBackend`; without CUDA
nothing of it runs (see :func:`backend_for`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from headrace._errors import InvalidArgumentError
from headrace._options import AUTOTUNE
from headrace._structure import flatten, pack_as
from headrace.core import (
    NO_RESERVATION,
    Buffer,
    Context,
    Iterator,
    Reservation,
    StateReader,
    UnaryNode,
)
from headrace.core.handoff import unpin
from headrace.core.indexing import IndexStream, RandomAccess, Reach, Refusal, take_all
from headrace.core.node import ShardRole, Traits
from headrace.core.state import settle_out_of_order

__all__ = [
    "CpuBackend",
    "CudaBackend",
    "DeviceTransferNode",
    "Transfer",
    "TransferBackend",
    "backend_for",
    "check_device",
]

#: Leaves start at multiples of this in a slot (DMA engines like aligned sources).
_ALIGN = 512


# -- the transfer backend: the only part that knows about the device ---------------------------


class Transfer:
    """A host-to-device copy in flight."""

    def wait(self) -> None:
        """Block until the copy has read all of its host memory (the buffer is free again)."""

    def hand_over(self) -> None:
        """Called on the consumer's thread before the batch is returned: make the
        consumer's work on the device tensors wait for the copy."""


class TransferBackend:
    """How host buffers are allocated and copied to a device.

    :class:`CudaBackend` is the real one; :class:`CpuBackend` copies into
    fresh CPU tensors, so the ring's logic runs (and is tested) without a GPU.
    """

    device: torch.device = torch.device("cpu")

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of ``nbytes`` (page-locked where the device needs it)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Transfer]:
        """Start copying ``host`` (views into one slot) to the device: the device
        tensors, and the transfer whose :meth:`Transfer.wait` frees the slot."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the backend holds (streams)."""


class CpuBackend(TransferBackend):
    """The copy is a plain clone, done when :meth:`copy` returns: the logic of the ring
    (reuse, order, errors, closing) without a device."""

    def copy(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Transfer]:
        return [tensor.clone() for tensor in host], Transfer()


class _CudaTransfer(Transfer):
    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        self.event, self.tensors = event, tensors

    def wait(self) -> None:
        self.event.synchronize()

    def hand_over(self) -> None:
        stream = torch.cuda.current_stream(self.tensors[0].device) if self.tensors else None
        if stream is None:
            return
        stream.wait_event(self.event)  # the consumer's kernels start after the copy
        for tensor in self.tensors:  # the caching allocator must not recycle them early
            tensor.record_stream(stream)


class CudaBackend(TransferBackend):
    """Pinned host buffers, copies on one dedicated stream, an event per batch."""

    def __init__(self, device: torch.device) -> None:
        if device.index is None:  # "cuda" is the caller's current device, not the workers'
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Transfer]:
        with torch.cuda.stream(self.stream):
            tensors = [tensor.to(self.device, non_blocking=True) for tensor in host]
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return tensors, _CudaTransfer(event, tensors)


def check_device(device: torch.device) -> None:
    """Refuse, with what to do instead, a device pinned transfers cannot serve."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"to_torch: device={str(device)!r} but torch has no CUDA here "
                f"(torch {torch.__version__}); use device='cpu' or install a CUDA build"
            )
        return
    raise InvalidArgumentError(
        f"to_torch: pin_memory=True stages batches through pinned buffers for CUDA devices, "
        f"not {str(device)!r}; pass pin_memory=False to copy with tensor.to({str(device)!r})"
    )


def backend_for(device: torch.device) -> TransferBackend:
    """The backend for ``device`` (see :func:`check_device`)."""
    check_device(device)
    return CudaBackend(device)


# -- the recipe node -------------------------------------------------------------------------


class DeviceTransferNode(UnaryNode):
    """The last stage of ``to_torch(device=..., pin_memory=True)``: elements become
    tensors on the device, staged through a ring of ``depth`` reused host buffers
    filled by ``threads`` worker threads."""

    stage = "to_device"
    budget_weight = 1.0

    def cardinality(self) -> int:
        return self.inputs[0].cardinality()  # one element out per element in

    def shard_role(self) -> ShardRole:
        return ShardRole.POSITIONAL  # it runs in the main process, above the workers

    def element_access(self, reach: Reach) -> RandomAccess | Refusal:
        return Refusal(self)  # elements live on a device, after the pipeline

    def traits(self) -> Traits:
        return Traits()

    def __init__(
        self,
        source: Any,
        device: str,
        *,
        threads: int = AUTOTUNE,
        depth: int = AUTOTUNE,
        backend: Callable[[torch.device], TransferBackend] = backend_for,
    ) -> None:
        super().__init__(source)
        for name, value in (("num_threads", threads), ("buffers", depth)):
            if value != AUTOTUNE and (not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(
                    f"to_torch: {name} must be a positive int or AUTOTUNE, got {value!r}"
                )
        self.device = str(torch.device(device))
        self.threads, self.depth, self.backend = threads, depth, backend

    def params(self) -> tuple[Any, ...]:
        return (self.device,)  # threads and depth change nothing in the order or the state

    def make_iterator(self, ctx: Context) -> Iterator:
        backend = self.backend(torch.device(self.device))
        source: _Source | None = _index_source(self.inputs[0], ctx)
        inner: Iterator | None = None
        if source is None:
            inner = self.inputs[0].make_iterator(ctx)
            source = _ElementSource(inner, ctx)
        threads = self.threads if self.threads != AUTOTUNE else _auto_threads()
        return DeviceIterator(self, ctx, source, inner, backend, threads)


def _auto_threads() -> int:
    """Gather threads: half the usable cores (the rest run the pipeline and the
    training loop), at most 8 — a PCIe link is saturated well before that."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 1) // 2))


# -- where batches come from: the pipeline's elements, or a random-access source's indices --------


class _Source:
    """Draws the next batch's payload (called under the ring's lock) and fills a slot
    with it (called on a worker thread, outside the lock)."""

    def draw(self) -> tuple[Any, Reservation]:
        """The next payload and the booking that holds it until it is in a slot."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: StateReader) -> None:
        raise NotImplementedError

    def layout(self, payload: Any) -> tuple[Any, list[Any]]:
        """The element's structure and its leaves: an ndarray to copy, or a
        ``(shape, dtype, fill)`` to gather, or anything else to pass through."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ElementSource(_Source):
    def __init__(self, inner: Iterator, ctx: Context) -> None:
        self.inner, self.ctx = inner, ctx

    def draw(self) -> tuple[Any, Reservation]:
        return self.inner.pull()

    def state(self) -> dict[str, Any]:
        # kept to restore as it is, at a batch boundary: at-least-once below a stage
        # out of order, whatever the ring draws after it
        return {"inner": settle_out_of_order(self.inner.get_state(), self.ctx.run.out_of_order)}

    def set_state(self, state: StateReader) -> None:
        self.inner.set_state(state.child("inner"))

    def layout(self, payload: Any) -> tuple[Any, list[Any]]:
        return payload, flatten(payload)

    def close(self) -> None:
        self.inner.close()


class _IndexSource(_Source):
    """``batch(n)`` over a random-access source of arrays: batches of indices, gathered
    by the workers straight into the ring (``np.take(..., out=...)``)."""

    def __init__(
        self, access: Any, stream: IndexStream, batch_size: int, drop_remainder: bool
    ) -> None:
        self.access, self.stream = access, stream
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def draw(self) -> tuple[Any, Reservation]:
        indices = take_all(self.stream, self.batch_size)
        count = len(indices)
        if count < self.batch_size and (count == 0 or self.drop_remainder):
            raise StopIteration
        return indices, NO_RESERVATION

    def state(self) -> dict[str, Any]:
        return {"indices": self.stream.get_state()}

    def set_state(self, state: StateReader) -> None:
        self.stream.set_state(state.child("indices"))

    def layout(self, payload: Any) -> tuple[Any, list[Any]]:
        if isinstance(payload, range) and payload.step == 1:
            selector: Any = slice(payload.start, payload.stop)
            rows = len(payload)
        else:
            selector = np.asarray(payload, dtype=np.intp)
            rows = len(selector)
        leaves = []
        for leaf in self.access.leaves:
            leaves.append(((rows, *leaf.shape[1:]), leaf.dtype, _gather(leaf, selector)))
        return self.access.structure, leaves

    def close(self) -> None:
        self.stream.close()
        self.access.close()


def _gather(leaf: np.ndarray, selector: Any) -> Callable[[np.ndarray], None]:
    def fill(out: np.ndarray) -> None:
        if isinstance(selector, slice):
            np.copyto(out, leaf[selector])
        else:
            # mode="raise" would gather into a temporary and copy it over (NumPy buffers
            # `out` then): 10x slower on image batches. The indices come from the
            # pipeline's own index stream, checked here so that "clip" never clips.
            if len(selector) and (selector.min() < 0 or selector.max() >= len(leaf)):
                raise IndexError(
                    f"to_device: index out of range 0..{len(leaf) - 1} in a batch's gather"
                )
            np.take(leaf, selector, axis=0, out=out, mode="clip")

    return fill


def _index_source(node: Any, ctx: Context) -> _IndexSource | None:
    """The fast route, when ``node`` batches a random-access source of numeric arrays
    (a ``prefetch`` after the batch is dropped: the ring already works ahead)."""
    from headrace._sources.arrays import SlicesAccess
    from headrace._transforms.batch import BatchNode
    from headrace._transforms.prefetch import PrefetchNode

    while type(node) is PrefetchNode:
        node = node.inputs[0]
    if type(node) is not BatchNode:
        return None
    plan = node.inputs[0].index_plan()
    if plan is None:
        return None
    access, make_stream = plan
    if type(access) is not SlicesAccess or not all(
        isinstance(leaf, np.ndarray) and _staged(leaf) and leaf.dtype.isnative and leaf.ndim >= 1
        for leaf in access.leaves
    ):
        return None
    access.prepare(ctx)
    return _IndexSource(access, make_stream(ctx), node.batch_size, node.drop_remainder)


# -- the ring --------------------------------------------------------------------------------


@dataclass
class _Slot:
    host: torch.Tensor | None = None  # 1-D uint8, page-locked for a CUDA device
    reservation: Reservation = NO_RESERVATION
    transfer: Transfer | None = None  # the last copy out of this slot


@dataclass
class _Result:
    value: Any = None
    transfer: Transfer | None = None
    error: BaseException | None = None
    state: dict[str, Any] = field(default_factory=dict)


class _Stop(Exception):
    """The ring is closing: a worker waiting for a slot gives up."""


class _Ring:
    """The shared state of the workers and the consumer. The threads reference this,
    never the :class:`DeviceIterator`, so dropping the iterator closes it."""

    def __init__(
        self,
        source: _Source,
        backend: TransferBackend,
        account: Buffer,
        depth: int,
        estimate: int,
    ) -> None:
        self.source, self.backend, self.account = source, backend, account
        self.depth = depth
        self.estimate = estimate  # bytes of one slot, from the element spec (0: unknown)
        self.slots = [_Slot() for _ in range(depth)]
        self.cond = threading.Condition()
        self.draw_lock = threading.Lock()
        self.results: dict[int, _Result] = {}
        self.drawn = 0  # tickets handed to workers
        self.taken = 0  # tickets handed to the consumer
        self.end: int | None = None  # the ticket at which the pipeline ended
        self.stopping = False
        self.threads: list[threading.Thread] = []

    # worker side
    def work(self) -> None:
        while True:
            with self.draw_lock:  # draws are numbered in the pipeline's order
                if self.stopping or self.end is not None:
                    return
                ticket = self.drawn
                self.drawn += 1
                result = _Result()
                upstream = NO_RESERVATION
                try:
                    payload, upstream = self.source.draw()
                except StopIteration:
                    with self.cond:
                        self.end = ticket
                        self.cond.notify_all()
                    return
                except BaseException as error:  # handed over at its batch
                    payload, result.error = None, unpin(error)
                result.state = self.source.state()
            try:
                if result.error is None:
                    self.fill(ticket, payload, result)
            except _Stop:
                return
            except BaseException as error:
                result.error = unpin(error)
            finally:
                del payload
                upstream.release()  # the batch now lives in the slot (or failed)
            with self.cond:
                self.results[ticket] = result
                self.cond.notify_all()

    def fill(self, ticket: int, payload: Any, result: _Result) -> None:
        structure, leaves = self.source.layout(payload)
        slot = self.slots[ticket % self.depth]
        with self.cond:  # the slot's last batch must have been handed over...
            while ticket - self.depth >= self.taken and not self.stopping:
                self.cond.wait()
            if self.stopping:
                raise _Stop
        if slot.transfer is not None:  # ...and its copy must have read the buffer
            slot.transfer.wait()
            slot.transfer = None
        offsets, total = _offsets(leaves)
        self.reserve(slot, total)
        host: list[torch.Tensor] = []
        placed: list[Any] = []
        for leaf, offset in zip(leaves, offsets, strict=True):
            if offset is None:
                placed.append(leaf)
                continue
            shape, dtype, fill = _as_fill(leaf)
            assert slot.host is not None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            view = slot.host[offset : offset + nbytes].view(_torch_dtype(dtype)).view(shape)
            fill(view.numpy())  # NumPy's copy or gather, without the GIL
            host.append(view)
            placed.append(None)
        tensors, transfer = self.backend.copy(host) if host else ([], Transfer())
        slot.transfer = transfer
        device = iter(tensors)
        result.value = pack_as(structure, [next(device) if p is None else p for p in placed])
        result.transfer = transfer

    def reserve(self, slot: _Slot, nbytes: int) -> None:
        """Size ``slot`` for ``nbytes``, booking it before allocating (grows, never shrinks)."""
        if slot.host is not None and slot.host.numel() >= nbytes:
            return
        nbytes = max(nbytes, self.estimate)
        slot.host = None  # the old buffer goes before the new one is booked
        slot.reservation.release()
        slot.reservation = NO_RESERVATION
        slot.reservation = self.account.admit(nbytes, together="one pinned host buffer")
        slot.host = self.backend.allocate(nbytes)

    # consumer side
    def take(self) -> _Result:
        ticket = self.taken
        with self.cond:
            while ticket not in self.results and ticket != self.end:
                if not any(thread.is_alive() for thread in self.threads):
                    raise RuntimeError("to_torch: the transfer threads stopped unexpectedly")
                self.cond.wait(0.5)
            if ticket == self.end:
                raise StopIteration
            result = self.results.pop(ticket)
            self.taken += 1
            self.cond.notify_all()  # a worker may be waiting for this ticket's slot
        return result

    def start(self, threads: int) -> None:
        for number in range(threads):
            thread = threading.Thread(
                target=self.work, name=f"headrace-to-device-{number}", daemon=True
            )
            self.threads.append(thread)
            thread.start()

    def stop(self) -> None:
        """Stop and join the workers, wait for copies in flight, return the bookings."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        current = threading.current_thread()
        for thread in self.threads:
            if thread is not current:  # garbage collection may run on a worker
                thread.join()
        self.threads.clear()
        for slot in self.slots:
            if slot.transfer is not None:
                slot.transfer.wait()
            slot.transfer, slot.host = None, None
            slot.reservation.release()
            slot.reservation = NO_RESERVATION
        self.results.clear()


def _as_fill(leaf: Any) -> tuple[tuple[int, ...], np.dtype[Any], Callable[[np.ndarray], None]]:
    if isinstance(leaf, np.ndarray):  # big-endian data lands in native order (torch's)
        return leaf.shape, leaf.dtype.newbyteorder("="), lambda out: np.copyto(out, leaf)
    shape, dtype, fill = leaf
    return tuple(shape), np.dtype(dtype), fill


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _staged(leaf: Any) -> bool:
    """Whether a leaf goes through the ring (numeric arrays torch has a dtype for) or
    passes through as it is (object arrays: bytes and strings stay NumPy)."""
    if isinstance(leaf, np.ndarray):
        dtype = leaf.dtype
    elif isinstance(leaf, tuple) and len(leaf) == 3 and callable(leaf[2]):
        dtype = np.dtype(leaf[1])
    else:
        return False
    if dtype.kind == "O":
        return False
    dtype = dtype.newbyteorder("=")
    try:
        _torch_dtype(dtype)
    except TypeError:
        return False
    return True


def _offsets(leaves: list[Any]) -> tuple[list[int | None], int]:
    """Where each staged leaf starts in a slot, and the slot's bytes."""
    offsets: list[int | None] = []
    total = 0
    for leaf in leaves:
        if not _staged(leaf):
            offsets.append(None)
            continue
        shape, dtype, _ = _as_fill(leaf)
        offsets.append(total)
        total += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, total


def _spec_bytes(spec: Any, batch_rows: int | None) -> int:
    """One element's bytes from its spec (a leading unknown dimension taken as
    ``batch_rows``), or 0 if the spec does not say."""
    total = 0
    for leaf in flatten(spec):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        try:
            if shape is None or dtype is None or np.dtype(dtype).kind == "O":
                return 0
        except TypeError:  # not a NumPy dtype (a ragged or nested spec)
            return 0
        dims = list(shape)
        if dims and dims[0] is None and batch_rows:
            dims[0] = batch_rows
        if any(d is None for d in dims):
            return 0
        nbytes = int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    return total


class DeviceIterator(Iterator):
    """The iterator of :class:`DeviceTransferNode` (see the module docstring)."""

    stage = "to_device"

    def __init__(
        self,
        node: DeviceTransferNode,
        ctx: Context,
        source: _Source,
        inner: Iterator | None,
        backend: TransferBackend,
        threads: int,
    ) -> None:
        super().__init__(*([inner] if inner is not None else []))
        self.source, self.backend, self.threads = source, backend, threads
        account = ctx.account(node)
        rows = getattr(node.inputs[0], "batch_size", None)
        estimate = _spec_bytes(node.inputs[0].element_spec, rows)
        depth = node.depth
        if depth == AUTOTUNE:  # one slot per thread plus two in the consumer's hands
            depth = threads + 2
            if estimate:
                depth = max(2, min(depth, account.share() // estimate))
        self.depth = depth
        self.ring = _Ring(source, backend, account, depth, estimate)
        self._state = source.state()  # the position after the last batch handed over
        self._closed = False
        self._finalizer = weakref.finalize(self, _Ring.stop, self.ring)

    def pull(self) -> tuple[Any, Reservation]:
        if self._closed:
            raise StopIteration
        if not self.ring.threads and self.ring.end is None:
            self.ring.start(self.threads)
        result = self.ring.take()
        self._state = result.state
        if result.error is not None:
            raise result.error
        if result.transfer is not None:
            result.transfer.hand_over()
        return result.value, NO_RESERVATION

    def get_state(self) -> dict[str, Any]:
        return dict(self._state)

    def set_state(self, state: dict[str, Any]) -> None:
        self.ring.stop()  # batches gathered ahead belong to the old position
        self.ring = _Ring(
            self.source, self.backend, self.ring.account, self.depth, self.ring.estimate
        )
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _Ring.stop, self.ring)
        self.source.set_state(StateReader(state, self.stage))
        self._state = self.source.state()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # stops the ring once
        self.source.close()
        self.backend.close()
