"""PostgreSQL's fragments of SQL text, and what it can do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlease._db.schema_indexes import task_key
from sqlease._db.statements import Capabilities
from sqlease._db.tables import Tables

if TYPE_CHECKING:
    from sqlease._db.postgresql.pooler import Pooling
    from sqlease.types import Fence


def capabilities(pooling: Pooling) -> Capabilities:
    """Behind a pooler in transaction mode without a ``listen_url``, nothing can LISTEN: no
    notifications reach idle clients, and no offer can stand (its liveness is the listening
    connection's advisory lock)."""
    listens = not pooling.transaction or pooling.listen_url is not None
    return Capabilities(offers=listens, notifications=listens, single_writer=False)


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
#: A claim's batch event: its owner and its mark (``:claim``), by which a try whose answer was
#: lost is found again (sqlease._db.postgresql.lost_claims).
JSON_CLAIM = "json_build_object('owner', CAST(:owner AS TEXT), 'claim', CAST(:claim AS TEXT))::text"
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


#: PostgreSQL: events younger than this are left for the next call. An event's id is taken
#: when it is written, and a transaction that commits later than a newer event's would be
#: passed over for good; no publish, claim or ack statement stays open this long (a publish
#: inside an application's own transaction could: see docs/reference/metrics.md). Under
#: SQLite's single writer ids become visible in order, so there is no wait.
EVENT_SETTLE_MS = 10_000

#: A handoff offer this long past its expiry whose worker's listening connection is gone (its
#: advisory lock free) belongs to a worker that was killed: nobody will withdraw it.
DEAD_OFFER_AFTER_MS = 60_000


def fence_params(fences: Sequence[Fence]) -> dict[str, Any]:
    """A batch of fences bound as the statements' ``:ids`` and ``:attempts``."""
    # Arrays (unnest), sorted by id so that concurrent batches tend to lock rows in one
    # order (fewer deadlocks). Bound as array literals, which FENCES casts: psycopg binds a
    # Python list through its list dumper, whose type inspection cost the draining worker's
    # loop about 8 us per statement (a sixth of binding an ack + claim's parameters).
    ordered = sorted(fences, key=lambda f: f.message_id)
    return {
        "ids": "{" + ",".join(str(int(f.message_id)) for f in ordered) + "}",
        "attempts": "{" + ",".join(str(int(f.attempt)) for f in ordered) + "}",
    }
