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

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras
from keras.src.trainers.data_adapters.data_adapter import DataAdapter

from headrace._warn import warn_user
from headrace.adapters._elements import ConvertedElements
from headrace.core.node import INFINITE, UNKNOWN
from headrace.memory.system import process_memory
from headrace.memory.units import parse_bytes
from headrace.profiling.trend import fit_trend as trend_of

if TYPE_CHECKING:
    from headrace.dataset import Dataset

__all__ = ["KerasAdapter", "MemoryGrowthWarning", "MemoryMonitor", "MemoryTrend", "to_keras"]


class KerasAdapter(DataAdapter):  # type: ignore[misc]
    """A Keras 3 ``DataAdapter`` over a headrace dataset: a fresh iterator per epoch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._tf_dataset: Any = None
        #: How the last ``get_tf_dataset`` call hands batches to Keras's TF trainer:
        #: ``"numpy"`` (directly) or ``"tf.data"`` (see the module doc).
        self.tf_route: str | None = None

    def _elements(self) -> ConvertedElements:
        # freed when Keras drops the epoch's iterator; an element's error leaves it usable
        return ConvertedElements(self.dataset)

    def get_numpy_iterator(self) -> ConvertedElements:
        return self._elements()

    def get_jax_iterator(self) -> ConvertedElements:
        return self._elements()  # Keras's JAX trainer puts NumPy batches on devices itself

    def get_tf_dataset(self) -> Any:
        if _steps_one_batch_on_one_replica(sys._getframe(1)):
            self.tf_route = "numpy"
            return _numpy_batches_for_tf(self.dataset)
        self.tf_route = "tf.data"
        # Keras asks once per fit/evaluate/predict call; building the tf.data graph
        # (tracing its functions) takes tens of ms, so one is built and reused: every
        # pass over it still runs a fresh headrace iterator. One batch is taken ahead on
        # TensorFlow's side, so that handing it over (a Python call under the GIL, which
        # the pipeline's own threads and Keras's loop also want) overlaps the step
        # instead of delaying it: without it fit ran at 0.84x tf.data's steps/s.
        if self._tf_dataset is None:
            self._tf_dataset = self.dataset.to_tf().prefetch(1)
        return self._tf_dataset

    def get_torch_dataloader(self) -> Any:
        import torch

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


def _numpy_batches_for_tf(dataset: Dataset) -> Any:
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
            return ConvertedElements(dataset, end=_out_of_range)

    def _out_of_range() -> BaseException:
        error: BaseException = tf.errors.OutOfRangeError(None, None, "end of the headrace dataset")
        return error

    return NumpyBatches()


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
    three it must be near-exact), one :class:`MemoryGrowthWarning` gives the slope and its
    uncertainty. Works with any ``fit`` input (tf.data, arrays, headrace).
    ``steps`` and ``epochs`` hold the samples; :meth:`trend` the verdict.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        *,
        min_growth: int | str = "2MiB",
        warmup_epochs: int = 1,
        min_epochs: int = 3,
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
