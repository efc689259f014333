"""``sqlease.Admin``: see and steer the durable state (the ``sqlease`` command uses it).

Task states are derived from the store, and agree with Celery's result states where both
exist: ``queued`` (PENDING), ``scheduled`` (an eta/countdown not yet due), ``running`` (leased),
``waiting_input`` / ``waiting_approval`` / ``paused`` (parked: no lease, no worker held),
``succeeded`` (SUCCESS), ``failed`` (FAILURE, or dead: ``attempts_exhausted``, ``rejected``,
``undecodable``), ``cancelled`` (REVOKED).

Admin writes are single short transactions. Pausing or cancelling a running task takes its
lease away: the worker finds out at its next heartbeat or fenced write, gets ``LeaseLost`` and
stops without a failure being recorded; its late result and ack are refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from sqlalchemy import Connection, and_, func, or_, select
from sqlalchemy.engine import URL

from sqlease._core.control import Control
from sqlease._core.results import ResultStore
from sqlease._core.rows import row_to_message
from sqlease._core.steps import StepStore
from sqlease._flow_admin import FlowAdmin
from sqlease._schedules.admin import ScheduleAdmin
from sqlease.errors import InvalidAnswer, InvalidTransition, UnknownTask
from sqlease.store import Event, Message, Store
from sqlease.urls import strip_prefix

TASK_STATES = (
    "queued",
    "scheduled",
    "running",
    "waiting_input",
    "waiting_approval",
    "paused",
    "succeeded",
    "failed",
    "cancelled",
)
_PARKED = {
    "waiting_input": "waiting_input",
    "waiting_approval": "waiting_approval",
    "paused": "paused",
}
_RESULT_STATES = {"SUCCESS": "succeeded", "FAILURE": "failed", "REVOKED": "cancelled"}


@dataclass
class TaskSnapshot:
    task_id: str
    state: str
    reason: str | None = None
    attempt: int = 0
    max_attempts: int | None = None
    queue: str | None = None
    run_id: str | None = None
    message_id: int | None = None
    priority: int | None = None
    lease_owner: str | None = None
    lease_expires_at_ms: int | None = None
    available_at_ms: int | None = None
    last_error: str | None = None
    checkpoint: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Any] | None = None
    result_state: str | None = None
    waiting: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _state_of(message: Message, now: int) -> str:
    if message.state == "dead":
        return "cancelled" if message.reason == "cancelled" else "failed"
    if message.state == "parked":
        return _PARKED.get(message.reason or "", "paused")
    if message.lease_expires_at_ms is not None and message.lease_expires_at_ms > now:
        return "running"
    if message.available_at_ms > now:
        return "scheduled"
    return "queued"


class Admin(ScheduleAdmin, FlowAdmin):
    """Inspect and steer sqlease tasks in one database (the broker URL, with or without the
    ``sqlease+`` prefix)."""

    def __init__(
        self, url: str | URL, *, table_prefix: str = "sqlease_", store: Store | None = None
    ) -> None:
        if store is None:
            raw = strip_prefix(url) if isinstance(url, str) else url
            store = Store(raw, table_prefix=table_prefix, auto_migrate=False)
        self.store = store
        self.results = ResultStore(store)
        self.steps = StepStore(store)
        self.control = Control(store, self.results)
        self.t = store.tables

    # ---- reading ---------------------------------------------------------------------

    def _now(self) -> int:
        return self.store.now_ms()

    def _current_message(self, conn: Connection, task_id: str) -> Message | None:
        m = self.t.messages
        row = conn.execute(
            select(m).where(m.c.task_id == task_id).order_by(m.c.id.desc()).limit(1)
        ).first()
        if row is None:
            return None
        return row_to_message(row)

    def _result_state(self, task_id: str) -> str | None:
        r = self.t.results
        with self.store._reading() as conn:
            value = conn.execute(select(r.c.state).where(r.c.task_id == task_id)).scalar()
        return None if value is None else str(value)

    def task(self, task_id: str) -> TaskSnapshot:
        """Everything known about a task: state, lease, checkpoint, steps, timeline."""
        now = self._now()
        with self.store._reading() as conn:
            message = self._current_message(conn, task_id)
        record = self.store.get_task(task_id)
        result_state = self._result_state(task_id)
        events = self.store.events(task_id=task_id)
        if message is None and record is None and result_state is None and not events:
            raise UnknownTask(f"no task {task_id!r} in this database")
        snapshot = TaskSnapshot(task_id=task_id, state="queued", result_state=result_state)
        if record is not None:
            snapshot.checkpoint = dict(record.checkpoint)
            snapshot.progress = snapshot.checkpoint.get("_progress")
            snapshot.run_id = record.run_id
        if message is not None:
            snapshot.state = _state_of(message, now)
            snapshot.reason = message.reason
            snapshot.attempt = message.attempt
            snapshot.max_attempts = message.max_attempts
            snapshot.queue = message.queue
            snapshot.run_id = message.run_id
            snapshot.message_id = message.id
            snapshot.priority = message.priority
            snapshot.available_at_ms = message.available_at_ms
            snapshot.last_error = message.last_error
            if snapshot.state == "running":
                snapshot.lease_owner = message.lease_owner
                snapshot.lease_expires_at_ms = message.lease_expires_at_ms
        elif result_state in _RESULT_STATES:
            snapshot.state = _RESULT_STATES[result_state]
        elif events and events[-1].kind == "purged":
            snapshot.state, snapshot.reason = "cancelled", "purged"
        elif any(e.kind == "acked" for e in events):
            # Without a result backend an ack is all we know: Celery also acks tasks that
            # raised (acks_on_failure), so configure the sqlease backend to tell them apart.
            snapshot.state = "succeeded"
        if message is None:
            attempts = [e.attempt for e in events if e.attempt]
            snapshot.attempt = max(attempts) if attempts else 0
        snapshot.waiting = self._waiting(task_id)
        snapshot.steps = [
            {"name": s.name, "status": s.status, "attempt": s.attempt, "error": s.error}
            for s in self.steps.all(task_id)
        ]
        snapshot.events = [self._event_dict(e) for e in events]
        return snapshot

    @staticmethod
    def _event_dict(event: Event) -> dict[str, Any]:
        return {
            "id": event.id,
            "kind": event.kind,
            "attempt": event.attempt,
            "message_id": event.message_id,
            "data": event.data,
            "at_ms": event.at_ms,
        }

    def _waiting(self, task_id: str) -> dict[str, Any] | None:
        w = self.t.waits
        with self.store._reading() as conn:
            row = conn.execute(
                select(w)
                .where(w.c.task_id == task_id, w.c.status == "waiting")
                .order_by(w.c.created_at_ms.desc())
                .limit(1)
            ).first()
        if row is None:
            return None
        return {
            "key": row.key,
            "kind": row.kind,
            "request": json.loads(row.request or "null"),
            "since_ms": int(row.created_at_ms),
        }

    def tasks(
        self,
        *,
        state: str | None = None,
        queue: str | None = None,
        run_id: str | None = None,
        limit: int = 100,
    ) -> list[TaskSnapshot]:
        """Tasks with a message in the store (queued to dead), newest first, filtered."""
        if state is not None and state not in TASK_STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(TASK_STATES)}")
        now = self._now()
        m = self.t.messages
        query = select(m).order_by(m.c.id.desc())
        if queue is not None:
            query = query.where(m.c.queue == queue)
        if run_id is not None:
            query = query.where(m.c.run_id == run_id)
        if state in ("failed", "cancelled"):
            query = query.where(m.c.state == "dead")
        elif state in _PARKED:
            query = query.where(m.c.state == "parked")
        elif state in ("queued", "scheduled", "running"):
            query = query.where(m.c.state == "ready")
        found: list[TaskSnapshot] = []
        with self.store._reading() as conn:
            for row in conn.execute(query):
                message = row_to_message(row)
                derived = _state_of(message, now)
                if state is not None and derived != state:
                    continue
                found.append(
                    TaskSnapshot(
                        task_id=message.task_id or f"message:{message.id}",
                        state=derived,
                        reason=message.reason,
                        attempt=message.attempt,
                        max_attempts=message.max_attempts,
                        queue=message.queue,
                        run_id=message.run_id,
                        message_id=message.id,
                        priority=message.priority,
                        lease_owner=message.lease_owner if derived == "running" else None,
                        lease_expires_at_ms=(
                            message.lease_expires_at_ms if derived == "running" else None
                        ),
                        available_at_ms=message.available_at_ms,
                        last_error=message.last_error,
                    )
                )
                if len(found) >= limit:
                    break
        if state == "succeeded":
            r = self.t.results
            with self.store._reading() as conn:
                rows = conn.execute(
                    select(r.c.task_id)
                    .where(r.c.state == "SUCCESS", r.c.task_id.isnot(None))
                    .order_by(r.c.updated_at_ms.desc())
                    .limit(limit)
                ).fetchall()
            found = [
                TaskSnapshot(task_id=row.task_id, state="succeeded", result_state="SUCCESS")
                for row in rows
            ]
        return found

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per queue: ready, scheduled, leased, waiting, paused, dead, oldest ready age (s)."""
        now = self._now()
        m = self.t.messages
        leased = and_(m.c.state == "ready", m.c.lease_expires_at_ms > now)
        unleased = and_(
            m.c.state == "ready",
            or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now),
        )
        ready = and_(unleased, m.c.available_at_ms <= now)
        scheduled = and_(unleased, m.c.available_at_ms > now)
        waiting = and_(m.c.state == "parked", m.c.reason.like("waiting_%"))
        paused = and_(m.c.state == "parked", m.c.reason == "paused")

        query = (
            select(
                m.c.queue,
                func.count().filter(ready),
                func.count().filter(scheduled),
                func.count().filter(leased),
                func.count().filter(waiting),
                func.count().filter(paused),
                func.count().filter(m.c.state == "dead"),
                func.min(m.c.available_at_ms).filter(ready),
            )
            .group_by(m.c.queue)
            .order_by(m.c.queue)
        )
        out: dict[str, dict[str, Any]] = {}
        with self.store._reading() as conn:
            for row in conn.execute(query):
                oldest = row[7]
                out[row[0]] = {
                    "ready": int(row[1]),
                    "scheduled": int(row[2]),
                    "leased": int(row[3]),
                    "waiting": int(row[4]),
                    "paused": int(row[5]),
                    "dead": int(row[6]),
                    "oldest_ready_age_s": None
                    if oldest is None
                    else round(max(0, now - int(oldest)) / 1000, 3),
                }
        return out

    # ---- steering --------------------------------------------------------------------

    def pause(self, task_id: str | None = None, *, run_id: str | None = None) -> int:
        """Hold queued tasks and take the lease from running ones; they keep their checkpoint
        and continue from it after ``resume``."""
        changed = self.control.pause(task_id, run_id=run_id)
        if task_id is not None and not changed:
            self._explain(task_id, "pause", "it is not queued, scheduled or running")
        return len(changed)

    def resume(self, task_id: str | None = None, *, run_id: str | None = None) -> int:
        """Make paused tasks claimable again (with a fresh attempt budget)."""
        changed = self.control.resume(task_id, run_id=run_id)
        if task_id is not None and not changed:
            self._explain(task_id, "resume", "it is not paused")
        return len(changed)

    def cancel(
        self,
        task_id: str | None = None,
        *,
        run_id: str | None = None,
        reason: str = "cancelled",
        leave_held: bool = False,
    ) -> int:
        """Cancel for good: the task will not run (again); a running one loses its lease.
        Its Celery result becomes REVOKED.

        ``leave_held``: a message under a live lease (running or prefetched) is left to its
        worker, and a task that has only such a message is not an error (0 is returned), as
        Celery's revoke does (``sqlease.revokes``)."""
        changed = self.control.cancel(task_id, run_id=run_id, reason=reason, leave_held=leave_held)
        if task_id is not None and not changed and not leave_held:
            self._explain(task_id, "cancel", "it has already finished or was cancelled")
        return len(changed)

    def requeue(self, task_id: str, *, max_attempts: int | None = None) -> bool:
        """Make a failed, exhausted, cancelled or parked task claimable again with a fresh
        attempt budget; its history is kept."""
        with self.store._reading() as conn:
            message = self._current_message(conn, task_id)
        if message is None:
            raise UnknownTask(
                f"no message for task {task_id!r} (finished tasks leave no message to requeue)"
            )
        if not self.store.requeue(message.id, max_attempts=max_attempts):
            raise InvalidTransition(
                f"task {task_id} is {_state_of(message, self._now())}; only failed, cancelled, "
                "paused or waiting tasks can be requeued"
            )
        return True

    def purge(self, queue: str) -> int:
        """Delete the queue's undelivered tasks (running ones are left alone)."""
        return self.store.purge(queue)

    # ---- answers -----------------------------------------------------------------------

    def provide_input(self, task_id: str, data: Any) -> None:
        """Answer a task waiting in ``wait_for_input``: validated against its schema."""
        self._answer(task_id, "input", data)

    def approve(self, task_id: str, note: str | None = None) -> None:
        self._answer(task_id, "approval", {"approved": True, "note": note})

    def reject(self, task_id: str, reason: str) -> None:
        if not reason:
            raise InvalidAnswer("a rejection needs a reason")
        self._answer(task_id, "approval", {"approved": False, "reason": reason})

    def _answer(self, task_id: str, kind: str, data: Any) -> None:
        if not self.control.answer(task_id, kind, data):
            self._explain(task_id, "answer", "it is not waiting for a person")

    def _explain(self, task_id: str, verb: str, why: str) -> NoReturn:
        try:
            snapshot = self.task(task_id)
        except UnknownTask:
            raise UnknownTask(f"no task {task_id!r} in this database") from None
        raise InvalidTransition(f"cannot {verb} task {task_id}: {why} (it is {snapshot.state})")


def now_iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))
