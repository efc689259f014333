"""PostgreSQL's storage parameters for the hot tables (migration 7): how much room each page
keeps for in-place updates, and when and how fast autovacuum cleans each table.

The reasons, table by table, are in docs/explanation/table-lifetimes.md. Every value is a
per-table override of the server's default; an operator may change any of them later with
``ALTER TABLE … SET (…)`` (the migration does not run again).
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from sqlease._db.tables import Tables

#: Per short table name: ``(parameter, value)``. Values are text as PostgreSQL prints them.
TABLE_SETTINGS: dict[str, tuple[tuple[str, str], ...]] = {
    # Every task is one insert, one or more claims (HOT updates, see MESSAGES_FILLFACTOR) and
    # one delete: the dead row versions outnumber the live rows many times over. Vacuum
    # after 1% of the live rows (not 20%: with a backlog of a million rows that is 200,000
    # dead versions in the claim index's way), at full speed (cost delay 0: the pages are
    # in memory and the table is the one every claim reads), and analyze after 2% so that
    # the planner sees a backlog grow or drain.
    "messages": (
        ("autovacuum_vacuum_scale_factor", "0.01"),
        ("autovacuum_vacuum_threshold", "1000"),
        ("autovacuum_analyze_scale_factor", "0.02"),
        ("autovacuum_vacuum_cost_delay", "0"),
    ),
    # One run lock per run being delivered, renewed by every heartbeat: room on each page
    # keeps the renewals HOT (no index covers the renewed column), and the table small.
    "runs": (
        ("fillfactor", "70"),
        ("autovacuum_vacuum_scale_factor", "0.05"),
        ("autovacuum_vacuum_cost_delay", "0"),
    ),
    # Appended to by every claim and ack, deleted from in batches by the retention: vacuum
    # after 5% instead of 20% so that the space a prune frees is reused before the table
    # grows, and (PostgreSQL 13 or later) after 5% of inserts so that new pages are marked
    # all-visible early.
    "events": (
        ("autovacuum_vacuum_scale_factor", "0.05"),
        ("autovacuum_vacuum_insert_scale_factor", "0.05"),
    ),
    # One row per task result, rewritten by each state (STARTED, then the outcome) and
    # deleted at its expiry: room for the rewrite on the page, vacuum after 5%.
    "results": (
        ("fillfactor", "80"),
        ("autovacuum_vacuum_scale_factor", "0.05"),
    ),
    # Task records: rewritten by each checkpoint and state change.
    "tasks": (
        ("fillfactor", "80"),
        ("autovacuum_vacuum_scale_factor", "0.05"),
    ),
    # A handful of rows, one per idle worker and queue, refreshed every idle look.
    "offers": (
        ("fillfactor", "50"),
        ("autovacuum_vacuum_cost_delay", "0"),
    ),
}

#: Parameters the server must be this new (server_version_num) to know.
MINIMUM_VERSION = {"autovacuum_vacuum_insert_scale_factor": 130000}


def apply(conn: Connection, tables: Tables) -> None:
    """Set TABLE_SETTINGS on ``tables`` (the parameters this server knows)."""
    version = int(conn.execute(text("SHOW server_version_num")).scalar_one())
    for short, settings in TABLE_SETTINGS.items():
        known = [(k, v) for k, v in settings if version >= MINIMUM_VERSION.get(k, 0)]
        if known:
            params = ", ".join(f"{k} = {v}" for k, v in known)
            conn.execute(text(f"ALTER TABLE {tables.name(short)} SET ({params})"))
