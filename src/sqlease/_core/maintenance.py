"""The maintenance pass: every worker runs it periodically, one worker at a time (a named
lease in ``<prefix>locks``), and ``sqlease maintain`` runs it once.

It expires results, idle auto-delete queues and, by retention, old events, task records,
steps, waits, dead messages and the results sqlease writes without an expiry
(``sqlease._core.retention``), marks steps whose delivery died
mid-step as ``outcome_unknown``, clears leases and run locks left on parked or finished
messages, drops broadcast copies (remote control, events) that nobody consumed within their
TTL, drops the handoff offers of killed workers (PostgreSQL), and logs a summary.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import Connection, delete, exists, not_, or_, select, update

from sqlease._core import exhausted_results, retention
from sqlease._core.flow_events import record_waits
from sqlease._core.store import Store

logger = logging.getLogger(__name__)

LOCK_NAME = "maintenance"
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
    with store.driver.writing() as conn:
        got = conn.execute(stmt).scalar()
    return got == owner


def release(store: Store, owner: str) -> bool:
    """Gives the lock up, if ``owner`` holds it, so that another worker's next pass runs
    without waiting out this one's lease. True if it was held."""
    locks = store.tables.locks
    stmt = delete(locks).where(locks.c.name == LOCK_NAME, locks.c.owner == owner)
    with store.driver.writing() as conn:
        return bool(conn.execute(stmt).rowcount)


def run_pass(
    store: Store,
    *,
    event_retention_ms: int,
    dead_retention_ms: int | None = None,
    now: int | None = None,
) -> dict[str, int]:
    """One maintenance pass; returns what it did, by kind. Each part runs in short
    transactions of its own (the retention deletes batch by batch, see
    ``sqlease._core.retention``), so that none holds locks a claim waits for.
    ``dead_retention_ms`` (default: ``event_retention_ms``) keeps dead messages and the
    results sqlease writes without an expiry."""
    now = store.now_ms() if now is None else now
    with store.driver.writing() as conn:
        summary = {"steps_outcome_unknown": _interrupted_steps(conn, store, now)}
    summary.update(_leftovers(store, now))
    with store.driver.writing() as conn:
        summary["waiting_for_limit"] = record_waits(conn, store, now)
    summary["exhausted_results_written"] = exhausted_results.write_missing(store)
    summary.update(_runs(store, now))
    summary.update(
        retention.prune(
            store,
            now,
            event_retention_ms=event_retention_ms,
            dead_retention_ms=(
                event_retention_ms if dead_retention_ms is None else dead_retention_ms
            ),
        )
    )
    return summary


def _runs(store: Store, now: int) -> dict[str, int]:
    """Repair: a run whose head waits parked behind its run (a promotion lost, a database
    migrated while older workers ran) goes on, and so do messages parked at a gate that has
    room (a process died between an ack and its promotion, a lease expired on a message
    whose attempts were spent); the order rows of runs with no message left
    go, a batch per pass."""
    t = store.tables
    m, ro = t.messages, t.run_order
    with store.driver.reading() as conn:
        stuck = [r.run_id for r in conn.execute(store.sql.stuck_runs)]
    promoted = store.promote_runs(stuck, now=now) if stuck else []
    with store.driver.reading() as conn:
        gates = [r.gate for r in conn.execute(store.sql.parked_gates)]
    at_gates = store.promote_gates(gates, now=now) if gates else []
    member = exists().where(m.c.run_id == ro.c.run_id, m.c.state.in_(("ready", "parked")))
    empty = select(ro.c.run_id).where(not_(member)).limit(retention.PRUNE_BATCH)
    with store.driver.writing() as conn:
        gone = _count(conn.execute(delete(ro).where(ro.c.run_id.in_(empty.scalar_subquery()))))
    return {
        "runs_promoted": len(promoted),
        "run_order_rows_removed": gone,
        "gates_promoted": len(at_gates),
    }


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
        select(steps.c.task_id, steps.c.name, steps.c.message_id, steps.c.attempt)
        .where(steps.c.status == "started", not_(live_lease))
        .limit(retention.PRUNE_BATCH)
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
        store.timeline.on(
            conn,
            row.task_id,
            None,
            "outcome_unknown",
            {"step": row.name, "attempt": row.attempt},
            now,
        )
    return len(interrupted)


def broadcast_queues(conn: Connection, store: Store) -> list[str]:
    """The remote-control and event queues (read whole: the queues table is bounded by the
    idle expiry of such queues)."""
    q = store.tables.queues
    found = conn.execute(
        select(q.c.name).where(or_(q.c.name.like("%.pidbox"), q.c.name.like("celeryev.%")))
    ).scalars()
    return list(found)


def leftover_statements(store: Store, now: int, broadcast_names: list[str]) -> dict[str, Any]:
    """The leftovers' statements (see ``_leftovers``), by the summary key they count in;
    ``broadcast_names`` from ``broadcast_queues``."""
    t = store.tables
    m, runs = t.messages, t.runs
    # runs holds one row per run being delivered (bounded by the live leases) and is
    # renewed by every heartbeat: it has no index on the expiry, so its renewals stay HOT.
    holder_alive = exists().where(m.c.id == runs.c.message_id, m.c.state == "ready")
    run_locks = delete(runs).where(runs.c.lease_expires_at_ms <= now, not_(holder_alive))
    # The broadcast queues are named first (``broadcast_queues``), so that their old copies
    # are found through the claim index by queue, a batch at a time.
    old_copies = select(m.c.id).where(
        m.c.queue.in_(sorted(broadcast_names)),
        m.c.state == "ready",
        m.c.task_id.is_(None),
        m.c.created_at_ms < now - BROADCAST_TTL_MS,
    )
    broadcasts = delete(m).where(
        store.driver.one_of(m.c.id, old_copies.limit(retention.PRUNE_BATCH))
    )
    found: dict[str, Any] = {
        "run_locks_pruned": run_locks,
        "broadcasts_dropped": broadcasts,
        # Gate slots whose lease expired (PostgreSQL's; a claim reuses them anyway).
        "gate_slots_pruned": delete(t.slots).where(t.slots.c.lease_expires_at_ms <= now),
    }
    # What only the dialect writes or leaves (PostgreSQL: dead workers' handoff offers;
    # SQLite: leases left on rows that are no longer ready).
    found.update(store.driver.leftovers(now))
    return found


def _leftovers(store: Store, now: int) -> dict[str, int]:
    """Leases on finished messages, run locks whose holder is gone, dead workers' offers,
    remote-control and event broadcasts nobody reads any more: each in a transaction of its
    own."""
    done: dict[str, int] = {}
    with store.driver.reading() as conn:
        names = broadcast_queues(conn, store)
    for kind, statement in leftover_statements(store, now, names).items():
        if kind == "broadcasts_dropped":
            done[kind] = retention.Batches(store).run_all([statement]) if names else 0
            continue
        with store.driver.writing() as conn:
            done[kind] = _count(conn.execute(statement))
    return done


class MaintenanceThread:
    """Runs the pass every ``interval`` seconds in this process, when it holds the lock."""

    def __init__(
        self,
        store: Store,
        owner: str,
        *,
        interval: float,
        event_retention_ms: int,
        dead_retention_ms: int | None = None,
    ) -> None:
        self.store = store
        self.owner = owner
        self.interval = interval
        self.event_retention_ms = event_retention_ms
        self.dead_retention_ms = dead_retention_ms
        self._stop = threading.Event()
        # Held for a whole pass: stop() must not give the lock up under a pass still running.
        self._pass_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sqlease-maintenance", daemon=True)

    def start(self) -> MaintenanceThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more passes. The lock is given up now, unless a pass is running: then the
        thread gives it up when that pass ends (stop() never waits for a pass)."""
        self._stop.set()
        if self._pass_lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._pass_lock.release()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.run_once()
        with self._pass_lock:
            self._release()

    def _release(self) -> None:
        try:
            release(self.store, self.owner)
        except Exception:  # the lease runs out on its own
            logger.debug("sqlease maintenance: could not give the lock up", exc_info=True)

    def run_once(self) -> dict[str, Any] | None:
        # On SQLite the whole pass is one section a fork waits for (sqlease._db.sqlite.fork_guard):
        # its statements run on this thread while the worker may fork a new pool process.
        with self._pass_lock, self.store.fork_section():
            if self._stop.is_set():
                return None
            return self._run_once()

    def _run_once(self) -> dict[str, Any] | None:
        try:
            now = self.store.now_ms()
            lease_ms = int(self.interval * 1000 * 2)
            if not acquire(self.store, self.owner, lease_ms, now):
                return None
            summary = run_pass(
                self.store,
                event_retention_ms=self.event_retention_ms,
                dead_retention_ms=self.dead_retention_ms,
                now=now,
            )
        except Exception:
            logger.warning("sqlease maintenance pass failed; will try again", exc_info=True)
            return None
        done = {k: v for k, v in summary.items() if v}
        if done:
            logger.info(
                "sqlease maintenance: %s", ", ".join(f"{k}={v}" for k, v in sorted(done.items()))
            )
        return summary
