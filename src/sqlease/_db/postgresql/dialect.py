"""PostgreSQL's fragments of SQL text and what it can do in one statement."""

from __future__ import annotations

from sqlease._db.schema_indexes import task_key
from sqlease._db.statements import Capabilities
from sqlease._db.tables import Tables

CAPABILITIES = Capabilities(
    one_statement=True,
    offers=True,
    notifications=True,
    batch_events=True,
    single_writer=False,
)

#: The statement's clock in epoch milliseconds, unless ``:now`` is bound.
#: statement_timestamp() is stable within a statement, so every comparison in one claim sees
#: the same instant.
NOW = (
    "COALESCE(CAST(:now AS BIGINT), "
    "CAST(floor(EXTRACT(EPOCH FROM statement_timestamp()) * 1000) AS BIGINT))"
)
GREATEST = "GREATEST"
#: The fences as rows ``(id, attempt)``. Arrays, not JSON: the planner then knows the batch
#: is small and looks rows up by primary key instead of scanning the ready rows.
FENCES = (
    "SELECT * FROM unnest(CAST(:ids AS BIGINT[]), CAST(:attempts AS INTEGER[])) AS f(id, attempt)"
)
JSON_OWNER = "json_build_object('owner', CAST(:owner AS TEXT))::text"
#: RETURNING in a statement that joins qualifies the message's columns.
ROW_PREFIX = "m."


def one_of_ids(column: str, ids: str) -> str:
    """``column`` is one of the ids the SELECT ``ids`` returns, as an array of them: looked up
    through the column's index whatever the tables' statistics. With a join or ``IN``, a
    generic plan (which estimates ``LIMIT :limit`` at a tenth of the rows) joined them to a
    sequential scan of the table once autovacuum had analyzed 5,000-50,000 messages (a claim
    of one at 40,000: 12.1 ms instead of 0.7; ``tests/store/test_generic_plans.py``). The
    driver's ``one_of`` is the same for SQLAlchemy constructs."""
    return f"{column} = ANY(ARRAY({ids}))"


def each_queue(per_queue: str) -> str:
    """``per_queue`` (which reads ``qn.name``) for each distinct queue of ``:queues``, as rows
    ``x``. A queue equality reads the claim index in order; one scan with
    ``queue = ANY(...)`` sorted every ready row of the queues instead, and a generic plan of it
    scanned the table."""
    return (
        "(SELECT DISTINCT name FROM unnest(CAST(:queues AS TEXT[])) AS u(name)) qn "
        f"CROSS JOIN LATERAL ({per_queue}) x"
    )


def batch_event(t: Tables, kind: str, data: str, source: str, where: str) -> str:
    """One event row for all the messages of ``source`` (as ``m``) one statement claimed or
    acked, listed in id order (no row when there are none). Per-message rows cost about a
    third of a claim's and an ack's server time and most of their WAL; ``Store.events()``
    expands the batch back into one event per message."""
    return (
        f"INSERT INTO {t.events.name} "
        "(kind, data, at_ms, task_ids, message_ids, attempts, task_keys) "
        f"SELECT '{kind}', {data}, {NOW}, array_agg(m.task_id ORDER BY m.id), "
        "array_agg(m.id ORDER BY m.id), array_agg(m.attempt ORDER BY m.id), "
        f"array_agg(DISTINCT {task_key('m.task_id')}) FILTER (WHERE m.task_id IS NOT NULL) "
        f"FROM {source} m WHERE {where} HAVING count(*) > 0"
    )
