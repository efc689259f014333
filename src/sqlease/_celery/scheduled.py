"""``celery inspect scheduled`` on a sqlease worker: the ETA and countdown tasks waiting in
the database for the queues the worker consumes.

A Celery worker on RabbitMQ or Redis receives an ETA task at once and holds it in memory
until it is due, so ``inspect scheduled`` lists its timer. A sqlease worker claims a task only
once it is due (a worker killed meanwhile loses nothing): its timer is empty, and the tasks it
will run are rows of the messages table. The command answers from them, in Celery's format
(``{"eta", "priority", "request": Request.info()}``), the timer's entries included if any.
"""

from __future__ import annotations

import base64
import json
import logging
from datetime import UTC, datetime
from typing import Any

from kombu.serialization import loads
from sqlalchemy import or_, select

logger = logging.getLogger(__name__)

#: The most rows one answer lists (a reply travels as one message).
LIMIT = 1_000
#: The priority Celery's consumer gives an ETA task's timer entry.
TIMER_PRIORITY = 6

_installed = False


def install() -> None:
    """Replace the worker's ``scheduled`` inspect command by one that also reads the
    database when the worker's broker is sqlease (once per process; other brokers' workers
    get Celery's answer unchanged)."""
    global _installed
    if _installed:
        return
    from celery.worker import control

    in_memory = control.Panel.data["scheduled"]

    @control.inspect_command(alias="dump_schedule")  # type: ignore[untyped-decorator]
    def scheduled(state: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """List of currently scheduled ETA/countdown tasks."""
        found: list[dict[str, Any]] = list(in_memory(state, **kwargs))
        try:
            found.extend(_from_database(state.consumer, {r["request"]["id"] for r in found}))
        except Exception:  # an inspect reply must come back: say what failed, list the rest
            logger.warning("sqlease: could not list the scheduled tasks", exc_info=True)
        return found

    _installed = True


def _from_database(consumer: Any, known: set[str]) -> list[dict[str, Any]]:
    transport = getattr(consumer.connection, "transport", None)
    store = getattr(transport, "store", None) if transport is not None else None
    if store is None or not hasattr(store, "tables"):
        return []  # not a sqlease broker
    queues = sorted({q.name for q in consumer.task_consumer.queues})
    m = store.tables.messages
    now = store.now_ms()
    query = (
        select(m.c.payload, m.c.available_at_ms)
        .where(
            m.c.state == "ready",
            m.c.queue.in_(queues),
            m.c.available_at_ms > now,
            or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now),
            # a rate limit's turn is no ETA (Celery keeps rate-limited tasks out of it too)
            or_(m.c.reason.is_(None), m.c.reason != "rate"),
        )
        .order_by(m.c.available_at_ms, m.c.id)
        .limit(LIMIT)
    )
    with store.driver.reading() as conn:
        rows = conn.execute(query).all()
    found = []
    for row in rows:
        entry = _entry(row.payload, row.available_at_ms, consumer.hostname)
        if entry is not None and entry["request"]["id"] not in known:
            found.append(entry)
    return found


def _entry(payload: str, available_at_ms: int, hostname: str) -> dict[str, Any] | None:
    """A stored Kombu message as Celery's timer entry lists it; None for a message that is
    not a Celery task (protocol 2)."""
    try:
        message = json.loads(payload)
        headers = message.get("headers") or {}
        properties = message.get("properties") or {}
        if "task" not in headers or "id" not in headers:
            return None
        body = message.get("body")
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs, _embed = loads(  # type: ignore[no-untyped-call]
            body, message.get("content-type"), message.get("content-encoding"), accept=None
        )
    except Exception:
        return None
    delivery = properties.get("delivery_info") or {}
    eta = headers.get("eta")
    if eta is None:
        eta = datetime.fromtimestamp(available_at_ms / 1000, UTC).isoformat()
    return {
        "eta": eta,
        "priority": TIMER_PRIORITY,
        "request": {
            "id": headers["id"],
            "name": headers["task"],
            "args": args,
            "kwargs": kwargs,
            "type": headers["task"],
            "hostname": hostname,
            "time_start": None,
            "acknowledged": False,
            "delivery_info": {
                "exchange": delivery.get("exchange"),
                "routing_key": delivery.get("routing_key"),
                "priority": properties.get("priority"),
                "redelivered": False,
            },
            "worker_pid": None,
        },
    }
