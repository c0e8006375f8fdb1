"""The HTML report of a profile: one self-contained file, plots drawn as inline SVG.

No scripts, fonts or styles from elsewhere: the file opens offline, in any
browser, years later, and can be attached to a bug report. Plots:

- memory over time, stacked by stage (each stage's held bytes), with the
  budget as a line and the process's measured growth (anonymous + shared) as
  another — the gap between the stack and the measured line is memory no
  stage accounts for; decisions taken are marked on the time axis;
- throughput per stage over time (elements out per second);
- time per stage: own work vs waiting on its input;

then the stage table, the decisions, warnings and lint findings.
"""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from headrace._memory.units import format_bytes

if TYPE_CHECKING:
    from headrace.profiling.profiler import Profile

__all__ = ["render_html"]

_PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
)
_WIDTH, _HEIGHT = 860, 300
LEFT, _RIGHT, TOP, _BOTTOM = 80, 190, 20, 40
_MAX_POINTS = 600


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def palette_color(index: int) -> str:
    return _PALETTE[index % len(_PALETTE)]


def _thin(count: int) -> list[int]:
    """Indices of at most ``_MAX_POINTS`` samples, evenly spread, last included."""
    if count <= _MAX_POINTS:
        return list(range(count))
    step = count / _MAX_POINTS
    picked = sorted({int(k * step) for k in range(_MAX_POINTS)} | {count - 1})
    return picked


class Axes:
    """Maps data to pixels for one chart and draws its frame."""

    def __init__(self, x_max: float, y_max: float) -> None:
        self.x_max = x_max if x_max > 0 else 1.0
        self.y_max = y_max if y_max > 0 else 1.0
        self.plot_w = _WIDTH - LEFT - _RIGHT
        self.plot_h = _HEIGHT - TOP - _BOTTOM

    def x(self, value: float) -> float:
        return LEFT + self.plot_w * value / self.x_max

    def y(self, value: float) -> float:
        return TOP + self.plot_h * (1 - value / self.y_max)

    def frame(self, y_label: str, y_format: str = "bytes", x_format: str = "seconds") -> list[str]:
        parts = [
            f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{self.plot_w}" '
            f'height="{self.plot_h}" fill="#fafafa" stroke="#ccc"/>'
        ]
        for k in range(5):
            value = self.y_max * k / 4
            y = self.y(value)
            text = format_bytes(int(value)) if y_format == "bytes" else f"{value:,.0f}"
            parts.append(
                f'<line x1="{LEFT}" x2="{LEFT + self.plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                f'stroke="#e5e5e5"/><text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" '
                f'font-size="11">{escape(text)}</text>'
            )
        ticks = ([float(k) for k in range(int(self.x_max) + 1)]
                 if x_format == "epoch" and self.x_max <= 20
                 else [self.x_max * k / 5 for k in range(6)])
        for value in ticks:
            x = self.x(value)
            parts.append(
                f'<text x="{x:.1f}" y="{TOP + self.plot_h + 16}" text-anchor="middle" '
                f'font-size="11">{_x_label(value, x_format)}</text>'
            )
        parts.append(
            f'<text x="14" y="{TOP + self.plot_h / 2:.0f}" font-size="12" '
            f'transform="rotate(-90 14 {TOP + self.plot_h / 2:.0f})" '
            f'text-anchor="middle">{escape(y_label)}</text>'
        )
        return parts


def _x_label(value: float, x_format: str) -> str:
    return f"{value:.2f} s" if x_format == "seconds" else f"{value:.0f}"


def chart_legend(entries: Sequence[tuple[str, str, str]]) -> list[str]:
    """(label, color, style) rows at the right of a chart; style 'box' or 'line' or 'dash'."""
    parts = []
    x = _WIDTH - _RIGHT + 12
    for row, (label, color, style) in enumerate(entries[:16]):
        y = TOP + 8 + row * 17
        if style == "box":
            mark = f'<rect x="{x}" y="{y - 8}" width="12" height="10" fill="{color}"/>'
        else:
            dash = ' stroke-dasharray="5,3"' if style == "dash" else ""
            mark = (f'<line x1="{x}" x2="{x + 14}" y1="{y - 3}" y2="{y - 3}" stroke="{color}" '
                    f'stroke-width="2"{dash}/>')
        parts.append(
            f'{mark}<text x="{x + 18}" y="{y + 1}" font-size="11">{escape(label[:26])}</text>'
        )
    return parts


def svg_chart(chart_id: str, title: str, parts: list[str]) -> str:
    return (
        f'<svg id="{chart_id}" class="chart" xmlns="http://www.w3.org/2000/svg" '
        f'width="{_WIDTH}" height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        f'aria-label="{escape(title)}"><title>{escape(title)}</title>{"".join(parts)}</svg>'
    )


def memory_chart(profile: Profile) -> str:
    """Held bytes stacked by stage, the budget line, the measured line, decision marks."""
    samples = profile.samples
    picked = _thin(len(samples))
    names = profile.stage_names
    x_max = samples[-1].seconds if samples else 1.0
    stacked_top = [sum(samples[k].held) for k in picked]
    y_max = max(
        [profile.budget_total * 1.05 if profile.budget_total < 4 * max([*stacked_top, 1]) else 0]
        + [max(0, samples[k].growth) * 1.05 for k in picked]
        + [top * 1.1 for top in stacked_top]
        + [1.0]
    )
    axes = Axes(x_max, y_max)
    parts = axes.frame("bytes")
    base = [0.0] * len(picked)
    legend: list[tuple[str, str, str]] = []
    for stage in range(len(names)):
        values = [
            samples[k].held[stage] if stage < len(samples[k].held) else 0 for k in picked
        ]
        if not any(values):
            continue
        upper = [b + v for b, v in zip(base, values, strict=True)]
        points = [f"{axes.x(samples[k].seconds):.1f},{axes.y(u):.1f}"
                  for k, u in zip(picked, upper, strict=True)]
        points += [f"{axes.x(samples[k].seconds):.1f},{axes.y(b):.1f}"
                   for k, b in reversed(list(zip(picked, base, strict=True)))]
        parts.append(
            f'<polygon class="stage-area" data-stage="{escape(names[stage])}" '
            f'points="{" ".join(points)}" fill="{palette_color(stage)}" fill-opacity="0.75"/>'
        )
        legend.append((names[stage], palette_color(stage), "box"))
        base = upper
    if profile.budget_total and profile.budget_total <= y_max:
        y = axes.y(profile.budget_total)
        parts.append(
            f'<line class="budget-line" x1="{LEFT}" x2="{LEFT + axes.plot_w}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="#d62728" stroke-width="2" stroke-dasharray="6,4"/>'
        )
        legend.append((f"budget {format_bytes(profile.budget_total)}", "#d62728", "dash"))
    elif profile.budget_total:
        legend.append((f"budget {format_bytes(profile.budget_total)} (off scale)", "#d62728",
                       "dash"))
    measured = " ".join(
        f"{axes.x(samples[k].seconds):.1f},{axes.y(max(0, samples[k].growth)):.1f}"
        for k in picked
    )
    if measured:
        parts.append(
            f'<polyline class="measured-line" points="{measured}" fill="none" stroke="#222" '
            f'stroke-width="1.5"/>'
        )
        legend.append(("measured (anon + shared)", "#222", "line"))
    for decision in profile.decisions[:60]:
        x = axes.x(decision.seconds)
        parts.append(
            f'<line class="decision" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" '
            f'y2="{TOP + 8}" stroke="#9467bd" stroke-width="2"><title>'
            f"{escape(decision.format())}</title></line>"
        )
    if profile.decisions:
        legend.append(("decision taken", "#9467bd", "line"))
    parts += chart_legend(legend)
    return svg_chart("memory-chart", "Memory over time, stacked by stage", parts)


def throughput_chart(profile: Profile) -> str:
    """Elements out per second of each stage, between consecutive samples."""
    samples = profile.samples
    picked = _thin(len(samples))
    names = profile.stage_names
    series: list[tuple[int, list[tuple[float, float]]]] = []
    for stage in range(len(names)):
        points = []
        for previous, current in itertools.pairwise(picked):
            a, b = samples[previous], samples[current]
            span = b.seconds - a.seconds
            if span <= 0 or stage >= len(b.elements):
                continue
            before = a.elements[stage] if stage < len(a.elements) else 0
            if b.epoch != a.epoch and b.elements[stage] < before:
                continue
            points.append((b.seconds, max(0.0, (b.elements[stage] - before) / span)))
        if any(rate for _, rate in points):
            series.append((stage, points))
    x_max = samples[-1].seconds if samples else 1.0
    y_max = max([rate for _, points in series for _, rate in points] + [1.0]) * 1.1
    axes = Axes(x_max, y_max)
    parts = axes.frame("elements / s", "count")
    legend = []
    for stage, points in series:
        path = " ".join(f"{axes.x(t):.1f},{axes.y(r):.1f}" for t, r in points)
        parts.append(
            f'<polyline class="throughput-line" data-stage="{escape(names[stage])}" '
            f'points="{path}" fill="none" stroke="{palette_color(stage)}" stroke-width="1.5"/>'
        )
        legend.append((names[stage], palette_color(stage), "line"))
    parts += chart_legend(legend)
    return svg_chart("throughput-chart", "Throughput per stage", parts)


def time_chart(profile: Profile) -> str:
    """Horizontal bars: each stage's own work and its time pulling its input."""
    stages = profile.stages
    height = TOP + _BOTTOM + 22 * max(len(stages), 1)
    x_max = max([stage.seconds for stage in stages] + [1e-6]) * 1.05
    plot_w = _WIDTH - 260 - 40
    parts = []
    for row, stage in enumerate(stages):
        y = TOP + row * 22
        own = stage.own_seconds
        waited = stage.seconds if own is None else stage.input_seconds
        own_w = 0.0 if own is None else plot_w * own / x_max
        wait_w = plot_w * min(waited, stage.seconds) / x_max
        label = ("  " * stage.depth + stage.name)[:34]
        parts.append(
            f'<text x="250" y="{y + 14}" text-anchor="end" font-size="11" '
            f'xml:space="preserve">{escape(label)}</text>'
            f'<rect class="time-bar" x="260" y="{y + 3}" width="{own_w:.1f}" height="14" '
            f'fill="#4e79a7"><title>own work {own or 0:.3f} s</title></rect>'
            f'<rect class="time-bar" x="{260 + own_w:.1f}" y="{y + 3}" width="{wait_w:.1f}" '
            f'height="14" fill="#bab0ac"><title>waiting {waited:.3f} s</title></rect>'
        )
    parts.append(
        f'<text x="260" y="{height - 12}" font-size="11">blue: own work; grey: waiting on its '
        f"input (or, for an asynchronous stage, on its threads); full bar = {x_max:.3f} s"
        "</text>"
    )
    return (
        f'<svg id="time-chart" class="chart" xmlns="http://www.w3.org/2000/svg" '
        f'width="{_WIDTH}" height="{height}" viewBox="0 0 {_WIDTH} {height}" role="img" '
        f'aria-label="Time per stage"><title>Time per stage</title>{"".join(parts)}</svg>'
    )


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], table_id: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#222;max-width:980px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left;white-space:pre}
.finding{border-left:4px solid #f28e2b;padding:4px 10px;margin:6px 0;background:#fff8f0}
.finding.info{border-color:#4e79a7;background:#f3f7fb}
.muted{color:#666;font-size:12px}
"""


def _workers_section(profile: Profile) -> str:
    """Maps on worker processes: each worker's memory, compute against transfer, traffic."""
    stages = profile.worker_stages
    if not stages:
        return ""
    peaks = profile.peak_worker_rss()
    segments, segment_bytes = profile.peak_shm
    stage_rows = []
    worker_rows = []
    for stage in stages:
        workers = stage.workers
        assert workers is not None
        moving = workers.compute_seconds + workers.transfer_seconds
        stage_rows.append((
            stage.name, workers.count, workers.reason, f"{workers.chunks:,}",
            f"{workers.elements:,}", f"{workers.compute_seconds:.3f}",
            f"{workers.transfer_seconds:.3f}",
            f"{workers.transfer_seconds / moving:.0%}" if moving > 0 else "-",
            format_bytes(workers.sent_bytes), format_bytes(workers.received_bytes),
        ))
        worker_rows += [
            (stage.name, worker.pid, format_bytes(worker.rss),
             format_bytes(peaks.get(worker.pid, worker.rss)), format_bytes(worker.uss),
             format_bytes(worker.pss_anon), format_bytes(worker.pss_shmem))
            for worker in workers.processes
        ]
    return "".join([
        "<h2>Worker processes</h2>",
        f"<p>Shared-memory segments of this pipeline: at most {segments} at once, "
        f"{escape(format_bytes(segment_bytes))}.</p>",
        html_table(["stage", "processes", "why", "chunks", "elements", "compute s", "transfer s",
                "transfer share", "sent", "received"], stage_rows, "workers"),
        '<p class="muted">Compute: the function in the workers. Transfer: moving elements '
        "both ways (pickling, shared-memory copies), in the workers and in this process.</p>",
        html_table(["stage", "pid", "RSS", "peak RSS", "USS", "PSS anonymous", "PSS shared"],
               worker_rows, "worker-memory"),
    ])


def render_html(profile: Profile) -> str:
    """The whole report as one HTML string (see the module doc)."""
    end = profile.end_memory
    summary = [
        f"{profile.elements:,} elements in {profile.epochs} epoch(s), {profile.seconds:.2f} s "
        f"({profile.throughput:,.0f} elements/s).",
        f"Budget {format_bytes(profile.budget_total)}, peak booked "
        f"{format_bytes(profile.budget_peak)}. Process growth (anonymous + shared) peak "
        f"{format_bytes(profile.peak_growth)}, of which no stage accounts for "
        f"{format_bytes(max(profile.peak_unaccounted, 0))}.",
        f"At the end: anonymous {format_bytes(end.anonymous)}, shared "
        f"{format_bytes(end.shared)}, file-backed {format_bytes(end.file_backed)}, USS "
        f"{format_bytes(end.uss)}, worker processes {end.worker_count} "
        f"({format_bytes(end.workers)}); open descriptors {end.descriptors.total} "
        f"(shared-memory segments {end.descriptors.shared_memory}, "
        f"{format_bytes(end.descriptors.shared_memory_bytes)}); threads {end.threads}.",
    ]
    stage_rows = [
        (
            "  " * s.depth + s.name + (f"  (runs {', '.join(s.fused)})" if s.fused else ""),
            f"{s.elements_in:,}" if s.has_inputs else "-",
            f"{s.elements_out:,}",
            f"{s.throughput:,.0f}",
            f"{s.seconds:.3f}",
            f"{s.input_seconds:.3f}",
            "async" if s.own_seconds is None else f"{s.own_seconds:.3f}",
            "" if s.inflation is None else f"{s.inflation:.2f}",
            format_bytes(int(s.mean_bytes_out)),
            format_bytes(s.share) if s.share else "-",
            format_bytes(s.held) if s.held else "-",
            format_bytes(s.peak) if s.peak else "-",
        )
        for s in profile.stages
    ]
    findings = "".join(
        f'<div class="finding {escape(f.severity)}"><b>{escape(f.code)}</b> at '
        f"<code>{escape(f.stage)}</code>: {escape(f.message)}<br><b>Fix:</b> {escape(f.fix)}</div>"
        for f in profile.findings
    ) or "<p>No findings.</p>"
    decisions = html_table(
        ["time", "stage", "decision", "from", "to"],
        [(f"{d.seconds:.3f} s", d.stage, d.what, "" if d.before is None else d.before, d.after)
         for d in profile.decisions],
        "decisions",
    ) if profile.decisions else "<p>No decisions changed while running.</p>"
    warned = "".join(f"<li>{escape(text)}</li>" for text in profile.warnings)
    return "".join([
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{escape(profile.title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(profile.title)}</h1>",
        "".join(f"<p>{escape(line)}</p>" for line in summary),
        "<h2>Memory over time, by stage</h2>",
        '<p class="muted">Stacked: bytes each stage holds. Dashed: the budget. Black: the '
        "process's measured growth; above the stack, memory no stage accounts for. Ticks at "
        "the top: decisions (hover for details).</p>",
        memory_chart(profile),
        "<h2>Throughput per stage</h2>",
        throughput_chart(profile),
        "<h2>Time per stage</h2>",
        time_chart(profile),
        _workers_section(profile),
        "<h2>Stages</h2>",
        html_table(
            ["stage", "in", "out", "out/s", "pull s", "input s", "own s", "inflation",
             "mean out", "share", "held", "peak"],
            stage_rows,
            "stages",
        ),
        "<h2>Decisions taken</h2>",
        decisions,
        "<h2>Warnings</h2>",
        f"<ul>{warned}</ul>" if warned else "<p>None.</p>",
        "<h2>Findings</h2>",
        findings,
        '<p class="muted">Generated by headrace. Self-contained: no external resources.</p>',
        "</body></html>",
    ])
