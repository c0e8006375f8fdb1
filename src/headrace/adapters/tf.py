"""``Dataset.to_tf()``: a ``tf.data.Dataset`` fed by a headrace pipeline.

For code that needs a real ``tf.data.Dataset`` — legacy ``input_fn``\\ s,
``tf.distribute`` strategies, Keras on the TensorFlow backend. The output
signature is built from the element spec (no element is read when the spec
is known statically), every pass over the TensorFlow dataset runs a fresh
headrace iterator under the pipeline's budget, and a known cardinality is
asserted so that Keras and ``tf.distribute`` know the number of steps.

How elements cross into TensorFlow, and why not ``from_generator``:
``tf.data.Dataset.from_generator`` wraps a ``GeneratorDataset`` in a
``flat_map`` and checks every element's structure in Python, about 0.3 ms
of CPU per element on top of the conversion here — Keras ``fit`` on it ran
at 0.8x the steps/s of the same pipeline in tf.data
(benchmarks/bench_frameworks.py). Here the same ``GeneratorDataset`` is
used directly, with three lean ``tf.numpy_function``\\ s: one opens a
headrace iterator when TensorFlow starts a pass, one pulls the next element
(checking each leaf's dtype and shape against the spec with a few attribute
reads, then handing TensorFlow the flat leaves; ``StopIteration`` ends the
pass), and one closes the iterator when the pass ends or TensorFlow drops
its iterator early. That halves the per-element overhead (measured in
benchmarks/results/frameworks.md). Elements that are already batches cross
once per batch. ``GeneratorDataset`` is private to TensorFlow (it is what
``from_generator`` is built on); where a TensorFlow version lacks it,
``from_generator`` is used, with the same values. No buffer is added on the
TensorFlow side: the pipeline's own ``prefetch`` (booked on its budget) is
what overlaps reading with training.

Errors keep their place. An element's error (from the pipeline or the spec
check) is raised by TensorFlow at that element's position, and the next
``get_next`` continues with the element after it, as headrace's own iterator
does. With a known cardinality the failed element still counts as one: the
pull hands TensorFlow a marker for it, which passes the cardinality assertion
and is raised by a ``map`` after it (a ``tf.cond``, so ordinary elements pay no
Python call for it). Without that, ``assert_cardinality`` would count only the
good elements and end every pass that had an error with
``FailedPreconditionError``, again on every later ``get_next``: a loop that
catches errors (or ``.ignore_errors()``) would never end. One case remains
TensorFlow's: an error *inside* a ``batch`` adds a position (the batch after it
starts afresh, as in tf.data), so that pass has more positions than the
cardinality TensorFlow was told, and ``assert_cardinality`` raises
``FailedPreconditionError`` for the extra one and at the end of that pass.
"""

from __future__ import annotations

import itertools
import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._errors import EmptyInputError, InvalidArgumentError
from headrace._memory.allocator import owns_pooled
from headrace._structure import TensorSpec, flatten, map_structure, shape_allows, structure_paths
from headrace.adapters._elements import ConvertedElements
from headrace.core.handoff import unpin
from headrace.core.node import INFINITE, UNKNOWN

if TYPE_CHECKING:
    from headrace._dataset import Dataset

__all__ = ["tf_signature", "to_tf"]


def _tf_spec(spec: Any, path: str) -> Any:
    import tensorflow as tf

    if not isinstance(spec, TensorSpec):
        raise InvalidArgumentError(f"to_tf: component {path} has no TensorSpec ({spec!r})")
    if spec.kind in ("bytes", "str"):
        dtype = tf.string
    else:
        try:
            dtype = tf.as_dtype(spec.dtype)
        except TypeError:
            raise InvalidArgumentError(
                f"to_tf: component {path} has dtype {spec.dtype}, which TensorFlow has no "
                "type for; cast it first (Dataset.cast or map)"
            ) from None
    return tf.TensorSpec(spec.shape, dtype)


def tf_signature(element_spec: Any) -> Any:
    """The ``tf.TensorSpec`` nest matching a headrace element spec (bytes/str -> tf.string)."""
    counter = iter(range(1 << 30))
    return map_structure(lambda spec: _tf_spec(spec, f"#{next(counter)}"), element_spec)


class _Feed:
    """The Python side of one ``to_tf`` dataset: its open passes, keyed by a number.

    TensorFlow calls :meth:`start` when it creates an iterator (one per pass),
    :meth:`pull` for each element and :meth:`finish` when the iterator ends or
    is destroyed. Passes running at the same time (two TensorFlow iterators)
    have their own keys and headrace iterators.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.specs: list[TensorSpec] = flatten(dataset.element_spec)
        self.paths = structure_paths(dataset.element_spec)
        self.open: dict[int, Any] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        #: errors waiting for :meth:`fail` to raise them, by marker (see :meth:`pull_marked`)
        self.failed: dict[int, Exception] = {}
        self._markers = itertools.count(1)

    def start(self) -> Any:
        with self._lock:
            key = next(self._keys)
        self.open[key] = iter(self.dataset)
        return np.int64(key)

    def finish(self, key: Any) -> Any:
        iterator = self.open.pop(int(key), None)
        if iterator is not None:
            iterator.close()  # threads, files and budget back now, not at garbage collection
        return np.int64(0)

    def pull(self, key: Any) -> list[Any]:
        iterator = self.open.get(int(key))
        if iterator is None:
            raise StopIteration  # finished already; TensorFlow reads this as the end
        leaves = flatten(next(iterator))  # StopIteration ends the pass, as TensorFlow expects
        self._check(leaves)
        for index in range(len(leaves)):
            value = leaves[index]
            # TensorFlow wraps an aligned array's buffer without copying it and then
            # owns it: an op may write its result into it (buffer forwarding). A
            # read-only page (a batch that is a view of a memmap) then kills the
            # process with SIGSEGV, and an array someone else still holds (a view of
            # the user's source array, a cached batch) would be overwritten. Only an
            # array nothing else references (a fresh batch: this list, `value` and
            # getrefcount's argument) is handed over as it is.
            if isinstance(value, np.ndarray) and value.dtype != object and not (
                (value.flags.owndata or owns_pooled(value)) and value.flags.writeable
                and sys.getrefcount(value) <= 3
            ):
                leaves[index] = value.copy()
        return leaves

    def pull_marked(self, key: Any) -> list[Any]:
        """:meth:`pull` with a marker first: 0 and the leaves, or, for an element that
        failed, the error's marker and placeholder leaves (never handed to the user:
        :meth:`fail` raises the error in the element's place)."""
        try:
            return [np.int64(0), *self.pull(key)]
        except StopIteration:
            raise
        except Exception as error:
            with self._lock:
                marker = next(self._markers)
            self.failed[marker] = unpin(error)
            return [np.int64(marker), *[_placeholder(spec) for spec in self.specs]]

    def fail(self, marker: Any) -> Any:
        """Raise the error that :meth:`pull_marked` kept under ``marker``."""
        error = self.failed.pop(int(marker), None)
        if error is None:  # pragma: no cover - a marker is raised once
            raise InvalidArgumentError(f"to_tf: no error kept under marker {int(marker)}")
        raise error

    def _check(self, leaves: list[Any]) -> None:
        for index, (leaf, spec) in enumerate(zip(leaves, self.specs, strict=True)):
            if spec.kind == "numeric" and isinstance(leaf, np.ndarray) and (
                leaf.dtype != spec.dtype or not shape_allows(spec.shape, leaf.shape)
            ):
                raise InvalidArgumentError(
                    f"to_tf: component {self.paths[index]} is {leaf.dtype}{list(leaf.shape)}, "
                    f"but the element spec says {spec}"
                )

    def elements(self) -> ConvertedElements:
        """For ``from_generator`` (the fallback route): one fresh iterator per pass (an
        iterator object: a generator would end the pass at an element's error)."""
        return ConvertedElements(self.dataset)


def _placeholder(spec: TensorSpec) -> np.ndarray:
    """A value of ``spec``'s dtype standing in for a failed element until its error is
    raised (a scalar: TensorFlow checks the dtype of what a ``numpy_function``
    returns, and the shape only where the element is handed out, which this one never is)."""
    if spec.kind in ("bytes", "str"):
        return np.array(b"", dtype=object)
    return np.zeros((), dtype=spec.dtype)


def _generator_dataset_class() -> Any:
    try:
        from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset
    except ImportError:  # pragma: no cover - a TensorFlow without it: from_generator
        return None
    return _GeneratorDataset


_NOTHING = object()


def to_tf(dataset: Dataset) -> Any:
    """A ``tf.data.Dataset`` yielding this pipeline's elements as tensors.

    An empty pipeline whose element spec can only be learnt from an element (a ``map``
    without ``output_signature`` over an empty input) becomes an empty dataset, as
    tf.data runs such a pipeline and yields nothing; with nothing to learn the spec
    from, its ``element_spec`` is an int64 scalar. State the spec
    (``map(..., output_signature=...)``) where a consumer reads it.
    """
    import tensorflow as tf

    try:
        spec = dataset.element_spec
    except EmptyInputError:
        # one stage's input is empty; the pipeline may still yield (a concatenate): only
        # a pipeline that yields nothing becomes the empty dataset, else the error stands
        with iter(dataset) as elements:
            if next(elements, _NOTHING) is not _NOTHING:
                raise
        return tf.data.Dataset.range(0)
    signature = tf_signature(spec)
    flat_signature = tf.nest.flatten(signature)
    feed = _Feed(dataset)
    cardinality = dataset.cardinality()
    generator_dataset = _generator_dataset_class()
    if generator_dataset is not None and len(flat_signature) == len(feed.specs):
        return _pulled(feed, signature, flat_signature, generator_dataset, cardinality)
    result = tf.data.Dataset.from_generator(feed.elements, output_signature=signature)
    if cardinality == INFINITE:
        result = result.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    elif cardinality != UNKNOWN:
        result = result.apply(tf.data.experimental.assert_cardinality(cardinality))
    return result


def _pulled(
    feed: _Feed, signature: Any, flat_signature: list[Any], generator_dataset: Any,
    cardinality: int,
) -> Any:
    """The ``GeneratorDataset`` route (see the module doc); with a finite known
    cardinality, failed elements travel as markers through ``assert_cardinality``
    and are raised by the ``map`` after it."""
    import tensorflow as tf

    out_types = [spec.dtype for spec in flat_signature]
    marked = cardinality >= 0

    def start(_: Any) -> Any:
        return tf.numpy_function(feed.start, [], tf.int64, stateful=True)

    def pull(key: Any) -> Any:
        if not marked:
            leaves = tf.numpy_function(feed.pull, [key], out_types, stateful=True)
        else:
            marker, *leaves = tf.numpy_function(
                feed.pull_marked, [key], [tf.int64, *out_types], stateful=True
            )
        for leaf, spec in zip(leaves, flat_signature, strict=True):
            leaf.set_shape(spec.shape)
        element = tf.nest.pack_sequence_as(signature, leaves)
        return (marker, element) if marked else element

    def finish(key: Any) -> Any:
        return tf.numpy_function(feed.finish, [key], tf.int64, stateful=True)

    output = (tf.TensorSpec([], tf.int64), signature) if marked else signature
    result = generator_dataset(
        tf.constant(0, tf.int64), start, pull, finish, output, name="headrace"
    )
    if cardinality == INFINITE:
        return result.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    if not marked:
        return result
    result = result.apply(tf.data.experimental.assert_cardinality(cardinality))

    def raise_failed(marker: Any, element: Any) -> Any:
        checked = tf.cond(
            marker > 0,
            lambda: tf.numpy_function(feed.fail, [marker], tf.int64, stateful=True),
            lambda: marker,
        )
        with tf.control_dependencies([checked]):
            return tf.nest.map_structure(tf.identity, element)

    return result.map(raise_failed)
