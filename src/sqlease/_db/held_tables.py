"""Held work's table, indexes and repair reads (migrations 12 and 13): the run order row that an
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
    at_gate = (messages.c.state == "parked") & (messages.c.reason == "gate")
    at_rate = (messages.c.state == "ready") & (messages.c.reason == "rate")
    return [
        Index(
            f"{prefix}messages_run_wait_ix",
            messages.c.run_id,
            messages.c.id,
            postgresql_where=parked,
            sqlite_where=parked,
        ),
        # The messages parked at a full gate, by gate in the order the gate lets them go
        # (migration 13): a promotion reads the first few of one gate.
        Index(
            f"{prefix}messages_gate_wait_ix",
            messages.c.gate,
            messages.c.priority.desc(),
            messages.c.available_at_ms,
            messages.c.id,
            postgresql_where=at_gate,
            sqlite_where=at_gate,
        ),
        # The messages a sweep gave the due time their rate limit lets them through
        # (migration 13): the last of a rate is where the next ones queue behind.
        Index(
            f"{prefix}messages_rate_wait_ix",
            messages.c.rate_gate,
            messages.c.available_at_ms,
            postgresql_where=at_rate,
            sqlite_where=at_rate,
        ),
    ]


def parked_gates(messages: str) -> TextClause:
    """The gates that have messages parked at them (the maintenance pass promotes those with
    room: none, unless a promotion was lost): a skip scan of their index, one probe per
    gate, however many wait at each."""
    m = messages
    return text(
        f"WITH RECURSIVE g(gate) AS (SELECT min(gate) FROM {m} WHERE state = 'parked' "
        f"AND reason = 'gate' UNION ALL SELECT (SELECT min(x.gate) FROM {m} x "
        "WHERE x.state = 'parked' AND x.reason = 'gate' AND x.gate > g.gate) "
        "FROM g WHERE g.gate IS NOT NULL) SELECT gate FROM g WHERE gate IS NOT NULL"
    )


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
