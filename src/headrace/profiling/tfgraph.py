"""Diagnose an existing ``tf.data.Dataset``: its graph, what each stage will hold, the fixes.

For users who have a tf.data pipeline and an OOM. ``headrace doctor`` reads the
dataset's chain of transformations from two places. The Python dataset objects
carry each op's arguments: cache file names, shuffle buffer sizes, prefetch
depths, interleave cycle lengths. The graph TensorFlow serializes from them
holds, as ``Const`` nodes, the arrays ``from_tensor_slices`` embedded.

It then samples a few elements where sizes change (map, interleave, the source)
and estimates what each stage will hold. It flags the same hazards as
headrace's lint, with fixes, and measures the process's memory across epochs.
It names the headrace equivalent of each stage. TensorFlow is imported only
when a tf.data dataset is given.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from headrace._memory.allocator import release_free_heap
from headrace._memory.system import available_memory
from headrace._memory.units import format_bytes, parse_bytes
from headrace.profiling.doctor import Diagnosis, EpochMeasure, fit_trend
from headrace.profiling.lint import LARGE_ELEMENT, Finding
from headrace.profiling.process import snapshot

__all__ = ["TfStage", "diagnose_tf", "format_tf_stages", "lint_tf", "read_tf_pipeline"]

#: Above this, the graph is not serialized to read it (TensorFlow refuses graphs past
#: 2 GB, and serializing embeds a copy of every constant).
_MAX_SERIALIZE = 256 << 20
#: A stage is not sampled through a buffer estimated above this (it would fill it).
_MAX_SAMPLE_THROUGH = 128 << 20

# Python class name -> (op kind, headrace equivalent)
_KINDS: dict[str, tuple[str, str]] = {
    "_TensorSliceDataset": ("from_tensor_slices",
                            "hr.Dataset.from_tensor_slices(array) (rows are views, no copy); "
                            "larger than RAM: np.save + hr.Dataset.from_npy(path)"),
    "_TensorDataset": ("from_tensors", "hr.Dataset.from_tensors(value)"),
    "_RangeDataset": ("range", "hr.Dataset.range(...)"),
    "TFRecordDatasetV2": ("tfrecord", "hr.TFRecordDataset(files) (descriptors capped)"),
    "_TFRecordDataset": ("tfrecord", "hr.TFRecordDataset(files) (descriptors capped)"),
    "TextLineDatasetV2": ("text", "hr.TextLineDataset(files)"),
    "_GeneratorDataset": ("from_generator", "hr.Dataset.from_generator(...)"),
    "_MapDataset": ("map", "ds.map(fn)"),
    "_ParallelMapDataset": ("map", "ds.map(fn, num_parallel_calls=hr.AUTOTUNE) (work in "
                            "flight booked on the budget)"),
    "_FilterDataset": ("filter", "ds.filter(predicate)"),
    "CacheDataset": ("cache", "no in-memory cache: keep an array source (no copy) or write "
                     "once with ds.save_tfrecords(...) and read hr.TFRecordDataset (page cache, "
                     "not charged)"),
    "_ShuffleDataset": ("shuffle", "ds.shuffle(n, seed=...) (shrinks to fit the budget; over "
                        "a random-access source it shuffles indices)"),
    "_PrefetchDataset": ("prefetch", "ds.prefetch(hr.AUTOTUNE) (depth grows inside the budget)"),
    "_BatchDataset": ("batch", "ds.batch(n, drop_remainder=...)"),
    "_ParallelBatchDataset": ("batch", "ds.batch(n, drop_remainder=...)"),
    "_PaddedBatchDataset": ("padded_batch", "ds.padded_batch(...)"),
    "_UnbatchDataset": ("unbatch", "ds.unbatch()"),
    "_InterleaveDataset": ("interleave", "ds.interleave(fn, cycle_length=...)"),
    "_ParallelInterleaveDataset": ("interleave", "ds.interleave(fn, cycle_length=..., "
                                   "num_parallel_calls=hr.AUTOTUNE) (slots share the budget, "
                                   "files capped)"),
    "_FlatMapDataset": ("flat_map", "ds.flat_map(fn)"),
    "_ShardDataset": ("shard", "ds.shard(n, i)"),
    "_TakeDataset": ("take", "ds.take(n)"),
    "_SkipDataset": ("skip", "ds.skip(n)"),
    "_RepeatDataset": ("repeat", "ds.repeat(count)"),
    "_ZipDataset": ("zip", "hr.Dataset.zip(...)"),
    "_ConcatenateDataset": ("concatenate", "ds.concatenate(other)"),
    "_EnumerateDataset": ("enumerate", "ds.enumerate()"),
}
#: Kinds whose elements are their input's (sizes need no sample).
_SAME_SIZE = {"cache", "shuffle", "prefetch", "filter", "shard", "take", "skip", "repeat"}


@dataclass(frozen=True)
class TfStage:
    """One transformation of a tf.data pipeline, source first in :func:`read_tf_pipeline`."""

    kind: str
    python_type: str
    op: str
    args: dict[str, Any]
    element_bytes: float | None
    #: What this stage will hold in memory at most (None where unbounded or unknown).
    holds: float | None
    #: Bytes of constants this stage embeds in the graph (from_tensor_slices arrays).
    constant_bytes: int
    cardinality: int
    headrace: str
    note: str = ""

    @property
    def name(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.args.items() if k != "filename" or v)
        return f"{self.kind}({shown})" if shown else self.kind


def _scalar_args(dataset: Any) -> dict[str, Any]:
    """The scalar tensor arguments a dataset object keeps (buffer sizes, counts, names)."""
    args: dict[str, Any] = {}
    for name, value in vars(dataset).items():
        if name.startswith("_variant") or not hasattr(value, "numpy"):
            continue
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) != 0:
            continue
        try:
            scalar = value.numpy()
        except Exception:
            continue
        if isinstance(scalar, bytes):
            args[name.lstrip("_")] = scalar.decode("utf-8", "replace")
        elif hasattr(scalar, "item"):
            args[name.lstrip("_")] = scalar.item()
    return args


def _tensor_bytes(tensor: Any) -> int:
    try:
        count = tensor.shape.num_elements()
        if tensor.dtype.name == "string":
            return int(sum(len(v) for v in tensor.numpy().ravel().tolist()))
        return int(count or 0) * int(tensor.dtype.size)
    except Exception:
        return 0


def _element_bytes(element: Any) -> int:
    import tensorflow as tf

    total = 0
    for leaf in tf.nest.flatten(element):
        if hasattr(leaf, "dtype") and leaf.dtype == tf.string:
            total += int(sum(len(v) for v in leaf.numpy().ravel().tolist()))
        elif hasattr(leaf, "numpy"):
            total += int(leaf.numpy().nbytes)
    return total


def _sample(dataset: Any, count: int = 4) -> float | None:
    sizes = [_element_bytes(element) for element in dataset.take(count)]
    return sum(sizes) / len(sizes) if sizes else None


def _graph_ops(dataset: Any, constant_bytes: int) -> tuple[list[str], int, str]:
    """Dataset op types along the chain (output first), bytes of Const nodes, and a note."""
    if constant_bytes > _MAX_SERIALIZE:
        return [], constant_bytes, (
            f"graph not serialized: its constants alone are {format_bytes(constant_bytes)}"
            + (" — past TensorFlow's 2 GB GraphDef limit" if constant_bytes >= 2 << 30 else "")
        )
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    nodes = {node.name: node for node in graph.node}
    consts = 0
    for node in graph.node:
        if node.op == "Const":
            tensor = node.attr["value"].tensor
            consts += len(tensor.tensor_content) or sum(len(s) for s in tensor.string_val)
    ops: list[str] = []
    output = next((n for n in graph.node if n.op == "_Retval"), None)
    current = nodes.get(output.input[0].split(":")[0]) if output is not None else None
    while (current is not None and current.op.endswith("Dataset")) or (
        current is not None and "Dataset" in current.op
    ):
        ops.append(current.op)
        inputs = [nodes.get(name.split(":")[0].lstrip("^")) for name in current.input]
        current = next((n for n in inputs if n is not None and "Dataset" in n.op), None)
    return ops, consts, ""


def read_tf_pipeline(dataset: Any, *, sample: bool = True) -> list[TfStage]:
    """The chain of a ``tf.data.Dataset``, source first, with sizes and what each will hold."""
    chain = []
    current = dataset
    while current is not None:
        chain.append(current)
        inputs = current._inputs()
        current = inputs[0] if inputs else None
    chain.reverse()  # source first
    constants = sum(
        _tensor_bytes(t) for d in chain if type(d).__name__ == "_TensorSliceDataset"
        for t in d._tensors
    )
    ops, graph_consts, graph_note = _graph_ops(dataset, constants)
    ops.reverse()
    aligned = ops if len(ops) == len(chain) else [""] * len(chain)
    stages: list[TfStage] = []
    buffered = 0.0  # largest buffer estimated below: sampling through it would fill it
    for position, item in enumerate(chain):
        python_type = type(item).__name__
        kind, equivalent = _KINDS.get(python_type, (python_type.strip("_").lower(), ""))
        args = _scalar_args(item)
        try:
            cardinality = int(item.cardinality().numpy())
        except Exception:
            cardinality = -2
        below = stages[-1].element_bytes if stages else None
        constant_bytes = 0
        note = ""
        if kind == "from_tensor_slices":
            constant_bytes = sum(_tensor_bytes(t) for t in item._tensors)
            size = constant_bytes / cardinality if cardinality > 0 else None
            note = graph_note or (
                f"the graph embeds {format_bytes(graph_consts)} of constants" if graph_consts
                else ""
            )
        else:
            size = _element_size(kind, args, item, below,
                                 sample and buffered <= _MAX_SAMPLE_THROUGH)
        holds = _holds(kind, args, size, item, constant_bytes)
        if holds is not None:
            buffered = max(buffered, holds)
        elif kind == "cache":
            buffered = float("inf")
        stages.append(TfStage(kind, python_type, aligned[position], args, size, holds,
                              constant_bytes, cardinality, equivalent, note))
    return stages


def _element_size(kind: str, args: dict[str, Any], item: Any, below: float | None,
                  sample: bool) -> float | None:
    """A stage's element size: from the stage below where the kind says (the same, or a
    batch of them), else measured on a sample when ``sample`` (no large buffer below
    would fill to give it)."""
    if kind in _SAME_SIZE:
        return below
    if kind in ("batch", "padded_batch") and below is not None:
        return below * int(args.get("batch_size", 1))
    if not sample:
        return below
    try:
        return _sample(item)
    except Exception:
        return below


def _holds(kind: str, args: dict[str, Any], size: float | None, item: Any,
           constant_bytes: int) -> float | None:
    cpus = os.cpu_count() or 1
    if kind == "from_tensor_slices":
        return float(constant_bytes)
    if size is None:
        return None
    if kind == "cache":
        return _cache_holds(args, size, item)
    if kind == "shuffle":
        return size * int(args.get("buffer_size", 0))
    if kind == "prefetch":
        depth = int(args.get("buffer_size", 1))
        return size * (depth if depth > 0 else 4)  # AUTOTUNE: a few, tf decides
    if kind == "map" and "num_parallel_calls" in args:
        calls = int(args["num_parallel_calls"])
        return size * (calls if calls > 0 else cpus)
    if kind == "interleave":
        cycle = int(args.get("cycle_length", cpus))
        block = int(args.get("block_length", 1))
        return size * (cycle if cycle > 0 else cpus) * max(block, 1)
    if kind in ("batch", "padded_batch"):
        return size
    return None


def _cache_holds(args: dict[str, Any], size: float, item: Any) -> float | None:
    """What a cache holds in memory: its whole input (nothing when it is on disk);
    None when the input's size is unknown or infinite."""
    if args.get("filename"):
        return 0.0  # on disk
    try:
        count = int(item._input_dataset.cardinality().numpy())
    except Exception:
        return None
    return size * count if count >= 0 else None


def format_tf_stages(stages: list[TfStage], budget: int) -> str:
    """The chain as read, source first: sizes, what each holds, the headrace equivalent."""
    lines = [f"tf.data pipeline as read from its graph (budget judged: {format_bytes(budget)}):",
             f"  {'stage':<44}{'op':<26}{'element':>11}{'holds':>12}  headrace"]
    for stage in stages:
        size = "?" if stage.element_bytes is None else format_bytes(int(stage.element_bytes))
        holds = "-" if stage.holds is None else format_bytes(int(stage.holds))
        if stage.kind == "cache" and stage.holds is None:
            holds = "unbounded"
        lines.append(f"  {stage.name[:43]:<44}{stage.op[:25]:<26}{size:>11}{holds:>12}  "
                     f"{stage.headrace}")
        if stage.note:
            lines.append(f"  {'':<44}{stage.note}")
    return "\n".join(lines)


def lint_tf(stages: list[TfStage], budget: int) -> list[Finding]:
    """Hazards of a tf.data chain (source first), each with a fix and the headrace way."""
    findings: list[Finding] = []
    for position, stage in enumerate(stages):
        for rule in _STAGE_RULES:
            found = rule(stage, position, stages, budget)
            if found is not None:
                findings.append(found)
    if stages and stages[-1].kind != "prefetch":
        findings.append(Finding(
            "no-prefetch", stages[-1].name,
            "the pipeline does not end with prefetch: the training step and the pipeline take "
            "turns", ".prefetch(tf.data.AUTOTUNE) (headrace: .prefetch(hr.AUTOTUNE))",
        ))
    return findings


# Each rule of lint_tf looks at one stage (``position`` in ``stages``, source first)
# and gives at most one finding.


def _constant_in_graph(stage: TfStage, position: int, stages: list[TfStage],
                       budget: int) -> Finding | None:
    if stage.kind != "from_tensor_slices" or stage.constant_bytes < 32 << 20:
        return None
    return Finding(
        "constant-in-graph", stage.name,
        f"from_tensor_slices embeds {format_bytes(stage.constant_bytes)} in the graph as "
        "constants: TensorFlow copies it (expect RSS of ~2-3x the array on top of it) "
        "and refuses graphs past 2 GB",
        "headrace: hr.Dataset.from_tensor_slices(array) serves rows as views of the "
        "array (no copy); for data larger than RAM, np.save it and use "
        "hr.Dataset.from_npy(path) (a memmap, file-backed, not charged)",
    )


def _cache_too_big(stage: TfStage, position: int, stages: list[TfStage],
                   budget: int) -> Finding | None:
    if stage.kind != "cache" or stage.args.get("filename"):
        return None
    if stage.holds is None:
        return Finding(
            "cache-too-big", stage.name,
            "an in-memory cache of an input of unknown or infinite size: it grows "
            "until the process is killed",
            "cache to disk (.cache(filename)) or not at all; headrace: read the source "
            "again (the page cache keeps it warm without charging the budget)",
        )
    if stage.holds <= budget // 2:
        return None
    return Finding(
        "cache-too-big", stage.name,
        f"cache() will hold ~{format_bytes(int(stage.holds))} "
        f"({stage.cardinality if stage.cardinality >= 0 else '?'} elements of "
        f"~{format_bytes(int(stage.element_bytes or 0))}), more than half the memory "
        f"budget of {format_bytes(budget)}",
        "cache to disk: .cache('/path/on/ssd/cache'); headrace: write it once with "
        "ds.save_tfrecords(...) and read hr.TFRecordDataset (no in-memory cache)",
    )


def _shuffle_too_big(stage: TfStage, position: int, stages: list[TfStage],
                     budget: int) -> Finding | None:
    if stage.kind != "shuffle" or stage.holds is None or stage.holds <= budget // 4:
        return None
    fits = int((budget // 4) // stage.element_bytes) if stage.element_bytes else 0
    return Finding(
        "shuffle-too-big", stage.name,
        f"shuffle(buffer_size={stage.args.get('buffer_size')}) of "
        f"~{format_bytes(int(stage.element_bytes or 0))} elements holds "
        f"~{format_bytes(int(stage.holds))}, more than a quarter of the budget of "
        f"{format_bytes(budget)}",
        f"shuffle file names or indices before reading, or buffer_size≈{fits:,}; "
        "headrace: the same shuffle shrinks to fit its share with a warning, and over "
        "hr.Dataset.from_tensor_slices / an indexed TFRecordDataset it shuffles indices",
    )


def _decode_before_shuffle(stage: TfStage, position: int, stages: list[TfStage],
                           budget: int) -> Finding | None:
    if stage.kind != "shuffle" or (stage.element_bytes or 0) < LARGE_ELEMENT:
        return None
    maps = [s for s in stages[:position] if s.kind == "map"]
    if not maps:
        return None
    decoder = maps[-1]
    index = stages.index(decoder)
    before = stages[index - 1].element_bytes if index else None
    if not (before and decoder.element_bytes and decoder.element_bytes >= 1.5 * before):
        return None
    return Finding(
        "decode-before-shuffle", stage.name,
        f"{decoder.name} inflates elements {decoder.element_bytes / before:.1f}x "
        f"(to ~{format_bytes(int(decoder.element_bytes))}) before the shuffle: its "
        "buffer holds decoded data",
        "shuffle the encoded elements (or file names) first, then "
        "map(decode, num_parallel_calls=AUTOTUNE)",
    )


def _shard_after_map(stage: TfStage, position: int, stages: list[TfStage],
                     budget: int) -> Finding | None:
    if stage.kind != "shard" or not any(s.kind == "map" for s in stages[:position]):
        return None
    return Finding(
        "shard-after-map", stage.name,
        "shard comes after a map: every worker maps every element and keeps 1 in n",
        "shard right after the source (headrace shards indices before any map over a "
        "random-access source)",
    )


def _filter_after_map(stage: TfStage, position: int, stages: list[TfStage],
                      budget: int) -> Finding | None:
    if stage.kind != "filter" or not any(s.kind == "map" for s in stages[:position]):
        return None
    return Finding(
        "filter-after-map", stage.name,
        "filter runs after a map: elements it drops were mapped for nothing",
        "filter first if the predicate can read the raw element",
        severity="info",
    )


def _parallel_above_cpus(stage: TfStage, position: int, stages: list[TfStage],
                         budget: int) -> Finding | None:
    calls = stage.args.get("num_parallel_calls")
    cpus = os.cpu_count() or 1
    if not (isinstance(calls, int) and calls > cpus):
        return None
    return Finding(
        "parallel-above-cpus", stage.name,
        f"num_parallel_calls={calls} on {cpus} CPUs",
        "num_parallel_calls=tf.data.AUTOTUNE (headrace: hr.AUTOTUNE, inside the budget)",
    )


def _interleave_open_files(stage: TfStage, position: int, stages: list[TfStage],
                           budget: int) -> Finding | None:
    calls = stage.args.get("num_parallel_calls")
    if stage.kind != "interleave" or not isinstance(calls, int) or calls == 0:
        return None
    cycle = stage.args.get("cycle_length", os.cpu_count() or 1)
    return Finding(
        "interleave-open-files", stage.name,
        f"parallel interleave keeps up to ~3 x cycle_length = {3 * int(cycle)} inputs "
        "open (descriptors and read buffers)",
        "headrace's interleave caps descriptors process-wide (Options(max_open_files))",
        severity="info",
    )


#: lint_tf's rules, in the order their findings are listed for a stage.
_STAGE_RULES: tuple[Callable[[TfStage, int, list[TfStage], int], Finding | None], ...] = (
    _constant_in_graph,
    _cache_too_big,
    _shuffle_too_big,
    _decode_before_shuffle,
    _shard_after_map,
    _filter_after_map,
    _parallel_above_cpus,
    _interleave_open_files,
)


def diagnose_tf(
    dataset: Any,
    *,
    epochs: int = 6,
    steps: int | None = None,
    warmup: int = 2,
    budget: int | str | None = None,
    min_rss_leak: int = 4 << 20,
    title: str = "headrace doctor (tf.data)",
    on_epoch: Callable[[EpochMeasure], None] | None = None,
) -> Diagnosis:
    """Read a tf.data pipeline's graph, lint it, and measure its memory across epochs."""
    limit = parse_bytes(budget) if budget is not None else available_memory() // 2
    stages = read_tf_pipeline(dataset)
    findings = lint_tf(stages, limit)
    measures: list[EpochMeasure] = []
    for epoch in range(epochs):
        started = time.perf_counter()
        count = 0
        iterator = iter(dataset)
        for element in iterator:
            count += 1
            del element
            if steps is not None and count >= steps:
                break
        del iterator
        gc.collect()
        release_free_heap()  # resident memory then counts live blocks, not free ones
        memory = snapshot(detailed=True)
        measure = EpochMeasure(epoch, count, time.perf_counter() - started, 0, memory.charged,
                               memory.descriptors.total, memory.descriptors.shared_memory,
                               memory.headrace_threads, 0, ())
        measures.append(measure)
        if on_epoch is not None:
            on_epoch(measure)
    fitted = measures[warmup:]
    charged = fit_trend("anonymous + shared memory", [float(m.charged) for m in fitted])
    leak = charged.significant(min_rss_leak)
    return Diagnosis(
        title=title,
        findings=tuple(findings),
        stage_names=tuple(stage.name for stage in stages),
        epochs=tuple(measures),
        warmup=warmup,
        traced=fit_trend("traced memory (not traced for tf.data)", []),
        charged=charged,
        stage_trends=(),
        leak=leak,
        growth=(),
        resources=(),
        min_leak=min_rss_leak,
        extra={"stages": tuple(stages), "budget": limit,
               "pipeline": format_tf_stages(stages, limit)},
    )
