"""The maintenance pass: every worker runs it periodically, one worker at a time (a named
lease in ``<prefix>locks``), and ``sqlease maintain`` runs it once.

It expires results and old events by retention (and, after the same retention, dead
messages and the results sqlease writes without an expiry), marks steps whose delivery died
mid-step as ``outcome_unknown``, clears leases and run locks left on parked or finished
messages, drops broadcast copies (remote control, events) that nobody consumed within their
TTL, drops the handoff offers of killed workers (PostgreSQL), and logs a summary.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    any_,
    delete,
    exists,
    false,
    func,
    not_,
    or_,
    select,
    update,
)

from sqlease._core.flow_events import record_waits
from sqlease._core.results import ResultStore
from sqlease._core.store import Store
from sqlease._db.tables import Tables

logger = logging.getLogger(__name__)

LOCK_NAME = "maintenance"
#: A handoff offer this long past its expiry whose worker's listening connection is gone (its
#: advisory lock free) belongs to a worker that was killed: nobody will withdraw it.
DEAD_OFFER_AFTER_MS = 60_000

#: Celery's control_queue_ttl / event_queue_ttl are 300 s / 5 s; copies older than this in
#: remote-control and event queues have no reader left.
BROADCAST_TTL_MS = 300_000


def acquire(store: Store, owner: str, lease_ms: int, now: int) -> bool:
    locks = store.tables.locks
    insert = store.driver.insert
    values = insert(locks).values(name=LOCK_NAME, owner=owner, expires_at_ms=now + lease_ms)
    stmt = values.on_conflict_do_update(
        index_elements=[locks.c.name],
        set_={"owner": values.excluded.owner, "expires_at_ms": values.excluded.expires_at_ms},
        where=or_(locks.c.expires_at_ms <= now, locks.c.owner == owner),
    ).returning(locks.c.owner)
    with store.engine.begin() as conn:
        got = conn.execute(stmt).scalar()
    return got == owner


def run_pass(store: Store, *, event_retention_ms: int, now: int | None = None) -> dict[str, int]:
    """One maintenance pass, one transaction; returns what it did, by kind."""
    now = store.now_ms() if now is None else now
    summary: dict[str, int] = {"results_expired": ResultStore(store).cleanup()}
    with store.engine.begin() as conn:
        summary["steps_outcome_unknown"] = _interrupted_steps(conn, store, now)
        summary.update(_leftovers(conn, store, now))
        summary["waiting_for_limit"] = record_waits(conn, store, now)
        if event_retention_ms > 0:
            summary.update(_history(conn, store.tables, now - event_retention_ms, store))
    return summary


def _count(result: Any) -> int:
    return int(result.rowcount or 0)


def _interrupted_steps(conn: Connection, store: Store, now: int) -> int:
    """Steps started by a delivery that no longer holds a live lease: outcome unknown."""
    t = store.tables
    m, steps = t.messages, t.steps
    live_lease = exists().where(
        m.c.id == steps.c.message_id,
        m.c.attempt == steps.c.attempt,
        m.c.state == "ready",
        m.c.lease_expires_at_ms > now,
    )
    interrupted = conn.execute(
        select(steps.c.task_id, steps.c.name, steps.c.message_id, steps.c.attempt).where(
            steps.c.status == "started", not_(live_lease)
        )
    ).fetchall()
    for row in interrupted:
        conn.execute(
            update(steps)
            .where(
                steps.c.task_id == row.task_id,
                steps.c.name == row.name,
                steps.c.status == "started",
            )
            .values(status="outcome_unknown")
        )
        store._event_on(
            conn,
            row.task_id,
            None,
            "outcome_unknown",
            {"step": row.name, "attempt": row.attempt},
            now,
        )
    return len(interrupted)


def _leftovers(conn: Connection, store: Store, now: int) -> dict[str, int]:
    """Leases on finished messages, run locks whose holder is gone, dead workers' offers,
    remote-control and event broadcasts nobody reads any more."""
    t = store.tables
    m, runs = t.messages, t.runs
    done: dict[str, int] = {}
    done["stray_leases_cleared"] = _count(
        conn.execute(
            update(m)
            .where(m.c.state != "ready", m.c.lease_owner.isnot(None))
            .values(lease_owner=None, lease_expires_at_ms=None)
        )
    )
    holder_alive = exists().where(m.c.id == runs.c.message_id, m.c.state == "ready")
    done["run_locks_pruned"] = _count(
        conn.execute(delete(runs).where(runs.c.lease_expires_at_ms <= now, not_(holder_alive)))
    )
    slots = t.slots
    done["gate_slots_pruned"] = _count(
        conn.execute(delete(slots).where(slots.c.lease_expires_at_ms <= now))
    )
    if store.driver.caps.offers:
        offers = t.offers
        # The lock test runs last (SQL does not promise an order; a live worker's lock only
        # makes the test fail, it never waits).
        lock_free = func.pg_try_advisory_xact_lock_shared(offers.c.lock_key)
        done["dead_offers_dropped"] = _count(
            conn.execute(
                delete(offers).where(offers.c.expires_at_ms < now - DEAD_OFFER_AFTER_MS, lock_free)
            )
        )
    broadcast = or_(m.c.queue.like("%.pidbox"), m.c.queue.like("celeryev.%"))
    done["broadcasts_dropped"] = _count(
        conn.execute(
            delete(m).where(
                broadcast,
                m.c.state == "ready",
                m.c.task_id.is_(None),
                m.c.created_at_ms < now - BROADCAST_TTL_MS,
            )
        )
    )
    return done


#: Rows of one kind deleted per statement by the retention deletes below: each statement is
#: short, so it never holds locks that delay claims for long; the rest go at the next pass.
PRUNE_BATCH = 10_000


def _retained(conn: Connection, t: Tables, horizon: int) -> dict[str, int]:
    """What no expiry removes: dead messages (failed, exhausted, cancelled, undecodable),
    and the FAILURE and REVOKED results that sqlease writes without an expiry (cancel,
    revoke, exhausted, undecodable), once older than ``horizon``."""
    m, r = t.messages, t.results
    dead = select(m.c.id).where(m.c.state == "dead", m.c.created_at_ms < horizon)
    unexpiring = select(r.c.key).where(
        r.c.expires_at_ms.is_(None),
        r.c.state.in_(("FAILURE", "REVOKED")),
        r.c.updated_at_ms < horizon,
    )
    return {
        "dead_messages_expired": _count(
            conn.execute(delete(m).where(m.c.id.in_(dead.limit(PRUNE_BATCH).scalar_subquery())))
        ),
        "unexpiring_results_expired": _count(
            conn.execute(
                delete(r).where(r.c.key.in_(unexpiring.limit(PRUNE_BATCH).scalar_subquery()))
            )
        ),
    }


def _history(conn: Connection, t: Tables, horizon: int, store: Store) -> dict[str, int]:
    """Dead messages and unexpiring results older than ``horizon`` (``_retained``), then the
    events, task records, steps and answers older than it whose task has no message left."""
    retained = _retained(conn, t, horizon)
    m, ev, steps, tasks, w = t.messages, t.events, t.steps, t.tasks, t.waits
    still_active = exists().where(m.c.task_id == ev.c.task_id)
    # A batch event (PostgreSQL) stays while any task it lists is still queued.
    lists_active = (
        exists().where(m.c.task_id == any_(ev.c.task_ids))
        if store.driver.caps.batch_events
        else false()
    )
    events = delete(ev).where(
        ev.c.at_ms < horizon,
        or_(
            and_(ev.c.task_id.is_(None), ev.c.task_ids.is_(None)),
            and_(ev.c.task_id.isnot(None), not_(still_active)),
            and_(ev.c.task_ids.isnot(None), not_(lists_active)),
        ),
    )
    task_active = exists().where(m.c.task_id == tasks.c.task_id)
    old_steps = delete(steps).where(
        or_(
            steps.c.finished_at_ms < horizon,
            and_(steps.c.finished_at_ms.is_(None), steps.c.started_at_ms < horizon),
        ),
        not_(exists().where(m.c.task_id == steps.c.task_id)),
    )
    return {
        **retained,
        "events_expired": _count(conn.execute(events)),
        "task_records_expired": _count(
            conn.execute(delete(tasks).where(tasks.c.updated_at_ms < horizon, not_(task_active)))
        ),
        "steps_expired": _count(conn.execute(old_steps)),
        "answers_expired": _count(
            conn.execute(
                delete(w).where(and_(w.c.status == "answered", w.c.answered_at_ms < horizon))
            )
        ),
    }


class MaintenanceThread:
    """Runs the pass every ``interval`` seconds in this process, when it holds the lock."""

    def __init__(
        self, store: Store, owner: str, *, interval: float, event_retention_ms: int
    ) -> None:
        self.store = store
        self.owner = owner
        self.interval = interval
        self.event_retention_ms = event_retention_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqlease-maintenance", daemon=True)

    def start(self) -> MaintenanceThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.run_once()

    def run_once(self) -> dict[str, Any] | None:
        # On SQLite the whole pass is one section a fork waits for (sqlease._db.sqlite.fork_guard):
        # its statements run on this thread while the worker may fork a new pool process.
        with self.store.fork_section():
            return self._run_once()

    def _run_once(self) -> dict[str, Any] | None:
        try:
            now = self.store.now_ms()
            lease_ms = int(self.interval * 1000 * 2)
            if not acquire(self.store, self.owner, lease_ms, now):
                return None
            summary = run_pass(self.store, event_retention_ms=self.event_retention_ms, now=now)
        except Exception:
            logger.warning("sqlease maintenance pass failed; will try again", exc_info=True)
            return None
        done = {k: v for k, v in summary.items() if v}
        if done:
            logger.info(
                "sqlease maintenance: %s", ", ".join(f"{k}={v}" for k, v in sorted(done.items()))
            )
        return summary
