"""Steering writes: pause, resume, cancel and answers, for ``Admin`` and Celery's revoke alike.

Each operation is one short transaction that changes the matching messages, drops their run
locks and writes one timeline event per message, so a stale worker finds out at its next
heartbeat or fenced write (``LeaseLost``) and stops without a failure being recorded. ``Admin``
adds the explanations a person needs when nothing matched; ``sqlease.revokes`` cancels with
``leave_held`` so that a task a worker holds is left to that worker, as Celery does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, and_, case, delete, func, or_, select, update

from sqlease._core.names import as_id
from sqlease._core.results import ResultStore, exception_meta
from sqlease._core.store import Store
from sqlease._core.waits import validate
from sqlease._db.rows import row_to_message
from sqlease.errors import InvalidAnswer, InvalidTransition
from sqlease.types import Message

Extra = Callable[[Connection, Message], None]


def revoked_meta(task_id: str, reason: str) -> bytes:
    # Celery's own result format, so AsyncResult(task_id).state == REVOKED.
    return exception_meta(task_id, "REVOKED", "TaskRevokedError", [reason], "celery.exceptions")


class Control:
    """The steering writes on one store."""

    def __init__(self, store: Store, results: ResultStore | None = None) -> None:
        self.store = store
        self.results = results if results is not None else ResultStore(store)
        self.t = store.tables

    def targets(self, task_id: str | None, run_id: str | None) -> Any:
        m = self.t.messages
        if (task_id is None) == (run_id is None):
            raise ValueError("give exactly one of task_id or run_id")
        if task_id is not None:
            return m.c.task_id == as_id("task_id", task_id)
        return m.c.run_id == as_id("run_id", run_id)

    def change(
        self,
        where: Any,
        values: dict[str, Any],
        kind: str,
        data: Any = None,
        *,
        extra: Extra | None = None,
    ) -> list[Message]:
        """Update the matching messages, drop their run locks, write one event each."""
        m, r = self.t.messages, self.t.runs
        now = self.store.now_ms()
        with self.store.driver.writing() as conn:
            rows = conn.execute(update(m).where(where).values(**values).returning(m)).fetchall()
            changed = [row_to_message(row) for row in rows]
            gates = {row._mapping["gate"] for row in rows} - {None}
            if changed:  # their gate slots (PostgreSQL's; none on SQLite)
                slots = self.t.slots
                conn.execute(delete(slots).where(slots.c.message_id.in_([c.id for c in changed])))
            for message in changed:
                if message.run_id is not None:
                    conn.execute(
                        delete(r).where(r.c.run_id == message.run_id, r.c.message_id == message.id)
                    )
                self.store.timeline.on(conn, message.task_id, None, kind, data, now)
                if extra is not None:
                    extra(conn, message)
        # A message that failed (cancelled) left its run: the run's next one goes on.
        self.store.promote_runs(m.run_id for m in changed if m.state == "dead" and m.run_id)
        # A message that held a gate's place gave it up: the next ones parked there go on.
        if gates:
            self.store.promote_gates(gates)
        return changed

    def pause(self, task_id: str | None = None, *, run_id: str | None = None) -> list[Message]:
        m = self.t.messages
        # A run's messages parked behind it, and messages parked at a full gate, are paused
        # with it (resumed, they are ready again: the claim's head and gate checks keep the
        # order and the limit; a sweep parks them again while the gate is full).
        waiting = and_(m.c.state == "parked", m.c.reason.in_(("run", "gate")))
        return self.change(
            and_(self.targets(task_id, run_id), or_(m.c.state == "ready", waiting)),
            {
                "state": "parked",
                "reason": "paused",
                "lease_owner": None,
                "lease_expires_at_ms": None,
            },
            "paused",
        )

    def resume(self, task_id: str | None = None, *, run_id: str | None = None) -> list[Message]:
        m = self.t.messages
        now = self.store.now_ms()
        return self.change(
            and_(self.targets(task_id, run_id), m.c.state == "parked", m.c.reason == "paused"),
            {
                "state": "ready",
                "reason": None,
                # A task paused before its eta keeps it.
                "available_at_ms": case(
                    (m.c.available_at_ms > now, m.c.available_at_ms), else_=now
                ),
                "max_attempts": m.c.attempt + self.store.max_attempts,
            },
            "resumed",
        )

    def cancel(
        self,
        task_id: str | None = None,
        *,
        run_id: str | None = None,
        reason: str = "cancelled",
        leave_held: bool = False,
    ) -> list[Message]:
        """Fail the matching unfinished messages ``cancelled`` and give each task a REVOKED
        result. ``leave_held``: a message under a live lease is left to its worker."""
        m = self.t.messages
        where = and_(self.targets(task_id, run_id), m.c.state.in_(("ready", "parked")))
        if leave_held:
            now = self.store.now_ms()
            where = and_(
                where, or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now)
            )

        def revoke(conn: Connection, message: Message) -> None:
            if message.task_id is not None:
                self.results.put_on(
                    conn,
                    f"celery-task-meta-{message.task_id}",
                    revoked_meta(message.task_id, reason),
                    state="REVOKED",
                    task_id=message.task_id,
                    now=self.store.now_ms(),
                )

        return self.change(
            where,
            {
                "state": "dead",
                "reason": "cancelled",
                "lease_owner": None,
                "lease_expires_at_ms": None,
                "last_error": reason,
            },
            "cancelled",
            {"reason": reason},
            extra=revoke,
        )

    def answer(self, task_id: str, kind: str, data: Any) -> bool:
        """Store a person's answer to the task's open wait and make it claimable again.
        False if the task has no wait at all; InvalidTransition / InvalidAnswer when the
        answer does not fit the wait."""
        task_id = as_id("task_id", task_id)
        try:
            answer_text = json.dumps(data)
        except (TypeError, ValueError) as exc:
            raise InvalidAnswer(f"the answer must be JSON-serializable: {exc}") from exc
        w = self.t.waits
        with self.store.driver.writing() as conn:
            wait = conn.execute(
                select(w)
                .where(w.c.task_id == task_id, w.c.status == "waiting")
                .order_by(w.c.created_at_ms.desc())
                .limit(1)
            ).first()
            if wait is None:
                answered = conn.execute(
                    select(func.count()).select_from(w).where(w.c.task_id == task_id)
                ).scalar_one()
                if answered:
                    raise InvalidTransition(
                        f"task {task_id} was already answered and is not waiting now"
                    )
                return False
            if wait.kind != kind:
                raise InvalidTransition(
                    f"task {task_id} waits for {wait.kind}, not {kind}; use "
                    f"{'provide_input' if wait.kind == 'input' else 'approve/reject'}"
                )
            if kind == "input":
                validate(data, json.loads(wait.request or "{}").get("schema"))
            self._answered(conn, task_id, kind, wait.key, answer_text, data)
        return True

    def _answered(
        self, conn: Connection, task_id: str, kind: str, key: str, answer_text: str, data: Any
    ) -> None:
        w, m = self.t.waits, self.t.messages
        now = self.store.now_ms()
        done = conn.execute(
            update(w)
            .where(w.c.task_id == task_id, w.c.key == key, w.c.status == "waiting")
            .values(status="answered", answer=answer_text, answered_at_ms=now)
        ).rowcount
        if not done:
            raise InvalidTransition(f"task {task_id} was answered meanwhile")
        reason = "waiting_input" if kind == "input" else "waiting_approval"
        conn.execute(
            update(m)
            .where(m.c.task_id == task_id, m.c.state == "parked", m.c.reason == reason)
            .values(
                state="ready",
                reason=None,
                available_at_ms=now,
                max_attempts=m.c.attempt + self.store.max_attempts,
            )
        )
        event = {"input": "input_provided"}.get(
            kind, "approved" if data.get("approved") else "rejected"
        )
        self.store.timeline.on(conn, task_id, None, event, {"key": key}, now)
