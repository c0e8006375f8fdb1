"""``Dataset.profile``: run a pipeline, count and time every stage, sample it over time.

The result (:class:`Profile`, frozen) prints as a terminal table per stage
(:meth:`Profile.format`) and writes a self-contained HTML report with plots
(:meth:`Profile.write_html`, see :mod:`headrace.profiling.report`).

Per stage: elements in and out, time its consumer spent in its pulls and how
much of that went on pulling its inputs (the rest is its own work; for a
stage that pulls its input on threads — prefetch, a parallel map — its pulls
are the consumer *waiting* for those threads), throughput, the inflation
factor (payload bytes out / bytes in: decoding inflates, projections
shrink), and its share, held and peak bytes. Over time: the samples and
decisions of :mod:`headrace.profiling.timeline`.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from headrace._errors import InvalidArgumentError
from headrace._memory.budget import KeptStats
from headrace._memory.units import format_bytes
from headrace._workers.memory import WorkerStats
from headrace.core.node import INFINITE
from headrace.profiling.probe import Instrumenter, StageRecord
from headrace.profiling.process import ProcessSnapshot
from headrace.profiling.timeline import Decision, Sample, Sampler, summarize_decisions

if TYPE_CHECKING:
    from headrace._dataset import Dataset
    from headrace.profiling.lint import Finding

__all__ = ["Profile", "StageProfile", "profile"]


@dataclass(frozen=True)
class StageProfile:
    """One stage of a profiled pipeline, over every epoch profiled."""

    name: str
    depth: int
    elements_in: int
    elements_out: int
    errors: int
    #: Time its consumer spent inside its pulls.
    seconds: float
    #: Of which, pulling its inputs (on the same thread; see ``asynchronous``).
    input_seconds: float
    #: Its inputs are pulled on other threads: ``seconds`` is then waiting for them.
    asynchronous: bool
    #: Elements out per second of the profile's wall time.
    throughput: float
    mean_bytes_out: float
    #: Payload bytes out / bytes in (None for a source, or with nothing sampled).
    inflation: float | None
    share: int
    held: int
    peak: int
    #: Recipe stages this one runs inside its own iterator (read by index, say).
    fused: tuple[str, ...] = ()
    #: ``id`` of the stage's recipe node while the profile ran (links findings to stages).
    key: int = 0
    #: False for a stage that reads no other stage (a source, or a chain run by index).
    has_inputs: bool = True
    #: Iterators it made over the profile (one per epoch; more under a ``repeat``).
    iterators: int = 0
    #: A map on worker processes: its workers' memory at the end, and its traffic (chunks,
    #: compute against transfer seconds, bytes through shared memory) over every epoch.
    workers: WorkerStats | None = None

    @property
    def own_seconds(self) -> float | None:
        """Time in its own work (None where its input runs on other threads)."""
        if self.asynchronous:
            return None
        return max(0.0, self.seconds - self.input_seconds)


@dataclass(frozen=True)
class Profile:
    """What :func:`profile` measured. Frozen: safe to keep, compare and render."""

    stages: tuple[StageProfile, ...]
    stage_names: tuple[str, ...]
    samples: tuple[Sample, ...]
    decisions: tuple[Decision, ...]
    warnings: tuple[str, ...]
    findings: tuple[Finding, ...]
    budget_total: int
    budget_peak: int
    elements: int
    epochs: int
    seconds: float
    start_memory: ProcessSnapshot
    end_memory: ProcessSnapshot
    title: str = "headrace profile"
    extra: dict[str, Any] = field(default_factory=dict)
    #: What stages keep beyond the run, as the last epoch saw it (a complete in-memory
    #: cache belongs to its dataset): bytes that stay booked, and on which budget.
    kept: tuple[KeptStats, ...] = ()

    @property
    def throughput(self) -> float:
        return self.elements / self.seconds if self.seconds > 0 else 0.0

    @property
    def peak_growth(self) -> int:
        """Largest growth of anonymous + shared memory seen, from the start."""
        return max((sample.growth for sample in self.samples), default=0)

    @property
    def peak_unaccounted(self) -> int:
        return max((sample.unaccounted for sample in self.samples), default=0)

    def format(self) -> str:
        """A terminal table per stage, then process memory, decisions and findings."""
        lines = [
            f"{self.title}: {self.elements:,} elements in {self.epochs} epoch(s), "
            f"{self.seconds:.2f} s ({self.throughput:,.0f}/s)",
            f"budget {format_bytes(self.budget_total)}, peak booked "
            f"{format_bytes(self.budget_peak)}; process growth (anonymous + shared) peak "
            f"{format_bytes(self.peak_growth)}, of which no stage accounts for "
            f"{format_bytes(max(self.peak_unaccounted, 0))}",
            f"process at end: anonymous {format_bytes(self.end_memory.anonymous)}, shared "
            f"{format_bytes(self.end_memory.shared)}, file-backed "
            f"{format_bytes(self.end_memory.file_backed)}, USS {format_bytes(self.end_memory.uss)}"
            f"; open descriptors {self.end_memory.descriptors.total}, threads "
            f"{self.end_memory.threads}",
            "",
            f"{'stage':<32}{'in':>10}{'out':>10}{'out/s':>11}{'pull s':>9}{'input s':>9}"
            f"{'own s':>8}{'infl.':>7}{'share':>11}{'held':>11}{'peak':>11}",
        ]
        for stage in self.stages:
            name = ("  " * stage.depth + stage.name)[:31]
            own = "async" if stage.own_seconds is None else f"{stage.own_seconds:.2f}"
            inflation = "" if stage.inflation is None else _ratio(stage.inflation)
            lines.append(
                f"{name:<32}{_count_in(stage):>10}{stage.elements_out:>10,}"
                f"{stage.throughput:>11,.0f}{stage.seconds:>9.2f}{stage.input_seconds:>9.2f}"
                f"{own:>8}{inflation:>7}{_bytes_or_dash(stage.share):>11}"
                f"{_bytes_or_dash(stage.held):>11}{_bytes_or_dash(stage.peak):>11}"
            )
            if stage.fused:
                lines.append(f"{'':<4}{'  ' * stage.depth}(runs {', '.join(stage.fused)} inside)")
        if self.kept:
            lines += ["", "kept beyond the run (belongs to the dataset):"]
            lines += [f"  {kept.format()}" for kept in self.kept]
        lines += self._format_workers()
        if self.decisions:
            lines += ["", "decisions taken while running:"]
            summary = summarize_decisions(self.decisions)
            lines += ["  " + line for line in summary[:30]]
            if len(summary) > 30:
                lines.append(f"  ... and {len(summary) - 30} more (see the HTML report)")
        if self.warnings:
            lines += ["", "warnings:"] + [f"  {text}" for text in self.warnings]
        if self.findings:
            lines += ["", "findings:"] + [finding.format() for finding in self.findings]
        return "\n".join(lines)

    @property
    def worker_stages(self) -> tuple[StageProfile, ...]:
        """The stages that ran on worker processes."""
        return tuple(s for s in self.stages if s.workers is not None and s.workers.kind == "processes")

    @property
    def peak_shm(self) -> tuple[int, int]:
        """Most shared-memory segments of this pipeline seen at once, and most bytes."""
        detailed = [s.memory for s in self.samples]
        return (max((m.shm_segments for m in detailed), default=0),
                max((m.shm_bytes for m in detailed), default=0))

    def peak_worker_rss(self) -> dict[int, int]:
        """Each worker process's largest RSS seen (by pid), over the samples and the end."""
        peaks: dict[int, int] = {}
        for memory in [s.memory for s in self.samples]:
            for worker in memory.worker_processes:
                peaks[worker.pid] = max(peaks.get(worker.pid, 0), worker.rss)
        for stage in self.worker_stages:
            assert stage.workers is not None
            for worker in stage.workers.processes:
                peaks[worker.pid] = max(peaks.get(worker.pid, 0), worker.rss)
        return peaks

    def _format_workers(self) -> list[str]:
        stages = self.worker_stages
        if not stages:
            return []
        segments, segment_bytes = self.peak_shm
        lines = ["", f"worker processes (shared memory at most {segments} segments, "
                 f"{format_bytes(segment_bytes)}):"]
        peaks = self.peak_worker_rss()
        for stage in stages:
            workers = stage.workers
            assert workers is not None
            moving = workers.compute_seconds + workers.transfer_seconds
            share = workers.transfer_seconds / moving if moving > 0 else 0.0
            lines.append(
                f"  {stage.name}: {workers.count} processes ({workers.reason}); "
                f"{workers.chunks:,} chunks of {workers.elements:,} elements; compute "
                f"{workers.compute_seconds:.2f} s, transfer {workers.transfer_seconds:.2f} s "
                f"({share:.0%} of their time); sent {format_bytes(workers.sent_bytes)}, "
                f"received {format_bytes(workers.received_bytes)}"
            )
            for worker in workers.processes:
                lines.append(
                    f"    pid {worker.pid}: RSS {format_bytes(worker.rss)} (peak "
                    f"{format_bytes(peaks.get(worker.pid, worker.rss))}), unique "
                    f"{format_bytes(worker.uss)}, proportional anonymous + shared "
                    f"{format_bytes(worker.charged)}"
                )
        return lines

    def to_html(self) -> str:
        """The self-contained HTML report (no external scripts, opens offline)."""
        from headrace.profiling.report import render_html

        return render_html(self)

    def write_html(self, path: str) -> str:
        """Write :meth:`to_html` to ``path``; returns the path."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_html())
        return path


def _ratio(value: float) -> str:
    """A ratio in at most 6 characters (a decoder from 8-byte indices inflates 50,000x)."""
    return f"{value:.2f}" if value < 100 else f"{value:.3g}"


def _count_in(stage: StageProfile) -> str:
    return f"{stage.elements_in:,}" if stage.has_inputs else "-"


def _bytes_or_dash(nbytes: int) -> str:
    return format_bytes(nbytes) if nbytes else "-"


class _Progress:
    """One live line on a terminal: epoch, elements, rate, budget used, growth."""

    def __init__(self, stream: TextIO, every: float = 0.25) -> None:
        self.stream, self.every = stream, every
        self.last = 0.0
        self.elements: list[int] = [0]
        self.started = time.perf_counter()

    def __call__(self, sample: Sample) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        done = self.elements[0]
        rate = done / max(now - self.started, 1e-9)
        self.stream.write(
            f"\r  epoch {sample.epoch + 1}: {done:,} elements, {rate:,.0f}/s, budget "
            f"{format_bytes(sample.budget_used)} of {format_bytes(sample.budget_total)}, "
            f"process +{format_bytes(max(sample.growth, 0))}   "
        )
        self.stream.flush()

    def finish(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _check_run(dataset: Dataset, steps: int | None, epochs: int) -> None:
    """Refuse a run :func:`profile` cannot make: no epochs, no steps, or an infinite
    dataset without ``steps``."""
    if epochs < 1:
        raise InvalidArgumentError(f"profile: epochs must be >= 1, got {epochs}")
    if steps is not None and steps < 1:
        raise InvalidArgumentError(f"profile: steps must be >= 1 or None, got {steps}")
    if steps is None and dataset.cardinality() == INFINITE:
        raise InvalidArgumentError(
            "profile: this dataset is infinite; pass steps=N to profile N elements per epoch"
        )


def profile(
    dataset: Dataset,
    *,
    steps: int | None = None,
    epochs: int = 1,
    interval: float = 0.05,
    progress: bool | None = None,
    stream: TextIO | None = None,
    lint: bool = True,
    title: str | None = None,
) -> Profile:
    """Run ``dataset`` for ``epochs`` epochs (``steps`` elements each, or to its end).

    Each epoch uses a new iterator, as Keras does. ``progress`` prints a live
    line to ``stream`` (default: stderr, when it is a terminal). ``lint`` adds
    the recipe's findings (:mod:`headrace.profiling.lint`), measured ones
    included.
    """
    _check_run(dataset, steps, epochs)
    out = stream if stream is not None else sys.stderr
    show = progress if progress is not None else bool(getattr(out, "isatty", lambda: False)())
    instrumenter = Instrumenter(dataset.node)
    reporter = _Progress(out) if show else None
    sampler = Sampler(instrumenter, interval=interval, on_sample=reporter)
    caught: list[warnings.WarningMessage] = []
    elements = 0
    budget_total = budget_peak = 0
    held: dict[int, tuple[int, int, int]] = {}
    kept: tuple[KeptStats, ...] = ()
    workers: dict[int, WorkerStats] = {}
    instrumenter.attach()
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            sampler.start()
            for epoch in range(epochs):
                instrumenter.expect_run()
                with iter(dataset) as iterator:
                    sampler.watch(iterator, epoch)
                    for _ in iterator:
                        elements += 1
                        if reporter is not None:
                            reporter.elements[0] = elements
                        if steps is not None and elements >= steps * (epoch + 1):
                            break
                    sampler.sample()
                    budget = iterator.context.budget
                    booked = budget.stats()
                    budget_total, budget_peak = booked.total, max(budget_peak, booked.peak)
                    kept = budget.kept_stats()
                    accounts = getattr(iterator.context, "_accounts", {})
                    for key, account in accounts.items():
                        _, _, peak = held.get(key, (0, 0, 0))
                        now = account.stats()
                        held[key] = (now.limit, now.held, max(peak, now.peak))
                    _add_workers(workers, iterator)
            seconds = time.perf_counter() - started
            sampler.stop()
    finally:
        instrumenter.detach()
        if reporter is not None:
            reporter.finish()
    stages = tuple(_stage_profiles(instrumenter, held, seconds, workers))
    findings: tuple[Finding, ...] = ()
    if lint:
        from headrace.profiling.lint import lint_recipe

        findings = tuple(lint_recipe(dataset, measured=stages, epochs=epochs))
    return Profile(
        stages=stages,
        stage_names=tuple(sampler.stage_names),
        samples=tuple(sampler.samples),
        decisions=tuple(sampler.decisions),
        warnings=tuple(str(w.message) for w in caught),
        findings=findings,
        budget_total=budget_total,
        budget_peak=budget_peak,
        elements=elements,
        epochs=epochs,
        seconds=seconds,
        start_memory=sampler.start_memory,
        end_memory=sampler.samples[-1].memory if sampler.samples else sampler.start_memory,
        title=title or "headrace profile",
        kept=kept,
    )


def _add_workers(found: dict[int, WorkerStats], iterator: Any) -> None:
    """Add one epoch's worker figures to ``found`` (by ``id`` of the stage's recipe node):
    traffic adds up over epochs, memory is the latest epoch's."""
    from dataclasses import replace

    from headrace.profiling.probe import record_of

    for stage in iterator.stages():
        if not hasattr(stage, "worker_stats"):
            continue
        record = record_of(stage)
        if record is None:
            continue
        now: WorkerStats = stage.worker_stats()
        before = found.get(id(record.node))
        if before is not None:
            now = replace(
                now,
                chunks=before.chunks + now.chunks,
                elements=before.elements + now.elements,
                compute_seconds=before.compute_seconds + now.compute_seconds,
                transfer_seconds=before.transfer_seconds + now.transfer_seconds,
                sent_bytes=before.sent_bytes + now.sent_bytes,
                received_bytes=before.received_bytes + now.received_bytes,
                segments=before.segments + now.segments,
                processes=now.processes or before.processes,
            )
        found[id(record.node)] = now


def _stage_profiles(
    instrumenter: Instrumenter, held: dict[int, tuple[int, int, int]], seconds: float,
    workers: dict[int, WorkerStats],
) -> list[StageProfile]:
    out = []
    for depth, record in instrumenter.depth_order():
        share, now, peak = held.get(id(record.node), (0, 0, 0))
        if record.accounts:  # an interleave's inner stage: over its slots' accounts
            now, share, peak = record.inner_held
        out.append(
            StageProfile(
                name=record.name,
                depth=depth,
                elements_in=record.elements_in,
                elements_out=record.count,
                errors=record.errors,
                seconds=record.seconds,
                input_seconds=record.input_seconds,
                asynchronous=record.asynchronous,
                throughput=record.count / seconds if seconds > 0 else 0.0,
                mean_bytes_out=record.mean_bytes,
                inflation=_inflation(record),
                share=share,
                held=now,
                peak=peak,
                fused=tuple(instrumenter.fused_into(record)),
                key=id(record.node),
                has_inputs=bool(record.children),
                iterators=record.iterators,
                workers=workers.get(id(record.node)),
            )
        )
    return out


def _inflation(record: StageRecord) -> float | None:
    if not record.children or not record.sampled:
        return None
    bytes_in = sum(child.mean_bytes * child.count for child in record.children)
    if bytes_in <= 0:
        return None
    return record.mean_bytes * record.count / bytes_in
