"""How the ``sqlease`` command shows things to a person: tables (tabulate), times in local ISO
form with how long ago they were, durations, and a task's timeline drawn as the demo draws
it. ``--json`` output never goes through here: scripts get the raw values."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

#: What an absent value is shown as.
NONE = "-"


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain table: headers, a rule, one line per row (the headers alone when there are no
    rows), numbers right-aligned."""
    cells = [[NONE if v is None else v for v in r] for r in rows]
    return tabulate(cells, headers=list(headers), tablefmt="simple", disable_numparse=False)


def local(ms: int | None) -> str:
    """Epoch milliseconds as local ISO time, to the second."""
    if ms is None:
        return NONE
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def duration(ms: int | float | None) -> str:
    """A length of time, to two units at most: ``850 ms``, ``4.2 s``, ``3 min 4 s``,
    ``2 h 5 min``, ``3 d 4 h``."""
    if ms is None:
        return NONE
    ms = abs(float(ms))
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    for unit, size, small, small_size in (
        ("d", 86_400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if whole >= size:
            big, rest = divmod(whole, size)
            rest //= small_size
            return f"{big} {unit}" + (f" {rest} {small}" if rest else "")
    return f"{whole} s"  # pragma: no cover - every whole >= 60 matched above


def relative(ms: int | None, now: int) -> str:
    """How far ``ms`` is from ``now``: ``3 min ago``, ``in 2.0 s``, ``now``."""
    if ms is None:
        return NONE
    delta = now - ms
    if abs(delta) < 500:
        return "now"
    return f"{duration(delta)} ago" if delta > 0 else f"in {duration(delta)}"


def when(ms: int | None, now: int) -> str:
    """``2026-12-02 21:14:03 (3 min ago)``."""
    if ms is None:
        return NONE
    return f"{local(ms)} ({relative(ms, now)})"


def short(text: Any, width: int = 60) -> str:
    """One line of at most ``width`` characters."""
    if text is None:
        return NONE
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _owner(owner: Any) -> str:
    host, pid = [*str(owner or "?:?").split(":"), "?"][:2]
    return f"by {host} pid {pid}"


def event_detail(event: dict[str, Any]) -> str:
    """What a timeline line says after the event's kind (as the demo writes it)."""
    data = event.get("data")
    kind = event["kind"]
    if kind == "claimed" and isinstance(data, dict):
        return _owner(data.get("owner")) + (" (handoff)" if data.get("handoff") else "")
    if kind == "lease_lost" and isinstance(data, dict) and "owner" in data:
        return _owner(data.get("owner"))
    if kind == "checkpoint" and isinstance(data, dict):
        checkpoint = data.get("checkpoint")
        shown = {k: v for k, v in (checkpoint or {}).items() if k != "_progress"}
        progress = (checkpoint or {}).get("_progress")
        text = json.dumps(shown, default=str) if checkpoint is not None else ""
        if isinstance(progress, dict) and "done" in progress:
            text += f" ({progress['done']}/{progress.get('total', '?')})"
        return short(text.strip() or f"revision {data.get('revision')}", 70)
    if data in (None, {}, ""):
        return ""
    return short(json.dumps(data, default=str) if not isinstance(data, str) else data, 70)


def timeline(events: Sequence[dict[str, Any]]) -> list[str]:
    """The events as the demo prints them: seconds since the first, attempt, kind, detail;
    headed by the first event's local time."""
    if not events:
        return ["  (no events: the retention has removed them, or none were recorded)"]
    start = int(events[0]["at_ms"])
    lines = [f"  from {local(start)}"]
    for event in events:
        attempt = event.get("attempt")
        lines.append(
            f"  +{(int(event['at_ms']) - start) / 1000:7.2f}s  "
            f"attempt {NONE if attempt is None else attempt}  "
            f"{event['kind']:<18} {event_detail(event)}".rstrip()
        )
    return lines
