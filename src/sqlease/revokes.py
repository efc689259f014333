"""Celery's revokes, made durable by the transport that publishes them.

``app.control.revoke(ids)``, ``AsyncResult.revoke()`` and ``revoke_by_stamped_headers(...)``
are pidbox broadcasts: on any broker only the workers online at that moment hear them, and
they keep them in memory. When sqlease publishes such a broadcast it also writes the revoke to
the database, in two ways:

- a task that no worker holds (queued, scheduled, paused or waiting, or leased by a worker
  whose lease has expired) is cancelled at once: failed ``cancelled``, ``REVOKED`` result;
- a task held under a live lease (prefetched or running) is left to the worker holding it,
  which heard the broadcast and does what Celery does on every broker: it discards a
  prefetched task (``REVOKED``, acked), terminates a running one only with
  ``terminate=True``, and otherwise lets it finish and keeps its result. The revoke is
  recorded on the task's timeline (``revoke_requested``), so that if that worker dies first,
  the worker the task is delivered to next discards it instead of running it
  (:func:`requested`, asked by the transport for every redelivery).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, or_, select

from sqlease._core.control import Control

if TYPE_CHECKING:
    from sqlease.store import Store

logger = logging.getLogger(__name__)

#: The timeline event of a revoke that reached a task while a worker held it.
REQUESTED = "revoke_requested"
_PAGE = 500


@dataclass(frozen=True)
class Revoke:
    """One revoke broadcast: by task ids, or by stamped headers (header -> revoked values)."""

    task_ids: tuple[str, ...] = ()
    stamps: dict[str, list[Any]] = field(default_factory=dict)
    terminate: bool = False


def _as_list(value: Any) -> list[Any]:
    # Celery's maybe_list: a list or tuple as is, anything else (None too) as one value.
    return list(value) if isinstance(value, list | tuple) else [value]


def parse(message: Mapping[str, Any]) -> Revoke | None:
    """The revoke a pidbox message carries (Kombu's envelope), or None for any other
    message, including one that is not JSON: such a message is only broadcast."""
    from kombu.serialization import loads

    try:
        properties = message.get("properties") or {}
        body = message.get("body")
        if properties.get("body_encoding") == "base64" and isinstance(body, str | bytes):
            body = base64.b64decode(body)
        command = loads(  # type: ignore[no-untyped-call]  # Kombu is untyped
            body,
            message.get("content-type"),
            message.get("content-encoding"),
            accept={"application/json"},
        )
    except Exception:
        return None
    if not isinstance(command, dict) or not isinstance(command.get("arguments") or {}, dict):
        return None
    arguments = command.get("arguments") or {}
    terminate = bool(arguments.get("terminate"))
    if command.get("method") == "revoke":
        ids = arguments.get("task_id")
        task_ids = tuple(str(i) for i in _as_list(ids) if i is not None)
        return Revoke(task_ids=task_ids, terminate=terminate) if task_ids else None
    if command.get("method") == "revoke_by_stamped_headers":
        headers = arguments.get("headers")
        if isinstance(headers, list):  # "name=value" strings, as Celery's worker reads them
            headers = dict(h.split("=", 1) for h in headers if isinstance(h, str) and "=" in h)
        if not isinstance(headers, dict) or not headers:
            return None
        stamps = {str(name): _as_list(values) for name, values in headers.items()}
        return Revoke(stamps=stamps, terminate=terminate)
    return None


def stamps_match(headers: Mapping[str, Any], revoked: Mapping[str, list[Any]]) -> bool:
    """Would Celery's worker discard a task with these message headers, given these revoked
    stamps? (The same test as ``celery.worker.request.Request.revoked``.)"""
    stamped = headers.get("stamped_headers") or []
    stamps = headers.get("stamps") or {}
    if not isinstance(stamped, list | tuple) or not isinstance(stamps, dict):
        return False
    for name in stamped:
        if name not in revoked or stamps.get(name) is None:
            continue
        values = revoked[name]
        if any(value in values for value in _as_list(stamps[name])):
            return True
    return False


def apply(store: Store, revoke: Revoke) -> None:
    """Write the revoke to the database (see the module's docstring)."""
    control = Control(store)
    task_ids = list(revoke.task_ids)
    if revoke.stamps:
        task_ids += _stamped_task_ids(store, revoke.stamps)
    data = {"terminate": revoke.terminate}
    for task_id in dict.fromkeys(task_ids):
        control.cancel(task_id, reason="revoked", leave_held=True)
        for message_id, attempt in _held_deliveries(store, task_id):
            store.record_event(
                REQUESTED, data, task_id=task_id, message_id=message_id, attempt=attempt
            )


def requested(store: Store, task_id: str) -> bool:
    """Was a revoke of this task recorded while a worker held it?"""
    ev = store.tables.events
    with store.driver.reading() as conn:
        row = conn.execute(
            select(ev.c.id).where(ev.c.task_id == task_id, ev.c.kind == REQUESTED).limit(1)
        ).first()
    return row is not None


def _held_deliveries(store: Store, task_id: str) -> list[tuple[int, int]]:
    m = store.tables.messages
    now = store.now_ms()
    with store.driver.reading() as conn:
        rows = conn.execute(
            select(m.c.id, m.c.attempt).where(
                m.c.task_id == task_id, m.c.state == "ready", m.c.lease_expires_at_ms > now
            )
        ).fetchall()
    return [(int(r.id), int(r.attempt)) for r in rows]


def _stamped_task_ids(store: Store, revoked: Mapping[str, list[Any]]) -> list[str]:
    """The unfinished tasks whose stamps match, read page by page from their payloads."""
    return [
        task_id
        for task_id, payload in _unfinished_payloads(store, list(revoked))
        if _headers_match(payload, revoked)
    ]


def _headers_match(payload: str, revoked: Mapping[str, list[Any]]) -> bool:
    try:
        headers = json.loads(payload).get("headers")
    except (ValueError, AttributeError):
        return False  # an unreadable message is failed when it is claimed; nothing to match
    return isinstance(headers, dict) and stamps_match(headers, revoked)


def _unfinished_payloads(store: Store, names: list[str]) -> Iterator[tuple[str, str]]:
    m = store.tables.messages
    unfinished = and_(m.c.state.in_(("ready", "parked")), m.c.task_id.is_not(None))
    # A cheap filter first: a payload that matches names the header (as JSON writes a plain
    # name). Names JSON would escape are not filtered on.
    if all(_plain(name) for name in names):
        unfinished = and_(
            unfinished, or_(*(m.c.payload.contains(f'"{name}"', autoescape=True) for name in names))
        )
    after = 0
    while True:
        with store.driver.reading() as conn:
            rows = conn.execute(
                select(m.c.id, m.c.task_id, m.c.payload)
                .where(unfinished, m.c.id > after)
                .order_by(m.c.id)
                .limit(_PAGE)
            ).fetchall()
        for row in rows:
            yield str(row.task_id), str(row.payload)
        if len(rows) < _PAGE:
            return
        after = int(rows[-1].id)


def _plain(name: str) -> bool:
    return name.isascii() and name.isprintable() and '"' not in name and "\\" not in name
