"""Fenced task state: checkpoints and task records, and events written under the lease."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlease._core.base import Aggregate, StoreParts, dump
from sqlease._core.leases import Leases
from sqlease._core.timeline import Timeline
from sqlease._db.retry import transient
from sqlease.types import CasResult, Fence, Outcome, TaskRecord


class Tasks(Aggregate):
    """Fenced task state: checkpoints, and events written under the lease."""

    def __init__(self, parts: StoreParts, leases: Leases, timeline: Timeline) -> None:
        super().__init__(parts)
        self._leases = leases
        self._timeline = timeline

    @transient
    def compare_and_set(
        self,
        fence: Fence,
        task_id: str,
        expected_revision: int,
        *,
        checkpoint: Mapping[str, Any] | None = None,
        state: str | None = None,
        reason: str | None = None,
        lease_ms: int = 0,
        event: str | None = "checkpoint",
        event_data: Any = None,
        run_id: str | None = None,
        now: int | None = None,
    ) -> CasResult:
        """Write the task's checkpoint and/or state if this delivery still holds its lease
        and the task is at ``expected_revision``. Renews the lease by ``lease_ms``."""
        now = self._now(now)
        checkpoint_text = None if checkpoint is None else json.dumps(dict(checkpoint))
        with self.driver.writing() as conn:
            held = conn.execute(
                self.sql.lease_check,
                {
                    "message_id": fence.message_id,
                    "attempt": fence.attempt,
                    "owner": fence.owner,
                    "lease_ms": int(lease_ms),
                    "task_id": task_id,
                    "now": now,
                },
            ).first()
            if held is None:
                return CasResult(Outcome.LEASE_LOST)
            expires = int(held._mapping["lease_expires_at_ms"])
            if held._mapping["run_id"] is not None:
                conn.execute(
                    self.sql.run_lease,
                    {
                        "run_id": held._mapping["run_id"],
                        "message_id": fence.message_id,
                        "lease_expires_at_ms": expires,
                    },
                )
            conn.execute(self.sql.task_ensure, {"task_id": task_id, "run_id": run_id, "now": now})
            revision = conn.execute(
                self.sql.task_cas,
                {
                    "task_id": task_id,
                    "expected": int(expected_revision),
                    "state": state,
                    "reason": reason,
                    "checkpoint": checkpoint_text,
                    "now": now,
                },
            ).scalar()
            if revision is None:
                return CasResult(Outcome.REVISION_CONFLICT, lease_expires_at_ms=expires)
            if event is not None:
                data = (
                    event_data
                    if event_data is not None
                    else (
                        {"revision": int(revision)}
                        if checkpoint is None
                        else {"revision": int(revision), "checkpoint": dict(checkpoint)}
                    )
                )
                self._timeline.insert(
                    conn, task_id, fence.message_id, fence.attempt, event, dump(data), now
                )
        return CasResult(Outcome.UPDATED, int(revision), expires)

    @transient
    def append_event(
        self,
        fence: Fence,
        kind: str,
        data: Any = None,
        *,
        task_id: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Append a timeline event under the lease; False (nothing written) if it is lost."""
        now = self._now(now)
        with self.driver.writing() as conn:
            if not self._leases.holds_on(conn, fence, task_id, now):
                return False
            self._timeline.insert(
                conn, task_id, fence.message_id, fence.attempt, kind, dump(data), now
            )
        return True

    @transient
    def get_task(self, task_id: str) -> TaskRecord | None:
        with self.driver.reading() as conn:
            row = conn.execute(self.sql.task_get, {"task_id": task_id}).first()
        if row is None:
            return None
        m = row._mapping
        return TaskRecord(
            task_id=m["task_id"],
            state=m["state"],
            reason=m["reason"],
            checkpoint=json.loads(m["checkpoint"] or "{}"),
            revision=int(m["revision"]),
            run_id=m["run_id"],
            created_at_ms=int(m["created_at_ms"]),
            updated_at_ms=int(m["updated_at_ms"]),
        )
