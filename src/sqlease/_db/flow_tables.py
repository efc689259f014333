"""Flow control's columns and tables: a message's concurrency gate, the slots that hold gates
on PostgreSQL, and the configured limits per task name and per queue (migration 8); unique
tasks' keys and the duplicates they turned away (migration 10)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
)


def message_columns() -> list[Column[object]]:
    """The messages' flow-control columns, all NULL for a message without limits."""
    return [
        # The Celery task name (the ``task`` header): per-task limits are looked up by it.
        Column("task_name", Text),
        # The message's own concurrency key and limit (the ``concurrency_key`` and
        # ``concurrency_limit`` headers); both or neither.
        Column("gate_key", Text),
        Column("gate_limit", Integer),
        # The gate the current (or last) lease was claimed under: ``key:<key>``,
        # ``task:<name>`` or ``queue:<name>``. A key's running count is the live leases
        # with that gate.
        Column("gate", Text),
        # The rate limit the current (or last) lease was claimed under.
        Column("rate_gate", Text),
    ]


def message_indexes(messages: Table, prefix: str) -> list[Index]:
    """The running count of a gate reads only that gate's rows.

    SQLite counts a gate's live leases from the messages: its index holds the expiry.
    PostgreSQL counts them in the slots and reads here only a gate's ready rows; its index
    names no column a claim or a renewal writes (the lease's owner and expiry, the attempt),
    so that those updates are HOT: no new entry in any index of the messages (migration 14).
    """
    gated = messages.c.gate.isnot(None)
    return [
        Index(
            f"{prefix}messages_gate_ix",
            messages.c.gate,
            messages.c.lease_expires_at_ms,
            sqlite_where=gated,
        ).ddl_if(dialect="sqlite"),
        Index(
            f"{prefix}messages_gate_ready_ix",
            messages.c.gate,
            postgresql_where=gated & (messages.c.state == "ready"),
        ).ddl_if(dialect="postgresql"),
    ]


def flow_tables(md: MetaData, p: str) -> tuple[Table, Table]:
    """``slots``: on PostgreSQL, one row per held place of a gate (``slot`` from 0 to the
    limit - 1), the row lock that concurrent claimers serialise on, as the runs table does for
    a run; a slot whose lease expired is free. ``flow_limits``: the limits per task name
    (``task:<name>``), per queue (``queue:<name>``) and per key (``key:<key>``, rates only)
    that workers write from their transport options."""
    slots = Table(
        f"{p}slots",
        md,
        Column("gate", Text, nullable=False),
        Column("slot", Integer, nullable=False),
        # The gate's limit when the slot was taken: a claim finds the full gates by it.
        Column("lim", Integer, nullable=False),
        Column("message_id", BigInteger, nullable=False),
        Column("attempt", Integer, nullable=False),
        Column("lease_owner", Text),
        Column("lease_expires_at_ms", BigInteger, nullable=False),
        PrimaryKeyConstraint("gate", "slot"),
    )
    Index(f"{p}slots_message_ix", slots.c.message_id)
    flow_limits = Table(
        f"{p}flow_limits",
        md,
        Column("name", Text, primary_key=True),
        # At most this many deliveries at once (NULL: no concurrency limit).
        Column("concurrency", Integer),
        # A rate limit as a generic cell rate algorithm: one delivery per ``interval_ms``,
        # ``tau_ms`` of burst tolerance, ``tat_ms`` the theoretical arrival time of the next
        # (NULL: no rate limit).
        Column("interval_ms", BigInteger),
        Column("tau_ms", BigInteger),
        Column("tat_ms", BigInteger),
        Column("rate", Text),
        Column("updated_at_ms", BigInteger, nullable=False),
    )
    return slots, flow_limits


def unique_tables(md: MetaData, p: str) -> tuple[Table, Table]:
    """``uniques``: one row per uniqueness key, naming the task that holds it. Whether it
    still holds is read from that task's messages (scopes ``queued`` and ``active``) or from
    ``until_ms`` (scope ``period``), so no ack, claim or transition has to touch it; a
    publish of the key locks the row, so two publishes of one key are decided one after the
    other. ``duplicates``: each publish turned away, by its own task id, naming the original
    (the result backend answers for a duplicate with the original's result)."""
    uniques = Table(
        f"{p}uniques",
        md,
        Column("key", Text, primary_key=True),
        Column("task_id", Text),
        # ``queued``, ``active`` or ``period``: how long the key holds after the publish.
        Column("scope", Text, nullable=False),
        # Scope ``period``: the key holds until then. Otherwise the publish's time: the row
        # may go once its task has no message left (retention, by this index).
        Column("until_ms", BigInteger, nullable=False),
        Column("created_at_ms", BigInteger, nullable=False),
        # Publishes turned away since the key was taken.
        Column("duplicates", Integer, nullable=False, server_default="0"),
    )
    Index(f"{p}uniques_until_ix", uniques.c.until_ms)
    duplicates = Table(
        f"{p}duplicates",
        md,
        Column("task_id", Text, primary_key=True),
        Column("original_id", Text),
        Column("unique_key", Text, nullable=False),
        Column("created_at_ms", BigInteger, nullable=False),
    )
    Index(f"{p}duplicates_created_ix", duplicates.c.created_at_ms)
    return uniques, duplicates
