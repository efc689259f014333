"""SQLite: its statements (one module per aggregate, its constants in ``dialect.py``), its
driver (``driver.py``, the operations, with the bases it inherits: ``lease_ops.py``, the lease
operations, and ``bookkeeping.py``, the writes beside their statements) and what the driver
runs on (``direct.py``, the kept sqlite3 connections; ``engine.py``; ``watcher.py``;
``checkpoints.py``; ``fork_guard.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause

from sqlease._db import sql_common as c
from sqlease._db import task_rows, topology_sql
from sqlease._db.held_tables import parked_gates, stuck_runs
from sqlease._db.leaders import leader_statements
from sqlease._db.sqlite import events, gates, held, leases, messages
from sqlease._db.sqlite.dialect import GREATEST, NOW, ROW_PREFIX
from sqlease._db.statements import Statements
from sqlease._db.tables import Tables
from sqlease._db.unique_sql import unique_statements

__all__ = ["SqliteStatements", "statements"]


@dataclass(frozen=True)
class SqliteStatements(Statements):
    """Every statement of the SQLite driver. SQLite has no data-modifying CTEs: the run locks,
    task rows, rate limits and events a PostgreSQL statement writes inside itself are
    statements of their own here, run by the driver in the same transaction."""

    enqueue: TextClause
    #: Publish a batch's plain messages in one statement (``message_publish_batch``).
    enqueue_batch: TextClause
    take: TextClause
    claim: TextClause
    claim_single: TextClause
    #: the run locks of a claim
    claim_runs: TextClause
    #: the rate limits a claim let deliveries through, advanced
    rate_take: TextClause
    renew: TextClause
    #: a renewed lease's run lock
    renew_runs: TextClause
    ack: TextClause
    #: Release, park or fail fenced deliveries.
    transition: TextClause
    #: a published task's row (sqlease._db.task_rows)
    task_publish: TextClause
    #: The runs' order rows, then their heads made ready if parked (``run_promote``).
    bump_runs: TextClause
    promote_runs: TextClause
    #: A sweep's park of the messages at a full gate, and a gate's promotion.
    park_find: TextClause
    park_set: TextClause
    gate_limit: TextClause
    promote_gate: TextClause
    #: A sweep's due times for the messages a rate limit holds, and their release.
    project_find: TextClause
    project_set: TextClause
    release_rates: TextClause


def statements(t: Tables) -> SqliteStatements:
    """Every statement for the tables ``t``, built once."""
    return SqliteStatements(
        size=c.size(t, NOW),
        purge=c.purge(t, NOW),
        requeue=c.requeue(t, NOW),
        next_due=messages.next_due(t),
        message_get=c.message_get(t),
        published_since=c.published_since(t, NOW),
        leased_to_owner=c.leased_to_owner(t),
        now=c.now_query(NOW),
        lease_check=c.lease_check(t, NOW, greatest=GREATEST, row_prefix=ROW_PREFIX),
        run_lease=c.run_lease(t),
        release_run=c.release_run(t),
        held_predicate=c.held(NOW),
        task_ensure=c.task_ensure(t, NOW),
        task_cas=c.task_cas(t, NOW),
        task_get=c.task_get(t),
        event_insert=c.event_insert(t, NOW),
        events_for_task=events.events_for_task(t),
        events_for_message=events.events_for_message(t),
        deliveries_of_tasks=events.deliveries_of_tasks(t),
        bind=topology_sql.bind(t),
        unbind=topology_sql.unbind(t),
        bindings_for=topology_sql.bindings_for(t),
        declare_exchange=topology_sql.declare_exchange(t),
        exchange_type=topology_sql.exchange_type(t),
        delete_exchange=topology_sql.delete_exchange(t),
        delete_exchange_bindings=topology_sql.delete_exchange_bindings(t),
        declare_queue=topology_sql.declare_queue(t, NOW),
        has_queue=topology_sql.has_queue(t),
        delete_queue=topology_sql.delete_queue(t),
        delete_queue_bindings=topology_sql.delete_queue_bindings(t),
        delete_queue_messages=topology_sql.delete_queue_messages(t, NOW),
        stuck_runs=stuck_runs(t.messages.name),
        parked_gates=parked_gates(t.messages.name),
        gates_of=gates.gates_of(t),
        # One writer holds the whole file from the publish's first write: no row lock needed.
        unique=unique_statements(t, row_locks=False),
        leaders=leader_statements(t, NOW, GREATEST),
        enqueue=messages.enqueue(t),
        enqueue_batch=messages.enqueue_batch(t),
        take=messages.take(t),
        claim=leases.claim(t, single_queue=False),
        claim_single=leases.claim(t, single_queue=True),
        claim_runs=leases.claim_runs(t),
        rate_take=leases.rate_take(t),
        renew=leases.renew(t),
        renew_runs=c.run_lease(t),
        ack=leases.ack(t),
        transition=leases.transition(t),
        task_publish=task_rows.publish(t, NOW),
        bump_runs=held.bump_runs(t),
        promote_runs=held.promote_runs(t),
        park_find=gates.park_find(t),
        park_set=gates.park_set(t),
        gate_limit=gates.gate_limit(t),
        promote_gate=gates.promote(t),
        project_find=gates.project_find(t),
        project_set=gates.project_set(t),
        release_rates=gates.release_rates(t),
    )
