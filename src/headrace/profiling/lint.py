"""Read a recipe before (or after) running it and name its memory and speed hazards.

Each :class:`Finding` names the stage, says what will happen in numbers, and
gives a concrete fix (the call to write instead). Rules:

- ``shuffle-too-big``: a shuffle over a streaming input whose buffer, at the
  elements' size, is more than its share of the budget (it will shrink).
- ``shard-after-map``: ``shard`` over a streaming input after a ``map``: every
  worker runs the map on every element and keeps 1/n of them. (Over a
  random-access source headrace shards indices before the map runs: no finding.)
- ``filter-after-map``: a ``filter`` after a ``map``; measured, with the share
  of elements it drops.
- ``decode-before-shuffle``: a ``map`` that inflates elements (decoding) before
  a streaming ``shuffle`` of large elements: the buffer holds decoded data.
- ``parallel-above-cpus``: ``num_parallel_calls`` above the CPU count.
- ``no-prefetch``: the pipeline does not end with ``prefetch``.
- ``python-heavy-threads``: a thread-parallel ``map`` whose function runs
  mostly Python bytecode (threads then take turns on the GIL).

Sizes come, in order of preference, from a profile's measurements, from a
fully known ``element_spec``, or from reading a few elements (``sample``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace._memory.units import format_bytes
from headrace._options import AUTOTUNE
from headrace._structure import TensorSpec, flatten
from headrace.core.node import Node, Traits, known_spec
from headrace.profiling.probe import payload_bytes, recipe_nodes

if TYPE_CHECKING:
    from headrace._dataset import Dataset
    from headrace.profiling.profiler import StageProfile

__all__ = ["Finding", "lint_recipe", "python_share"]

#: Elements at or above this size make decoding before a shuffle worth a finding.
LARGE_ELEMENT = 32 << 10
#: A cache over an input of unknown length gets a conditional finding when its share holds
#: fewer elements than this (a longer input would spill).
_UNKNOWN_LENGTH_FITS = 100_000
#: Seconds one Python line costs, roughly, on these machines (for ``python_share``).
_SECONDS_PER_LINE = 45e-9


@dataclass(frozen=True)
class Finding:
    """One hazard of a recipe: where, what, and the fix."""

    code: str
    stage: str
    message: str
    fix: str
    severity: str = "warning"  # or "info"

    def format(self) -> str:
        return f"  [{self.severity}] {self.code} at {self.stage}: {self.message}\n      fix: {self.fix}"


def _node_kind(node: Node) -> str:
    return type(node).__name__


def _spec_bytes(spec: Any) -> int | None:
    """Bytes of one element from a fully known spec (None if any size is unknown)."""
    total = 0
    for leaf in flatten(spec):
        if not isinstance(leaf, TensorSpec) or leaf.kind != "numeric":
            return None
        shape = leaf.shape
        if shape is None or any(dim is None for dim in shape):  # unknown rank or size
            return None
        total += int(np.prod([int(dim or 0) for dim in shape], dtype=np.int64)) * (
            leaf.dtype.itemsize
        )
    return total


def _sample_bytes(node: Node, count: int, options: Any) -> float | None:
    """Mean cost of the first ``count`` elements of ``node`` (a probe: no iteration counted)."""
    from headrace._memory.sizeof import admit
    from headrace._options import Options
    from headrace.core.run import DatasetIterator

    sizes = []
    opts = (options or Options()).merge(Options(warn_on_shrink=False))
    with DatasetIterator(node, opts, probe=True) as iterator:
        for element in iterator:
            # what a buffer books for it: objects' attributes counted (payload_bytes sees
            # a Holder's 56 B), views of a larger owner as the rows a buffer copies out
            sizes.append(max(payload_bytes(element), admit(element)[1]))
            if len(sizes) >= count:
                break
    return sum(sizes) / len(sizes) if sizes else None


def python_share(fn: Callable[..., Any], element: Any, *, repeats: int = 3) -> tuple[float, float]:
    """How much of one call of ``fn`` runs Python bytecode: (share 0..1, seconds per call).

    Counts the Python lines one call executes (``sys.settrace``) and prices
    them at ~45 ns each against the call's untraced time. A function that
    spends its time in NumPy or I/O (which release the GIL) scores near 0.
    """
    from headrace._transforms.map import apply_fn

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        apply_fn(fn, element)
        best = min(best, time.perf_counter() - started)
    lines = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        apply_fn(fn, element)
    finally:
        sys.settrace(previous)
    return min(1.0, lines * _SECONDS_PER_LINE / max(best, 1e-9)), best


class _Recipe:
    """The recipe's nodes with their consumers, shares and element sizes."""

    def __init__(
        self, dataset: Dataset, measured: Sequence[StageProfile] | None, sample: int,
        epochs: int = 1,
    ) -> None:
        self.dataset = dataset
        self.root = dataset.node
        self.nodes = recipe_nodes(self.root)
        self.measured = {stage.key: stage for stage in measured or ()}
        self.epochs = max(epochs, 1)
        self.sample = sample
        self.shares = self._shares()
        self._sizes: dict[int, float | None] = {}

    def _shares(self) -> dict[int, int]:
        """Each buffering stage's share, from an iterator built (and closed) for it."""
        from headrace._options import Options
        from headrace.core.run import DatasetIterator

        if self.measured:
            return {key: stage.share for key, stage in self.measured.items() if stage.share}
        options = self.dataset.options.merge(Options(warn_on_shrink=False))
        try:
            with DatasetIterator(self.root, options, probe=True) as iterator:
                accounts = getattr(iterator.context, "_accounts", {})
                return {key: account.share() for key, account in accounts.items()}
        except Exception:  # a recipe that cannot even start: the run will say why
            return {}

    def size(self, node: Node) -> float | None:
        """Bytes of one element ``node`` produces (measured, spec, or sampled)."""
        key = id(node)
        if key in self._sizes:
            return self._sizes[key]
        size: float | None = None
        stage = self.measured.get(key)
        if stage is not None and stage.mean_bytes_out:
            size = stage.mean_bytes_out
        if size is None:
            spec = known_spec(node)
            size = None if spec is None else _spec_bytes(spec)
        if size is None and self.sample:
            try:
                size = _sample_bytes(node, self.sample, self.dataset.options)
            except Exception:
                size = None
        self._sizes[key] = size
        return size

    def count(self, node: Node) -> int | None:
        """Elements ``node`` yields per pass: its cardinality, else measured per epoch, else None.

        A buffer fills to at most this many: a shuffle of 1,000,000 over 300
        elements holds 300, and saying it "will shrink" would be false.
        """
        cardinality = node.cardinality()
        if cardinality >= 0:
            return cardinality
        stage = self.measured.get(id(node))
        if stage is not None:  # per iterator it made: a repeat above makes one per pass
            return -(-stage.elements_out // max(stage.iterators, self.epochs, 1))
        return None

    def chain_below(self, node: Node) -> list[Node]:
        """The single-input chain under ``node`` down to a source or a multi-input node."""
        out = []
        current = node
        while len(current.inputs) == 1:
            current = current.inputs[0]
            out.append(current)
        return out


def lint_recipe(
    dataset: Dataset,
    *,
    measured: Sequence[StageProfile] | None = None,
    sample: int = 0,
    cpu_count: int | None = None,
    epochs: int = 1,
) -> list[Finding]:
    """The hazards of ``dataset``'s recipe, each with a fix (see the module doc).

    ``measured``: a profile's stages (sizes and drop rates then come from the
    run; ``epochs``: how many epochs it measured). ``sample``: read that many
    elements where a size is needed and no measurement or spec gives it (runs
    the pipeline's functions on them).

    A finding about a buffer whose input's length is unknown (a generator, a
    filter) is worded as a condition ("once more than N elements have
    arrived"): the recipe alone cannot tell whether it ever fills.
    """
    recipe = _Recipe(dataset, measured, sample, epochs)
    cpus = cpu_count or os.cpu_count() or 1
    findings: list[Finding] = []
    for node in recipe.nodes:
        traits = node.traits()
        findings += _buffer_findings(recipe, node, traits)
        parallel = traits.parallel_calls
        if parallel is not None and parallel != AUTOTUNE and parallel > cpus:
            findings.append(Finding(
                "parallel-above-cpus", node.stage,
                f"num_parallel_calls={parallel} on a machine with {cpus} CPUs: the extra "
                "calls only hold memory (each call in flight is booked) and switch threads",
                f"num_parallel_calls=hr.AUTOTUNE (or at most {cpus})",
            ))
        if traits.maps and parallel not in (None, 1) and sample:
            finding = _gil_finding(node, parallel)
            if finding is not None:
                findings.append(finding)
    if not recipe.root.traits().prefetches:
        findings.append(Finding(
            "no-prefetch", recipe.root.stage,
            "the pipeline does not end with prefetch: the consumer (the training step) and "
            "the pipeline take turns instead of overlapping",
            "end it with .prefetch(hr.AUTOTUNE) (its depth grows inside the budget)",
        ))
    return findings


def _buffer_findings(recipe: _Recipe, node: Node, traits: Traits) -> list[Finding]:
    """What a stage's kind says of it: a shuffle's buffer, a shard after a map, a
    filter's drops, an in-memory cache."""
    if traits.shuffle_buffer is not None and node.inputs[0].index_plan() is None:
        return _shuffle_findings(recipe, node, traits.shuffle_buffer)
    finding: Finding | None = None
    if traits.shards is not None and node.inputs[0].index_plan() is None:
        shards, index = traits.shards
        maps = [n for n in recipe.chain_below(node) if n.traits().maps]
        if maps:
            finding = Finding(
                "shard-after-map", node.stage,
                f"shard({shards}, {index}) comes after {maps[0].stage}: "
                f"every worker runs the map on all elements and keeps 1 in {shards}",
                f"shard right after the source, before {maps[0].stage} "
                f"(ds.shard({shards}, {index}).map(...))",
            )
    elif traits.drops:
        finding = _filter_finding(recipe, node)
    elif traits.caches_in_memory:
        finding = _cache_finding(recipe, node)
    return [] if finding is None else [finding]


def _shuffle_findings(recipe: _Recipe, node: Node, buffer_size: int) -> list[Finding]:
    findings: list[Finding] = []
    size = recipe.size(node.inputs[0])
    share = recipe.shares.get(id(node), 0)
    if not size:
        return findings
    count = recipe.count(node.inputs[0])
    fill = buffer_size if count is None else min(buffer_size, count)
    need = fill * size
    if share and need > share:
        fits = max(int(share // size), 1)
        outcome = (
            f"it will shrink to ~{fits:,} elements" if count is not None
            else f"once more than ~{fits:,} elements have arrived it stops filling and "
            f"shuffles within ~{fits:,} (its input's length is unknown)"
        )
        findings.append(Finding(
            "shuffle-too-big", node.stage,
            f"shuffle(buffer_size={buffer_size:,}) of ~{format_bytes(int(size))} "
            f"elements holds ~{format_bytes(int(need))}, more than its share "
            f"{format_bytes(share)} of the budget: {outcome}",
            "shuffle something small and random-access instead (from_tensor_slices or an "
            "indexed TFRecordDataset shuffles indices, not elements; or shuffle file names "
            f"before interleave), or buffer_size={fits:,}, or a larger "
            "Options(memory_budget=...)",
        ))
    # Decoded data in the buffer matters when the buffer is large: a quarter of its share
    # or more (a shuffle of 2 elements holds two decoded elements, and that is fine).
    if size >= LARGE_ELEMENT and (not share or need >= share / 4):
        decoder, inflation = _decoder_below(recipe, node)
        if decoder is not None and inflation is not None:
            findings.append(Finding(
                "decode-before-shuffle", node.stage,
                f"{decoder.stage} inflates elements {inflation:.1f}x before "
                f"shuffle(buffer_size={buffer_size:,}) of ~{format_bytes(int(size))} "
                "elements: the buffer holds decoded data",
                f"shuffle the encoded elements first and decode after: "
                f".shuffle({buffer_size}).map({decoder.stage[4:-1] or 'decode'}, "
                "num_parallel_calls=hr.AUTOTUNE)",
            ))
    return findings


def _decoder_below(recipe: _Recipe, node: Node) -> tuple[Node | None, float | None]:
    """The nearest map under ``node`` that itself inflates elements 1.5x or more.

    Its own inflation: its output against its own input (a batch between it
    and the shuffle multiplies the size without decoding anything).
    """
    for below in recipe.chain_below(node):
        if not below.traits().maps:
            continue
        stage = recipe.measured.get(id(below))
        if stage is not None and stage.inflation is not None:
            inflation: float | None = stage.inflation
        else:
            out, before = recipe.size(below), recipe.size(below.inputs[0])
            inflation = out / before if out and before else None
        if inflation is not None and inflation >= 1.5:
            return below, inflation
    return None, None


def _cache_finding(recipe: _Recipe, node: Any) -> Finding | None:
    """An in-memory cache of more than its share spills to disk: say so before the run."""
    from headrace._persist.memory_store import in_memory_room

    size = recipe.size(node.inputs[0])
    count = recipe.count(node.inputs[0])
    share = recipe.shares.get(id(node), 0)
    if not size or not share:
        return None
    room = in_memory_room(share)  # the rest of the share is the spill's buffers
    fix = ("cache(filename) on a fast disk, cache after a map or filter that shrinks the "
           "elements, or a larger Options(memory_budget=...)")
    if count is None:  # a generator, a filter: the recipe cannot tell whether it fits
        fits = int(room // size)
        if fits >= _UNKNOWN_LENGTH_FITS:
            return None
        return Finding(
            "cache-too-big", node.stage,
            f"cache() of an input of unknown length: the in-memory part of its share "
            f"({format_bytes(room)} of {format_bytes(share)}) holds ~{fits:,} elements of ~{format_bytes(int(size))}; if the input is "
            "longer, the rest spills to a temporary directory, and later epochs read it back "
            "from disk",
            fix, severity="info",
        )
    if size * count <= room:
        return None
    need = int(size * count)
    return Finding(
        "cache-too-big", node.stage,
        f"cache() of {count:,} elements of ~{format_bytes(int(size))} holds "
        f"~{format_bytes(need)}, more than the in-memory part of its share "
        f"({format_bytes(room)} of {format_bytes(share)}) of the budget: "
        "the rest spills to a temporary directory, and later epochs read it back from disk",
        fix,
    )


def _filter_finding(recipe: _Recipe, node: Any) -> Finding | None:
    maps = [n for n in recipe.chain_below(node) if n.traits().maps]
    if not maps:
        return None
    measured = recipe.measured.get(id(node))
    if measured is not None and measured.elements_in:
        dropped = 1 - measured.elements_out / measured.elements_in
        if dropped < 0.5:
            return None
        map_stage = recipe.measured.get(id(maps[0]))
        spent = (
            f"; {maps[0].stage} spent {map_stage.own_seconds:.2f} s on them"
            if map_stage is not None and map_stage.own_seconds is not None else ""
        )
        return Finding(
            "filter-after-map", node.stage,
            f"{node.stage} drops {dropped:.0%} of what {maps[0].stage} produced{spent}",
            f"filter before the map when the predicate can read the raw element "
            f"(ds.filter(...).map(...)): the map then runs on {1 - dropped:.0%} of the elements",
        )
    return Finding(
        "filter-after-map", node.stage,
        f"{node.stage} runs after {maps[0].stage}: elements it drops were mapped for nothing",
        "if the predicate can read the raw element, filter first (ds.filter(...).map(...)); "
        "a profile measures how many it drops",
        severity="info",
    )


def _gil_finding(node: Any, parallel: int | None) -> Finding | None:
    from headrace.core.node import first_element

    try:
        element = first_element(node.inputs[0], node.stage)
        share, seconds = python_share(node.fn, element)
    except Exception:
        return None
    if share < 0.5 or seconds < 5e-6:
        return None
    return Finding(
        "python-heavy-threads", node.stage,
        f"{node.stage} runs Python bytecode for ~{share:.0%} of each call "
        f"({seconds * 1e6:,.0f} µs): its {parallel} threads take turns on the "
        "GIL, so num_parallel_calls adds memory in flight, not speed",
        "vectorize it: .batch(n).map(fn_on_whole_batch) with NumPy (one call per batch), or "
        "run the Python work in worker processes; keep num_parallel_calls for functions that "
        "release the GIL (NumPy on large arrays, decoders, I/O)",
    )
