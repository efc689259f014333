"""The tables: SQLAlchemy Core objects built per ``table_prefix``, the single source of truth
for the DDL (migrations create them, see ``sqlease._db.migrations``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    false,
)

from sqlease._db.flow_tables import flow_tables, message_columns, message_indexes, unique_tables
from sqlease._db.held_tables import held_indexes, held_tables
from sqlease._db.schedule_tables import schedule_tables
from sqlease._db.schema_indexes import batch_events_index
from sqlease._db.topology_tables import topology_tables
from sqlease.errors import ConfigurationError

_PREFIX_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")

# A BIGINT on PostgreSQL; on SQLite an INTEGER PRIMARY KEY (the rowid) with AUTOINCREMENT so
# that an id is never handed out twice, even after the highest row is deleted: a reused id
# would let a stale (id, attempt) fence match a different message.
_Id = BigInteger().with_variant(Integer(), "sqlite")

# PostgreSQL arrays; on SQLite, where batch events are not written, plain (always NULL) text.
_TextArray = Text().with_variant(ARRAY(Text), "postgresql")
_BigIntArray = Text().with_variant(ARRAY(BigInteger), "postgresql")
_IntArray = Text().with_variant(ARRAY(Integer), "postgresql")

MESSAGE_STATES = ("ready", "parked", "dead")
#: PostgreSQL: percent of each messages page filled by inserts (see migration 2).
MESSAGES_FILLFACTOR = 50


def validate_prefix(prefix: str) -> str:
    """The prefix as the tables are named: in lower case. SQL folds unquoted names to lower
    case on PostgreSQL and ignores their case on SQLite, and a statement may name a table
    either way; ``Shop_`` and ``shop_`` are the same tables, as SQLite always had them."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ConfigurationError(
            f"table_prefix {prefix!r} is not usable: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 41 characters"
        )
    return prefix.lower()


@dataclass(frozen=True)
class Tables:
    prefix: str
    metadata: MetaData
    schema_version: Table
    messages: Table
    runs: Table
    tasks: Table
    events: Table
    bindings: Table
    queues: Table
    results: Table
    counters: Table
    steps: Table
    waits: Table
    locks: Table
    offers: Table
    schedules: Table
    leaders: Table
    slots: Table
    flow_limits: Table
    uniques: Table
    duplicates: Table
    run_order: Table
    exchanges: Table

    def name(self, short: str) -> str:
        return f"{self.prefix}{short}"


def build_tables(prefix: str = "sqlease_") -> Tables:
    p = validate_prefix(prefix)
    md = MetaData(
        naming_convention={
            "ix": "%(table_name)s_%(column_0_N_name)s_ix",
            "pk": "%(table_name)s_pk",
            "ck": "%(table_name)s_%(constraint_name)s_ck",
        }
    )
    schema_version = Table(
        f"{p}schema_version",
        md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("version", Integer, nullable=False),
    )
    messages = Table(
        f"{p}messages",
        md,
        Column("id", _Id, primary_key=True, autoincrement=True),
        Column("queue", Text, nullable=False),
        Column("payload", Text, nullable=False),
        Column("priority", SmallInteger, nullable=False, server_default="0"),
        Column("available_at_ms", BigInteger, nullable=False),
        Column("created_at_ms", BigInteger, nullable=False),
        Column("run_id", Text),
        Column("task_id", Text),
        Column("state", Text, nullable=False, server_default="ready"),
        Column("reason", Text),
        Column("lease_owner", Text),
        Column("lease_expires_at_ms", BigInteger),
        Column("attempt", Integer, nullable=False, server_default="0"),
        Column("max_attempts", Integer, nullable=False),
        Column("last_error", Text),
        *message_columns(),
        CheckConstraint("state IN ('ready', 'parked', 'dead')", name="state"),
        CheckConstraint("max_attempts >= 1", name="max_attempts"),
        sqlite_autoincrement=True,
        # Room on every page, so that a claim (which changes no indexed column) is a HOT
        # update: the new row version stays on its page and no index gets a new entry.
        postgresql_with={"fillfactor": MESSAGES_FILLFACTOR},
    )
    # The claim path: ready rows by queue in delivery order. Partial, so parked and dead rows
    # never slow it down (acked rows are deleted).
    Index(
        f"{p}messages_claim_ix",
        messages.c.queue,
        messages.c.priority.desc(),
        messages.c.available_at_ms,
        messages.c.id,
        postgresql_where=messages.c.state == "ready",
        sqlite_where=messages.c.state == "ready",
    )
    # The head of a run: the lowest id among its unfinished messages.
    Index(
        f"{p}messages_run_ix",
        messages.c.run_id,
        messages.c.id,
        postgresql_where=messages.c.run_id.isnot(None),
        sqlite_where=messages.c.run_id.isnot(None),
    )
    Index(f"{p}messages_task_ix", messages.c.task_id)
    Index(
        f"{p}messages_inactive_ix",
        messages.c.state,
        messages.c.queue,
        postgresql_where=messages.c.state != "ready",
        sqlite_where=messages.c.state != "ready",
    )
    # Retention (migration 7): dead messages by age. On created_at_ms, which no update
    # changes, and partial, so ready rows (the hot ones) never enter it.
    Index(
        f"{p}messages_dead_ix",
        messages.c.created_at_ms,
        postgresql_where=messages.c.state == "dead",
        sqlite_where=messages.c.state == "dead",
    )
    # Migration 7: leases left on rows that are no longer ready (SQLite's maintenance pass
    # clears them). Normally empty: it holds exactly the rows that statement changes. Not on
    # PostgreSQL, where an index naming the lease's owner would keep every claim from being
    # a HOT update; nothing leaves a lease on a row it parks there (migration 14).
    Index(
        f"{p}messages_stray_ix",
        messages.c.id,
        sqlite_where=(messages.c.state != "ready") & messages.c.lease_owner.isnot(None),
    ).ddl_if(dialect="sqlite")
    # One row per run whose head is (or was) leased: the per-run lock that concurrent
    # claimers serialise on (a NOT EXISTS read alone lets two transactions both pass).
    runs = Table(
        f"{p}runs",
        md,
        Column("run_id", Text, primary_key=True),
        Column("message_id", BigInteger, nullable=False),
        Column("attempt", Integer, nullable=False),
        Column("lease_owner", Text),
        Column("lease_expires_at_ms", BigInteger, nullable=False),
    )
    tasks = Table(
        f"{p}tasks",
        md,
        Column("task_id", Text, primary_key=True),
        Column("state", Text),
        Column("reason", Text),
        Column("checkpoint", Text, nullable=False, server_default="{}"),
        Column("revision", BigInteger, nullable=False, server_default="0"),
        Column("run_id", Text),
        Column("created_at_ms", BigInteger, nullable=False),
        Column("updated_at_ms", BigInteger, nullable=False),
        # Migration 9: what a person asks of a finished task, written by the publish and the
        # claim statements themselves (sqlease._db.task_rows), kept after the ack deletes the
        # message: the Celery task name, its queue and the latest delivery's attempt.
        Column("task_name", Text),
        Column("queue", Text),
        Column("attempt", Integer, nullable=False, server_default="0"),
        # Migration 10: the Celery group the task was published in (its ``group`` header):
        # a group's members are found by it, after their messages are gone too.
        Column("group_id", Text),
    )
    Index(
        f"{p}tasks_group_ix",
        tasks.c.group_id,
        postgresql_where=tasks.c.group_id.isnot(None),
        sqlite_where=tasks.c.group_id.isnot(None),
    )
    # Retention (migration 7): old task records by creation time, which no update changes
    # (an index on updated_at_ms would make every checkpoint write a non-HOT update).
    Index(f"{p}tasks_created_ix", tasks.c.created_at_ms)
    events = Table(
        f"{p}events",
        md,
        Column("id", _Id, primary_key=True, autoincrement=True),
        Column("task_id", Text),
        Column("message_id", BigInteger),
        Column("attempt", Integer),
        Column("kind", Text, nullable=False),
        Column("data", Text),
        Column("at_ms", BigInteger, nullable=False),
        # A batch event (PostgreSQL, migration 3): one ``claimed`` or ``acked`` row for all
        # the messages of one claim or ack statement, listed position by position. task_id,
        # message_id and attempt are NULL on such a row. ``Store.events`` expands it.
        Column("task_ids", _TextArray),
        Column("message_ids", _BigIntArray),
        Column("attempts", _IntArray),
        # Its task ids' hashes (migration 11), which its index is over (TASK_KEY_MASK).
        Column("task_keys", _IntArray),
        sqlite_autoincrement=True,
    )
    Index(f"{p}events_task_ix", events.c.task_id, events.c.id)
    # Retention (migration 7): old events are found by time, not by a scan of the table.
    Index(f"{p}events_at_ix", events.c.at_ms)
    Index(f"{p}events_message_ix", events.c.message_id, events.c.id)
    batch_events_index(events)
    bindings, queues, exchanges = topology_tables(md, p)
    # Celery results (the result backend's key/value space), each written under the lease of
    # the delivery that produced it when fenced.
    results = Table(
        f"{p}results",
        md,
        Column("key", Text, primary_key=True),
        Column("value", LargeBinary, nullable=False),
        Column("state", Text),
        Column("task_id", Text),
        Column("message_id", BigInteger),
        Column("attempt", Integer),
        Column("expires_at_ms", BigInteger),
        Column("updated_at_ms", BigInteger, nullable=False),
    )
    Index(f"{p}results_message_ix", results.c.message_id)
    Index(f"{p}results_expires_ix", results.c.expires_at_ms)
    Index(f"{p}results_task_ix", results.c.task_id)
    # Retention (migration 7): the results nothing expires, by age.
    Index(
        f"{p}results_unexpiring_ix",
        results.c.updated_at_ms,
        postgresql_where=results.c.expires_at_ms.is_(None),
        sqlite_where=results.c.expires_at_ms.is_(None),
    )
    counters = Table(
        f"{p}counters",
        md,
        Column("key", Text, primary_key=True),
        Column("value", BigInteger, nullable=False),
        Column("expires_at_ms", BigInteger),
    )
    Index(f"{p}counters_expires_ix", counters.c.expires_at_ms)
    # Durable steps: one row per (task, step name); "started" with no outcome after a crash
    # means the side effect may or may not have happened.
    steps = Table(
        f"{p}steps",
        md,
        Column("task_id", Text, nullable=False),
        Column("name", Text, nullable=False),
        Column("status", Text, nullable=False),
        Column("result", Text),
        Column("error", Text),
        Column("message_id", BigInteger),
        Column("attempt", Integer),
        Column("started_at_ms", BigInteger, nullable=False),
        Column("finished_at_ms", BigInteger),
        PrimaryKeyConstraint("task_id", "name"),
        CheckConstraint(
            "status IN ('started', 'succeeded', 'failed', 'outcome_unknown')", name="status"
        ),
    )
    # Migration 7: old steps by age (retention), and the steps still open (the maintenance
    # pass looks for those whose delivery died).
    Index(f"{p}steps_started_ix", steps.c.started_at_ms)
    Index(
        f"{p}steps_open_ix",
        steps.c.message_id,
        steps.c.attempt,
        postgresql_where=steps.c.status == "started",
        sqlite_where=steps.c.status == "started",
    )
    # A task waiting for a person: one row per (task, key); the answer is kept so that the
    # delivery after it (which runs the task again from its checkpoint) finds it.
    waits = Table(
        f"{p}waits",
        md,
        Column("task_id", Text, nullable=False),
        Column("key", Text, nullable=False),
        Column("kind", Text, nullable=False),
        Column("request", Text),
        Column("status", Text, nullable=False),
        Column("answer", Text),
        Column("created_at_ms", BigInteger, nullable=False),
        Column("answered_at_ms", BigInteger),
        PrimaryKeyConstraint("task_id", "key"),
        CheckConstraint("kind IN ('input', 'approval')", name="kind"),
        CheckConstraint("status IN ('waiting', 'answered')", name="status"),
    )
    # Retention (migration 7): old waits by creation time.
    Index(f"{p}waits_created_ix", waits.c.created_at_ms)
    # Named leases for singletons such as the maintenance pass (one worker at a time).
    locks = Table(
        f"{p}locks",
        md,
        Column("name", Text, primary_key=True),
        Column("owner", Text, nullable=False),
        Column("expires_at_ms", BigInteger, nullable=False),
    )
    # Idle workers' standing offers to take a queue's next message (PostgreSQL, migration 4):
    # a publish that finds a live offer for its queue leases the message to that worker in
    # the same statement and hands it over with the notification, so no claim round trip
    # stands between the publish and the task's start. One-shot: the publish marks it
    # ``handed`` (migration 5), and only its worker, once it has read that handoff's
    # notification (``offer_seq``, a fresh number from OFFERS_SEQUENCE at every write that
    # makes the offer live), can make it live again. A refresh sent before the worker heard
    # of the handoff would otherwise offer a worker that is no longer idle.
    offers = Table(
        f"{p}offers",
        md,
        Column("owner", Text, nullable=False),
        Column("queue", Text, nullable=False),
        Column("lease_ms", BigInteger, nullable=False),
        # The advisory lock the offering worker's listening connection holds while it lives.
        Column("lock_key", BigInteger, nullable=False),
        Column("expires_at_ms", BigInteger, nullable=False),
        Column("offer_seq", BigInteger, nullable=False, server_default="0"),
        Column("handed", Boolean, nullable=False, server_default=false()),
        PrimaryKeyConstraint("owner", "queue"),
    )
    # On the queue alone: an offer's refresh (a new expiry) is then a HOT update that leaves
    # the index untouched, so the table stays small without vacuum.
    Index(f"{p}offers_queue_ix", offers.c.queue)
    schedules, leaders = schedule_tables(md, p)
    message_indexes(messages, p)
    held_indexes(messages, p)
    run_order = held_tables(md, p)
    slots, flow_limits = flow_tables(md, p)
    uniques, duplicates = unique_tables(md, p)
    return Tables(
        p,
        md,
        schema_version,
        messages,
        runs,
        tasks,
        events,
        bindings,
        queues,
        results,
        counters,
        steps,
        waits,
        locks,
        offers,
        schedules,
        leaders,
        slots,
        flow_limits,
        uniques,
        duplicates,
        run_order,
        exchanges,
    )


def offers_sequence(tables: Tables) -> str:
    """The sequence whose numbers tell one live incarnation of an offer from another."""
    return tables.name("offers_seq")
