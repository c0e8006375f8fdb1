"""``headrace doctor``: lint a recipe, then run it for several epochs and look for leaks.

Each epoch makes a new iterator and *drops* it without ``close()`` — what
Keras does — then collects garbage and measures: the bytes live in the
allocators (malloc's blocks in use, NumPy's data among them, and Python's
small objects: :func:`allocated_bytes`), the process's anonymous + shared
memory, each stage's booked bytes, headrace's threads still alive,
descriptors and shared-memory segments open, iterators still alive.

What it costs. Those reads take microseconds, so a doctor epoch costs about
what a plain one does. ``tracemalloc`` sees the same growth but pays for a
traceback on every allocation: with 16 frames an image pipeline's Python map
ran 13x slower, and even one frame cost it 3x. So the epochs run untraced,
and tracebacks are taken only when needed: once a leak is found and no
holder (below) explains it, :data:`ATTRIBUTION_EPOCHS` more epochs run under
``tracemalloc`` with :data:`DEEP_FRAMES` frames to find where it was
allocated. ``deep=True`` traces every epoch instead (traced memory then
counts in the verdict too); off glibc, where malloc has no counter, every
epoch is traced with one frame.

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
*allocated*, read from ``tracemalloc``'s tracebacks (of the traced pass): the
innermost frame that lies in a function of the recipe (a map's function, a
filter's predicate, a generator) or in a transformation's own module names the
stage.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import sys
import time
import tracemalloc
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from headrace._errors import InvalidArgumentError
from headrace._memory.allocator import heap_info, release_free_heap
from headrace._memory.units import format_bytes
from headrace.profiling.lint import Finding
from headrace.profiling.probe import recipe_nodes
from headrace.profiling.process import headrace_threads, snapshot
from headrace.profiling.trend import Trend, fit_trend

if TYPE_CHECKING:
    from headrace._dataset import Dataset
    from headrace.core.node import Node

__all__ = ["Diagnosis", "EpochMeasure", "Trend", "allocated_bytes", "diagnose", "fit_trend"]


@dataclass(frozen=True)
class EpochMeasure:
    """What one epoch left behind, measured after its iterator was dropped and collected."""

    epoch: int
    elements: int
    seconds: float
    #: Bytes ``tracemalloc`` traced (0 in an untraced epoch).
    traced: int
    charged: int
    descriptors: int
    shared_memory_segments: int
    headrace_threads: int
    live_iterators: int
    #: Bytes each stage had booked at the end of the epoch (before the drop).
    held: tuple[int, ...]
    #: Bytes live in malloc and Python's allocator (:func:`allocated_bytes`; 0 if unknown).
    allocated: int = 0


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
    #: The trend of :attr:`EpochMeasure.allocated` (no points where it is unknown).
    allocated: Trend = field(default_factory=lambda: fit_trend("allocated memory", []))
    #: The attribution pass: epochs traced only to say where a leak was allocated.
    traced_epochs: tuple[EpochMeasure, ...] = ()
    #: Every measured epoch was traced with deep tracebacks (``diagnose(deep=True)``).
    deep: bool = False

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

    @property
    def memory_trends(self) -> tuple[Trend, ...]:
        """The memory measures that were fitted: allocated, traced (each where measured),
        then anonymous + shared."""
        return (*[t for t in (self.allocated, self.traced) if t.points], self.charged)

    @property
    def growth_per_epoch(self) -> float:
        """The largest fitted memory growth per epoch (bytes; what a LEAK line quotes)."""
        return max(t.slope for t in self.memory_trends)

    def _table(self) -> list[str]:
        allocated = any(m.allocated for m in self.epochs)
        traced = any(m.traced for m in self.epochs)
        head = f"  {'epoch':>5} {'elements':>9} {'s':>6}"
        head += f" {'allocated':>11}" * allocated + f" {'traced':>11}" * traced
        lines = [head + f" {'anon+shm':>11} {'fds':>5} {'threads':>8} {'live iters':>10}"]
        for m in self.epochs:
            row = f"  {m.epoch:>5} {m.elements:>9,} {m.seconds:>6.2f}"
            row += f" {format_bytes(m.allocated):>11}" * allocated
            row += f" {format_bytes(m.traced):>11}" * traced
            lines.append(row + f" {format_bytes(m.charged):>11} {m.descriptors:>5}"
                         f" {m.headrace_threads:>8} {m.live_iterators:>10}")
        if self.traced_epochs:
            lines.append(f"  then {len(self.traced_epochs)} epochs traced "
                         f"({DEEP_FRAMES} frames) to find where the growth was allocated: "
                         + ", ".join(f"{m.seconds:.2f} s" for m in self.traced_epochs))
        return lines

    def _verdict_lines(self) -> list[str]:
        if not self.leak:
            return ["", f"no leak: growth per epoch is within noise (floor "
                    f"{format_bytes(self.min_leak)}/epoch)."]
        lines = ["", f"LEAK: memory grows by ~{format_bytes(int(self.growth_per_epoch))} "
                 "per epoch, beyond noise."]
        for item in self.growth:
            where = item.where if item.where.startswith(("kept in", "its booked")) else (
                f"allocated at {item.where}")
            lines.append(f"  {item.stage}: ~{format_bytes(int(item.bytes_per_epoch))}/epoch, "
                         f"{where}")
        if not self.growth:
            lines.append("  (not traced to a stage: native code, or the consumer's own)")
        return lines

    def format(self) -> str:
        """The diagnosis as text: findings, the per-epoch table, the fits, the verdict."""
        lines = [f"{self.title}"]
        if self.extra.get("pipeline"):
            lines += ["", str(self.extra["pipeline"])]
        if self.findings:
            lines += ["", "recipe findings:"] + [f.format() for f in self.findings]
        else:
            lines += ["", "recipe findings: none"]
        lines += ["", f"{len(self.epochs)} epochs (the first {self.warmup} are warm-up, "
                  "not fitted); after each, the iterator was dropped without close():"]
        lines += self._table()
        lines += [""] + ["  " + trend.format() for trend in self.memory_trends]
        for trend in self.stage_trends:
            if trend.significant(self.min_leak, self.sigmas):
                lines.append("  " + trend.format() + "  <- grows")
        lines += self._verdict_lines()
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
    from headrace._memory.sizeof import sizeof

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


# -- what is allocated, without tracing every allocation ----------------------------------------

#: Frames a traced allocation keeps in a deep pass: enough to walk out of NumPy's or a
#: library's allocating frames to the recipe function that called them.
DEEP_FRAMES = 16
#: Epochs of the traced pass that runs only once a leak is found: the first one's
#: survivors are the baseline (state replaced every epoch is allocated again in each),
#: the next two measure what each allocation site adds per epoch.
ATTRIBUTION_EPOCHS = 3
#: What one of Python's small-object blocks is counted as: ``sys.getallocatedblocks``
#: counts objects, not bytes, and most objects a pipeline makes (ints, floats, short
#: tuples and strings, small dicts' headers) take 32 to 80 bytes.
SMALL_OBJECT_BYTES = 64


def allocated_bytes() -> int | None:
    """Bytes live in the process's allocators, read in microseconds: malloc's blocks in
    use (every arena, NumPy's data and C extensions' buffers included) plus Python's
    small objects at :data:`SMALL_OBJECT_BYTES` each. None where malloc cannot say.

    This is what lets the doctor run at nearly the speed of a plain epoch:
    ``tracemalloc`` sees the same growth but costs every allocation a traceback.
    """
    heap = heap_info()
    if heap is None:
        return None
    return int(heap.uordblks + heap.hblkhd) + sys.getallocatedblocks() * SMALL_OBJECT_BYTES


# -- the epochs --------------------------------------------------------------------------------


#: How long a dropped iterator's threads get to end before they are counted. They are
#: told to stop when the iterator is collected and end on their own thread: counted at
#: once, a loaded machine showed the last epoch's map threads as still running.
THREADS_END_SECONDS = 0.5


def _let_threads_end() -> None:
    """Wait (bounded) for headrace's threads to end; a thread a leak keeps stays counted."""
    deadline = time.perf_counter() + THREADS_END_SECONDS
    while headrace_threads() and time.perf_counter() < deadline:
        time.sleep(0.005)


class _Runner:
    """Internal: runs one epoch at a time the doctor's way (a new iterator, dropped without
    ``close()``, as Keras does) and measures what it left behind."""

    def __init__(self, dataset: Dataset, nodes: list[Node], steps: int | None) -> None:
        self.dataset = dataset
        self.nodes = nodes
        self.steps = steps
        self.alive: list[weakref.ref[Any]] = []

    def _drain(self) -> tuple[int, tuple[int, ...]]:
        """One epoch; the iterator is dropped when this returns, never closed."""
        iterator = iter(self.dataset)
        count = 0
        for element in iterator:
            count += 1
            del element
            if self.steps is not None and count >= self.steps:
                break
        accounts = _accounts(iterator)
        held = tuple(accounts[id(node)].stats().held if id(node) in accounts else 0
                     for node in self.nodes)
        self.alive.append(weakref.ref(iterator))
        return count, held

    def epoch(self, index: int) -> EpochMeasure:
        started = time.perf_counter()
        count, held = self._drain()
        gc.collect()
        _let_threads_end()
        release_free_heap()  # resident memory then counts live blocks, not free ones
        seconds = time.perf_counter() - started
        memory = snapshot(detailed=True)
        return EpochMeasure(
            index, count, seconds,
            tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0,
            memory.charged, memory.descriptors.total, memory.descriptors.shared_memory,
            memory.headrace_threads, sum(ref() is not None for ref in self.alive), held,
            allocated_bytes() or 0,
        )


@dataclass
class _Pass:
    """Internal: the epochs of one pass, and what was sampled at its first and last mark."""

    measures: list[EpochMeasure] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    snapshots: list[tracemalloc.Snapshot] = field(default_factory=list)


def _run_pass(
    runner: _Runner, epochs: range, marks: tuple[int, int],
    holders: list[tuple[str, str, Any]] | None, on_epoch: Callable[[EpochMeasure], None] | None,
) -> _Pass:
    """Run ``epochs``; after the two ``marks`` (epoch indices), cost the holders (when
    given) and take a traced snapshot (when tracing)."""
    done = _Pass()
    for index in epochs:
        measure = runner.epoch(index)
        done.measures.append(measure)
        if on_epoch is not None:
            on_epoch(measure)
        if index in marks:
            if holders is not None:
                done.kept.append(_retained(holders))
            if tracemalloc.is_tracing():
                done.snapshots.append(tracemalloc.take_snapshot())
    return done


@contextlib.contextmanager
def _tracing(frames: int) -> Any:
    """``tracemalloc`` on for the block (with ``frames`` frames unless the caller had it
    on already: theirs is left as it is)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start(frames)
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()


# -- the verdict ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Verdict:
    """Internal: the fitted trends of the measured epochs and whether they call it a leak."""

    allocated: Trend
    traced: Trend
    charged: Trend
    stages: tuple[Trend, ...]
    leak: bool


def _verdict(
    measures: list[EpochMeasure], warmup: int, names: list[str], *, traced_counts: bool,
    min_leak: int, min_rss_leak: int, sigmas: float,
) -> _Verdict:
    """Fit each measure over the epochs after the warm-up; ``traced_counts``: the epochs
    were traced on purpose (a caller's own tracing, with ``trace=False``, is not fitted)."""
    fitted = measures[warmup:]
    has_allocated = all(m.allocated for m in fitted)
    has_traced = traced_counts and all(m.traced for m in fitted)
    allocated = fit_trend("allocated memory (malloc + Python objects)",
                          [float(m.allocated) for m in fitted] if has_allocated else [])
    traced = fit_trend("traced memory (tracemalloc)",
                       [float(m.traced) for m in fitted] if has_traced else [])
    charged = fit_trend("anonymous + shared memory", [float(m.charged) for m in fitted])
    stages = tuple(fit_trend(f"{name} booked", [float(m.held[k]) for m in fitted])
                   for k, name in enumerate(names))
    leak = (
        allocated.significant(min_leak, sigmas) or traced.significant(min_leak, sigmas)
        or charged.significant(min_rss_leak, sigmas)
        or any(t.significant(min_leak, sigmas) for t in stages)
    )
    return _Verdict(allocated, traced, charged, stages, bool(leak))


def _kept_growth(
    holders: list[tuple[str, str, Any]], kept: list[list[int]], span: int, min_leak: int,
) -> list[StageGrowth]:
    """Who keeps the growth. First, because a list a map appends elements to holds memory
    allocated by the stage that made them, which is all the allocation's traceback names."""
    return _kept(holders, kept[0], kept[1], span, min_leak) if len(kept) == 2 else []


def _explained(kept: list[StageGrowth], verdict: _Verdict) -> bool:
    """Whether the holders that grew keep most of the measured growth: then where it was
    allocated adds nothing a user acts on, and the traced pass is not worth its cost."""
    grown = max((t.slope for t in (verdict.allocated, verdict.traced) if t.points), default=0.0)
    return bool(kept) and sum(item.bytes_per_epoch for item in kept) >= grown / 2


def _blame(
    nodes: list[Node], names: list[str], verdict: _Verdict, kept: list[StageGrowth],
    traced: _Pass | None, traced_span: int, *, min_leak: int, sigmas: float,
) -> list[StageGrowth]:
    """The stages to blame, most likely first: who keeps the growth, then where it was
    allocated, then whose booked bytes grow."""
    growth = list(kept)
    if traced is not None and len(traced.snapshots) == 2:
        before, after = traced.snapshots
        for item in _attribute(before, after, traced_span, _stage_locator(nodes), min_leak):
            if item.stage not in [g.stage for g in growth]:
                growth.append(item)
    for trend, name in zip(verdict.stages, names, strict=True):
        if trend.significant(min_leak, sigmas) and name not in [g.stage for g in growth]:
            growth.append(StageGrowth(name, trend.slope, "its booked bytes"))
    return growth


def _integer_argument(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"doctor: {name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < least:
        raise InvalidArgumentError(f"doctor: {name} must be >= {least}, got {value}")
    return value


def _check(epochs: Any, steps: Any, warmup: Any) -> None:
    """Refuse bad counts before anything runs, naming the argument and the value."""
    _integer_argument("warmup", warmup, 0)
    if steps is not None:
        _integer_argument("steps", steps, 1)
    _integer_argument("epochs", epochs, 1)
    if epochs < warmup + 3:
        raise InvalidArgumentError(
            f"doctor: needs at least warmup + 3 = {warmup + 3} epochs (a leak is a trend "
            f"over the epochs after the warm-up), got {epochs}")


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
    deep: bool = False,
    title: str = "headrace doctor",
    on_epoch: Callable[[EpochMeasure], None] | None = None,
    on_traced_epoch: Callable[[EpochMeasure], None] | None = None,
) -> Diagnosis:
    """Lint ``dataset``'s recipe and run it ``epochs`` times looking for leaks.

    ``steps`` caps the elements per epoch. ``min_leak``: the least growth per
    epoch of allocated memory (or a stage's booked bytes) reported as a leak
    (``min_rss_leak`` for the process's anonymous + shared memory, which
    allocators make noisier).

    By default the epochs run untraced, at close to a plain epoch's speed: what
    they allocate is read from malloc's and Python's own counters. Only when
    that finds a leak do :data:`ATTRIBUTION_EPOCHS` more epochs run under
    ``tracemalloc`` with :data:`DEEP_FRAMES` frames, to say which stage's code
    allocated it. ``deep=True`` traces every epoch that way instead (the old
    behaviour, many times slower on allocation-heavy Python maps; its traced
    memory then counts in the verdict too). ``trace=False`` never traces: a
    leak is then blamed only on who keeps it or on booked bytes. Where malloc
    has no counter (off glibc), every epoch is traced with one frame.

    ``on_epoch`` is called after each of the ``epochs`` measured epochs,
    ``on_traced_epoch`` after each epoch of the attribution pass.
    """
    _check(epochs, steps, warmup)
    findings = tuple(lint_recipe_safe(dataset)) if lint else ()
    nodes = recipe_nodes(dataset.node)
    names = [str(getattr(node, "stage", type(node).__name__)) for node in nodes]
    holders = _holders(nodes)
    runner = _Runner(dataset, nodes, steps)
    marks = (max(warmup - 1, 0), epochs - 1)
    span = marks[1] - marks[0]  # epochs between the two marks
    counted = allocated_bytes() is not None
    frames = DEEP_FRAMES if deep else 1
    trace_all = trace and (deep or not counted or tracemalloc.is_tracing())
    with _tracing(frames) if trace_all else contextlib.nullcontext():
        measured = _run_pass(runner, range(epochs), marks, holders, on_epoch)
    verdict = _verdict(measured.measures, warmup, names, traced_counts=trace_all,
                       min_leak=min_leak, min_rss_leak=min_rss_leak, sigmas=sigmas)
    traced: _Pass | None = measured if len(measured.snapshots) == 2 else None
    traced_span = span
    extra_epochs: list[EpochMeasure] = []
    kept = _kept_growth(holders, measured.kept, span, min_leak) if verdict.leak else []
    if verdict.leak and trace and not _explained(kept, verdict) and not _deep_enough(traced):
        # where it was allocated needs deep tracebacks: a short traced pass, only now
        with _tracing(DEEP_FRAMES):
            traced = _run_pass(runner, range(epochs, epochs + ATTRIBUTION_EPOCHS),
                               (epochs, epochs + ATTRIBUTION_EPOCHS - 1), None, on_traced_epoch)
        extra_epochs = traced.measures
        traced_span = ATTRIBUTION_EPOCHS - 1
    growth = _blame(nodes, names, verdict, kept, traced, traced_span, min_leak=min_leak,
                    sigmas=sigmas)
    return Diagnosis(
        title=title,
        findings=findings,
        stage_names=tuple(names),
        epochs=tuple(measured.measures),
        warmup=warmup,
        traced=verdict.traced,
        charged=verdict.charged,
        stage_trends=verdict.stages,
        leak=verdict.leak,
        growth=tuple(growth),
        resources=tuple(_resources(measured.measures[warmup:] or measured.measures)),
        min_leak=min_leak,
        sigmas=sigmas,
        allocated=verdict.allocated,
        traced_epochs=tuple(extra_epochs),
        deep=deep,
    )


def _deep_enough(traced: _Pass | None) -> bool:
    """Whether the measured pass's own snapshots can name stages: deep enough, or traced
    by the caller's own ``tracemalloc`` (which a new pass could not deepen)."""
    if traced is None:
        return tracemalloc.is_tracing()
    return traced.snapshots[0].traceback_limit >= DEEP_FRAMES or tracemalloc.is_tracing()


def lint_recipe_safe(dataset: Dataset) -> list[Finding]:
    """The recipe's findings, sampling a few elements where sizes are needed."""
    from headrace.profiling.lint import lint_recipe

    try:
        return lint_recipe(dataset, sample=4)
    except Exception as error:  # lint must never stop the diagnosis
        return [Finding("lint-failed", "pipeline", f"could not read the recipe: {error}",
                        "report this as a headrace bug", severity="info")]
