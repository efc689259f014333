"""Durable steps: a named piece of a task that runs once across deliveries.

A step is recorded ``started`` (fenced) before its function runs and ``succeeded`` with its
JSON result (fenced) after. A later delivery finds either the result (and returns it without
running the function again) or a ``started`` record with no outcome: the earlier delivery
crashed mid-step, the side effect may or may not have happened, and the step is
``outcome_unknown`` unless declared idempotent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update

from sqlease._core.store import Store
from sqlease._db.retry import transient
from sqlease.types import Fence


@dataclass(frozen=True)
class StepRecord:
    task_id: str
    name: str
    status: str
    result: Any
    error: str | None
    attempt: int | None
    message_id: int | None = None


class StepStore:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.steps = store.tables.steps
        self._insert = store.driver.insert

    def _held(self, conn: Any, fence: Fence, task_id: str | None) -> bool:
        return self.store.holds_on(conn, fence, task_id)

    @transient
    def get(self, task_id: str, name: str) -> StepRecord | None:
        s = self.steps
        with self.store.driver.reading() as conn:
            row = conn.execute(select(s).where(s.c.task_id == task_id, s.c.name == name)).first()
        if row is None:
            return None
        return StepRecord(
            row.task_id,
            row.name,
            row.status,
            None if row.result is None else json.loads(row.result),
            row.error,
            None if row.attempt is None else int(row.attempt),
            None if row.message_id is None else int(row.message_id),
        )

    @transient
    def all(self, task_id: str) -> list[StepRecord]:
        s = self.steps
        with self.store.driver.reading() as conn:
            rows = conn.execute(
                select(s).where(s.c.task_id == task_id).order_by(s.c.started_at_ms, s.c.name)
            ).fetchall()
        return [
            StepRecord(
                r.task_id,
                r.name,
                r.status,
                None if r.result is None else json.loads(r.result),
                r.error,
                None if r.attempt is None else int(r.attempt),
            )
            for r in rows
        ]

    @transient
    def start(self, fence: Fence, task_id: str, name: str) -> bool:
        """Record the step as started by this delivery (fenced)."""
        now = self.store.now_ms()
        row = {
            "task_id": task_id,
            "name": name,
            "status": "started",
            "result": None,
            "error": None,
            "message_id": fence.message_id,
            "attempt": fence.attempt,
            "started_at_ms": now,
            "finished_at_ms": None,
        }
        stmt = self._insert(self.steps).values(**row)
        stmt = stmt.on_conflict_do_update(
            index_elements=[self.steps.c.task_id, self.steps.c.name],
            set_={k: stmt.excluded[k] for k in row if k not in ("task_id", "name")},
        )
        with self.store.driver.writing() as conn:
            if not self._held(conn, fence, task_id):
                return False
            conn.execute(stmt)
            self.store.timeline.on(conn, task_id, fence, "step_started", {"step": name}, now)
        return True

    @transient
    def finish(
        self,
        fence: Fence,
        task_id: str,
        name: str,
        *,
        result: Any = None,
        error: str | None = None,
    ) -> bool:
        """Record the step's outcome (fenced)."""
        now = self.store.now_ms()
        status = "failed" if error is not None else "succeeded"
        s = self.steps
        with self.store.driver.writing() as conn:
            if not self._held(conn, fence, task_id):
                return False
            conn.execute(
                update(s)
                .where(s.c.task_id == task_id, s.c.name == name)
                .values(
                    status=status,
                    result=None if error else json.dumps(result),
                    error=error,
                    finished_at_ms=now,
                    message_id=fence.message_id,
                    attempt=fence.attempt,
                )
            )
            self.store.timeline.on(conn, task_id, fence, f"step_{status}", {"step": name}, now)
        return True

    @transient
    def mark_unknown(self, fence: Fence, task_id: str, name: str) -> bool:
        """Record that an interrupted step's outcome is unknown (fenced; for inspection)."""
        s = self.steps
        now = self.store.now_ms()
        with self.store.driver.writing() as conn:
            if not self._held(conn, fence, task_id):
                return False
            changed = conn.execute(
                update(s)
                .where(s.c.task_id == task_id, s.c.name == name, s.c.status == "started")
                .values(status="outcome_unknown")
            ).rowcount
            if changed:
                self.store.timeline.on(conn, task_id, fence, "outcome_unknown", {"step": name}, now)
        return True
