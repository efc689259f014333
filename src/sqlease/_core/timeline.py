"""The timeline: immutable events, appended in the same transaction as the change they
record, and read back per task or message."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from sqlease._core.base import Aggregate, dump
from sqlease._db.driver import event_params
from sqlease._db.retry import transient
from sqlease.types import Event, Fence


@dataclass(frozen=True)
class Delivered:
    """What a task's events say of its deliveries: the highest attempt claimed or acked (0:
    none), and how the latest of them ended, if it did (``acked`` or ``purged``)."""

    attempt: int
    ended: str | None


class Timeline(Aggregate):
    """Appending events, and reading them back."""

    def insert(
        self,
        conn: Connection,
        task_id: str | None,
        message_id: int | None,
        attempt: int | None,
        kind: str,
        data: str | None,
        now: int | None,
    ) -> None:
        """Append one event (``data`` already JSON) inside the caller's transaction."""
        conn.execute(
            self.sql.event_insert, event_params(task_id, message_id, attempt, kind, data, now)
        )

    def insert_many(
        self,
        conn: Connection,
        events: Sequence[tuple[str | None, str, str | None]],
        now: int | None,
    ) -> None:
        """Append ``(task_id, kind, data)`` events of no delivery (``data`` already JSON) in
        one statement of many rows, inside the caller's transaction."""
        if events:
            conn.execute(
                self.sql.event_insert,
                [
                    event_params(task_id, None, None, kind, data, now)
                    for task_id, kind, data in events
                ],
            )

    def on(
        self,
        conn: Connection,
        task_id: str | None,
        fence: Fence | None,
        kind: str,
        data: Any,
        now: int | None,
    ) -> None:
        """Append an event of the delivery ``fence`` inside the caller's transaction."""
        self.insert(
            conn,
            task_id,
            None if fence is None else fence.message_id,
            None if fence is None else fence.attempt,
            kind,
            dump(data),
            now,
        )

    @transient
    def record_event(
        self,
        kind: str,
        data: Any = None,
        *,
        task_id: str | None = None,
        message_id: int | None = None,
        attempt: int | None = None,
        now: int | None = None,
    ) -> None:
        """Append an observation that needs no lease (e.g. ``lease_lost`` seen by a worker)."""
        with self.driver.writing() as conn:
            self.insert(conn, task_id, message_id, attempt, kind, dump(data), self._now(now))

    @transient
    def events(self, *, task_id: str | None = None, message_id: int | None = None) -> list[Event]:
        if (task_id is None) == (message_id is None):
            raise ValueError("pass exactly one of task_id or message_id")
        stmt = self.sql.events_for_task if task_id is not None else self.sql.events_for_message
        params = {"task_id": task_id} if task_id is not None else {"message_id": message_id}
        with self.driver.reading() as conn:
            rows = conn.execute(stmt, params).fetchall()
        return [
            Event(
                int(r.id),
                r.task_id,
                None if r.message_id is None else int(r.message_id),
                None if r.attempt is None else int(r.attempt),
                r.kind,
                None if r.data is None else json.loads(r.data),
                int(r.at_ms),
            )
            for r in rows
        ]

    def delivered_on(self, conn: Connection, task_ids: Sequence[str]) -> dict[str, Delivered]:
        """``Delivered`` of each of these tasks that has a delivery or an end in its events,
        in one statement on the caller's reading connection (a page of a listing, whose
        finished tasks' attempts the claims do not write to the task rows)."""
        if not task_ids:
            return {}
        rows = conn.execute(
            self.sql.deliveries_of_tasks, {"task_ids": json.dumps(list(task_ids))}
        ).fetchall()
        attempts: dict[str, int] = {}
        ends: dict[str, str] = {}
        for r in sorted(rows, key=lambda r: int(r.id)):  # the latest end wins
            attempts[r.task_id] = max(attempts.get(r.task_id, 0), int(r.attempt or 0))
            if r.kind in ("acked", "purged"):
                ends[r.task_id] = str(r.kind)
        return {task_id: Delivered(n, ends.get(task_id)) for task_id, n in attempts.items()}
