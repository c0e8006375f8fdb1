"""``headrace doctor``: lint a recipe, then run it for several epochs and look for leaks.

Each epoch makes a new iterator and *drops* it without ``close()`` — what
Keras does — then collects garbage and measures: memory traced by Python's
allocator (``tracemalloc``: every NumPy array and Python object), the
process's anonymous + shared memory, each stage's booked bytes, headrace's
threads still alive, descriptors and shared-memory segments open, iterators
still alive.

Real growth vs noise. The first ``warmup`` epochs are left out (allocator
pools, caches and lazily built state grow once). Over the rest, each measure's
slope per epoch is tested by :mod:`headrace.profiling.trend`: a robust slope
past a floor (``min_leak`` bytes per epoch) and a least-squares slope above
zero by more than the Student-t critical value at ``sigmas``. A clean
pipeline's memory wanders but does not climb with the epoch count; a leak adds
about the same bytes every epoch, which both fits see.

Which stage. First, who *keeps* it: the mutable state each stage's functions
can reach (closures, defaults, the globals they name, a callable object's
attributes) is costed after the warm-up and after the last epoch; a holder
that grew names its stage ("kept in SEEN (global of remember)"). A map that
appends its elements to a list keeps memory that the stage which made them
allocated, so allocation alone would blame the source. Then, where it was
*allocated*, read from ``tracemalloc``'s tracebacks: the innermost frame that
lies in a function of the recipe (a map's function, a filter's predicate, a
generator) or in a transformation's own module names the stage.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import time
import tracemalloc
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from headrace.errors import InvalidArgumentError
from headrace.memory.allocator import release_free_heap
from headrace.memory.units import format_bytes
from headrace.profiling.lint import Finding
from headrace.profiling.probe import recipe_nodes
from headrace.profiling.process import snapshot
from headrace.profiling.trend import Trend, fit_trend

if TYPE_CHECKING:
    from headrace.core.node import Node
    from headrace.dataset import Dataset

__all__ = ["Diagnosis", "EpochMeasure", "Trend", "diagnose", "fit_trend"]


@dataclass(frozen=True)
class EpochMeasure:
    """What one epoch left behind, measured after its iterator was dropped and collected."""

    epoch: int
    elements: int
    seconds: float
    traced: int
    charged: int
    descriptors: int
    shared_memory_segments: int
    headrace_threads: int
    live_iterators: int
    #: Bytes each stage had booked at the end of the epoch (before the drop).
    held: tuple[int, ...]


@dataclass(frozen=True)
class StageGrowth:
    """Traced memory that grew across epochs, attributed to one stage."""

    stage: str
    bytes_per_epoch: float
    where: str  # file:line of the allocation


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's verdict: lint findings, per-epoch measures, trends, leaks."""

    title: str
    findings: tuple[Finding, ...]
    stage_names: tuple[str, ...]
    epochs: tuple[EpochMeasure, ...]
    warmup: int
    traced: Trend
    charged: Trend
    stage_trends: tuple[Trend, ...]
    leak: bool
    growth: tuple[StageGrowth, ...]
    resources: tuple[str, ...]
    min_leak: int
    sigmas: float = 4.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not self.leak and not self.resources

    @property
    def leaking_stages(self) -> tuple[str, ...]:
        names: list[str] = []
        for item in self.growth:
            if item.stage not in names:
                names.append(item.stage)
        return tuple(names)

    def format(self) -> str:
        lines = [f"{self.title}"]
        if self.extra.get("pipeline"):
            lines += ["", str(self.extra["pipeline"])]
        if self.findings:
            lines += ["", "recipe findings:"] + [f.format() for f in self.findings]
        else:
            lines += ["", "recipe findings: none"]
        lines += ["", f"{len(self.epochs)} epochs (the first {self.warmup} are warm-up, "
                  "not fitted); after each, the iterator was dropped without close():"]
        lines.append(f"  {'epoch':>5} {'elements':>9} {'s':>6} {'traced':>11} {'anon+shm':>11}"
                     f" {'fds':>5} {'threads':>8} {'live iters':>10}")
        for m in self.epochs:
            lines.append(
                f"  {m.epoch:>5} {m.elements:>9,} {m.seconds:>6.2f} {format_bytes(m.traced):>11}"
                f" {format_bytes(m.charged):>11} {m.descriptors:>5} {m.headrace_threads:>8}"
                f" {m.live_iterators:>10}"
            )
        lines += ["", "  " + self.traced.format(), "  " + self.charged.format()]
        for trend in self.stage_trends:
            if trend.significant(self.min_leak, self.sigmas):
                lines.append("  " + trend.format() + "  <- grows")
        if self.leak:
            lines += ["", f"LEAK: memory grows by ~{format_bytes(int(max(self.traced.slope, self.charged.slope)))} "
                      "per epoch, beyond noise."]
            for item in self.growth:
                where = item.where if item.where.startswith(("kept in", "its booked")) else (
                    f"allocated at {item.where}")
                lines.append(
                    f"  {item.stage}: ~{format_bytes(int(item.bytes_per_epoch))}/epoch, {where}"
                )
            if not self.growth:
                lines.append("  (not traced to a stage: native code, or the consumer's own)")
        else:
            lines += ["", f"no leak: growth per epoch is within noise (floor "
                      f"{format_bytes(self.min_leak)}/epoch)."]
        if self.resources:
            lines += ["", "not returned:"] + [f"  {text}" for text in self.resources]
        return "\n".join(lines)

    def to_html(self) -> str:
        """A self-contained HTML page: the per-epoch charts, the verdict, the findings."""
        from headrace.profiling.doctor_report import render_diagnosis

        return render_diagnosis(self)

    def write_html(self, path: str) -> str:
        """Write :meth:`to_html` to ``path``; returns the path."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_html())
        return path


# -- which stage: code ranges of the recipe's functions and transformations ------------------


def _code_of(value: Any) -> types.CodeType | None:
    if isinstance(value, types.FunctionType):
        return value.__code__
    if isinstance(value, types.MethodType):
        return _code_of(value.__func__)
    func = getattr(value, "func", None)  # functools.partial
    if func is not None and func is not value:
        return _code_of(func)
    call = vars(type(value)).get("__call__")
    if isinstance(call, types.FunctionType) and not isinstance(value, type):
        return call.__code__
    return None


def _lines(code: types.CodeType) -> tuple[str, int, int]:
    numbers = [line for _, _, line in code.co_lines() if line is not None]
    first = min(numbers, default=code.co_firstlineno)
    last = max(numbers, default=code.co_firstlineno)
    for const in code.co_consts:  # nested functions and lambdas
        if isinstance(const, types.CodeType):
            _, low, high = _lines(const)
            first, last = min(first, low), max(last, high)
    return code.co_filename, first, last


def _stage_locator(nodes: list[Node]) -> Callable[[str, int], str | None]:
    """A function (file, line) -> the stage whose code that is, or None."""
    ranges: list[tuple[str, int, int, str]] = []
    modules: dict[str, str] = {}
    for node in nodes:
        name = str(getattr(node, "stage", type(node).__name__))
        for value in vars(node).values():
            code = _code_of(value) if callable(value) else None
            if code is not None:
                ranges.append((*_lines(code), name))
        module = getattr(__import__(type(node).__module__, fromlist=["_"]), "__file__", None)
        if module and "headrace" in module:
            modules.setdefault(module, name)

    def locate(filename: str, line: int) -> str | None:
        for path, first, last, name in ranges:
            if path == filename and first <= line <= last:
                return name
        return modules.get(filename)

    return locate


# -- which stage keeps it: state a recipe function can reach ----------------------------------

_CONTAINERS = (list, dict, set, bytearray, collections.deque)


def _names_of(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_of(const)
    return names


def _state_of(value: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """Mutable objects a callable can keep things in: its closure, defaults, the globals
    it names, its own attributes (a callable object, a bound method's ``self``)."""
    if depth > 2:
        return []
    out: list[tuple[str, Any]] = []
    if isinstance(value, types.MethodType):
        return [(f"{type(value.__self__).__name__} (self)", value.__self__),
                *_state_of(value.__func__, depth + 1)]
    if isinstance(value, functools.partial):
        return [*[("partial argument", arg) for arg in (*value.args, *value.keywords.values())],
                *_state_of(value.func, depth + 1)]
    if isinstance(value, types.FunctionType):
        code = value.__code__
        for name, cell in zip(code.co_freevars, value.__closure__ or (), strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                out.append((f"{name} (closure of {code.co_name})", cell.cell_contents))
        for default in value.__defaults__ or ():
            out.append((f"a default of {code.co_name}", default))
        for name in sorted(_names_of(code)):
            if name in value.__globals__:
                out.append((f"{name} (global of {code.co_name})", value.__globals__[name]))
        return out
    if callable(value) and not isinstance(value, type) and hasattr(value, "__dict__"):
        return [(f"{type(value).__name__} instance", value)]
    return out


def _holders(nodes: list[Node]) -> list[tuple[str, str, Any]]:
    """(stage, what, object) for the mutable state each stage's functions can reach."""
    seen: set[int] = set()
    out: list[tuple[str, str, Any]] = []
    for node in nodes:
        stage = str(getattr(node, "stage", type(node).__name__))
        for value in vars(node).values():
            if not callable(value) or isinstance(value, type) or hasattr(value, "make_iterator"):
                continue
            for what, held in _state_of(value):
                if id(held) in seen or isinstance(held, (types.ModuleType, type)):
                    continue
                if isinstance(held, _CONTAINERS) or (
                    hasattr(held, "__dict__") and not callable(held)
                    and not isinstance(held, types.FunctionType)
                ) or what.endswith(" instance"):
                    seen.add(id(held))
                    out.append((stage, what, held))
    return out


def _retained(holders: list[tuple[str, str, Any]]) -> list[int]:
    """Bytes each holder keeps, as the budget would cost them."""
    from headrace.memory.sizeof import sizeof

    sizes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # objects sizeof cannot size (locks, threads)
        for _, _, held in holders:
            try:
                sizes.append(sizeof(vars(held) if hasattr(held, "__dict__")
                                    and not isinstance(held, _CONTAINERS) else held))
            except Exception:  # a holder sizeof cannot walk: not attributable
                sizes.append(0)
    return sizes


def _kept(
    holders: list[tuple[str, str, Any]], before: list[int], after: list[int], epochs: int,
    floor: int,
) -> list[StageGrowth]:
    out = []
    for (stage, what, _), low, high in zip(holders, before, after, strict=True):
        per_epoch = (high - low) / max(epochs, 1)
        if per_epoch >= floor / 2:
            out.append(StageGrowth(stage, per_epoch, f"kept in {what}"))
    out.sort(key=lambda item: -item.bytes_per_epoch)
    return out


def _attribute(
    before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, epochs: int,
    locate: Callable[[str, int], str | None], floor: int,
) -> list[StageGrowth]:
    by_stage: dict[str, list[Any]] = {}
    for stat in after.compare_to(before, "traceback"):
        if stat.size_diff <= 0:
            continue
        for frame in reversed(stat.traceback):  # innermost first
            stage = locate(frame.filename, frame.lineno)
            if stage is not None:
                entry = by_stage.setdefault(stage, [0, {}])
                entry[0] += stat.size_diff
                where = f"{frame.filename}:{frame.lineno}"
                entry[1][where] = entry[1].get(where, 0) + stat.size_diff
                break
    out = []
    for stage, (total, places) in by_stage.items():
        per_epoch = total / max(epochs, 1)
        if per_epoch >= floor / 2:
            where = max(places.items(), key=lambda item: item[1])[0]
            out.append(StageGrowth(stage, per_epoch, where))
    out.sort(key=lambda item: -item.bytes_per_epoch)
    return out


def _resources(measures: list[EpochMeasure]) -> list[str]:
    """Iterators, threads, descriptors or shared memory that every epoch leaves behind."""
    out = []
    checks = (
        ("iterators still alive after collection", [m.live_iterators for m in measures]),
        ("headrace threads still running", [m.headrace_threads for m in measures]),
        ("open descriptors", [m.descriptors for m in measures]),
        ("shared-memory segments open", [m.shared_memory_segments for m in measures]),
    )
    for what, values in checks:
        if len(values) >= 3 and values[-1] - values[0] >= len(values) - 2 and all(
            b >= a for a, b in itertools.pairwise(values)
        ):
            out.append(f"{what}: {values[0]} after the first epoch, {values[-1]} after the "
                       f"last (+{(values[-1] - values[0]) / (len(values) - 1):.1f} per epoch); "
                       "close iterators (`with iter(ds) as it:`) or find what keeps them")
    return out


def _accounts(iterator: Any) -> dict[int, Any]:
    accounts: dict[int, Any] = getattr(iterator.context, "_accounts", {})
    return accounts


def diagnose(
    dataset: Dataset,
    *,
    epochs: int = 8,
    steps: int | None = None,
    warmup: int = 2,
    min_leak: int = 64 << 10,
    min_rss_leak: int = 2 << 20,
    sigmas: float = 4.0,
    lint: bool = True,
    trace: bool = True,
    title: str = "headrace doctor",
    on_epoch: Callable[[EpochMeasure], None] | None = None,
) -> Diagnosis:
    """Lint ``dataset``'s recipe and run it ``epochs`` times looking for leaks.

    ``steps`` caps the elements per epoch. ``min_leak``: the least growth per
    epoch of traced memory reported as a leak (``min_rss_leak`` for the
    process's anonymous + shared memory, which allocators make noisier).
    """
    from headrace.core.run import DatasetIterator

    if epochs < warmup + 3:
        raise InvalidArgumentError(
            f"doctor: needs at least warmup + 3 = {warmup + 3} epochs (a leak is a trend "
            f"over the epochs after the warm-up), got {epochs}")
    findings = tuple(lint_recipe_safe(dataset)) if lint else ()
    nodes = recipe_nodes(dataset.node)
    names = [str(getattr(node, "stage", type(node).__name__)) for node in nodes]
    started_tracing = trace and not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start(16)
    holders = _holders(nodes)
    kept_before: list[int] = []
    kept_after: list[int] = []
    alive: list[weakref.ref[DatasetIterator]] = []
    measures: list[EpochMeasure] = []
    baseline: tracemalloc.Snapshot | None = None
    last: tracemalloc.Snapshot | None = None
    try:
        for epoch in range(epochs):
            started = time.perf_counter()
            iterator = iter(dataset)
            count = 0
            for element in iterator:
                count += 1
                del element
                if steps is not None and count >= steps:
                    break
            accounts = _accounts(iterator)
            held = tuple(
                accounts[id(node)].stats().held if id(node) in accounts else 0 for node in nodes
            )
            alive.append(weakref.ref(iterator))
            del iterator, accounts  # dropped, not closed: as Keras does
            gc.collect()
            release_free_heap()  # resident memory then counts live blocks, not free ones
            seconds = time.perf_counter() - started
            memory = snapshot(detailed=True)
            traced_now = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
            measure = EpochMeasure(
                epoch, count, seconds, traced_now, memory.charged, memory.descriptors.total,
                memory.descriptors.shared_memory, memory.headrace_threads,
                sum(ref() is not None for ref in alive), held,
            )
            measures.append(measure)
            if on_epoch is not None:
                on_epoch(measure)
            if epoch == warmup - 1 or (warmup == 0 and epoch == 0):
                kept_before = _retained(holders)
            elif epoch == epochs - 1:
                kept_after = _retained(holders)
            if tracemalloc.is_tracing():
                if epoch == warmup - 1 or (warmup == 0 and epoch == 0):
                    baseline = tracemalloc.take_snapshot()
                elif epoch == epochs - 1:
                    last = tracemalloc.take_snapshot()
    finally:
        if started_tracing:
            tracemalloc.stop()
    fitted = measures[warmup:]
    traced = fit_trend("traced memory", [float(m.traced) for m in fitted])
    charged = fit_trend("anonymous + shared memory", [float(m.charged) for m in fitted])
    stage_trends = tuple(
        fit_trend(f"{name} booked", [float(m.held[k]) for m in fitted])
        for k, name in enumerate(names)
    )
    leak = (
        (trace and traced.significant(min_leak, sigmas))
        or charged.significant(min_rss_leak, sigmas)
        or any(t.significant(min_leak, sigmas) for t in stage_trends)
    )
    growth: list[StageGrowth] = []
    span = (epochs - 1) - max(warmup - 1, 0)  # epochs between the two measures
    if leak and kept_before and kept_after:
        # who keeps it first: a list a map appends elements to holds memory allocated by
        # the stage that made them, which is all the allocation's traceback can name
        growth = _kept(holders, kept_before, kept_after, span, min_leak)
    if leak and baseline is not None and last is not None:
        for item in _attribute(baseline, last, span, _stage_locator(nodes), min_leak):
            if item.stage not in [g.stage for g in growth]:
                growth.append(item)
    for trend, name in zip(stage_trends, names, strict=True):
        if trend.significant(min_leak, sigmas) and name not in [g.stage for g in growth]:
            growth.append(StageGrowth(name, trend.slope, "its booked bytes"))
    return Diagnosis(
        title=title,
        findings=findings,
        stage_names=tuple(names),
        epochs=tuple(measures),
        warmup=warmup,
        traced=traced,
        charged=charged,
        stage_trends=stage_trends,
        leak=bool(leak),
        growth=tuple(growth),
        resources=tuple(_resources(measures[warmup:] or measures)),
        min_leak=min_leak,
        sigmas=sigmas,
    )


def lint_recipe_safe(dataset: Dataset) -> list[Finding]:
    """The recipe's findings, sampling a few elements where sizes are needed."""
    from headrace.profiling.lint import lint_recipe

    try:
        return lint_recipe(dataset, sample=4)
    except Exception as error:  # lint must never stop the diagnosis
        return [Finding("lint-failed", "pipeline", f"could not read the recipe: {error}",
                        "report this as a headrace bug", severity="info")]
