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
keeps headrace's batches as they are. ``pin_memory=True`` makes the
DataLoader copy each batch into page-locked memory for fast, asynchronous
``.to("cuda", non_blocking=True)``; on a CPU-only machine leave it off.
"""

from __future__ import annotations

from collections.abc import Iterator as PyIterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headrace.adapters._sharding import WorkerSharding, resolve_sharding, shard_for_worker
from headrace.core.node import INFINITE, UNKNOWN, Node
from headrace.structure import map_structure
from headrace.transforms.batch import BatchNode
from headrace.transforms.padded_batch import PaddedBatchNode
from headrace.transforms.unbatch import RebatchNode

if TYPE_CHECKING:
    from headrace.dataset import Dataset

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
    ``DataLoader`` with workers, each worker reads a disjoint part.
    ``len()`` is the number of elements when the dataset's cardinality is
    known and does not depend on the number of workers.
    """

    def __init__(self, dataset: Dataset, worker_sharding: str, copy_readonly: bool) -> None:
        super().__init__()
        self.dataset = dataset
        self.copy_readonly = copy_readonly
        self.worker_sharding = resolve_sharding(dataset, worker_sharding)

    def part(self) -> Dataset:
        """What this process reads: the whole dataset, or this DataLoader worker's part."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self.dataset
        return shard_for_worker(self.dataset, self.worker_sharding, info.num_workers, info.id)

    def __iter__(self) -> PyIterator[Any]:
        copy_readonly = self.copy_readonly

        def convert(leaf: Any) -> Any:
            return as_tensor(leaf, copy_readonly=copy_readonly)

        with iter(self.part()) as elements:
            for element in elements:
                yield map_structure(convert, element)

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


def _batches(node: Node) -> bool:
    """Whether a stage below groups elements (then source sharding changes the count)."""
    if isinstance(node, (BatchNode, PaddedBatchNode, RebatchNode)):
        return True
    return any(_batches(child) for child in node.inputs)


def to_torch(
    dataset: Dataset,
    *,
    worker_sharding: WorkerSharding = "auto",
    copy_readonly: bool = False,
) -> TorchIterableDataset:
    """``dataset`` as a torch ``IterableDataset``; see the module docstring."""
    return TorchIterableDataset(dataset, worker_sharding, copy_readonly)
