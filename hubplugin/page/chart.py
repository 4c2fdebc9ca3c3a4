"""A lease's usage over time as a small inline SVG chart: pure, no script, nothing to fetch.

Two lines over the same time axis, both in percent: GPU utilization and GPU memory in use (of
the memory the lease may use). A line breaks where samples are missing for longer than
``gap_s`` (the page service was down, the lease had not started), instead of drawing a slope
over time nobody measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

from markupsafe import Markup

from .usage import UsagePoint

WIDTH = 320
HEIGHT = 64
LEFT = 30
"""Room for the axis labels on the left."""
BOTTOM = 14
"""Room for the time labels below."""


def _segments(points: Sequence[UsagePoint], value: Callable[[UsagePoint], float | None],
              gap_s: float) -> list[list[tuple[float, float]]]:
    """Runs of ``(at, value)`` without a gap longer than ``gap_s`` or a missing value."""
    segments: list[list[tuple[float, float]]] = []
    last_at: float | None = None
    for point in points:
        v = value(point)
        if v is None:
            last_at = None
            continue
        if last_at is None or point.at - last_at > gap_s or not segments:
            segments.append([])
        segments[-1].append((point.at, v))
        last_at = point.at
    return segments


def _hours(span_s: float) -> str:
    hours = span_s / 3600
    return f"{hours:g} h" if hours >= 1 else f"{span_s / 60:.0f} min"


def usage_chart(points: Sequence[UsagePoint], *, start: float, end: float, gap_s: float,
                title: str = "GPU utilization and memory") -> Markup:
    """The SVG of ``points`` between ``start`` and ``end`` (epoch seconds)."""
    span = max(end - start, 1.0)
    plot_w = WIDTH - LEFT
    plot_h = HEIGHT - BOTTOM

    def x(at: float) -> float:
        return LEFT + plot_w * min(max((at - start) / span, 0.0), 1.0)

    def y(pct: float) -> float:
        return plot_h * (1 - min(max(pct, 0.0), 100.0) / 100)

    parts = [
        f'<svg class="sg-chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)} over the last {_hours(span)}">',
        f"<title>{escape(title)} over the last {_hours(span)}</title>",
        f'<rect x="{LEFT}" y="0" width="{plot_w}" height="{plot_h}" class="sg-chart-bg"/>',
        f'<line x1="{LEFT}" y1="{plot_h / 2:g}" x2="{WIDTH}" y2="{plot_h / 2:g}" '
        'class="sg-chart-grid"/>',
        f'<text x="{LEFT - 3}" y="8" class="sg-chart-label" text-anchor="end">100%</text>',
        f'<text x="{LEFT - 3}" y="{plot_h}" class="sg-chart-label" text-anchor="end">0</text>',
        f'<text x="{LEFT}" y="{HEIGHT - 2}" class="sg-chart-label">{_hours(span)} ago</text>',
        f'<text x="{WIDTH}" y="{HEIGHT - 2}" class="sg-chart-label" text-anchor="end">now</text>',
    ]
    lines = (("sg-util", lambda p: p.utilization_pct), ("sg-mem", lambda p: p.memory_pct))
    drawn = 0
    for css, value in lines:
        for segment in _segments([p for p in points if start <= p.at <= end], value, gap_s):
            drawn += 1
            if len(segment) == 1:
                at, v = segment[0]
                parts.append(f'<circle class="{css}" cx="{x(at):.1f}" cy="{y(v):.1f}" r="1.5"/>')
                continue
            coords = " ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in segment)
            parts.append(f'<polyline class="{css}" points="{coords}"/>')
    if not drawn:
        parts.append(f'<text x="{LEFT + plot_w / 2:g}" y="{plot_h / 2 + 4:g}" '
                     'class="sg-chart-empty" text-anchor="middle">no samples yet</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
