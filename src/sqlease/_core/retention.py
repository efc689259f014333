"""The retention deletes of the maintenance pass: what no lease or expiry removes by itself.

Every delete names the rows it takes by their key in a subquery with a LIMIT (PRUNE_BATCH),
found through an index (migration 7; tests/store/test_retention_plans.py checks the plans on
PostgreSQL), and runs in a transaction of its own: a batch holds its row locks (and, on
SQLite, the write lock) for a few milliseconds, never for the whole pass. Batches follow one
another until a short one says the kind is done, or the pass's time budget is spent (the
rest goes at the next pass).

Lifetimes (docs/explanation/table-lifetimes.md):

- dead messages (failed, rejected, exhausted, cancelled, undecodable) and the FAILURE and
  REVOKED results sqlease writes without an expiry: ``dead_retention_ms`` after they were
  made;
- events, task records (with their checkpoints), steps and waits: ``event_retention_ms``
  after they were made, once their task has no message left;
- uniqueness keys, once they no longer hold, and duplicates: ``event_retention_ms`` after
  they were taken (a key with a period: after the period);
- queues declared auto_delete, exclusive or with ``x-expires``: ``expires_ms`` after their
  last declaration or consumer's touch, with their bindings and ready messages;
- results and chord counters with an expiry: at it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Connection, Delete, and_, delete, exists, or_, select

from sqlease._core.store import Store
from sqlease._db.tables import Tables

#: Rows of one kind deleted per statement. 1,000 rows take a few milliseconds on either
#: database, so a batch never delays a claim for longer than that.
PRUNE_BATCH = 1_000
#: Idle queues forgotten per transaction (each takes its bindings and messages with it).
QUEUE_BATCH = 100
#: Seconds one pass may spend on retention deletes before leaving the rest to the next.
PASS_BUDGET_S = 10.0


class Batches:
    """Runs delete statements batch by batch within one pass's time budget."""

    def __init__(self, store: Store, budget_s: float = PASS_BUDGET_S) -> None:
        self.store = store
        self.deadline = time.monotonic() + budget_s

    def run(self, build: Callable[[], Delete], batch: int = PRUNE_BATCH) -> int:
        """Run ``build()`` (a delete of at most ``batch`` rows) until it deletes fewer."""
        total = 0
        while True:
            with self.store.driver.writing() as conn:
                done = int(conn.execute(build()).rowcount or 0)
            total += done
            if done < batch or time.monotonic() >= self.deadline:
                return total

    def run_all(self, statements: Iterable[Delete]) -> int:
        """Run each of these fixed delete statements batch by batch."""
        return sum(self.run(_fixed(statement)) for statement in statements)

    def each(self, step: Callable[[Connection], int], batch: int) -> int:
        """Run ``step`` (which handles at most ``batch`` items) until it handles fewer."""
        total = 0
        while True:
            with self.store.driver.writing() as conn:
                done = step(conn)
            total += done
            if done < batch or time.monotonic() >= self.deadline:
                return total


def _fixed(statement: Delete) -> Callable[[], Delete]:
    return lambda: statement


OneOf = Callable[[Any, Any], Any]
#: The driver's deletes of old batch events (``Driver.batch_event_deletes``).
BatchEvents = Callable[[Any, int], dict[str, Delete]]


def _in_batch(one_of: OneOf, key: Any, query: Any) -> Any:
    """``key`` among the first PRUNE_BATCH keys of ``query``: the rows one batch deletes
    (``Driver.one_of``: on PostgreSQL an array looked up through the key's index)."""
    return one_of(key, query.limit(PRUNE_BATCH))


def expired_results(t: Tables, now: int, one_of: OneOf) -> list[Callable[[], Delete]]:
    """Results and chord counters past their expiry."""
    r, c = t.results, t.counters
    return [
        lambda: delete(r).where(
            _in_batch(one_of, r.c.key, select(r.c.key).where(r.c.expires_at_ms <= now))
        ),
        lambda: delete(c).where(
            _in_batch(one_of, c.c.key, select(c.c.key).where(c.c.expires_at_ms <= now))
        ),
    ]


def dead_messages(t: Tables, horizon: int, one_of: OneOf) -> Delete:
    m = t.messages
    old = select(m.c.id).where(m.c.state == "dead", m.c.created_at_ms < horizon)
    return delete(m).where(_in_batch(one_of, m.c.id, old))


def unexpiring_results(t: Tables, horizon: int, one_of: OneOf) -> Delete:
    """The FAILURE and REVOKED results sqlease writes without an expiry (cancel, revoke,
    exhausted, undecodable); a user's own results without an expiry stay."""
    r = t.results
    old = select(r.c.key).where(
        r.c.expires_at_ms.is_(None),
        r.c.updated_at_ms < horizon,
        r.c.state.in_(("FAILURE", "REVOKED")),
    )
    return delete(r).where(_in_batch(one_of, r.c.key, old))


def old_events(
    t: Tables, horizon: int, one_of: OneOf, batch_events: BatchEvents
) -> dict[str, Delete]:
    """Old events, in separate statements (one OR of them would read every message into a
    hash): of no task, of a task with no message left, and (``batch_events``: the driver's,
    where it writes batch rows) batch events none of whose tasks is still queued."""
    m, ev = t.messages, t.events
    old = select(ev.c.id).where(ev.c.at_ms < horizon)
    found = {
        "events_untasked": delete(ev).where(
            _in_batch(one_of, ev.c.id, old.where(ev.c.task_id.is_(None), ev.c.task_ids.is_(None)))
        ),
        "events": delete(ev).where(
            _in_batch(
                one_of,
                ev.c.id,
                old.where(ev.c.task_id.isnot(None), ~exists().where(m.c.task_id == ev.c.task_id)),
            )
        ),
    }
    found.update(batch_events(old, PRUNE_BATCH))
    return found


def old_task_records(t: Tables, horizon: int, one_of: OneOf) -> Delete:
    """Task records (and their checkpoints) made and last changed before ``horizon``, of
    tasks with no message left."""
    m, tasks = t.messages, t.tasks
    old = select(tasks.c.task_id).where(
        tasks.c.created_at_ms < horizon,
        tasks.c.updated_at_ms < horizon,
        ~exists().where(m.c.task_id == tasks.c.task_id),
    )
    return delete(tasks).where(_in_batch(one_of, tasks.c.task_id, old))


def old_steps(t: Tables, horizon: int, one_of: OneOf) -> Delete:
    """Steps started (and finished, if they did) before ``horizon``, of tasks with no
    message left: taken by task, so the batch is found through the primary key's first
    column, the condition repeated for the task's other steps."""
    m, steps = t.messages, t.steps
    # A step finishes after it starts: started before the horizon covers both cases.
    condition = and_(
        steps.c.started_at_ms < horizon,
        or_(steps.c.finished_at_ms.is_(None), steps.c.finished_at_ms < horizon),
        ~exists().where(m.c.task_id == steps.c.task_id),
    )
    old = select(steps.c.task_id).where(condition)
    return delete(steps).where(_in_batch(one_of, steps.c.task_id, old), condition)


def old_waits(t: Tables, horizon: int, one_of: OneOf) -> dict[str, Delete]:
    """Answered waits, and waits whose task has no message left (cancelled, purged),
    made before ``horizon``; by task, as steps."""
    m, w = t.messages, t.waits
    answered = and_(
        w.c.created_at_ms < horizon, w.c.status == "answered", w.c.answered_at_ms < horizon
    )
    orphaned = and_(w.c.created_at_ms < horizon, ~exists().where(m.c.task_id == w.c.task_id))
    return {
        name: delete(w).where(
            _in_batch(one_of, w.c.task_id, select(w.c.task_id).where(condition)), condition
        )
        for name, condition in (("waits_answered", answered), ("waits", orphaned))
    }


def old_uniques(t: Tables, horizon: int, one_of: OneOf) -> dict[str, Delete]:
    """Uniqueness keys taken (scope ``period``: run out) before ``horizon`` that no longer
    hold: a period past, or a task with no live message left; and the duplicates recorded
    before ``horizon``."""
    m, u, d = t.messages, t.uniques, t.duplicates
    live = exists().where(m.c.task_id == u.c.task_id, m.c.state != "dead")
    gone = and_(u.c.until_ms < horizon, or_(u.c.scope == "period", ~live))
    return {
        "uniques": delete(u).where(_in_batch(one_of, u.c.key, select(u.c.key).where(gone))),
        "duplicates": delete(d).where(
            _in_batch(one_of, d.c.task_id, select(d.c.task_id).where(d.c.created_at_ms < horizon))
        ),
    }


def expire_idle_queues(store: Store, conn: Connection, now: int) -> int:
    """Forget up to QUEUE_BATCH queues whose idle expiry has passed: each queue row goes
    only if its expiry is still past (a consumer's touch since makes the delete miss), and
    then its bindings and ready, unleased messages go with it."""
    q = store.tables.queues
    names = conn.execute(
        select(q.c.name)
        .where(q.c.expires_at_ms < now)
        .order_by(q.c.expires_at_ms)
        .limit(QUEUE_BATCH)
    ).scalars()
    gone = 0
    sql = store.sql
    for name in list(names):
        row = conn.execute(
            delete(q).where(q.c.name == name, q.c.expires_at_ms < now).returning(q.c.name)
        ).first()
        if row is None:
            continue
        conn.execute(sql.delete_queue_bindings, {"queue": name})
        conn.execute(sql.delete_queue_messages, {"queue": name, "now": now})
        gone += 1
    return gone


def prune(
    store: Store,
    now: int,
    *,
    event_retention_ms: int,
    dead_retention_ms: int,
    budget_s: float = PASS_BUDGET_S,
) -> dict[str, int]:
    """Every retention delete, batch by batch; what went, by kind. A retention of 0 keeps
    that kind forever."""
    t = store.tables
    one_of = store.driver.one_of
    batches = Batches(store, budget_s)
    done = {"results_expired": sum(batches.run(build) for build in expired_results(t, now, one_of))}
    done["idle_queues_expired"] = batches.each(
        lambda conn: expire_idle_queues(store, conn, now), QUEUE_BATCH
    )
    if dead_retention_ms > 0:
        dead = now - dead_retention_ms
        done["dead_messages_expired"] = batches.run(lambda: dead_messages(t, dead, one_of))
        done["unexpiring_results_expired"] = batches.run(
            lambda: unexpiring_results(t, dead, one_of)
        )
    if event_retention_ms > 0:
        horizon = now - event_retention_ms
        events = old_events(t, horizon, one_of, store.driver.batch_event_deletes)
        done["events_expired"] = batches.run_all(events.values())
        done["task_records_expired"] = batches.run(lambda: old_task_records(t, horizon, one_of))
        done["steps_expired"] = batches.run(lambda: old_steps(t, horizon, one_of))
        waits = old_waits(t, horizon, one_of)
        done["answers_expired"] = batches.run_all(waits.values())
        done["uniques_expired"] = batches.run_all(old_uniques(t, horizon, one_of).values())
    return done


def statements(store: Store, now: int) -> dict[str, Delete]:
    """Every retention delete as a pass builds it (for tests that read their plans)."""
    t, one_of = store.tables, store.driver.one_of
    results, counters = (build() for build in expired_results(t, now, one_of))
    return {
        "results_expired": results,
        "counters_expired": counters,
        "dead_messages": dead_messages(t, now, one_of),
        "unexpiring_results": unexpiring_results(t, now, one_of),
        **old_events(t, now, one_of, store.driver.batch_event_deletes),
        "task_records": old_task_records(t, now, one_of),
        "steps": old_steps(t, now, one_of),
        **old_waits(t, now, one_of),
        **old_uniques(t, now, one_of),
    }
