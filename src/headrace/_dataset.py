"""``Dataset``: the immutable, picklable recipe users build pipelines with.

Every method returns a new ``Dataset``; nothing runs until ``iter(dataset)``,
which builds a :class:`~headrace.core.iterator.DatasetIterator` (threads, open
files and budget live there, never here). Argument names and defaults follow
``tf.data`` so that code ports by changing the import; where headrace
differs, the method's docstring says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TextIO

import numpy as np

from headrace._errors import InvalidArgumentError
from headrace._options import AUTOTUNE, Options
from headrace._persist.cache import CacheNode
from headrace._persist.snapshot import SnapshotNode
from headrace._sources.arrays import RangeNode, TensorSlicesNode, TensorsNode, load_npy
from headrace._sources.files import TextLineNode, list_files
from headrace._sources.generator import GeneratorNode
from headrace._structure import flatten, map_structure, pack_as
from headrace._transforms.batch import BatchNode
from headrace._transforms.composed import (
    bucket_by_sequence_length_impl,
    choose_from_datasets_impl,
    dataset_of,
    generator_signature,
    reduce_impl,
    sample_from_datasets_impl,
)
from headrace._transforms.enumerate import EnumerateNode
from headrace._transforms.filter import FilterNode
from headrace._transforms.global_shuffle import GlobalShuffleNode
from headrace._transforms.interleave import InterleaveNode
from headrace._transforms.map import MapNode
from headrace._transforms.padded_batch import PaddedBatchNode
from headrace._transforms.prefetch import PrefetchNode
from headrace._transforms.repeat import RepeatNode
from headrace._transforms.shard import ShardNode
from headrace._transforms.shuffle import ShuffleNode
from headrace._transforms.take import SkipNode, TakeNode
from headrace._transforms.unbatch import RebatchNode, UnbatchNode
from headrace._transforms.zip import ConcatenateNode, ZipNode
from headrace.core.node import (
    INFINITE,
    UNKNOWN,
    Node,
    check_positive,
    known_spec,
    spec_sampling,
)
from headrace.core.run import DatasetIterator
from headrace.io import objstore

if TYPE_CHECKING:
    from headrace.profiling.profiler import Profile

__all__ = ["Dataset", "TFRecordDataset", "TextLineDataset"]


class _Cast:
    """A picklable per-element dtype cast (``Dataset.cast``)."""

    def __init__(self, dtypes: Any) -> None:
        self.dtypes = dtypes
        self.__qualname__ = f"cast({dtypes!r})"

    def __call__(self, *components: Any) -> Any:
        element: Any = components if len(components) != 1 else components[0]
        if isinstance(self.dtypes, dict) and isinstance(element, dict):
            return {
                key: _cast_leaf(value, self.dtypes[key]) if key in self.dtypes else value
                for key, value in element.items()
            }
        if isinstance(self.dtypes, tuple) and isinstance(element, tuple):
            return tuple(
                value if dtype is None else _cast_leaf(value, dtype)
                for value, dtype in zip(element, self.dtypes, strict=True)
            )
        dtype = np.dtype(self.dtypes)
        return map_structure(
            lambda value: _cast_leaf(value, dtype) if _is_float(value) else value, element
        )


def _is_float(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind == "f"


def _cast_leaf(value: Any, dtype: Any) -> Any:
    if isinstance(value, dict):
        return {key: _cast_leaf(item, dtype) for key, item in value.items()}
    return np.asarray(value).astype(dtype, copy=False)


class Dataset:
    """A recipe for a stream of elements, built tf.data-style and run under a byte budget.

    Why a separate recipe and run: a recipe can be pickled, sent to workers
    and iterated many times; all resources (threads, descriptors, buffers)
    belong to one iterator and are freed with it.
    """

    __slots__ = ("_node", "_options")

    def __init__(self, node: Node, options: Options | None = None) -> None:
        self._node = node
        self._options = options or Options()

    # -- sources -------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """One element per row of ``tensors`` (an array or a dict/tuple of arrays).

        Rows are read-only **views** of your arrays: nothing is copied, and the
        arrays' memory is not charged to the budget. ``np.memmap`` arrays work
        for data larger than RAM. A *list* is one array (as in tf.data); a
        tuple is a structure. A list of arrays or of strings is not stacked
        into that array: its rows are served from your list as they are asked
        for (views of your arrays, ``str`` encoded to ``bytes`` then), so the
        pipeline holds no copy of it; its rows must all have one shape. An
        array of strings (``<U``, ``S``, ``object``) is served the same way.
        Python ints become int64 (NumPy's rule; tf.data would give int32 for
        small values); a list of numbers is converted to one array. Bytes and
        strings become exact Python objects in ``object`` arrays.
        """
        return Dataset(TensorSlicesNode(tensors))

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """A dataset of exactly one element: ``tensors`` itself (read-only views).

        A list of arrays or strings is stacked when the element is made, not
        kept stacked by the dataset.
        """
        return Dataset(TensorsNode(tensors))

    @staticmethod
    def range(
        start: int, stop: int | None = None, step: int = 1, *, output_type: Any = np.int64
    ) -> Dataset:
        """int64 scalars like Python's ``range`` (``range(5)``, ``range(2, 10, 3)``).

        ``output_type`` (a NumPy or TensorFlow dtype) gives scalars of another type.
        """
        return Dataset(RangeNode(start, stop, step, output_type))

    @staticmethod
    def random(
        seed: int | None = None, rerandomize_each_iteration: bool | None = None
    ) -> Dataset:
        """An infinite stream of random int64 values in ``[0, 2**32)``, as tf.data's.

        Same seed, same sequence (NumPy's Philox: not TensorFlow's sequence); each
        iteration repeats it unless ``rerandomize_each_iteration``. Resumable.
        """
        from headrace._sources.random import RandomNode

        return Dataset(RandomNode(seed, rerandomize_each_iteration))

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: Sequence[Any] | None = None,
        output_signature: Any = None,
    ) -> Dataset:
        """Elements from ``generator(*args)``, called anew for each epoch.

        ``output_signature`` (a :class:`TensorSpec` or a nest of them), or
        tf.data's older ``output_types`` (+ ``output_shapes``, unknown rank when
        left out), is required: every yielded element is checked and converted
        against it (``str`` declared bytes is UTF-8 encoded, as tf.data does),
        and a mismatch names the element index and component. Resuming replays
        the generator and skips what was already produced.
        """
        signature = generator_signature(output_types, output_shapes, output_signature)
        return Dataset(GeneratorNode(generator, signature, tuple(args or ())))

    @staticmethod
    def from_npy(path: str | os.PathLike[str]) -> Dataset:
        """Rows of a ``.npy`` file, memory-mapped read-only: never read whole into RAM.

        The file's pages are file-backed (the kernel can drop and re-read them),
        so a 100 GB array streams through a 256 MiB budget.
        """
        return Dataset(_NpyNode(path))

    # -- introspection -------------------------------------------------------------------
    @staticmethod
    def from_sql(
        query: str,
        params: Sequence[Any] = (),
        *,
        connection: Any,
        key: str | None = None,
        batch_size: int = 1024,
        page_rows: int = 65536,
        null_defaults: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, Any] | None = None,
        max_retries: int = 3,
        retry_delay: float = 0.2,
    ) -> Dataset:
        """Rows of a SQL query in batches of ``{column: NumPy array}``.

        ``connection``: ``"sqlite:///path.db"``, ``"postgresql://..."`` (the
        ``[postgres]`` extra) or a picklable function returning a sqlite3 or ADBC
        PostgreSQL connection. ``params`` are the query's own parameters (``?`` for
        SQLite, ``$1`` for PostgreSQL) — never format values into ``query``, which
        is one statement (a trailing ``;`` or comment is fine). With ``key`` (a
        column whose values are unique and never NULL, sortable) reads are paged by
        key (``page_rows`` a page, booked on the budget), resume from the last key,
        retry a lost connection from it up to ``max_retries`` times, and shard by
        key under ``auto_shard(..., policy="data")``; a key found not unique or
        NULL while reading raises :class:`SqlError` (pages would skip rows). A
        wrong query fails at once with the database's message, never retried.
        NULLs take ``null_defaults[column]`` or raise naming the column, row and
        key. ``dtypes`` fixes a column's NumPy type; otherwise SQLite's come from
        the first page (a page holds at least ``batch_size`` rows: ``page_rows`` is
        raised to it), a page whose values mix kinds (ints and text) making the
        column ``object``, each value kept as it is; a later value that type would
        change (1.5 or '1' in int64) raises :class:`SqlError` rather than being
        converted. See :mod:`headrace._sources.sql`.
        """
        from headrace._sources.sql import SqlNode

        return Dataset(SqlNode(query, params, connection, key, batch_size, page_rows,
                               null_defaults or {}, dtypes or {}, max_retries, retry_delay))

    @property
    def element_spec(self) -> Any:
        """The nested :class:`TensorSpec` of each element (``None`` = unknown size).

        Where a stage cannot know it without data (``map`` without
        ``output_signature``, ``interleave``) the first element is read once, with
        this dataset's options (its memory budget); an empty input is an
        :class:`~headrace._errors.EmptyInputError` (an :class:`ElementSpecError`) here
        only: iterating never needs the spec, and an empty stream yields nothing, as
        in tf.data. Nothing else (building, ``repr``) reads data.
        """
        with spec_sampling(self._options):
            return self._node.element_spec

    def cardinality(self) -> int:
        """Number of elements, or ``headrace.INFINITE`` / ``headrace.UNKNOWN`` (as tf.data)."""
        return self._node.cardinality()

    def __len__(self) -> int:
        size = self.cardinality()
        if size == INFINITE:
            raise TypeError("the dataset is infinite" + _hand_off_hint(sys._getframe(1)))
        if size == UNKNOWN:
            raise TypeError(
                "the dataset's length is unknown without reading it"
                + _hand_off_hint(sys._getframe(1))
            )
        return size

    def __getitems__(self, indices: Any) -> Any:
        """Refused, naming the adapter: a pipeline is a stream, read in order.

        torch's ``DataLoader`` takes an object that is not an ``IterableDataset`` for a
        map-style dataset and fetches its samples with ``dataset.__getitems__(indices)``
        (a name only torch uses); this is where it hears that a headrace dataset goes
        through :meth:`to_torch`. No ``__getitem__``: NumPy would take a dataset for a
        sequence and read it. (Random access by index is a saved dataset's:
        :meth:`load`, then ``global_shuffle``.)
        """
        raise TypeError(
            "torch's DataLoader took a headrace.Dataset for a map-style dataset and asked "
            f"for the samples at {list(indices)[:4]!r}...; a headrace.Dataset is a stream: "
            "pass ds.to_torch() and keep headrace's batches: "
            "DataLoader(ds.to_torch(), batch_size=None)"
        )

    @property
    def __array__(self) -> Any:
        """Keras 3 chooses its input adapter by probing ``hasattr(x, "__array__")`` first;
        there ``model.fit(ds)`` hears to pass :meth:`to_keras` (else Keras says only
        "Unrecognized data type"). Absent for everyone else (NumPy included)."""
        if _caller_module(sys._getframe(1)).startswith("keras."):
            raise TypeError(
                "Keras got a headrace.Dataset: pass ds.to_keras() to fit/evaluate/predict "
                "(and validation_data=val.to_keras()); it is the Keras DataAdapter that "
                "runs one pass of the pipeline per epoch (pip install headrace[keras])"
            )
        raise AttributeError("__array__")

    @property
    def options(self) -> Options:
        """The options this dataset's iterators run with."""
        return self._options

    def fingerprint(self) -> str:
        """A digest of the pipeline's structure; iterator states carry it."""
        return self._node.fingerprint()

    # -- running -------------------------------------------------------------------------
    def __iter__(self) -> DatasetIterator:
        return DatasetIterator(self._node, self._options)

    def as_numpy_iterator(self) -> DatasetIterator:
        """An iterator of NumPy elements (headrace's elements already are NumPy)."""
        return iter(self)

    def profile(
        self,
        steps: int | None = None,
        epochs: int = 1,
        *,
        report: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
        stream: TextIO | None = None,
        interval: float = 0.05,
        lint: bool = True,
        title: str | None = None,
    ) -> Profile:
        """Run the pipeline and measure every stage: a :class:`~headrace.profiling.Profile`.

        ``epochs`` iterators (as Keras makes one per epoch), each for ``steps``
        elements or to the end. Per stage: elements in and out, time waiting on
        its input vs working, throughput, inflation, share, held and peak bytes;
        over time: memory by stage against the budget and the process's own
        measure, and the decisions taken (shrinks, AUTOTUNE). ``report``: also
        write the self-contained HTML report there. ``print(profile.format())``
        shows the table. ``progress`` prints a live line to ``stream`` (default:
        stderr, when it is a terminal); memory is sampled every ``interval``
        seconds; ``lint`` adds the recipe's findings; ``title`` heads the report.
        This is the one way to profile from Python (``headrace profile`` from the
        shell); ``headrace.profiling.profile`` is deprecated.
        """
        from headrace.profiling.profiler import profile

        result = profile(self, steps=steps, epochs=epochs, progress=progress, stream=stream,
                         interval=interval, lint=lint, title=title)
        if report is not None:
            result.write_html(os.fspath(report))
        return result

    def with_options(self, options: Options) -> Dataset:
        """The same recipe with ``options`` merged over the current ones."""
        if not isinstance(options, Options):
            raise InvalidArgumentError(f"with_options needs an Options, got {options!r}")
        return Dataset(self._node, self._options.merge(options))

    def _wrap(self, node: Node) -> Dataset:
        return Dataset(node, self._options)

    # -- extending -----------------------------------------------------------------------
    @property
    def node(self) -> Node:
        """The recipe this dataset is a facade over (a :class:`headrace.core.Node`).

        A transformation written outside headrace builds its node over this one
        and returns it with :meth:`derive`.
        """
        return self._node

    def derive(self, node: Node) -> Dataset:
        """A dataset over ``node`` with this dataset's options.

        How a third-party transformation returns its result: the options (the
        memory budget above all) carry over, as they do for built-in stages.
        """
        if not isinstance(node, Node):
            raise InvalidArgumentError(
                f"derive needs a headrace.core.Node, got {type(node).__name__}"
            )
        return self._wrap(node)

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """``transformation_func(self)``: plug a reusable chain or a custom stage in fluently.

        As tf.data's ``apply``: lets ``ds.apply(my_library.dedupe(...)).batch(32)``
        read in order instead of ``dedupe(...)(ds).batch(32)``.
        """
        result = transformation_func(self)
        if not isinstance(result, Dataset):
            raise InvalidArgumentError(
                f"apply: {getattr(transformation_func, '__qualname__', transformation_func)!r} "
                f"must return a Dataset, got {type(result).__name__}"
            )
        return result

    # -- transformations -----------------------------------------------------------------
    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        *,
        output_signature: Any = None,
        workers: str | None = None,
        output_nbytes: Callable[[Any], int] | None = None,
    ) -> Dataset:
        """Apply ``map_func`` to each element (a tuple is unpacked into arguments).

        ``num_parallel_calls=N`` or ``AUTOTUNE`` runs calls on threads, with
        the work in flight booked on the budget. ``deterministic=None`` means
        the pipeline option (True by default): input order is kept.

        ``workers`` says where parallel calls run: ``"threads"`` (the default:
        right for NumPy, I/O and decoders, which release the GIL),
        ``"processes"`` (pure-Python functions: ``num_parallel_calls`` worker
        processes, ``map_func`` pickled once per worker, arrays through shared
        memory), or ``"auto"`` (measure the first calls, then choose; the
        choice shows in ``stats().workers``). Order, errors and checkpoints are
        the same whichever runs them.

        ``output_signature`` (a :class:`TensorSpec` or a nest of them) states
        the spec of ``map_func``'s results. headrace does not trace functions as
        tf.data does: without it, :attr:`element_spec` (and stages that need it,
        such as ``padded_batch``) learn it by reading one input element and
        calling ``map_func`` on it — avoid that for expensive functions or
        inputs that cannot be read twice.

        ``output_nbytes(element)`` says how many bytes ``map_func``'s output for that
        input will take (e.g. :func:`headrace.image.decoded_nbytes` from an image's
        header): parallel calls are then booked at that size *before* they run,
        instead of at what the outputs so far suggest (the largest of them, or, for
        an input larger than any seen, its size times the ratio of the largest output
        to the largest input), and a call whose output
        does not fit beside what the stage holds waits for room. What outputs are
        seen to cost beyond the hint (an array's header, where the hint counts its
        data) is added to it. A hint that raises, or answers anything but a finite
        number of bytes of at least 0, is that element's error, in its place; one
        that understates an output by more than twice its call's booking is no
        longer trusted (the map then books as without it).
        """
        if workers is not None and workers != "threads":  # registers the process iterator
            import headrace._transforms.process_map  # noqa: F401
        return self._wrap(
            MapNode(
                self._node, map_func, num_parallel_calls, deterministic,
                output_signature=output_signature, workers=workers,
                output_nbytes=output_nbytes,
            )
        )

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keep elements for which ``predicate`` returns a scalar True."""
        return self._wrap(FilterNode(self._node, predicate))

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Consecutive elements stacked along a new first axis.

        On an array source a batch is one read-only slice (or one gather after
        a shuffle): no per-row copy. The last partial batch is kept unless
        ``drop_remainder``. ``num_parallel_calls`` and ``deterministic`` are
        accepted for tf.data's signature and checked; a batch is one NumPy
        copy (or none), so headrace assembles batches in order on the
        consumer's thread, and the order is always tf.data's deterministic one.
        """
        if num_parallel_calls is not None and num_parallel_calls != AUTOTUNE:
            check_positive("batch: num_parallel_calls", num_parallel_calls)
        return self._wrap(BatchNode(self._node, batch_size, drop_remainder))

    def ragged_batch(
        self, batch_size: int, drop_remainder: bool = False, row_splits_dtype: Any = np.int64
    ) -> Dataset:
        """Batch elements whose first dimension differs, unpadded: see
        :mod:`headrace._transforms.ragged_batch` (components of rank >= 1 become
        ``RaggedColumn``\\ s — the values and row splits of a ``tf.RaggedTensor``)."""
        from headrace._transforms.ragged_batch import RaggedBatchNode

        return self._wrap(
            RaggedBatchNode(self._node, batch_size, drop_remainder, row_splits_dtype)
        )

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Batch elements of different shapes, padding each component.

        ``padded_shapes=None`` pads every dimension to the batch's largest;
        a fixed size pads to that size (an element larger than it is an error
        naming the element, as tf.data's "Attempted to pad to a smaller size").
        Padding defaults to 0, ``b""``/``""`` or False.
        """
        return self._wrap(
            PaddedBatchNode(self._node, batch_size, padded_shapes, padding_values, drop_remainder)
        )

    def unbatch(self) -> Dataset:
        """Split each batched element back into its rows."""
        return self._wrap(UnbatchNode(self._node))

    def rebatch(self, batch_size: int | Sequence[int], drop_remainder: bool = False) -> Dataset:
        """``unbatch().batch(N)`` in one step; a list of sizes is used in turn (tf.data)."""
        return self._wrap(RebatchNode(self._node, batch_size, drop_remainder))

    def shuffle(
        self,
        buffer_size: int,
        seed: int | None = None,
        reshuffle_each_iteration: bool = True,
    ) -> Dataset:
        """Randomly reorder elements through a buffer of ``buffer_size`` (tf.data's algorithm).

        On a random-access source (arrays, ranges, indexed files) the buffer
        holds indices, so even a full shuffle costs 8 bytes per element.
        Otherwise a buffer larger than the budget allows shrinks to fit, with
        one warning. Same seed and budget: same order; each new iterator
        reshuffles unless ``reshuffle_each_iteration=False``.
        """
        return self._wrap(ShuffleNode(self._node, buffer_size, seed, reshuffle_each_iteration))

    def global_shuffle(
        self, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Every element exactly once, in a full random order, holding nothing.

        Needs a random-access dataset (arrays, ranges, ``from_npy``, indexed
        TFRecord files), read through what tf.data 2.21 reads through: map, zip,
        concatenate, enumerate, take, skip, shard, a finite repeat,
        ``batch(drop_remainder=True)``, prefetch, cache; other stages and an
        empty input are refused, naming the stage. The order comes from a
        keyed permutation, so there is no buffer to fill, no first-batch wait,
        and resuming is O(1). Workers sharing a seed can ``shard`` it disjointly.
        """
        return self._wrap(GlobalShuffleNode(self._node, seed, reshuffle_each_iteration))

    def parse_examples(self, features: Mapping[str, Any]) -> Dataset:
        """Parse batches of serialized ``tf.train.Example`` records into dicts of columns.

        Apply after ``batch``: one columnar parse per batch (C code when built)
        instead of one Python call per record. ``features`` maps names to
        ``FixedLenFeature``/``VarLenFeature``/``FixedLenSequenceFeature``/
        ``RaggedFeature`` specs from :mod:`headrace.io.example`, as in
        ``tf.io.parse_example``. The spec is checked and planned here, once: a mistake in
        it raises now, not at the first batch. The parsed features are booked on this
        stage's share of the budget before they are made (an int64 parses to 8 times
        its wire size): a batch that cannot fit is refused, naming ``parse_examples``;
        a smaller ``batch`` before it fits.
        """
        from headrace._transforms.parse_examples import ParseExamplesNode

        return self._wrap(ParseExamplesNode(self._node, features))

    def prefetch(self, buffer_size: int | None) -> Dataset:
        """Prepare up to ``buffer_size`` elements on a background thread.

        ``AUTOTUNE`` (or ``None``, as in tf.data) grows the depth while the
        consumer waits, inside the stage's share of the budget; ``0`` prefetches
        nothing.
        """
        return self._wrap(PrefetchNode(self._node, buffer_size))

    def repeat(self, count: int | None = None) -> Dataset:
        """The dataset ``count`` times (``None`` or negative: forever), a new pass each time."""
        return self._wrap(RepeatNode(self._node, count))

    def cache(self, filename: str | os.PathLike[str] = "") -> Dataset:
        """Read the input once; every later epoch (of a ``repeat``, or a new ``iter()``)
        reads the cache.

        ``filename=""``: in memory while it fits this stage's share of the
        budget, then spilled to a temporary directory (one warning), so it never
        passes the budget; kept, booked, with the dataset (freed when the dataset
        is garbage-collected), as tf.data keeps it. ``filename``:
        tf.data's persistent cache, complete only at the end of the input, reused
        by later runs of the same pipeline over the same data (keyed by content:
        a digest of its arrays, the identity of its files; a changed input rebuilds
        it). Stopping early (``cache().take(k)``)
        discards the partial cache, as tf.data does: write ``take(k).cache()``.
        ``filename`` may be an ``s3://``, ``gs://`` or ``az://`` URL, for runs on
        machines that do not outlive the job: the first complete pass is written
        locally and uploaded when it completes (the manifest last, only if no other
        writer's is there), later passes anywhere read it with ranged reads
        (:mod:`headrace._persist.remote_store`); ``file://`` is the path.
        See :mod:`headrace._persist.cache`.
        """
        return self._wrap(CacheNode(self._node, filename))

    def snapshot(
        self, path: str | os.PathLike[str], compression: str | None = "AUTO"
    ) -> Dataset:
        """tf.data's ``snapshot``: the first complete pass is saved under ``path`` (in a
        directory named by this pipeline's content fingerprint: its structure, a digest
        of its arrays, the identity of its files, so a changed input makes a new
        snapshot), later passes — in any process — read it. ``path`` may be an
        ``s3://``, ``gs://`` or ``az://`` URL: written locally, uploaded when the first
        pass completes, read with ranged reads (:mod:`headrace._persist.remote_store`).
        See :mod:`headrace._persist.snapshot` for the differences.
        """
        return self._wrap(SnapshotNode(self._node, path, compression))

    def take(self, count: int) -> Dataset:
        """At most the first ``count`` elements (negative: all)."""
        return self._wrap(TakeNode(self._node, count))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (negative: skip all)."""
        return self._wrap(SkipNode(self._node, count))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Elements ``index``, ``index + num_shards``, ... (tf.data's element-level shard)."""
        return self._wrap(ShardNode(self._node, num_shards, index))

    def interleave(
        self,
        map_func: Callable[..., Dataset],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        *,
        workers: str = "threads",
    ) -> Dataset:
        """Mix the datasets ``map_func`` makes of each element, in tf.data's exact order.

        ``cycle_length`` inputs are open at once, ``block_length`` (default 1)
        consecutive elements come from each. Left as ``None``, ``cycle_length``
        depends on this machine's CPU count, as in tf.data (a warning says so):
        pass it for an order that is the same everywhere. With
        ``num_parallel_calls`` (<= cycle_length) slots read ahead on threads;
        the order stays the sequential one unless ``deterministic=False``. All
        inner pipelines share this stage's part of the budget, and their files
        count against the process-wide cap on open files.

        ``workers="processes"`` runs the inner pipelines (reading and parsing
        shards) in ``num_parallel_calls`` worker processes instead, so GIL-bound
        readers use every core; ``map_func`` must then be picklable, and the
        order is the sequential one always (see
        :mod:`headrace._transforms.process_interleave`).
        """
        return self._wrap(
            InterleaveNode(
                self._node, map_func, cycle_length, block_length, num_parallel_calls,
                deterministic, workers,
            )
        )

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        """The datasets ``map_func`` makes of each element, one after another."""
        return self.interleave(map_func, cycle_length=1, block_length=1)

    @staticmethod
    def list_files(
        file_pattern: str | Sequence[str], shuffle: bool | None = None, seed: int | None = None
    ) -> Dataset:
        """Paths matching a glob pattern, as ``str``; shuffled unless ``shuffle=False`` (tf.data).

        The list is sorted before any shuffle, so the same seed gives the same
        order on every machine. No match is an error naming the pattern, and so is
        a file name without wildcards that names no file (tf.data leaves it out).
        """
        files = np.array(list_files(file_pattern), dtype=object)
        dataset = Dataset(TensorSlicesNode(files, keep_str=True, paths=True))
        if shuffle is None or shuffle:
            dataset = dataset.shuffle(len(files), seed=seed)
        return dataset

    @staticmethod
    def zip(*datasets: Any) -> Dataset:
        """Elements of several datasets side by side, ending with the shortest.

        Accepts ``zip(a, b)``, ``zip((a, b))`` or ``zip({"x": a, "y": b})``.
        """
        structure: Any = datasets[0] if len(datasets) == 1 else tuple(datasets)
        leaves = flatten(_datasets_as_leaves(structure))
        if not leaves or not all(isinstance(leaf, Dataset) for leaf in leaves):
            raise InvalidArgumentError("zip needs Datasets (or a tuple/dict of Datasets)")
        nodes = [leaf._node for leaf in leaves]
        node = ZipNode(pack_as(structure, nodes), nodes)
        return Dataset(node, leaves[0]._options)

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then ``dataset``'s (same structure and dtypes)."""
        return self._wrap(ConcatenateNode(self._node, dataset._node))

    def enumerate(self, start: int = 0) -> Dataset:
        """``(index, element)`` pairs, the index an int64 counting from ``start``."""
        return self._wrap(EnumerateNode(self._node, start))

    # -- tf.data's other transformations (each in its own module) ------------------------
    def take_while(self, predicate: Callable[..., Any]) -> Dataset:
        """Elements up to the first for which ``predicate`` is False (input not read past it)."""
        from headrace._transforms.take_while import TakeWhileNode

        return self._wrap(TakeWhileNode(self._node, predicate))

    def ignore_errors(self, log_warning: bool = False) -> Dataset:
        """Drop the elements whose production raised (see :mod:`headrace._transforms.ignore_errors`)."""
        from headrace._transforms.ignore_errors import IgnoreErrorsNode

        return self._wrap(IgnoreErrorsNode(self._node, log_warning))

    def unique(self) -> Dataset:
        """Each distinct element once, in order of first appearance; the set of values
        seen is booked on the budget (see :mod:`headrace._transforms.unique`)."""
        from headrace._transforms.unique import UniqueNode

        return self._wrap(UniqueNode(self._node))

    def scan(self, initial_state: Any, scan_func: Callable[[Any, Any], Any]) -> Dataset:
        """Carry a state: ``scan_func(state, element) -> (new_state, output)`` emits ``output``.

        A checkpoint is a count: restoring re-runs ``scan_func`` over the input so far.
        """
        from headrace._transforms.scan import ScanNode

        return self._wrap(ScanNode(self._node, initial_state, scan_func))

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """``reduce_func(state, element) -> new_state`` over every element; the final state."""
        return reduce_impl(self, initial_state, reduce_func)

    def get_single_element(self) -> Any:
        """The one element of this dataset; an error if it has none or more than one."""
        with iter(self) as iterator:
            try:
                element = next(iterator)
            except StopIteration:
                raise InvalidArgumentError(
                    "get_single_element: the dataset was empty; it must have exactly one element"
                ) from None
            try:
                next(iterator)
            except StopIteration:
                return element
        raise InvalidArgumentError(
            "get_single_element: the dataset had more than one element; it must have exactly one"
        )

    def window(
        self,
        size: int,
        shift: int | None = None,
        stride: int = 1,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Windows of ``size`` elements, each a dataset per component, as tf.data's
        (use ``flat_map(lambda w: w.batch(size))``); see :mod:`headrace._transforms.window`."""
        from headrace._transforms.window import WindowNode

        return self._wrap(
            WindowNode(self._node, size, shift, stride, drop_remainder, _dataset_of)
        )

    def group_by_window(
        self,
        key_func: Callable[..., Any],
        reduce_func: Callable[[Any, Dataset], Dataset],
        window_size: int | None = None,
        window_size_func: Callable[[Any], Any] | None = None,
    ) -> Dataset:
        """Group elements by ``key_func`` into windows reduced by ``reduce_func``, in
        tf.data's order; see :mod:`headrace._transforms.group_by_window`."""
        from headrace._transforms.group_by_window import GroupByWindowNode

        return self._wrap(
            GroupByWindowNode(
                self._node, key_func, reduce_func, window_size, window_size_func, _dataset_of
            )
        )

    def bucket_by_sequence_length(
        self,
        element_length_func: Callable[..., Any],
        bucket_boundaries: Sequence[int],
        bucket_batch_sizes: Sequence[int],
        padded_shapes: Any = None,
        padding_values: Any = None,
        pad_to_bucket_boundary: bool = False,
        no_padding: bool = False,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Batch elements of similar length together, as tf.data (``group_by_window``
        keyed by bucket, each bucket's batches padded to its longest or boundary)."""
        return bucket_by_sequence_length_impl(
            self, element_length_func, bucket_boundaries, bucket_batch_sizes, padded_shapes,
            padding_values, pad_to_bucket_boundary, no_padding, drop_remainder,
        )

    @staticmethod
    def choose_from_datasets(
        datasets: Sequence[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
    ) -> Dataset:
        """Element ``i`` from ``datasets[choice_i]``, the choices an int64 dataset (tf.data)."""
        return choose_from_datasets_impl(Dataset, datasets, choice_dataset, stop_on_empty_dataset)

    @staticmethod
    def sample_from_datasets(
        datasets: Sequence[Dataset],
        weights: Sequence[float] | None = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset:
        """Elements drawn at random from ``datasets`` in proportion to ``weights`` (tf.data)."""
        return sample_from_datasets_impl(
            Dataset, datasets, weights, seed, stop_on_empty_dataset, rerandomize_each_iteration
        )

    def cast(self, dtypes: Any) -> Dataset:
        """Lower (or raise) precision of chosen components, e.g. float32 -> float16.

        ``dtypes`` is one dtype (applied to every floating-point component),
        a dict ``{key: dtype}`` for dict elements, or a tuple with ``None``
        for components to leave alone. Halving float bytes halves what every
        buffer after this stage holds.
        """
        return self._wrap(MapNode(self._node, _Cast(dtypes), None, None, stage="cast"))

    def save_tfrecords(
        self,
        path: str | os.PathLike[str],
        *,
        num_shards: int = 1,
        compression_type: str | None = None,
        progress: bool | Literal["always"] = True,
        batched: bool = False,
    ) -> list[str]:
        """Write this dataset of dicts as ``tf.train.Example`` records across ``num_shards``.

        Offline preprocessing: shards are atomic (all appear under their final
        names only when every one is complete), each uncompressed shard gets a
        ``.hrx`` record index (so it can be read by random access: global
        shuffle, O(1) resume), and a progress bar on a terminal shows how far it
        got (``progress="always"`` forces it). ``batched=True`` writes each row
        of batched elements as one Example — the fast path. Returns the paths.
        See :func:`headrace._persist.writers.save_tfrecords`.
        """
        from headrace._persist.writers import save_tfrecords

        return save_tfrecords(
            self,
            path,
            num_shards=num_shards,
            compression_type=compression_type,
            progress=progress,
            batched=batched,
        )

    # -- frameworks ----------------------------------------------------------------------
    def to_tf(self) -> Any:
        """A ``tf.data.Dataset`` with an output signature built from :attr:`element_spec`.

        For code that needs one (legacy input functions, ``tf.distribute``);
        each pass runs a fresh headrace iterator. See :mod:`headrace.adapters.tf`.
        """
        from headrace.adapters.tf import to_tf

        return to_tf(self)

    def to_torch(
        self, *, worker_sharding: str = "auto", copy_readonly: bool = False, **device: Any
    ) -> Any:
        """A ``torch.utils.data.IterableDataset`` of tensors sharing the batches' memory.

        Use it in ``DataLoader(..., batch_size=None)``; with ``num_workers > 0``
        each worker reads a disjoint part. ``device="cuda", pin_memory=True``
        (with ``num_threads``, ``buffers``) delivers batches on the GPU through
        reused pinned buffers. See :mod:`headrace.adapters.torch`.
        """
        from headrace.adapters.torch import to_torch

        return to_torch(
            self, worker_sharding=worker_sharding, copy_readonly=copy_readonly,  # type: ignore[arg-type]
            **device,
        )

    def to_keras(self) -> Any:
        """This dataset for Keras 3's ``fit``/``evaluate``/``predict``, one epoch per pass.

        See :mod:`headrace.adapters.keras`.
        """
        from headrace.adapters.keras import to_keras

        return to_keras(self)

    def save(
        self,
        path: str | os.PathLike[str],
        shard_func: Callable[..., Any] | None = None,
        compression: str | None = None,
        checkpoint_args: dict[str, Any] | None = None,
        *,
        num_shards: int | None = None,
    ) -> None:
        """Write this dataset to the directory ``path``, for :meth:`load` (tf.data's meaning).

        ``shard_func(element) -> int`` picks each element's shard, an id from 0 to
        4095 (default: round robin over ``num_shards``, up to 8 by the CPU count;
        each id up to the largest is a shard of its own); shards are written in
        parallel; ``compression`` is None, ``"GZIP"`` or ``"ZLIB"``;
        ``checkpoint_args={"checkpoint_interval": n}`` makes an interrupted save
        continue from its last checkpoint when called again. The directory is
        complete only once its manifest is written, last. No pickle: see
        :mod:`headrace._persist.saved`. The shard files count against
        ``max_open_files``. With more shards than it lets the save keep open, a
        shard's file is closed as a complete part when another shard needs its
        slot; ``load`` reads a shard's parts in order.
        """
        from headrace._persist.saved import save

        path = objstore.local_path(path) if isinstance(path, str) else path
        save(self, path, shard_func, compression, checkpoint_args, num_shards=num_shards)

    @staticmethod
    def load(
        path: str | os.PathLike[str],
        element_spec: Any = None,
        reader_func: Callable[[Dataset], Dataset] | None = None,
    ) -> Dataset:
        """The dataset :meth:`save` wrote at ``path``.

        Uncompressed and with the default ``reader_func`` (shards interleaved one
        element at a time: the saved order, under default sharding) it is a
        random-access source: ``global_shuffle``, ``shard`` and resume work on
        indices. ``reader_func`` receives a dataset whose elements are the shards'
        datasets, as in tf.data (``lambda shards: shards.interleave(lambda s: s)``).

        A dataset saved empty loads as an empty dataset (its ``element_spec`` raises
        :class:`EmptyInputError` unless ``element_spec`` is given here). A manifest
        that is not valid (missing or garbage fields, a spec nested past reason) raises :class:`DataLossError` naming it; so does an element whose
        structure, dtype or shape is not the element spec's (the manifest's, or
        ``element_spec`` given here), as it is read.
        """
        from headrace._persist.saved import (
            DecodeRecord,
            LoadNode,
            SavedEmpty,
            ShardsAsDatasets,
            SpecCheck,
            load_plan,
        )

        path = objstore.local_path(path) if isinstance(path, str) else path
        directory, manifest, spec, files, compression = load_plan(path, element_spec)
        if spec is None:  # saved empty, no spec given: yields nothing, as in tf.data
            return Dataset.range(0).map(SavedEmpty(directory))
        check = SpecCheck(spec, given=element_spec is not None)  # each element, as decoded
        if reader_func is None and compression is None:
            return Dataset(LoadNode(directory, manifest, spec, check))
        shards = [
            TFRecordDataset(names, compression_type=compression, indexed=compression is None)
            .map(DecodeRecord(directory, check), output_signature=spec)
            for names in files
        ]
        indices = Dataset.range(len(shards))
        if reader_func is None:  # tf.data's default: the shards interleaved one at a time
            return indices.interleave(
                ShardsAsDatasets(shards), cycle_length=max(len(shards), 1), block_length=1
            )
        result = reader_func(indices.map(ShardsAsDatasets(shards)))
        if not isinstance(result, Dataset):
            raise InvalidArgumentError(
                f"load: reader_func must return a Dataset, got {type(result).__name__}"
            )
        return result

    def __repr__(self) -> str:
        """Never reads data: a spec that would need it shows as not known yet."""
        spec = known_spec(self._node)
        shown = "<known after reading an element>" if spec is None else repr(spec)
        return f"<headrace.Dataset element_spec={shown}>"


def _caller_module(frame: Any) -> str:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) else ""


def _hand_off_hint(frame: Any) -> str:
    """What to use instead, when torch's sampler asked a Dataset its length."""
    if _caller_module(frame).startswith("torch."):
        return (
            "; torch's DataLoader took the headrace.Dataset for a map-style dataset: pass "
            "ds.to_torch() instead: DataLoader(ds.to_torch(), batch_size=None)"
        )
    return ""


def _dataset_of(elements: list[Any]) -> Dataset:
    """A window's or group's elements as a small dataset (window, group_by_window)."""
    return dataset_of(Dataset, elements)


def _datasets_as_leaves(structure: Any) -> Any:
    if isinstance(structure, Dataset):
        return structure
    if isinstance(structure, dict):
        return {key: _datasets_as_leaves(value) for key, value in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_datasets_as_leaves(value) for value in structure)
    raise InvalidArgumentError(f"zip needs Datasets, got {type(structure).__name__}")


class _NpyNode(TensorSlicesNode):
    """A memory-mapped ``.npy`` file; pickles as its path, not its contents."""

    stage = "from_npy"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        super().__init__(load_npy(self.path))

    def params(self) -> tuple[Any, ...]:
        return (self.path, *super().params())

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]



class _PerFile:
    """``map_func`` for ``num_parallel_reads``: one file's dataset (picklable)."""

    def __init__(self, make: Callable[[str], Dataset]) -> None:
        self.make = make
        self.__qualname__ = f"per_file({getattr(make, '__qualname__', make)})"

    def __call__(self, filename: str) -> Dataset:
        return self.make(filename)


def read_files_in_parallel(
    filenames: Any, num_parallel_reads: int | None, make: Callable[[str], Dataset]
) -> Dataset | None:
    """tf.data's ``num_parallel_reads``: interleave one dataset per file, cycle = k, block 1.

    k files are open at once, in tf.data's order; whether they read ahead on threads
    is AUTOTUNE's choice (threads only pay when the reads wait — see interleave).
    """
    if num_parallel_reads is None:
        return None
    names = [filenames] if isinstance(filenames, (str, os.PathLike)) else list(filenames)
    cycle = len(names) if num_parallel_reads == AUTOTUNE else num_parallel_reads
    # (paths=True: the files' identities key a cache or snapshot of what is read)
    files = Dataset(
        TensorSlicesNode(np.array([os.fspath(n) for n in names], dtype=object), paths=True)
    )
    return files.interleave(
        _PerFile(make), cycle_length=max(cycle, 1), block_length=1, num_parallel_calls=AUTOTUNE
    )


class _TextFile:
    def __init__(
        self, compression_type: str | None, buffer_size: int | None, max_line_bytes: int | None
    ) -> None:
        self.compression_type, self.buffer_size = compression_type, buffer_size
        self.max_line_bytes = max_line_bytes
        self.__qualname__ = "text_file"

    def __call__(self, filename: str) -> Dataset:
        return TextLineDataset(
            filename, self.compression_type, self.buffer_size, max_line_bytes=self.max_line_bytes
        )


def TextLineDataset(
    filenames: Any,
    compression_type: str | None = None,
    buffer_size: int | None = None,
    num_parallel_reads: int | None = None,
    *,
    max_line_bytes: int | None = None,
) -> Dataset:
    """Lines of text files as ``bytes`` (split on ``\\n``, one trailing ``\\r`` stripped).

    Like ``tf.data.TextLineDataset``: ``compression_type`` ``None``/``"GZIP"``/
    ``"ZLIB"``; ``num_parallel_reads=k`` reads k files at once, interleaved
    round-robin. Files are opened through the process-wide pool, so the cap
    on open descriptors holds; resuming seeks to the saved byte offset.

    ``max_line_bytes`` (default 64 MiB) bounds one line: a longer one raises
    :class:`RecordTooLargeError` naming the file and the line's byte offset,
    after the lines before it were delivered, instead of reading a file with
    no newlines (a binary file, a one-line dump) into memory.
    """
    parallel = read_files_in_parallel(
        filenames, num_parallel_reads, _TextFile(compression_type, buffer_size, max_line_bytes)
    )
    if parallel is not None:
        return parallel
    return Dataset(TextLineNode(filenames, compression_type, buffer_size, max_line_bytes))


class _TFRecordFile:
    def __init__(self, compression_type: str | None, buffer_size: int | None, **kwargs: Any):
        self.compression_type, self.buffer_size, self.kwargs = compression_type, buffer_size, kwargs
        self.__qualname__ = "tfrecord_file"

    def __call__(self, filename: str) -> Dataset:
        return TFRecordDataset(filename, self.compression_type, self.buffer_size, **self.kwargs)


def TFRecordDataset(
    filenames: Any,
    compression_type: str | None = None,
    buffer_size: int | None = None,
    num_parallel_reads: int | None = None,
    *,
    indexed: bool = False,
    build_missing_indexes: bool = True,
    verify_crc: bool = True,
    max_record_bytes: int | None = None,
    skip_corrupt: bool = False,
) -> Dataset:
    """Serialized records of TFRecord files, byte-compatible with TensorFlow, no TF needed.

    Same arguments as ``tf.data.TFRecordDataset``; ``num_parallel_reads=k``
    interleaves k files round-robin. Every record's CRCs are checked
    (``verify_crc=False`` skips that); a declared length over
    ``max_record_bytes`` (default 1 GiB) is refused before anything is
    allocated; a corrupt or truncated record raises :class:`DataLossError`
    naming file and offset, unless ``skip_corrupt=True`` (a bad data CRC skips
    the record, a bad length or truncation the rest of the file; counted).

    ``indexed=True`` (uncompressed files) uses ``.hrx`` record indexes —
    built when missing, refused when stale — to make the dataset
    random-access: shuffles hold indices, ``global_shuffle`` permutes every
    record, ``shard`` reads only its own, resume is O(1).
    """
    from headrace._sources.tfrecord import tfrecord_node

    options: dict[str, Any] = {
        "indexed": indexed,
        "build_missing_indexes": build_missing_indexes,
        "verify_crc": verify_crc,
        "max_record_bytes": max_record_bytes,
        "skip_corrupt": skip_corrupt,
    }
    if not indexed:
        parallel = read_files_in_parallel(
            filenames,
            num_parallel_reads,
            _TFRecordFile(compression_type, buffer_size, **options),
        )
        if parallel is not None:
            return parallel
    return Dataset(tfrecord_node(filenames, compression_type, buffer_size, **options))
