"""``Admin``'s reads of tasks: one task's snapshot with its timeline, and listings.

A task is known by its message while it has one (queued to dead), by its task row (its name
and queue, written at publish: sqlease._db.task_rows), by its events (its deliveries) and by
its Celery result after its ack deleted the message.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, or_, select

from sqlease._core.names import as_id, require_text
from sqlease._db.rows import row_to_message
from sqlease.admin._recent import read_page
from sqlease.errors import UnknownTask
from sqlease.types import Event, Message

if TYPE_CHECKING:
    from sqlease._core.steps import StepStore
    from sqlease._db.tables import Tables
    from sqlease.store import Store

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
PARKED = {
    "waiting_input": "waiting_input",
    "waiting_approval": "waiting_approval",
    "paused": "paused",
    # parked behind an unfinished earlier task of its run: queued, with reason "run"
    "run": "queued",
    # parked at its full concurrency gate (key, task or queue limit): queued, reason "gate"
    "gate": "queued",
}
RESULT_STATES = {"SUCCESS": "succeeded", "FAILURE": "failed", "REVOKED": "cancelled"}
_FINISHED_EVENTS = ("acked", "purged")
#: What a task's current message says of it (over what its task row says).
_FROM_MESSAGE = (
    "state",
    "reason",
    "attempt",
    "max_attempts",
    "queue",
    "run_id",
    "message_id",
    "priority",
    "available_at_ms",
    "last_error",
    "lease_owner",
    "lease_expires_at_ms",
)


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
    #: The Celery task name (``app.tasks.charge``), when it was published with one.
    task_name: str | None = None
    #: When it was first published, epoch milliseconds.
    created_at_ms: int | None = None
    #: When it finished (its result written, or its ack), if it has.
    finished_at_ms: int | None = None
    #: The Celery group it was published in (its ``group`` header), if any.
    group_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Its public home, as documented (and as a pickle or a repr names it).
TaskSnapshot.__module__ = "sqlease.admin"


def state_of(message: Message, now: int) -> str:
    if message.state == "dead":
        return "cancelled" if message.reason == "cancelled" else "failed"
    if message.state == "parked":
        return PARKED.get(message.reason or "", "paused")
    if message.lease_expires_at_ms is not None and message.lease_expires_at_ms > now:
        return "running"
    if message.available_at_ms > now and message.reason != "rate":
        return "scheduled"  # (a rate limit's turn is no schedule: queued)
    return "queued"


def _snapshot_of(message: Message, derived: str, task_row: Any) -> TaskSnapshot:
    running = derived == "running"
    return TaskSnapshot(
        task_id=message.task_id or f"message:{message.id}",
        state=derived,
        reason=message.reason,
        attempt=message.attempt,
        max_attempts=message.max_attempts,
        queue=message.queue,
        run_id=message.run_id,
        message_id=message.id,
        priority=message.priority,
        lease_owner=message.lease_owner if running else None,
        lease_expires_at_ms=message.lease_expires_at_ms if running else None,
        available_at_ms=message.available_at_ms,
        last_error=message.last_error,
        task_name=None if task_row is None else task_row.task_name,
        created_at_ms=(message.created_at_ms if task_row is None else int(task_row.created_at_ms)),
    )


class TaskReads:
    """One task's snapshot and the task listings (``Admin.task``, ``Admin.tasks``)."""

    def __init__(self, store: Store, steps: StepStore) -> None:
        self.store = store
        self.steps = steps
        self.t: Tables = store.tables

    def _now(self) -> int:
        return self.store.now_ms()

    def current_message(self, conn: Connection, task_id: str) -> Message | None:
        task_id = as_id("task_id", task_id)
        m = self.t.messages
        row = conn.execute(
            select(m).where(m.c.task_id == task_id).order_by(m.c.id.desc()).limit(1)
        ).first()
        return None if row is None else row_to_message(row)

    def _task_row(self, conn: Connection, task_id: str) -> Any:
        k = self.t.tasks
        return conn.execute(
            select(k.c.task_name, k.c.queue, k.c.attempt, k.c.created_at_ms, k.c.group_id).where(
                k.c.task_id == task_id
            )
        ).first()

    def _result_row(self, conn: Connection, task_id: str) -> Any:
        r = self.t.results
        return conn.execute(
            select(r.c.state, r.c.updated_at_ms).where(r.c.task_id == task_id).limit(1)
        ).first()

    def result_state(self, task_id: str) -> str | None:
        with self.store.driver.reading() as conn:
            row = self._result_row(conn, task_id)
        return None if row is None or row.state is None else str(row.state)

    def task(self, task_id: str) -> TaskSnapshot:
        """Everything known about a task: state, lease, checkpoint, steps, timeline."""
        task_id = as_id("task_id", task_id)
        now = self._now()
        with self.store.driver.reading() as conn:
            message = self.current_message(conn, task_id)
            task_row = self._task_row(conn, task_id)
            result = self._result_row(conn, task_id)
        record = self.store.get_task(task_id)
        result_state = None if result is None else str(result.state)
        events = self.store.events(task_id=task_id)
        if message is None and record is None and result is None and not events:
            raise UnknownTask(f"no task {task_id!r} in this database")
        snapshot = TaskSnapshot(task_id=task_id, state="queued", result_state=result_state)
        if record is not None:
            snapshot.checkpoint = dict(record.checkpoint)
            snapshot.progress = snapshot.checkpoint.get("_progress")
            snapshot.run_id = record.run_id
        if task_row is not None:
            snapshot.task_name = task_row.task_name
            snapshot.queue = task_row.queue
            snapshot.attempt = int(task_row.attempt)
            snapshot.created_at_ms = int(task_row.created_at_ms)
            snapshot.group_id = task_row.group_id
        elif events:
            snapshot.created_at_ms = events[0].at_ms
        if message is not None:
            derived = state_of(message, now)
            found = _snapshot_of(message, derived, task_row)
            for name in _FROM_MESSAGE:
                setattr(snapshot, name, getattr(found, name))
            if snapshot.created_at_ms is None:
                snapshot.created_at_ms = message.created_at_ms
        else:
            self._finished(snapshot, result, events)
        snapshot.waiting = self._waiting(task_id)
        snapshot.steps = [
            {"name": s.name, "status": s.status, "attempt": s.attempt, "error": s.error}
            for s in self.steps.all(task_id)
        ]
        snapshot.events = [event_dict(e) for e in events]
        return snapshot

    @staticmethod
    def _finished(snapshot: TaskSnapshot, result: Any, events: list[Event]) -> None:
        """A task without a message: its state from its result, else from its timeline."""
        ends = [e for e in events if e.kind in _FINISHED_EVENTS]
        if result is not None and str(result.state) in RESULT_STATES:
            snapshot.state = RESULT_STATES[str(result.state)]
            snapshot.finished_at_ms = int(result.updated_at_ms)
        elif events and events[-1].kind == "purged":
            snapshot.state, snapshot.reason = "cancelled", "purged"
            snapshot.finished_at_ms = events[-1].at_ms
        elif ends:
            # Without a result backend an ack is all we know: Celery also acks tasks that
            # raised (acks_on_failure), so configure the sqlease backend to tell them apart.
            snapshot.state = "succeeded"
            snapshot.finished_at_ms = ends[-1].at_ms
        attempts = [e.attempt for e in events if e.attempt]
        if attempts:
            snapshot.attempt = max(snapshot.attempt, *attempts)

    def _waiting(self, task_id: str) -> dict[str, Any] | None:
        w = self.t.waits
        with self.store.driver.reading() as conn:
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
        before: str | None = None,
    ) -> list[TaskSnapshot]:
        """Tasks newest first. With no filter every recent task, finished ones included,
        from the task records, a page of ``limit`` after the cursor ``before`` (a page's
        last task's ``CREATED_MS:TASK_ID``; sqlease.admin._recent). Filtered: tasks with a
        message in the store (queued to dead); with ``state="succeeded"`` the latest
        successful results, with their task's name, queue and attempt."""
        if state is not None and state not in TASK_STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(TASK_STATES)}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a whole number of tasks >= 1, not {limit!r}")
        if state is None and queue is None and run_id is None:
            return self.recent(limit, before)
        if before is not None:
            raise ValueError("a page cursor (before) pages the unfiltered list only")
        if state == "succeeded":
            return self._succeeded(queue, limit)
        now = self._now()
        m, k = self.t.messages, self.t.tasks
        query = (
            select(m, k.c.task_name.label("k_task_name"), k.c.created_at_ms.label("k_created"))
            .outerjoin(k, k.c.task_id == m.c.task_id)
            .order_by(m.c.id.desc())
        )
        if queue is not None:
            query = query.where(m.c.queue == require_text("queue", queue))
        if run_id is not None:
            query = query.where(m.c.run_id == as_id("run_id", run_id))
        if state in ("failed", "cancelled"):
            query = query.where(m.c.state == "dead")
        elif state == "queued":  # ready, or parked behind its run or at its gate
            query = query.where(or_(m.c.state == "ready", m.c.reason.in_(("run", "gate"))))
        elif state in PARKED:
            query = query.where(m.c.state == "parked")
        elif state in ("scheduled", "running"):
            query = query.where(m.c.state == "ready")
        found: list[TaskSnapshot] = []
        with self.store.driver.reading() as conn:
            for row in conn.execute(query):
                message = row_to_message(row)
                derived = state_of(message, now)
                if state is not None and derived != state:
                    continue
                snapshot = _snapshot_of(message, derived, None)
                snapshot.task_name = row.k_task_name
                if row.k_created is not None:
                    snapshot.created_at_ms = int(row.k_created)
                found.append(snapshot)
                if len(found) >= limit:
                    break
        return found

    def recent(self, limit: int, before: str | None, **filters: Any) -> list[TaskSnapshot]:
        """A page of task records (``sqlease.admin._recent.read_page``'s filters), each
        with the state its latest message or its result says."""
        now = self._now()
        page = read_page(self.store, self.t, limit, before, **filters)
        found = []
        for row in page.rows:
            message = page.messages.get(row.task_id)
            if message is not None:
                snapshot = _snapshot_of(message, state_of(message, now), row)
            else:
                seen = page.delivered.get(row.task_id)
                attempt = max(int(row.attempt), seen.attempt if seen else 0)
                snapshot = TaskSnapshot(row.task_id, "queued", attempt=attempt)
                snapshot.queue, snapshot.run_id = row.queue, row.run_id
                result = page.results.get(row.task_id)
                if result is not None and str(result.state) in RESULT_STATES:
                    snapshot.state = RESULT_STATES[str(result.state)]
                    snapshot.finished_at_ms = int(result.updated_at_ms)
                elif attempt > 0 and (seen is None or seen.ended != "purged"):
                    snapshot.state = "succeeded"  # its message acked (see _recent)
                else:
                    snapshot.state, snapshot.reason = "cancelled", "purged"
            snapshot.task_name, snapshot.group_id = row.task_name, row.group_id
            snapshot.created_at_ms = int(row.created_at_ms)
            found.append(snapshot)
        return found

    def _succeeded(self, queue: str | None, limit: int) -> list[TaskSnapshot]:
        r, k = self.t.results, self.t.tasks
        query = (
            select(
                r.c.task_id,
                r.c.attempt,
                r.c.updated_at_ms,
                k.c.task_name,
                k.c.queue,
                k.c.attempt.label("k_attempt"),
                k.c.run_id,
                k.c.created_at_ms,
            )
            .outerjoin(k, k.c.task_id == r.c.task_id)
            .where(r.c.state == "SUCCESS", r.c.task_id.isnot(None))
            .order_by(r.c.updated_at_ms.desc())
            .limit(limit)
        )
        if queue is not None:
            query = query.where(k.c.queue == queue)
        with self.store.driver.reading() as conn:
            rows = conn.execute(query).fetchall()
        return [
            TaskSnapshot(
                task_id=row.task_id,
                state="succeeded",
                result_state="SUCCESS",
                task_name=row.task_name,
                queue=row.queue,
                # the result's own fence: the delivery that succeeded
                attempt=int(row.attempt or row.k_attempt or 0),
                run_id=row.run_id,
                created_at_ms=None if row.created_at_ms is None else int(row.created_at_ms),
                finished_at_ms=int(row.updated_at_ms),
            )
            for row in rows
        ]


def event_dict(event: Event) -> dict[str, Any]:
    return {
        "id": event.id,
        "kind": event.kind,
        "attempt": event.attempt,
        "message_id": event.message_id,
        "data": event.data,
        "at_ms": event.at_ms,
    }
