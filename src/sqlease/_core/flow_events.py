"""The timeline says which limit holds a task back: a maintenance pass writes one
``waiting_for_limit`` event per delivery attempt of each due, unleased message whose
concurrency gate is full or whose rate limit is closed (checked here rather than in the
claim, which must stay one short statement)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, and_, exists, func, or_, select

from sqlease._core.store import Store

#: Messages looked at per pass; the rest get their event at the next pass.
BATCH = 1_000
KIND = "waiting_for_limit"


def _why(
    msg: Any, limits: dict[str, Any], running: dict[str, int], now: int
) -> dict[str, Any] | None:
    names = [
        n
        for n in (
            None if msg.gate_key is None else f"key:{msg.gate_key}",
            None if msg.task_name is None else f"task:{msg.task_name}",
            f"queue:{msg.queue}",
        )
        if n is not None
    ]
    gate: str | None
    if msg.gate_key is not None:
        gate, limit = f"key:{msg.gate_key}", int(msg.gate_limit)
    else:
        gate, limit = next(
            (
                (n, int(limits[n].concurrency))
                for n in names
                if limits.get(n) is not None and limits[n].concurrency is not None
            ),
            (None, 0),
        )
    if gate is not None and running.get(gate, 0) >= limit:
        return {"limit": gate, "kind": "concurrency", "running": running.get(gate, 0), "max": limit}
    rate = next((limits[n] for n in names if n in limits and limits[n].interval_ms), None)
    if rate is not None and rate.tat_ms is not None and rate.tat_ms - rate.tau_ms > now:
        return {
            "limit": rate.name,
            "kind": "rate",
            "rate": rate.rate,
            "opens_at_ms": int(rate.tat_ms - rate.tau_ms),
        }
    return None


def record_waits(conn: Connection, store: Store, now: int) -> int:
    """Write the ``waiting_for_limit`` events that are due; returns how many."""
    t = store.tables
    m, fl, ev = t.messages, t.flow_limits, t.events
    limits = {r.name: r for r in conn.execute(select(fl))}
    gated = [m.c.gate_key.isnot(None)]
    tasks = [n[5:] for n in limits if n.startswith("task:")]
    queues = [n[6:] for n in limits if n.startswith("queue:")]
    if tasks:
        gated.append(m.c.task_name.in_(tasks))
    if queues:
        gated.append(m.c.queue.in_(queues))
    told = exists().where(ev.c.message_id == m.c.id, ev.c.kind == KIND, ev.c.attempt == m.c.attempt)
    waiting = conn.execute(
        select(
            m.c.id, m.c.task_id, m.c.attempt, m.c.queue, m.c.task_name, m.c.gate_key, m.c.gate_limit
        )
        .where(
            or_(
                and_(
                    m.c.state == "ready",
                    or_(m.c.available_at_ms <= now, m.c.reason == "rate"),
                    or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now),
                ),
                # parked at its full gate by a worker's sweep (sqlease._core.leases)
                and_(m.c.state == "parked", m.c.reason == "gate"),
            ),
            m.c.task_id.isnot(None),
            or_(*gated),
            ~told,
        )
        .order_by(m.c.id)
        .limit(BATCH)
    ).all()
    if not waiting:
        return 0
    running = {
        str(g): int(n)
        for g, n in conn.execute(
            select(m.c.gate, func.count())
            .where(and_(m.c.gate.isnot(None), m.c.lease_expires_at_ms > now))
            .group_by(m.c.gate)
        )
    }
    written = 0
    for msg in waiting:
        why = _why(msg, limits, running, now)
        if why is not None:
            store.timeline.insert(
                conn, msg.task_id, msg.id, msg.attempt, KIND, json.dumps(why), now
            )
            written += 1
    return written
