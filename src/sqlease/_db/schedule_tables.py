"""The periodic-task tables (migration 6): the entries and the beat's leader lease."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    true,
)


def schedule_tables(md: MetaData, p: str) -> tuple[Table, Table]:
    """Periodic tasks (migration 6): the entries and the beat's leader lease."""
    schedules = Table(
        f"{p}schedules",
        md,
        Column("name", Text, primary_key=True),
        Column("task", Text, nullable=False),
        # The Celery schedule as JSON: {"kind": "interval" | "crontab" | "solar", ...}.
        Column("schedule", Text, nullable=False),
        Column("args", Text, nullable=False, server_default="[]"),
        Column("kwargs", Text, nullable=False, server_default="{}"),
        Column("options", Text, nullable=False, server_default="{}"),
        Column("enabled", Boolean, nullable=False, server_default=true()),
        Column("catch_up", Text, nullable=False, server_default="once"),
        Column("catch_up_limit", Integer, nullable=False, server_default="100"),
        # 'config': from beat_schedule (a sync may change or remove it); 'runtime': added
        # through Admin or the CLI (a sync keeps it).
        Column("source", Text, nullable=False),
        Column("config_digest", Text),
        # The next slot; NULL while the leader has yet to compute it (in the app's timezone)
        # after an add or a change of the schedule.
        Column("next_run_at_ms", BigInteger),
        # A "run now" request, fired by the leader at its next tick.
        Column("run_requested_at_ms", BigInteger),
        Column("last_run_at_ms", BigInteger),
        Column("last_task_id", Text),
        Column("total_run_count", BigInteger, nullable=False, server_default="0"),
        # Bumped by every edit: a fire compares it, so it never sends what an edit replaced.
        Column("revision", BigInteger, nullable=False, server_default="0"),
        Column("created_at_ms", BigInteger, nullable=False),
        Column("updated_at_ms", BigInteger, nullable=False),
        CheckConstraint("catch_up IN ('skip', 'once', 'all')", name="catch_up"),
        CheckConstraint("source IN ('config', 'runtime')", name="source"),
    )
    # The leader's tick reads only what is due: O(entries due), not O(entries).
    Index(f"{p}schedules_due_ix", schedules.c.enabled, schedules.c.next_run_at_ms)
    Index(f"{p}schedules_requested_ix", schedules.c.run_requested_at_ms)
    # One row per leader lease; ``term`` grows at every takeover and fences the leader's
    # writes as ``attempt`` fences a task's.
    leaders = Table(
        f"{p}leaders",
        md,
        Column("name", Text, primary_key=True),
        Column("owner", Text, nullable=False),
        Column("term", BigInteger, nullable=False),
        Column("expires_at_ms", BigInteger, nullable=False),
        Column("acquired_at_ms", BigInteger, nullable=False),
        # JSON the leader publishes: its app's task names and timezone, its host.
        Column("info", Text),
    )
    return schedules, leaders
