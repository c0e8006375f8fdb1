"""JAX: NumPy batches for this process's shard, prefetched onto devices, checkpointable.

``to_jax(dataset)`` returns a :class:`DeviceIterator`: it shards the dataset
for this host with :func:`headrace.auto_shard` (``jax.process_index()`` of
``jax.process_count()`` when JAX runs on several hosts), reads NumPy batches,
and keeps ``prefetch`` of them already transferred with ``jax.device_put``
(asynchronous: the copy overlaps the current step). With a ``sharding``
(e.g. ``NamedSharding(mesh, P("batch"))``) each host's batch becomes its part
of one global array (``jax.make_array_from_process_local_data``).

The read-ahead is booked on the pipeline's budget (G1), as a stage of its own
("to_jax read-ahead"): each batch transferred ahead is booked at its arrays'
size until ``next()`` hands it out. ``prefetch`` is the most batches it reads
ahead; when the next one would not fit its share, it reads ahead fewer. On a
CPU-only host the "device" arrays are host memory, which is why they count.

``get_state()`` is the headrace state *after the last batch handed out* — the
batches already on the device are not counted as consumed — so it can be
saved with the training state (e.g. in an Orbax/JSON checkpoint) and
``set_state()`` resumes exactly there.

Errors keep their place. The read-ahead holds positions, not just batches: a
batch the pipeline (or the transfer) failed to produce is held as its error,
in its place, with the state after it. ``next()`` raises it only after every
earlier batch was handed out, and the following ``next()`` continues with the
batch after it, as headrace's own iterator does — nothing is lost or repeated
around an error, and a ``get_state()`` taken right after it resumes after the
failed batch, exactly where a plain ``iter(dataset)`` would.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import jax

from headrace._distribute import AutoShardPolicy, auto_shard
from headrace._errors import CheckpointError, InvalidArgumentError
from headrace._memory.buffer import NO_RESERVATION, Buffer, Reservation, release_all
from headrace._stateful import StateDict
from headrace._structure import flatten, map_structure
from headrace.core.handoff import unpin
from headrace.core.node import AccountStage

if TYPE_CHECKING:
    from headrace._dataset import Dataset
    from headrace.core.run import DatasetIterator

__all__ = ["DeviceIterator", "to_jax"]


#: One position of the read-ahead: the device batch (None for a failed one), the state
#: after it (or why there is none), the error raised in its place (None if none), and
#: the batch's booking on the read-ahead's share.
_Position = tuple[Any, dict[str, Any] | CheckpointError, Exception | None, Reservation]


class _ReadAheadStage(AccountStage):
    """Stands for to_jax's read-ahead in the budget's split (never iterated)."""

    stage = "to_jax read-ahead"
    budget_weight = 1.0


_READ_AHEAD = _ReadAheadStage()


class DeviceIterator(StateDict):
    """Batches as JAX arrays, ``prefetch`` of them transferred ahead; see the module doc.

    ``state_dict``/``load_state_dict`` are ``get_state``/``set_state`` in the form
    checkpoint tools take (one JSON string; see :mod:`headrace._stateful`).
    """

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
        context = self._elements.context
        self._account: Buffer = context.account(_READ_AHEAD)
        context.budget.allot()  # the read-ahead's share, before any batch is read
        self._ahead: collections.deque[_Position] = collections.deque()
        self._ended = False  # the pipeline said StopIteration: ask it no more
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

    def _fill(self, depth: int) -> None:
        """Read ahead until ``depth`` positions wait. A batch that fails (in the
        pipeline or in the transfer) takes its position as its error, so that it is
        raised in order and the batches pulled after it are not lost."""
        account = self._account
        while not self._ended and len(self._ahead) < depth:
            if self._ahead and not account.fits(account.largest()):
                return  # the share is full: the batch in hand goes, the rest waits
            try:
                element = self._put(next(self._elements))
                booking = account.admit_existing([_device_bytes(element)])[0]
            except StopIteration:
                self._ended = True
                return
            except Exception as error:  # raised by __next__ at this position, not here
                self._ahead.append((None, self._state_now(), unpin(error), NO_RESERVATION))
                continue
            self._ahead.append((element, self._state_now(), None, booking))

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> Any:
        self._fill(1)
        if not self._ahead:
            raise StopIteration
        position = self._ahead.popleft()
        element, state, error, booking = position
        before, self._state = self._state, state
        if error is not None:
            raise error
        try:  # the next transfers start while the caller computes on this batch
            self._fill(self.prefetch)
        except BaseException:  # an interrupt while reading ahead: this batch stays next
            self._ahead.appendleft(position)
            self._state = before
            raise
        booking.release()  # handed out: the caller holds it now
        return element

    def get_state(self) -> dict[str, Any]:
        """The headrace state after the last batch returned (prefetched ones not counted)."""
        if isinstance(self._state, CheckpointError):
            raise CheckpointError(str(self._state))
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume after the batch that ``state`` was taken at; drops what was prefetched."""
        self._drop_ahead()
        self._ended = False
        self._elements.set_state(state)
        self._state = self._state_now()

    def _drop_ahead(self) -> None:
        release_all(position[3] for position in self._ahead)
        self._ahead.clear()

    def close(self) -> None:
        self._drop_ahead()
        self._elements.close()

    def __enter__(self) -> DeviceIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_bytes(element: Any) -> int:
    """The bytes of a transferred batch: its arrays' sizes."""
    return sum(int(getattr(leaf, "nbytes", 0) or 0) for leaf in flatten(element))


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
