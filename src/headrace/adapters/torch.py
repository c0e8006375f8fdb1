"""``Dataset.to_torch()``: a ``torch.utils.data.IterableDataset`` of tensors, without copies.

NumPy batches become tensors that share their memory (``torch.from_numpy``).
headrace's zero-copy batches are read-only views (G5); ``torch.from_numpy``
warns on those, so they go through DLPack instead, which torch accepts for
read-only arrays without a copy or a warning. torch has no read-only
tensors: writing into such a tensor in place writes into the source array —
pass ``copy_readonly=True`` if your training step does that. Object arrays
(bytes, str) stay NumPy arrays: torch has no string tensors.

Inside a ``DataLoader(..., batch_size=None, num_workers=n)`` each worker runs
its own part of the pipeline (see :mod:`headrace.adapters._sharding` for the
``worker_sharding`` policies): together they deliver every element exactly
once, and an explicit memory budget is split among them. ``batch_size=None``
keeps headrace's batches as they are.

**To a GPU.** ``to_torch(device="cuda", pin_memory=True)`` delivers the
batches already on the device: worker threads gather each batch straight into
one of a small ring of reused, budget-booked pinned host buffers and copy it
on a dedicated CUDA stream, overlapping the copies with your training step
(see :mod:`headrace.adapters.torch_device`). Iterate it directly, not through
a ``DataLoader`` (CUDA belongs to the main process); the iterator checkpoints
(``get_state``/``set_state``) at the last batch it handed over.
``device=...`` with ``pin_memory=False`` copies each batch with a plain
``tensor.to(device)`` on your thread. ``device="cpu"`` (or None) with
``pin_memory=True`` does what torch's ``DataLoader`` does without an
accelerator: it warns once and delivers ordinary CPU tensors, so a script
written for a GPU still runs on a laptop. ``DataLoader(pin_memory=True)`` over
``to_torch()`` still works as before, at the cost of one more copy per batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import tempfile
import weakref
from collections.abc import Iterator as PyIterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headrace._errors import InvalidArgumentError
from headrace._options import AUTOTUNE
from headrace._structure import map_structure
from headrace._warn import warn_user
from headrace.adapters._elements import ConvertedElements
from headrace.adapters._sharding import WorkerSharding, resolve_sharding, shard_for_worker
from headrace.core.node import INFINITE, UNKNOWN, Node
from headrace.core.run import set_next_iteration

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = ["TorchIterableDataset", "as_tensor", "to_torch"]


def as_tensor(value: Any, *, copy_readonly: bool = False) -> Any:
    """One NumPy leaf as a torch tensor sharing its memory (object arrays stay NumPy)."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray) or value.dtype == object:
        return value
    if value.dtype.byteorder == ">":  # torch has no big-endian tensors: one conversion
        return torch.from_numpy(value.astype(value.dtype.newbyteorder("=")))
    if value.flags.writeable:
        return torch.from_numpy(value)
    if copy_readonly:
        return torch.from_numpy(value.copy())
    if any(stride < 0 for stride in value.strides):  # torch refuses negative strides
        return torch.from_numpy(value.copy())
    return torch.utils.dlpack.from_dlpack(value)  # read-only: shared, and no warning from torch


class TorchIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """What :func:`to_torch` returns: an ``IterableDataset`` over a headrace pipeline.

    ``iter()`` runs a fresh headrace iterator (a new epoch) and yields its
    elements with every NumPy leaf as a tensor sharing its memory. In a
    ``DataLoader`` with workers, each worker reads a disjoint part. An
    element's error is raised at its position and the next ``next()`` goes on
    with the element after it, as ``iter(dataset)`` does (nothing after an
    error is lost); in the main process the iterator also has
    ``get_state``/``set_state``/``close``.
    ``len()`` is the number of elements when the dataset's cardinality is
    known and does not depend on the number of workers.
    """

    def __init__(
        self,
        dataset: Dataset,
        worker_sharding: str,
        copy_readonly: bool,
        device: torch.device | None = None,
        pin_memory: bool = False,
        num_threads: int = AUTOTUNE,
        buffers: int = AUTOTUNE,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.copy_readonly = copy_readonly
        self.worker_sharding = resolve_sharding(dataset, worker_sharding)
        self.device, self.pin_memory = device, pin_memory
        self.num_threads, self.buffers = num_threads, buffers
        self._clock = _EpochClock()  # made here: workers inherit it (fork) or get it sent

    def part(self) -> Dataset:
        """What this process reads: the whole dataset, or this DataLoader worker's part,
        made the worker's iteration of its epoch (see :meth:`_worker_iteration`)."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self.dataset
        part = shard_for_worker(self.dataset, self.worker_sharding, info.num_workers, info.id)
        set_next_iteration(part.node, self._worker_iteration(info, part))
        return part

    def _worker_iteration(self, info: Any, part: Dataset) -> int:
        """Which iteration a DataLoader worker runs, for the stages that reshuffle (or
        redraw) each iteration: the DataLoader's epoch number, as iterating in the main
        process counts them (G3: the same seed, the same orders, run after run).

        A worker cannot count epochs alone: non-persistent workers start afresh every
        epoch, from the main process's copy. So every worker of one epoch shows the
        :class:`_EpochClock` one key, torch's ``base_seed`` (drawn once per DataLoader
        iterator; ``info.seed`` is it plus the worker id) with the worker's own count of
        iterators (persistent workers keep their seed), and the clock numbers keys in
        the order they come. Under output sharding every worker must run the very same
        pipeline, the single-process iteration of that number; under source sharding
        each shuffles only its own rows, so its id keys its stream too (one permutation
        in every worker moved them in lockstep) — unless a stream above the sources is
        split by position (a ``zip`` of unlike branches): then every worker must draw
        that stream alike, or the parts would overlap."""
        count = self.__dict__.get("_worker_iterators", 0)
        self.__dict__["_worker_iterators"] = count + 1
        (key,) = np.random.SeedSequence([info.seed - info.id, count]).generate_state(
            1, dtype=np.uint64)
        epoch = self._clock.epoch(int(key) >> 1 | 1)  # (an int64, never 0: a free slot)
        if self.worker_sharding == "source" and not _shards_a_stream(part.node):
            return int(epoch * info.num_workers + info.id)
        return epoch

    def __iter__(self) -> PyIterator[Any]:
        device = self.device
        if device is not None and device.type != "cpu":
            if torch.utils.data.get_worker_info() is not None:
                raise InvalidArgumentError(
                    f"to_torch(device={str(device)!r}) runs in a DataLoader worker; iterate it "
                    "in the main process (it copies to the device itself), or leave device unset"
                )
            if self.pin_memory:
                from headrace.adapters.torch_device import DeviceTransferNode

                node = DeviceTransferNode(
                    self.dataset.node, str(device), threads=self.num_threads, depth=self.buffers
                )
                return iter(self.dataset.derive(node))
        return self._elements(device)

    def _elements(self, device: torch.device | None) -> ConvertedElements:
        copy_readonly = self.copy_readonly
        to_device = device is not None and device.type != "cpu"

        def convert(element: Any) -> Any:
            return map_structure(leaf_to_tensor, element)

        def leaf_to_tensor(leaf: Any) -> Any:
            tensor = as_tensor(leaf, copy_readonly=copy_readonly)
            if to_device and isinstance(tensor, torch.Tensor):
                return tensor.to(device)
            return tensor

        # an iterator object, not a generator: an element's error leaves it usable
        return ConvertedElements(self.part(), convert)

    def __len__(self) -> int:
        size = self.dataset.cardinality()
        if size in (INFINITE, UNKNOWN):
            raise TypeError("the dataset's length is not known")
        if self.worker_sharding == "source" and _batches(self.dataset.node):
            raise TypeError(
                "the number of batches depends on the number of DataLoader workers "
                "(each batches its own part); use worker_sharding='output' for a length"
            )
        return size


class _EpochClock:
    """Epoch numbers for a DataLoader's worker processes: a counter and the last few
    keys it numbered, in a small file the workers lock while they read and update it
    (a path: it reaches forked and spawned workers alike; a multiprocessing lock made
    here would be refused by a forkserver's or spawn's workers).

    ``epoch(key)`` gives the number it gave ``key`` before, or the next one: the
    workers of one epoch share a key, so they get one number, and a late worker of an
    earlier epoch still finds its own among the last ``SLOTS``. Where the file is not
    there (the pipeline sent to another machine) each process numbers keys by itself,
    from 0. The file goes with the object in the process that made it."""

    SLOTS = 8
    _LAYOUT = struct.Struct(f"<{1 + 2 * SLOTS}q")  # next epoch, then (key, epoch) a slot

    def __init__(self) -> None:
        self.alone: dict[int, int] = {}
        self.path = ""  # (none: no temporary folder to write in; each process alone)
        try:
            fd, path = tempfile.mkstemp(prefix="headrace-epochs-")
        except OSError:
            return  # to_torch() must not fail for a clock only DataLoader workers read
        weakref.finalize(self, _remove_owned, path, os.getpid())
        try:
            os.write(fd, bytes(self._LAYOUT.size))
        except OSError:
            return  # (a full disk: the file stays short, and a worker reading it is alone)
        finally:
            os.close(fd)
        self.path = path

    def epoch(self, key: int) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return self.alone.setdefault(key, len(self.alone))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            counts = list(self._LAYOUT.unpack(os.pread(fd, self._LAYOUT.size, 0)))
            for slot in range(self.SLOTS):
                if counts[1 + 2 * slot] == key:
                    return int(counts[2 + 2 * slot])
            epoch = counts[0]
            counts[0] = epoch + 1
            slot = epoch % self.SLOTS
            counts[1 + 2 * slot], counts[2 + 2 * slot] = key, epoch
            os.pwrite(fd, self._LAYOUT.pack(*counts), 0)
            return int(epoch)
        finally:
            os.close(fd)  # (the lock goes with it)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "alone": {}}


def _shards_a_stream(node: Node) -> bool:
    """Whether a worker's part splits a stream above its sources by position (each
    worker runs it whole and keeps every n-th element)."""
    from headrace._transforms.shard import ShardNode

    if isinstance(node, ShardNode) and node.inputs[0].inputs:
        return True
    return any(_shards_a_stream(child) for child in node.inputs)


def _remove_owned(path: str, owner: int) -> None:
    """Remove the clock's file, in the process that made it only (forked workers inherit
    the finalizer, and one that ends with its epoch must not take the file along)."""
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _batches(node: Node) -> bool:
    """Whether a stage below groups elements (then source sharding changes the count)."""
    if node.traits().groups:
        return True
    return any(_batches(child) for child in node.inputs)


def to_torch(
    dataset: Dataset,
    *,
    worker_sharding: WorkerSharding = "auto",
    copy_readonly: bool = False,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
    num_threads: int = AUTOTUNE,
    buffers: int = AUTOTUNE,
) -> TorchIterableDataset:
    """``dataset`` as a torch ``IterableDataset``; see the module docstring.

    ``num_threads`` (gather threads) and ``buffers`` (the ring's pinned buffers,
    each booked on the budget) apply to ``device=<accelerator>, pin_memory=True``;
    AUTOTUNE picks half the cores (at most 8) and one buffer per thread plus two,
    fewer if the budget's share cannot hold them.
    """
    resolved = None if device is None else torch.device(device)
    if pin_memory:
        if resolved is None or resolved.type == "cpu":
            warn_user(
                "to_torch: pin_memory=True has no effect without an accelerator device "
                f"(device={None if resolved is None else str(resolved)!r}); the batches "
                "stay ordinary CPU tensors",
                UserWarning,
            )
        else:
            from headrace.adapters.torch_device import check_device

            check_device(resolved)
    for name, value in (("num_threads", num_threads), ("buffers", buffers)):
        if value != AUTOTUNE and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise InvalidArgumentError(
                f"to_torch: {name} must be a positive int or AUTOTUNE, got {value!r}"
            )
    return TorchIterableDataset(
        dataset, worker_sharding, copy_readonly, resolved, pin_memory, num_threads, buffers
    )
