"""The HTML page of a ``headrace doctor`` diagnosis: self-contained, plots as inline SVG.

Like the profile's report (:mod:`headrace.profiling.report`, whose drawing
helpers it shares) it loads nothing from elsewhere. It shows what the verdict
rests on, so that a user can check it rather than trust it:

- memory after each epoch (allocated: malloc's blocks in use and Python's
  objects; traced by ``tracemalloc`` where every epoch was traced; the
  process's anonymous + shared memory; each from the first epoch), the
  warm-up epochs shaded (not fitted), and the fitted growth per epoch drawn
  over the rest;
- each stage's booked bytes after each epoch;

then the verdict (which stage, allocated or kept where), what was not
returned (iterators, threads, descriptors, shared memory), the per-epoch
table and the recipe's lint findings with their fixes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headrace._memory.units import format_bytes
from headrace.profiling.report import (
    LEFT,
    STYLE,
    TOP,
    Axes,
    chart_legend,
    escape,
    html_table,
    palette_color,
    svg_chart,
)

if TYPE_CHECKING:
    from headrace.profiling.doctor import Diagnosis
    from headrace.profiling.trend import Trend

__all__ = ["render_diagnosis"]


def _line(axes: Axes, points: list[tuple[float, float]], css: str, color: str,
          name: str, dash: bool = False) -> str:
    path = " ".join(f"{axes.x(x):.1f},{axes.y(max(y, 0.0)):.1f}" for x, y in points)
    dashed = ' stroke-dasharray="6,4"' if dash else ""
    dots = "".join(
        f'<circle cx="{axes.x(x):.1f}" cy="{axes.y(max(y, 0.0)):.1f}" r="3" fill="{color}">'
        f"<title>{escape(name)}: epoch {x:.0f}, {escape(format_bytes(int(y)))}</title></circle>"
        for x, y in points
    ) if not dash else ""
    return (f'<polyline class="{css}" data-series="{escape(name)}" points="{path}" fill="none" '
            f'stroke="{color}" stroke-width="2"{dashed}/>{dots}')


def _epoch_caption(axes: Axes) -> str:
    return (f'<text x="{LEFT + axes.plot_w / 2:.0f}" y="{TOP + axes.plot_h + 32}" '
            'text-anchor="middle" font-size="11">epoch</text>')


def _memory_series(diagnosis: Diagnosis) -> list[tuple[str, list[tuple[float, float]], Trend]]:
    """(name, growth since the first epoch after each epoch, its fit) of each memory measure
    the diagnosis has: allocated and traced where measured, anonymous + shared always."""
    epochs = diagnosis.epochs
    first = epochs[0]
    measures = [
        ("allocated (malloc + Python objects)", "allocated", diagnosis.allocated),
        ("traced (tracemalloc)", "traced", diagnosis.traced),
        ("anonymous + shared", "charged", diagnosis.charged),
    ]
    return [
        (name, [(float(m.epoch), float(getattr(m, field) - getattr(first, field)))
                for m in epochs], trend)
        for name, field, trend in measures
        if field == "charged" or (trend.points and any(getattr(m, field) for m in epochs))
    ]


def epoch_chart(diagnosis: Diagnosis) -> str:
    """Growth of each memory measure after each epoch, with the fits."""
    epochs = diagnosis.epochs
    if not epochs:
        return svg_chart("epoch-chart", "Memory after each epoch", [])
    series = _memory_series(diagnosis)
    x_max = max(float(epochs[-1].epoch), 1.0)
    y_max = max([y for _, points, _ in series for _, y in points]
                + [float(diagnosis.min_leak)]) * 1.15
    axes = Axes(x_max, y_max)
    parts = axes.frame("growth since epoch 0", x_format="epoch")
    parts.append(_epoch_caption(axes))
    if diagnosis.warmup:
        right = axes.x(min(diagnosis.warmup - 0.5, x_max))
        parts.append(
            f'<rect class="warmup" x="{LEFT}" y="{TOP}" width="{right - LEFT:.1f}" '
            f'height="{axes.plot_h}" fill="#999" fill-opacity="0.15"><title>warm-up: not '
            "fitted</title></rect>"
        )
    legend = []
    for index, (name, points, trend) in enumerate(series):
        parts.append(_line(axes, points, "epoch-line", palette_color(index), name))
        legend.append((name, palette_color(index), "line"))
        fitted = points[diagnosis.warmup:]
        if len(fitted) >= 2:
            parts.append(_trend_line(axes, fitted, trend, palette_color(index)))
    legend.append(("fitted growth per epoch", "#555", "dash"))
    parts += chart_legend(legend)
    return svg_chart("epoch-chart", "Memory after each epoch", parts)


def _trend_line(axes: Axes, fitted: list[tuple[float, float]], trend: Trend, color: str) -> str:
    """The robust slope drawn through the fitted epochs' median point."""
    xs = sorted(x for x, _ in fitted)
    ys = sorted(y for _, y in fitted)
    mid_x, mid_y = xs[len(xs) // 2], ys[len(ys) // 2]
    ends = [(x, mid_y + trend.slope * (x - mid_x)) for x in (xs[0], xs[-1])]
    return _line(axes, ends, "trend-line", color, f"{trend.what} fit", dash=True)


def stage_chart(diagnosis: Diagnosis) -> str:
    """Each stage's booked bytes at the end of each epoch (before its iterator was dropped)."""
    epochs = diagnosis.epochs
    series = [
        (name, [(float(m.epoch), float(m.held[k])) for m in epochs if k < len(m.held)])
        for k, name in enumerate(diagnosis.stage_names)
    ]
    series = [(name, points) for name, points in series if any(y for _, y in points)]
    x_max = max(float(epochs[-1].epoch), 1.0) if epochs else 1.0
    y_max = max([y for _, points in series for _, y in points] + [1.0]) * 1.15
    axes = Axes(x_max, y_max)
    parts = axes.frame("booked", x_format="epoch")
    parts.append(_epoch_caption(axes))
    legend = []
    for index, (name, points) in enumerate(series):
        parts.append(_line(axes, points, "stage-line", palette_color(index + 2), name))
        legend.append((name, palette_color(index + 2), "line"))
    if not series:
        parts.append(f'<text x="{LEFT + 20}" y="{TOP + 30}" font-size="12">No stage held '
                     "bytes at the end of an epoch.</text>")
    parts += chart_legend(legend)
    return svg_chart("stage-chart", "Booked bytes by stage after each epoch", parts)


def render_diagnosis(diagnosis: Diagnosis) -> str:
    """The whole page as one HTML string (see the module doc)."""
    if diagnosis.leak:
        verdict = (
            f'<p class="verdict leak"><b>LEAK</b>: memory grows by '
            f"~{escape(format_bytes(int(diagnosis.growth_per_epoch)))}"
            " per epoch, beyond noise.</p>"
        )
        growth = html_table(
            ["stage", "per epoch", "where"],
            [(g.stage, format_bytes(int(g.bytes_per_epoch)), g.where) for g in diagnosis.growth],
            "growth",
        ) if diagnosis.growth else (
            "<p>Not traced to a stage: native code, or the consumer's own.</p>")
    else:
        verdict = (
            '<p class="verdict ok"><b>No leak</b>: growth per epoch is within noise (floor '
            f"{escape(format_bytes(diagnosis.min_leak))}/epoch).</p>"
        )
        growth = ""
    resources = (
        '<ul id="resources">' + "".join(f"<li>{escape(text)}</li>" for text in diagnosis.resources)
        + "</ul>" if diagnosis.resources else "<p>Everything was returned.</p>"
    )
    findings = "".join(
        f'<div class="finding {escape(f.severity)}"><b>{escape(f.code)}</b> at '
        f"<code>{escape(f.stage)}</code>: {escape(f.message)}<br><b>Fix:</b> {escape(f.fix)}</div>"
        for f in diagnosis.findings
    ) or "<p>No findings.</p>"
    trends = [*diagnosis.memory_trends] + [
        t for t in diagnosis.stage_trends if t.significant(diagnosis.min_leak, diagnosis.sigmas)
    ]
    epoch_rows = [
        (m.epoch, f"{m.elements:,}", f"{m.seconds:.2f}", format_bytes(m.allocated),
         format_bytes(m.traced), format_bytes(m.charged), m.descriptors,
         m.shared_memory_segments, m.headrace_threads, m.live_iterators)
        for m in diagnosis.epochs
    ]
    traced_pass = (
        f'<p class="muted">Then {len(diagnosis.traced_epochs)} epochs ran under tracemalloc '
        "with deep tracebacks, only to find where the growth was allocated: "
        + ", ".join(f"{m.seconds:.2f} s" for m in diagnosis.traced_epochs) + ".</p>"
        if diagnosis.traced_epochs else "")
    return "".join([
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{escape(diagnosis.title)}</title><style>{STYLE}"
        ".verdict{padding:6px 10px}.leak{background:#fdecea}.ok{background:#edf7ed}</style>"
        "</head><body>",
        f"<h1>{escape(diagnosis.title)}</h1>",
        (f'<pre id="pipeline">{escape(diagnosis.extra["pipeline"])}</pre>'
         if diagnosis.extra.get("pipeline") else ""),
        verdict,
        growth,
        "<h2>Memory after each epoch</h2>",
        f'<p class="muted">Each epoch made a new iterator and dropped it without close(), '
        f"as Keras does; then garbage was collected and memory measured. Shaded: the "
        f"{diagnosis.warmup} warm-up epoch(s), not fitted. Dashed: the fitted growth.</p>",
        epoch_chart(diagnosis),
        "<ul>" + "".join(f"<li>{escape(t.format())}</li>" for t in trends) + "</ul>",
        "<h2>Booked bytes by stage</h2>",
        stage_chart(diagnosis),
        "<h2>Not returned</h2>",
        resources,
        "<h2>Epochs</h2>",
        html_table(["epoch", "elements", "s", "allocated", "traced", "anon + shared", "descriptors",
                "shm segments", "headrace threads", "live iterators"], epoch_rows, "epochs"),
        traced_pass,
        "<h2>Recipe findings</h2>",
        findings,
        '<p class="muted">Generated by headrace doctor. Self-contained: no external '
        "resources.</p>",
        "</body></html>",
    ])
