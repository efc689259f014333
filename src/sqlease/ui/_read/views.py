"""What the dashboard reads beyond ``Admin``'s verbs: workers, throughput, a keyset page of
tasks, runs, a task's message payload, result and history. Reads only, each one short
read transaction; every statement is SQLAlchemy Core on the existing tables (both dialects).

Pages are keyset pages, never an OFFSET over a table: with no state filter on the task
records' creation time (every task, finished ones included), filtered by state on
``messages.id`` (the primary key, newest first). A page costs the rows it returns plus those
its filters skip (docs/performance.md has the numbers at 1,000,000 tasks and messages).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, and_, func, or_, select

from sqlease.admin import TASK_STATES, Admin
from sqlease.admin._reads import state_of as _state_of
from sqlease.store import Message
from sqlease.ui._read.history import host_of, parse_payload
from sqlease.ui._read.task_list import TaskPage, TaskRow, recent_page, succeeded_page

#: Throughput counts these event kinds: a finished delivery, and a failed one.
DONE_KINDS = ("acked",)
FAILED_KINDS = ("failed", "attempts_exhausted")
#: How far a writer's clock may run behind another's: a time bound found by id is searched
#: this much early (the exact time is filtered too).
CLOCK_SLACK_MS = 60_000


@dataclass
class Throughput:
    bucket_s: int
    #: Bucket start (ms), finished deliveries, failed ones; oldest first.
    buckets: list[tuple[int, int, int]]


def _like_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class AdminViews:
    """The dashboard's reads over one ``Admin`` (its store and tables)."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin
        self.store = admin.store
        self.t = admin.store.tables

    def now(self) -> int:
        return self.store.now_ms()

    # ---- overview ------------------------------------------------------------------

    def overview(self) -> dict[str, dict[str, Any]]:
        """Per queue: ``Admin.stats()`` split into ``failed`` and ``cancelled``."""
        stats = self.admin.stats()
        m = self.t.messages
        query = (
            select(m.c.queue, func.count())
            .where(m.c.state == "dead", m.c.reason == "cancelled")
            .group_by(m.c.queue)
        )
        with self.store.driver.reading() as conn:
            cancelled = {row[0]: int(row[1]) for row in conn.execute(query)}
        for queue, row in stats.items():
            row["cancelled"] = cancelled.get(queue, 0)
            row["failed"] = row["dead"] - row["cancelled"]
        return stats

    def workers(self) -> list[dict[str, Any]]:
        """Owners holding unexpired leases: tasks held, the latest lease expiry (a lease is
        renewed at every heartbeat, so the expiry tells when the owner was last heard of)."""
        now = self.now()
        m = self.t.messages
        query = (
            select(
                m.c.lease_owner,
                func.count(),
                func.max(m.c.lease_expires_at_ms),
                func.min(m.c.lease_expires_at_ms),
            )
            .where(m.c.state == "ready", m.c.lease_expires_at_ms > now)
            .group_by(m.c.lease_owner)
            .order_by(m.c.lease_owner)
        )
        with self.store.driver.reading() as conn:
            rows = conn.execute(query).fetchall()
        return [
            {
                "owner": row[0],
                "host": host_of(row[0]),
                "held": int(row[1]),
                "lease_expires_at_ms": int(row[2]),
                "earliest_expiry_ms": int(row[3]),
            }
            for row in rows
        ]

    def _first_id_at(self, conn: Connection, table: Table, column: str, ms: int) -> int:
        """The lowest id whose time column is ``ms`` or later, by binary search on the
        primary key (about 20 index lookups). Ids grow with time; a clock skewed between
        writers blurs that, so callers search ``CLOCK_SLACK_MS`` early and filter the time
        exactly as well."""
        ids, times = table.c.id, table.c[column]
        low = conn.execute(select(func.min(ids))).scalar()
        high = conn.execute(select(func.max(ids))).scalar()
        if low is None or high is None:
            return 0
        low, high = int(low), int(high) + 1
        while low < high:
            middle = (low + high) // 2
            at = conn.execute(select(times).where(ids >= middle).order_by(ids).limit(1)).scalar()
            if at is not None and int(at) < ms:
                low = middle + 1
            else:
                high = middle
        return low

    def throughput(self, *, minutes: int = 30, bucket_s: int = 60) -> Throughput:
        """Finished and failed deliveries per bucket over the last ``minutes``: the events
        from the window's first id on (a binary search on the primary key), counted in the
        database, so the cost is the window's events, not the table's."""
        now = self.now()
        bucket_ms = bucket_s * 1000
        start = (now - minutes * 60_000) // bucket_ms * bucket_ms
        counts = {b: [0, 0] for b in range(start, now + 1, bucket_ms)}
        e = self.t.events
        kinds = DONE_KINDS + FAILED_KINDS
        bucket = (e.c.at_ms - e.c.at_ms % bucket_ms).label("bucket")
        with self.store.driver.reading() as conn:
            floor = self._first_id_at(conn, e, "at_ms", start - CLOCK_SLACK_MS)
            window = and_(e.c.id >= floor, e.c.at_ms >= start, e.c.kind.in_(kinds))
            singles = conn.execute(
                select(bucket, e.c.kind, func.count())
                .where(window, e.c.task_ids.is_(None))
                .group_by(bucket, e.c.kind)
            ).fetchall()
            # A PostgreSQL batch row stands for every message it lists (one row per claim
            # or ack statement, so few): counted here rather than in dialect-specific SQL.
            batches = conn.execute(
                select(e.c.at_ms, e.c.kind, e.c.task_ids).where(window, e.c.task_ids.isnot(None))
            ).fetchall()
        tallies = [(int(b), kind, int(n)) for b, kind, n in singles]
        tallies += [
            (int(at) // bucket_ms * bucket_ms, kind, len(ids or ())) for at, kind, ids in batches
        ]
        for b, kind, n in tallies:
            if b in counts:
                counts[b][0 if kind in DONE_KINDS else 1] += n
        return Throughput(bucket_s, [(b, c[0], c[1]) for b, c in sorted(counts.items())])

    # ---- tasks ---------------------------------------------------------------------

    def _state_filter(self, state: str, now: int) -> ColumnElement[bool]:
        m = self.t.messages
        live = and_(m.c.state == "ready", m.c.lease_expires_at_ms > now)
        idle = and_(
            m.c.state == "ready",
            or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now),
        )
        return {
            "queued": or_(
                and_(idle, or_(m.c.available_at_ms <= now, m.c.reason == "rate")),
                # behind its run, or at its full gate
                and_(m.c.state == "parked", m.c.reason.in_(("run", "gate"))),
            ),
            "scheduled": and_(
                idle, m.c.available_at_ms > now, or_(m.c.reason.is_(None), m.c.reason != "rate")
            ),
            "running": live,
            "waiting_input": and_(m.c.state == "parked", m.c.reason == "waiting_input"),
            "waiting_approval": and_(m.c.state == "parked", m.c.reason == "waiting_approval"),
            "waiting": and_(m.c.state == "parked", m.c.reason.like("waiting\\_%", escape="\\")),
            "paused": and_(
                m.c.state == "parked",
                or_(
                    m.c.reason.is_(None),
                    and_(
                        m.c.reason.not_like("waiting\\_%", escape="\\"),
                        m.c.reason.not_in(("run", "gate")),
                    ),
                ),
            ),
            "failed": and_(
                m.c.state == "dead", or_(m.c.reason.is_(None), m.c.reason != "cancelled")
            ),
            "cancelled": and_(m.c.state == "dead", m.c.reason == "cancelled"),
        }[state]

    def task_page(
        self,
        *,
        state: str | None = None,
        queue: str | None = None,
        name: str | None = None,
        run_id: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
        search: str | None = None,
        before: int | str | None = None,
        limit: int = 50,
    ) -> TaskPage:
        """Tasks newest first. With no state, every recent task from the task records
        (``before``: the cursor ``CREATED_MS:TASK_ID`` a page gave). With a state, the
        messages in it (``before``: the page's upper message id, exclusive); ``waiting`` is
        both waiting states; finished tasks leave no message, so ``state="succeeded"`` lists
        them from their results. States are those of ``Admin``."""
        if state is not None and state not in (*TASK_STATES, "waiting"):
            raise ValueError(f"unknown state {state!r}; one of {', '.join(TASK_STATES)}")
        if state is None:
            return recent_page(
                self.admin,
                queue=queue,
                name=name,
                run_id=run_id,
                since_ms=since_ms,
                until_ms=until_ms,
                search=search,
                before=None if before is None else str(before),
                limit=limit,
            )
        if isinstance(before, str):
            raise ValueError(f"before must be a message id on a page filtered by state: {before!r}")
        if state == "succeeded":
            return succeeded_page(
                self.admin, queue=queue, name=name, run_id=run_id, search=search, limit=limit
            )
        if not 1 <= limit <= 500:
            raise ValueError(f"limit must be 1 to 500, not {limit}")
        now = self.now()
        m = self.t.messages
        query = select(m).order_by(m.c.id.desc()).limit(limit + 1)
        if state is not None:
            query = query.where(self._state_filter(state, now))
        if queue:
            query = query.where(m.c.queue == queue)
        if run_id:
            query = query.where(m.c.run_id == run_id)
        if search:
            query = query.where(m.c.task_id == search)
        if before is not None:
            query = query.where(m.c.id < before)
        if name:
            query = query.where(self._name_filter(name))
        with self.store.driver.reading() as conn:
            # Times become id bounds too, so that the page is a range of the primary key.
            if since_ms is not None:
                floor = self._first_id_at(conn, m, "created_at_ms", since_ms - CLOCK_SLACK_MS)
                query = query.where(m.c.created_at_ms >= since_ms, m.c.id >= floor)
            if until_ms is not None:
                ceiling = self._first_id_at(conn, m, "created_at_ms", until_ms + CLOCK_SLACK_MS)
                query = query.where(m.c.created_at_ms < until_ms, m.c.id < ceiling)
            rows = conn.execute(query).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        found = [self._task_row(row._mapping, now) for row in rows]
        return TaskPage(found, found[-1].message_id if more and found else None)

    def _name_filter(self, name: str) -> ColumnElement[bool]:
        m = self.t.messages
        tasks = self.t.tasks
        if "name" in tasks.c:  # a tasks.name column (a newer schema) is indexed data
            return m.c.task_id.in_(select(tasks.c.task_id).where(tasks.c.name == name))
        # Else the Celery ``task`` header inside the stored message, as json.dumps writes it.
        pattern = f'%"task": {_like_escape(json.dumps(name))}%'
        return m.c.payload.like(pattern, escape="\\")

    def _task_row(self, mapping: Any, now: int) -> TaskRow:
        from sqlease._db.rows import message_from

        message: Message = message_from(mapping, has_last_error=True)
        state = _state_of(message, now)
        return TaskRow(
            task_id=message.task_id or f"message:{message.id}",
            message_id=message.id,
            state=state,
            reason=message.reason,
            queue=message.queue,
            name=parse_payload(message.payload).name,
            run_id=message.run_id,
            attempt=message.attempt,
            max_attempts=message.max_attempts,
            priority=message.priority,
            created_at_ms=message.created_at_ms,
            available_at_ms=message.available_at_ms,
            lease_owner=message.lease_owner if state == "running" else None,
            lease_expires_at_ms=message.lease_expires_at_ms if state == "running" else None,
            last_error=message.last_error,
        )

    # ---- one task ------------------------------------------------------------------

    def message_of(self, task_id: str) -> Message | None:
        with self.store.driver.reading() as conn:
            return self.admin.reads.current_message(conn, task_id)

    def result_of(self, task_id: str) -> dict[str, Any] | None:
        """The Celery result meta the sqlease backend stored (None without one; a value
        that is not JSON is described, not decoded)."""
        r = self.t.results
        with self.store.driver.reading() as conn:
            row = conn.execute(
                select(r.c.value, r.c.state, r.c.attempt, r.c.updated_at_ms)
                .where(r.c.task_id == task_id, r.c.key.not_like("%chord%"))
                .order_by(r.c.updated_at_ms.desc())
                .limit(1)
            ).first()
        if row is None:
            return None
        raw = bytes(row.value)
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            meta = {"status": row.state, "result": f"({len(raw)} bytes, not JSON)"}
        if not isinstance(meta, dict):
            meta = {"status": row.state, "result": meta}
        meta["_attempt"] = None if row.attempt is None else int(row.attempt)
        meta["_updated_at_ms"] = int(row.updated_at_ms)
        return meta

    # ---- runs ----------------------------------------------------------------------

    def runs(self, *, limit: int = 200) -> list[dict[str, Any]]:
        """Runs with unfinished messages: how many, the head (lowest id), who holds it."""
        m, runs = self.t.messages, self.t.runs
        now = self.now()
        query = (
            select(m.c.run_id, func.count(), func.min(m.c.id), func.min(m.c.created_at_ms))
            .where(m.c.run_id.isnot(None))
            .group_by(m.c.run_id)
            .order_by(func.min(m.c.id))
            .limit(limit)
        )
        with self.store.driver.reading() as conn:
            rows = conn.execute(query).fetchall()
            ids = [row[0] for row in rows]
            holders = {
                h.run_id: h
                for h in conn.execute(
                    select(runs).where(runs.c.run_id.in_(ids), runs.c.lease_expires_at_ms > now)
                )
            }
        return [
            {
                "run_id": row[0],
                "messages": int(row[1]),
                "head_message_id": int(row[2]),
                "since_ms": int(row[3]),
                "holder": None
                if row[0] not in holders
                else {
                    "message_id": int(holders[row[0]].message_id),
                    "owner": holders[row[0]].lease_owner,
                    "expires_at_ms": int(holders[row[0]].lease_expires_at_ms),
                },
            }
            for row in rows
        ]

    def run(self, run_id: str) -> dict[str, Any]:
        """A run's unfinished tasks in delivery order, and which of them holds the run."""
        m, runs = self.t.messages, self.t.runs
        now = self.now()
        with self.store.driver.reading() as conn:
            rows = conn.execute(select(m).where(m.c.run_id == run_id).order_by(m.c.id)).fetchall()
            holder = conn.execute(
                select(runs).where(runs.c.run_id == run_id, runs.c.lease_expires_at_ms > now)
            ).first()
        tasks = [self._task_row(row._mapping, now) for row in rows]
        held = None
        if holder is not None:
            held = {
                "message_id": int(holder.message_id),
                "owner": holder.lease_owner,
                "attempt": int(holder.attempt),
                "expires_at_ms": int(holder.lease_expires_at_ms),
            }
        return {"run_id": run_id, "tasks": tasks, "holder": held}
