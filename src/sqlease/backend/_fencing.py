"""What the backend's writes know of the delivery they are made for, across Celery's own logic
(which calls back into the key/value primitives without passing it on)."""

from __future__ import annotations

from contextvars import ContextVar

from sqlease._core.chord_counters import PartCount
from sqlease.types import Fence

#: The fence of the delivery whose result is being written, and its task id.
writing_under: ContextVar[tuple[Fence, str] | None] = ContextVar(
    "sqlease_writing_under", default=None
)
#: The chord part (task id) whose count is being written: counted once (ResultStore.incr).
counting_part: ContextVar[str | None] = ContextVar("sqlease_counting_part", default=None)
#: While a chord part is counted: the expiries Celery's base sets (``expire``), written
#: together at the end in one transaction (the chord's last part sets one per header part).
pending_expiries: ContextVar[list[tuple[str, float | None]] | None] = ContextVar(
    "sqlease_pending_expiries", default=None
)
#: While a chord part is counted: its count, made before Celery's base runs
#: (``ChordCounters.count_part``), which its calls of ``incr``, ``expire`` and
#: ``_restore_group`` then answer from: its counter's key, the count, and the expiries that
#: count wrote.
Counted = tuple[str, PartCount, frozenset[tuple[str, float | None]]]
counted_part: ContextVar[Counted | None] = ContextVar("sqlease_counted_part", default=None)
#: Set on a request whose result was refused (its lease was gone).
REFUSED = "sqlease_refused"
