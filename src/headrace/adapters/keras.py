"""Keras 3: ``model.fit(ds.to_keras())``, and the :class:`MemoryMonitor` callback.

How Keras 3 recognises inputs (``keras.src.trainers.data_adapters.get_data_adapter``):
arrays, ``tf.data.Dataset``, ``keras.utils.PyDataset``, a torch ``DataLoader``,
Grain datasets, Python generators — and any ``DataAdapter`` instance, passed
through as is. A generator cannot restart (epoch 2 finds it empty, hence the
``.repeat()`` + ``steps_per_epoch`` workaround) and a ``PyDataset`` is
indexed by batch number (Keras shuffles those numbers), which a stream cannot
honour. A ``DataAdapter`` is the route that fits: Keras asks it for a fresh
iterator per epoch in the backend's own form, and for the number of batches.
:func:`to_keras` returns one, so on every backend:

* one epoch is one pass over a finite dataset (a known cardinality is the
  number of steps, no ``.repeat()`` or ``steps_per_epoch``); an infinite one
  needs ``steps_per_epoch``, as in Keras; an unknown cardinality is learned
  by Keras at the end of the first epoch (it warns once that the input ran
  out, as it does for a ``tf.data`` dataset of unknown length);
* ``validation_data=val.to_keras()``, ``evaluate`` and ``predict`` work alike;
* on the JAX, torch and NumPy backends the NumPy batches are handed over
  as they are (torch: tensors sharing their memory, see ``to_torch``);
* on the TensorFlow backend too, for a single-replica model stepping once per
  call (Keras's defaults): Keras's TF trainer calls its compiled step on each
  batch of any iterator that is not a ``tf.data`` one, so the adapter gives it
  the NumPy batches directly, wrapped as a ``DistributedDataset`` so that
  Keras does not re-distribute them. Nothing is held outside the pipeline's
  budget, and no ``numpy_function`` hop or tf.data graph sits between the
  pipeline and the step (``fit`` at 1.2x the steps/s of the same pipeline in
  tf.data in benchmarks/bench_frameworks.py, where the hop made it 0.9x). Under
  a strategy with several
  replicas, or ``steps_per_execution > 1``, Keras needs a real
  ``tf.data.Dataset`` (to split batches across replicas, to loop inside one
  call): ``to_tf`` then, built once per adapter, with one batch prefetched on
  TensorFlow's side.

``MemoryMonitor`` is a callback for any ``fit``, whatever its input.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras
from keras.src.trainers.data_adapters.data_adapter import DataAdapter

from headrace._errors import CheckpointError
from headrace._memory.system import process_memory
from headrace._memory.units import parse_bytes
from headrace._warn import warn_user
from headrace.adapters._elements import ConvertedElements
from headrace.core.node import INFINITE, UNKNOWN
from headrace.core.run import set_next_iteration
from headrace.profiling.trend import fit_trend as trend_of

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = [
    "IteratorCheckpoint",
    "KerasAdapter",
    "MemoryGrowthWarning",
    "MemoryMonitor",
    "MemoryTrend",
    "to_keras",
]

#: How many batches' states an epoch's iterator keeps while a checkpoint is attached:
#: more than any Keras trainer reads ahead of its steps (the JAX one: two).
_KEPT_STATES = 16


class _RecordedElements(ConvertedElements):
    """An epoch's iterator that keeps the state after each of its last batches.

    A checkpoint taken after step *n* must be the state after *n* batches, while
    Keras's trainer may have read more (the JAX trainer keeps two batches on the
    device): :meth:`state_after` answers for any of the last :data:`_KEPT_STATES`.
    """

    def __init__(self, dataset: Dataset, convert: Any, end: Any) -> None:
        super().__init__(dataset, convert, end)
        self.handed = 0
        self.states: collections.deque[tuple[int, dict[str, Any] | CheckpointError]] = (
            collections.deque(maxlen=_KEPT_STATES)
        )
        self._record()

    def _record(self) -> None:
        try:
            state: dict[str, Any] | CheckpointError = self.get_state()
        except CheckpointError as error:  # refused here (out of order): said when asked
            state = error
        self.states.append((self.handed, state))

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.handed = 0
        self.states.clear()
        self._record()

    def __next__(self) -> Any:
        element = super().__next__()
        self.handed += 1
        self._record()
        return element

    def state_after(self, count: int) -> dict[str, Any]:
        for handed, state in self.states:
            if handed == count:
                if isinstance(state, CheckpointError):
                    raise CheckpointError(str(state))
                return state
        raise CheckpointError(
            f"IteratorCheckpoint: no state after batch {count} of this epoch (kept: "
            f"{[handed for handed, _ in self.states]}); Keras read further ahead than "
            f"{_KEPT_STATES} batches"
        )


class KerasAdapter(DataAdapter):  # type: ignore[misc]
    """A Keras 3 ``DataAdapter`` over a headrace dataset: a fresh iterator per epoch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._tf_dataset: Any = None
        #: How the last ``get_tf_dataset`` call hands batches to Keras's TF trainer:
        #: ``"numpy"`` (directly) or ``"tf.data"`` (see the module doc).
        self.tf_route: str | None = None
        #: Set by :class:`IteratorCheckpoint`: each epoch's iterator keeps its states.
        self.recording = False
        #: The last epoch iterator made while recording (what a checkpoint reads).
        self.current: _RecordedElements | None = None
        #: A state the next epoch's iterator resumes from (set by a checkpoint's restore).
        self.resume_from: dict[str, Any] | None = None
        #: The epoch fit is in (set by the checkpoint callback while recording).
        self.epoch: int | None = None

    def _elements(self, convert: Any = None, end: Any = None) -> ConvertedElements:
        # freed when Keras drops the epoch's iterator; an element's error leaves it usable
        if not self.recording:
            return ConvertedElements(self.dataset, convert, end)
        if self.epoch is not None:
            # Epoch e's iterator is iteration e (its reshuffle), however many iterators
            # Keras made before it (one to build the model, one ahead at each epoch's
            # end): a resumed fit then gets the same orders as the uninterrupted one.
            set_next_iteration(self.dataset.node, self.epoch)
        elements = _RecordedElements(self.dataset, convert, end)
        if self.resume_from is not None:
            state, self.resume_from = self.resume_from, None
            elements.set_state(state)
        self.current = elements
        return elements

    def get_numpy_iterator(self) -> ConvertedElements:
        return self._elements()

    def get_jax_iterator(self) -> ConvertedElements:
        return self._elements()  # Keras's JAX trainer puts NumPy batches on devices itself

    def get_tf_dataset(self) -> Any:
        if _steps_one_batch_on_one_replica(sys._getframe(1)):
            self.tf_route = "numpy"
            return _numpy_batches_for_tf(self)
        self.tf_route = "tf.data"
        # Keras asks once per fit/evaluate/predict call; building the tf.data graph
        # (tracing its functions) takes tens of ms, so one is built and reused: every
        # pass over it still runs a fresh headrace iterator. One batch is taken ahead on
        # TensorFlow's side, so that handing it over (a Python call under the GIL, which
        # the pipeline's own threads and Keras's loop also want) overlaps the step
        # instead of delaying it: without it fit ran at 0.84x tf.data's steps/s.
        if self.recording:
            raise CheckpointError(
                "IteratorCheckpoint: this fit hands Keras a tf.data.Dataset (several "
                "replicas or steps_per_execution > 1), whose read-ahead the iterator state "
                "cannot see; checkpoint with one replica and steps_per_execution=1, or on "
                "the JAX or torch backend"
            )
        if self._tf_dataset is None:
            self._tf_dataset = self.dataset.to_tf().prefetch(1)
        return self._tf_dataset

    def get_torch_dataloader(self) -> Any:
        import torch

        if self.recording:  # the epoch's iterator must be one whose states are kept
            return torch.utils.data.DataLoader(_torch_epochs(self), batch_size=None)
        return torch.utils.data.DataLoader(self.dataset.to_torch(), batch_size=None)

    @property
    def num_batches(self) -> int | None:
        size = self.dataset.cardinality()
        return None if size in (INFINITE, UNKNOWN) else size

    @property
    def batch_size(self) -> int | None:
        return None  # headrace batches; Keras needs no batch size for a dataset

    @property
    def has_partial_batch(self) -> bool | None:
        return None

    @property
    def partial_batch_size(self) -> int | None:
        return None


def _steps_one_batch_on_one_replica(caller: Any) -> bool:
    """Whether the Keras TF epoch iterator asking for a dataset (the calling frame) runs
    one step per call on one replica: then its trainer takes NumPy batches as they are.

    Keras does not pass the strategy or ``steps_per_execution`` to the adapter; the
    ``TFEpochIterator`` that calls ``get_tf_dataset`` holds both. Anything unexpected
    (another caller, a Keras that renamed them) answers no: the tf.data route is
    always correct, the direct one only faster.
    """
    epoch_iterator = caller.f_locals.get("self")
    strategy = getattr(epoch_iterator, "_distribute_strategy", None)
    if strategy is None or getattr(epoch_iterator, "steps_per_execution", None) != 1:
        return False
    if "TPU" in type(strategy).__name__:
        return False  # a TPU step takes its inputs from an infeed, not host arrays
    return getattr(strategy, "num_replicas_in_sync", None) == 1


def _numpy_batches_for_tf(adapter: KerasAdapter) -> Any:
    """The dataset's batches as Keras's TF trainer takes them without tf.data."""
    import tensorflow as tf

    class NumpyBatches(tf.distribute.DistributedDataset):  # type: ignore[misc]
        # A DistributedDataset, so that Keras does not hand it to
        # strategy.experimental_distribute_dataset (which wants tf.data); its iterator
        # is then "not a tf.data iterator" to the train function, which calls the
        # compiled step on each batch it yields.
        def __iter__(self) -> ConvertedElements:
            # Keras's TF train function takes one batch per call and stops an epoch of
            # unknown length on OutOfRangeError, as a tf.data iterator would raise; a
            # StopIteration there would leave its step's outputs undefined.
            return adapter._elements(end=_out_of_range)

    def _out_of_range() -> BaseException:
        error: BaseException = tf.errors.OutOfRangeError(None, None, "end of the headrace dataset")
        return error

    return NumpyBatches()


def _torch_epochs(adapter: KerasAdapter) -> Any:
    """An ``IterableDataset`` whose epochs are the adapter's recorded iterators."""
    import torch

    from headrace._structure import map_structure
    from headrace.adapters.torch import as_tensor

    class TorchEpochs(torch.utils.data.IterableDataset):  # type: ignore[type-arg,misc]
        def __iter__(self) -> ConvertedElements:
            return adapter._elements(convert=lambda e: map_structure(as_tensor, e))

    return TorchEpochs()


def to_keras(dataset: Dataset) -> KerasAdapter:
    """``dataset`` as an input for ``model.fit``/``evaluate``/``predict`` (see module doc)."""
    return KerasAdapter(dataset)


class MemoryGrowthWarning(UserWarning):
    """The process's memory grew steadily across epochs: something keeps what it should drop."""


@dataclass(frozen=True)
class MemoryTrend:
    """A least-squares line through the memory at each epoch's end.

    ``slope`` and ``stderr`` are in bytes per epoch; ``leaking`` is whether the
    slope passes the monitor's ``min_growth`` and lies above zero by more than
    the Student-t critical value at ``z`` (see :mod:`headrace.profiling.trend`).
    """

    epochs: int
    slope: float
    stderr: float
    first: int
    last: int
    leaking: bool


def fit_trend(values: list[int], min_growth: float, z: float) -> MemoryTrend:
    """The trend of ``values`` (one per epoch): slope, its standard error, and the verdict
    (:mod:`headrace.profiling.trend`'s test, as ``headrace doctor`` makes it)."""
    trend = trend_of("memory", [float(value) for value in values])
    return MemoryTrend(len(values), trend.ols, trend.stderr, values[0] if values else 0,
                       values[-1] if values else 0, trend.significant(min_growth, z))


class MemoryMonitor(keras.callbacks.Callback):  # type: ignore[misc]
    """Record this process's memory per epoch and every ``every_n_steps``; warn on growth.

    Memory is RssAnon + RssShmem (what a leak grows; file-backed pages of
    memmaps and the page cache are left out). After each epoch past
    ``warmup_epochs`` (the first epoch builds graphs and caches), a line is
    fitted through the epoch-end values; when its slope is above
    ``min_growth`` bytes per epoch and above zero beyond the noise (``z``
    sigmas, as a Student-t test, so that a few epochs of allocator noise are
    not a leak: a steady leak is certain from six fitted epochs, while over
    four it must be near-exact), one :class:`MemoryGrowthWarning` gives the slope and its
    uncertainty. The first verdict waits for ``min_epochs`` fitted epochs (four by
    default): three points leave one degree of freedom, and a warm-up that grows
    for a few epochs before it levels off (on the JAX backend, 15 MiB over the
    first four) then passes for a line. Works with any ``fit`` input (tf.data, arrays, headrace).
    ``steps`` and ``epochs`` hold the samples; :meth:`trend` the verdict.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        *,
        min_growth: int | str = "2MiB",
        warmup_epochs: int = 1,
        min_epochs: int = 4,
        z: float = 3.0,
    ) -> None:
        super().__init__()
        self.every_n_steps = max(int(every_n_steps), 1)
        self.min_growth = parse_bytes(min_growth)
        self.warmup_epochs = warmup_epochs
        self.min_epochs = max(min_epochs, 3)
        self.z = z
        self.steps: list[tuple[int, int, int]] = []  # (epoch, step, bytes)
        self.epochs: list[tuple[int, int]] = []  # (epoch, bytes at its end)
        self.warned = False
        self._epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps.clear()
        self.epochs.clear()
        self.warned = False

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if (batch + 1) % self.every_n_steps == 0:
            self.steps.append((self._epoch, batch + 1, process_memory().charged))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epochs.append((epoch, process_memory().charged))
        trend = self.trend()
        if trend.leaking and not self.warned:
            self.warned = True
            warn_user(
                f"memory grew by {trend.slope / 2**20:.1f} ± {trend.stderr / 2**20:.1f} MiB "
                f"per epoch over {trend.epochs} epochs (RssAnon+RssShmem "
                f"{trend.first / 2**20:.0f} -> {trend.last / 2**20:.0f} MiB): something keeps "
                "what each epoch should drop (an iterator per epoch never closed, a growing "
                "list, a cache); a headrace pipeline's own stages show in iterator.stats()",
                MemoryGrowthWarning,
            )

    def trend(self) -> MemoryTrend:
        """The fitted trend over the epochs seen so far, after the warm-up ones."""
        values = [value for _, value in self.epochs[self.warmup_epochs :]]
        if len(values) < self.min_epochs:
            return MemoryTrend(len(values), 0.0, math.inf, 0, 0, False)
        return fit_trend(values, self.min_growth, self.z)


class IteratorCheckpoint(keras.callbacks.Callback):  # type: ignore[misc]
    """Save where a :func:`to_keras` input stands with the model's checkpoint; resume there.

    ``model.fit`` makes a new iterator per epoch and may read batches ahead of its
    steps, so the position to save is not "the iterator's state" but the state
    after the batches the *steps* consumed. With this callback attached, each
    epoch's iterator keeps its last states, and the callback writes to ``path``
    (a JSON file, replaced atomically) at every epoch's end and, with an int
    ``save_freq``, every ``save_freq`` steps: the epoch, the step, and the
    iterator state (at an epoch's end: none, the next epoch starts afresh; a save
    at an epoch's last step, where Keras knows its steps, is that epoch's end). While
    it is attached, epoch *e*'s iterator is the dataset's iteration *e* (what
    ``reshuffle_each_iteration`` draws its order from), whatever other iterators
    Keras makes, so a resumed fit reshuffles as the uninterrupted one did.
    Save the model at the same moments (``keras.callbacks.ModelCheckpoint`` with
    the same ``save_freq``).

    To resume (a new process): build the same pipeline, make the callback with
    the same ``path``, and call ``fit(..., initial_epoch=callback.initial_epoch)``:
    the first epoch continues after the saved step (Keras then warns that the
    input ran out of data for that shortened epoch) and later ones are the
    uninterrupted run's, batch for batch.

    Works where Keras takes the batches from the adapter's iterator (the JAX,
    torch and NumPy backends, and the TensorFlow one with one replica and
    ``steps_per_execution=1``); where Keras needs a ``tf.data.Dataset`` it raises
    :class:`~headrace._errors.CheckpointError` naming why.
    """

    def __init__(
        self, adapter: KerasAdapter, path: str | os.PathLike[str], *, save_freq: str | int = "epoch"
    ) -> None:
        super().__init__()
        if not isinstance(adapter, KerasAdapter):
            raise TypeError(
                f"IteratorCheckpoint takes the adapter fit reads (ds.to_keras()), got "
                f"{type(adapter).__name__}"
            )
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"IteratorCheckpoint: save_freq must be 'epoch' or a positive int, got "
                f"{save_freq!r}"
            )
        self.adapter = adapter
        self.path = os.fspath(path)
        self.save_freq = save_freq
        adapter.recording = True
        #: What ``path`` held when the callback was made (None: start from the beginning).
        self.restored: dict[str, Any] | None = self._read()
        self._pending = self.restored is not None
        self._epoch = 0
        self._base = 0  # steps of this epoch done before the run resumed it

    @property
    def initial_epoch(self) -> int:
        """The epoch to pass to ``fit(initial_epoch=...)``: the checkpoint's, or 0."""
        return 0 if self.restored is None else int(self.restored["epoch"])

    def _read(self) -> dict[str, Any] | None:
        if not os.path.exists(self.path):
            return None
        with open(self.path, encoding="utf-8") as file:
            try:
                saved = json.load(file)
            except ValueError as error:
                raise CheckpointError(
                    f"IteratorCheckpoint: {self.path} is not JSON ({error})"
                ) from None
        if not isinstance(saved, dict) or saved.get("format") != "headrace.keras_checkpoint":
            raise CheckpointError(
                f"IteratorCheckpoint: {self.path} is not a headrace Keras checkpoint"
            )
        return saved

    def _write(self, epoch: int, step: int, state: dict[str, Any] | None) -> None:
        record = {"format": "headrace.keras_checkpoint", "epoch": epoch, "step": step,
                  "state": state}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(record, file)
        os.replace(temporary, self.path)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self._base = epoch, 0
        self.adapter.epoch = epoch
        if not self._pending:
            return
        self._pending = False
        saved = self.restored
        assert saved is not None
        if int(saved["epoch"]) != epoch:
            raise CheckpointError(
                f"IteratorCheckpoint: {self.path} resumes epoch {saved['epoch']}, but fit "
                f"starts at epoch {epoch}; pass initial_epoch=callback.initial_epoch"
            )
        if saved["state"] is not None:  # within the epoch: its iterator resumes there
            self.adapter.resume_from = saved["state"]
            self._base = int(saved["step"])

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self._base + batch + 1
        if self.save_freq == "epoch" or step % int(self.save_freq):
            return
        if step == (self.params or {}).get("steps"):
            # the epoch's last step: saved as its end, so that a resume starts the next
            # epoch (an epoch resumed with no step left crashed Keras's JAX trainer)
            self._write(self._epoch + 1, 0, None)
            return
        current = self.adapter.current
        if current is None:
            raise CheckpointError("IteratorCheckpoint: fit did not read through the adapter")
        self._write(self._epoch, self._base + batch + 1, current.state_after(batch + 1))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._write(epoch + 1, 0, None)
