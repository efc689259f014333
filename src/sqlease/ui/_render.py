"""Templates and the filters they use: times, JSON, the throughput chart, masked URLs."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from sqlease.ui._read.views import Throughput

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"

REDACTED = "(redacted)"


def iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def time_tag(ms: int | None) -> Markup:
    """A ``<time>`` the page's script shows in local ISO form and relative to now; UTC
    without the script."""
    if ms is None:
        return Markup("-")
    value = iso(ms)
    return Markup(f'<time datetime="{value}" data-ms="{int(ms)}">{value}</time>')


def pretty(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def short_json(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def chart(series: Throughput, width: int = 600, height: int = 120) -> Markup:
    """The throughput as an inline SVG bar chart: finished (below) and failed (stacked)."""
    buckets = series.buckets
    if not buckets:
        return Markup("")
    peak = max((d + f for _, d, f in buckets), default=0) or 1
    step = width / len(buckets)
    bar = max(1.0, step - 1)
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height + 16}" role="img" '
        f'aria-label="tasks finished and failed per {series.bucket_s} s">',
        f'<line class="axis" x1="0" y1="{height}" x2="{width}" y2="{height}"/>',
    ]
    for i, (start, done, failed) in enumerate(buckets):
        x = i * step
        h_done = done / peak * height
        h_failed = failed / peak * height
        label = escape(f"{iso(start)}: {done} finished, {failed} failed")
        parts.append(f"<g><title>{label}</title>")
        parts.append(
            f'<rect class="done" x="{x:.1f}" y="{height - h_done:.1f}" '
            f'width="{bar:.1f}" height="{h_done:.1f}"/>'
        )
        parts.append(
            f'<rect class="failed" x="{x:.1f}" y="{height - h_done - h_failed:.1f}" '
            f'width="{bar:.1f}" height="{h_failed:.1f}"/></g>'
        )
    parts.append(
        f'<text x="0" y="{height + 13}">{escape(iso(buckets[0][0])[11:16])} UTC</text>'
        f'<text x="{width}" y="{height + 13}" text-anchor="end">now</text>'
        f'<text class="peak" x="2" y="10">peak {peak} per {series.bucket_s} s</text>'
    )
    parts.append("</svg>")
    return Markup("".join(parts))


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(TEMPLATES)),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        time=time_tag, iso=iso, pretty=pretty, short_json=short_json, age=age, chart=chart
    )
    return env
