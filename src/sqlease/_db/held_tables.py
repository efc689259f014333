"""Held work's table, index and repair read (migration 12): the run order row that an
enqueue into a run and the statement that frees a run's place both write, the index that
finds the messages parked behind their run, and the maintenance pass's read of the runs whose
head waits there.

A message of a run whose earlier messages are unfinished is inserted ``parked`` with reason
``run``: outside the claim index, so a claim never steps over it, with its id and so its
place in the run kept. Whatever finishes a run's head (ack, reject, exhaustion, cancel,
purge) makes the next one ready in its own statement. On PostgreSQL an enqueue and such a
statement can run at once, each in a snapshot that misses the other; both write the run's
row here (a version number), which serializes them and tells each whether the other
committed after its snapshot was taken (sqlease._db.postgresql.held)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, MetaData, Table, Text, TextClause, text


def held_tables(md: MetaData, p: str) -> Table:
    """``run_order``: one row per run that has had a message enqueued (removed by the
    maintenance pass once the run has none left)."""
    return Table(
        f"{p}run_order",
        md,
        Column("run_id", Text, primary_key=True),
        Column("version", BigInteger, nullable=False, server_default="0"),
    )


def held_indexes(messages: Table, prefix: str) -> list[Index]:
    """The messages parked behind their run, by run: the maintenance pass's repair finds
    the runs whose head waits there (none, unless a promotion was lost) without reading
    the ready rows."""
    parked = (messages.c.state == "parked") & (messages.c.reason == "run")
    return [
        Index(
            f"{prefix}messages_run_wait_ix",
            messages.c.run_id,
            messages.c.id,
            postgresql_where=parked,
            sqlite_where=parked,
        )
    ]


def stuck_runs(messages: str) -> TextClause:
    """The runs whose head (lowest unfinished message) waits parked behind its run: none
    unless a promotion was lost. From the index of the parked messages and, per run, one
    probe of the run index."""
    m = messages  # the messages table's name
    return text(
        f"SELECT w.run_id FROM (SELECT run_id, min(id) AS first FROM {m} "
        "WHERE state = 'parked' AND reason = 'run' GROUP BY run_id) w "
        f"WHERE NOT EXISTS (SELECT 1 FROM {m} h WHERE h.run_id = w.run_id AND h.id < w.first "
        "AND h.state IN ('ready', 'parked'))"
    )
