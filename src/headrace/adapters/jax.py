"""JAX: NumPy batches for this process's shard, prefetched onto devices, checkpointable.

``to_jax(dataset)`` returns a :class:`DeviceIterator`: it shards the dataset
for this host with :func:`headrace.auto_shard` (``jax.process_index()`` of
``jax.process_count()`` when JAX runs on several hosts), reads NumPy batches,
and keeps ``prefetch`` of them already transferred with ``jax.device_put``
(asynchronous: the copy overlaps the current step). With a ``sharding``
(e.g. ``NamedSharding(mesh, P("batch"))``) each host's batch becomes its part
of one global array (``jax.make_array_from_process_local_data``).

``get_state()`` is the headrace state *after the last batch handed out* — the
batches already on the device are not counted as consumed — so it can be
saved with the training state (e.g. in an Orbax/JSON checkpoint) and
``set_state()`` resumes exactly there.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import jax

from headrace.distribute import AutoShardPolicy, auto_shard
from headrace.errors import CheckpointError, InvalidArgumentError
from headrace.structure import map_structure

if TYPE_CHECKING:
    from headrace.core.run import DatasetIterator
    from headrace.dataset import Dataset

__all__ = ["DeviceIterator", "to_jax"]


class DeviceIterator:
    """Batches as JAX arrays, ``prefetch`` of them transferred ahead; see the module doc."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        prefetch: int = 2,
        device: Any = None,
        sharding: Any = None,
        shard_policy: AutoShardPolicy | str | None = AutoShardPolicy.DATA,
    ) -> None:
        if prefetch < 0:
            raise InvalidArgumentError(f"to_jax: prefetch must be >= 0, got {prefetch}")
        if device is not None and sharding is not None:
            raise InvalidArgumentError("to_jax: give a device or a sharding, not both")
        self.dataset = dataset if shard_policy is None else auto_shard(dataset, shard_policy)
        self.prefetch = prefetch
        self.device = device
        self.sharding = sharding
        self._elements: DatasetIterator = iter(self.dataset)
        self._ahead: collections.deque[tuple[Any, dict[str, Any] | CheckpointError]] = (
            collections.deque())
        self._state: dict[str, Any] | CheckpointError = self._state_now()

    def _state_now(self) -> dict[str, Any] | CheckpointError:
        """The state here, or why there is none: a checkpoint refused (a stage above one
        running out of order) is raised when one is asked for, not while iterating."""
        try:
            return self._elements.get_state()
        except CheckpointError as error:
            return error

    def _put(self, element: Any) -> Any:
        if self.sharding is not None:
            sharding = self.sharding
            return map_structure(
                lambda leaf: jax.make_array_from_process_local_data(  # type: ignore[no-untyped-call]
                    sharding, leaf
                ),
                element,
            )
        return jax.device_put(element, self.device)  # asynchronous: returns at once

    def _fill(self) -> None:
        while len(self._ahead) < max(self.prefetch, 1):
            try:
                element = next(self._elements)
            except StopIteration:
                return
            self._ahead.append((self._put(element), self._state_now()))

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> Any:
        self._fill()
        if not self._ahead:
            raise StopIteration
        element, state = self._ahead.popleft()
        self._state = state
        self._fill()  # the next transfers start while the caller computes on this batch
        return element

    def get_state(self) -> dict[str, Any]:
        """The headrace state after the last batch returned (prefetched ones not counted)."""
        if isinstance(self._state, CheckpointError):
            raise CheckpointError(str(self._state))
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume after the batch that ``state`` was taken at; drops what was prefetched."""
        self._ahead.clear()
        self._elements.set_state(state)
        self._state = self._state_now()

    def close(self) -> None:
        self._ahead.clear()
        self._elements.close()

    def __enter__(self) -> DeviceIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_jax(
    dataset: Dataset,
    *,
    prefetch: int = 2,
    device: Any = None,
    sharding: Any = None,
    shard_policy: AutoShardPolicy | str | None = AutoShardPolicy.DATA,
) -> DeviceIterator:
    """A checkpointable iterator of device arrays over this host's shard of ``dataset``.

    ``shard_policy``: how :func:`headrace.auto_shard` splits the data among
    hosts (``DATA``, ``FILE``, or ``None`` if the dataset is already this
    host's part); with one process it changes nothing.
    """
    return DeviceIterator(
        dataset, prefetch=prefetch, device=device, sharding=sharding, shard_policy=shard_policy
    )
