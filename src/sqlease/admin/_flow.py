"""``Admin``'s view of flow control: each gate's running count, limit and waiting count, the
configured limits per task name and per queue, unique tasks' keys and duplicates, and the
members of a Celery group."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, or_, select

from sqlease._core.names import as_id, require_text
from sqlease._core.uniques import UniqueState

if TYPE_CHECKING:
    from sqlease.store import Store


@dataclass
class GateState:
    """One concurrency gate: ``key:<key>``, ``task:<name>`` or ``queue:<name>``."""

    gate: str
    #: deliveries holding a live lease under the gate, across every worker
    running: int
    #: the limit (for a key, the highest its waiting or running messages carry)
    limit: int | None
    #: messages due now, not leased, that would go through this gate
    waiting: int

    @property
    def full(self) -> bool:
        return self.limit is not None and self.running >= self.limit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"full": self.full}


class FlowAdmin:
    """Flow control as ``Admin`` shows and steers it: limits, rates, gates, unique keys and
    Celery groups."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _now(self) -> int:
        return self.store.now_ms()

    def limits(self) -> dict[str, int]:
        """The configured limits: ``{"task:<name>": n, "queue:<name>": n}``."""
        return self.store.limits()

    def set_limits(self, limits: Mapping[str, int], *, replace: bool = False) -> None:
        self.store.set_limits(limits, replace=replace)

    def remove_limit(self, name: str) -> bool:
        return self.store.remove_limit(name)

    def rate_limits(self) -> dict[str, dict[str, Any]]:
        """The rate limits: ``{"task:<name>": {"rate", "interval_ms", "next_at_ms"}}``."""
        return self.store.rate_limits()

    def set_rate_limits(self, rates: Mapping[str, Any], *, replace: bool = False) -> None:
        self.store.set_rate_limits(rates, replace=replace)

    def unique(self, key: str) -> UniqueState | None:
        """A uniqueness key: the task that holds it, whether a publish of it now would be
        turned away, and how many were. None if no task has taken it."""
        require_text("key", key)
        return self.store.unique(key, now=self._now())

    def original_of(self, task_id: str) -> str | None:
        """The task a duplicate publish of a unique task was turned away for (its result is
        that task's), or None if ``task_id`` was not a duplicate."""
        task_id = as_id("task_id", task_id)
        return self.store.originals_of([task_id]).get(task_id)

    def group(self, group_id: str) -> list[str]:
        """The task ids published in a Celery group (their ``group`` header), in publish
        order, as long as their task records are kept."""
        require_text("group_id", group_id)
        k = self.store.tables.tasks
        with self.store.driver.reading() as conn:
            rows = conn.execute(
                select(k.c.task_id)
                .where(k.c.group_id == group_id)
                .order_by(k.c.created_at_ms, k.c.task_id)
            ).scalars()
            found = [str(r) for r in rows]
            conn.rollback()
        return found

    def gates(self) -> list[GateState]:
        """Every gate that has running or waiting messages or a configured limit, busiest
        first."""
        m = self.store.tables.messages
        now = self._now()
        configured = self.store.limits()
        running: dict[str, int] = {}
        limit: dict[str, int] = dict(configured)
        waiting: dict[str, int] = {}
        live = and_(m.c.state == "ready", m.c.lease_expires_at_ms > now)
        idle = and_(
            m.c.state == "ready",
            m.c.available_at_ms <= now,
            or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now),
        )
        task_limited = [n.split(":", 1)[1] for n in configured if n.startswith("task:")]
        queue_limited = [n.split(":", 1)[1] for n in configured if n.startswith("queue:")]
        with self.store.driver.reading() as conn:
            for gate, count in conn.execute(
                select(m.c.gate, func.count()).where(m.c.gate.isnot(None), live).group_by(m.c.gate)
            ):
                running[str(gate)] = int(count)
            for key, most in conn.execute(
                select(m.c.gate_key, func.max(m.c.gate_limit))
                .where(m.c.gate_key.isnot(None), m.c.state == "ready")
                .group_by(m.c.gate_key)
            ):
                limit[f"key:{key}"] = int(most)
            for key, count in conn.execute(
                select(m.c.gate_key, func.count())
                .where(m.c.gate_key.isnot(None), idle)
                .group_by(m.c.gate_key)
            ):
                waiting[f"key:{key}"] = int(count)
            if task_limited:
                for name, count in conn.execute(
                    select(m.c.task_name, func.count())
                    .where(m.c.gate_key.is_(None), m.c.task_name.in_(task_limited), idle)
                    .group_by(m.c.task_name)
                ):
                    waiting[f"task:{name}"] = int(count)
            if queue_limited:
                not_task = or_(m.c.task_name.is_(None), m.c.task_name.notin_(task_limited))
                for queue, count in conn.execute(
                    select(m.c.queue, func.count())
                    .where(m.c.gate_key.is_(None), m.c.queue.in_(queue_limited), not_task, idle)
                    .group_by(m.c.queue)
                ):
                    waiting[f"queue:{queue}"] = int(count)
            conn.rollback()
        names = set(running) | set(waiting) | set(configured)
        states = [GateState(g, running.get(g, 0), limit.get(g), waiting.get(g, 0)) for g in names]
        return sorted(states, key=lambda s: (-s.running, -s.waiting, s.gate))
