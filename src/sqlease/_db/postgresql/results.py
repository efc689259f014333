"""PostgreSQL: a task result's write, one statement (SQLite runs the lease check and the upsert
in one transaction instead, through SQLAlchemy's expressions in ``sqlease._core.results``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.ops import ResultWrite
from sqlease._db.postgresql.dialect import NOW
from sqlease._db.postgresql.offers import offer_writes
from sqlease._db.tables import Tables, offers_sequence

_COLS = "key, value, state, task_id, message_id, attempt, expires_at_ms, updated_at_ms"


def _holder_offer(t: Tables) -> str:
    """CTEs ``rr``, ``ro``: the holder's next handoff offer (``:offer_*`` parameters),
    written only if the lease held (the worker is alive and the task over)."""
    return (
        offer_writes(
            t.offers.name,
            offers_sequence(t),
            NOW,
            revive="refresh",
            params="offer_",
            only_if="EXISTS (SELECT 1 FROM h)",
            names=("rr", "ro"),
        )
        + ", "
    )


def result_put(t: Tables, *, offer: bool) -> TextClause:
    """The lease check (``lease_check``) as a row-locking UPDATE (only when ``:fenced``), the upsert
    only if it held (and, with ``:keep_success``, never over a stored SUCCESS), and the
    waiters' notification: with the value when it was stored, by key alone when a stored
    SUCCESS was kept; only if a client waits (the try of ``:waiters_key`` fails, see
    sqlease._core.waiters; NULL: always).

    ``offer``: the final result of a delivery its worker took while idle carries that
    worker's next handoff offer, so it stands before the client even wakes and the client's
    next publish is handed over (the worker's ack would put it back a round trip later)."""
    return text(
        f"WITH h AS (UPDATE {t.messages.name} AS m SET lease_expires_at_ms = "
        "m.lease_expires_at_ms WHERE CAST(:fenced AS BOOLEAN) AND m.id = :message_id "
        f"AND m.attempt = :attempt AND {c.held(NOW)} "
        "AND (CAST(:task_id AS TEXT) IS NULL OR m.task_id IS NULL "
        "OR m.task_id = CAST(:task_id AS TEXT)) RETURNING m.id), "
        f"up AS (INSERT INTO {t.results.name} AS r ({_COLS}) "
        "SELECT CAST(:key AS TEXT), :value, CAST(:state AS TEXT), "
        "CAST(:task_id AS TEXT), CAST(:message_id AS BIGINT), "
        "CAST(:attempt AS INTEGER), CAST(:expires_at_ms AS BIGINT), "
        "CAST(:updated_at_ms AS BIGINT) "
        "WHERE NOT CAST(:fenced AS BOOLEAN) OR EXISTS (SELECT 1 FROM h) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
        "state = excluded.state, task_id = excluded.task_id, "
        "message_id = excluded.message_id, attempt = excluded.attempt, "
        "expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms "
        "WHERE NOT CAST(:keep_success AS BOOLEAN) "
        "OR r.state IS DISTINCT FROM 'SUCCESS' RETURNING 1), "
        f"{_holder_offer(t) if offer else ''}"
        "n AS (SELECT pg_notify(CAST(:channel AS TEXT), CASE WHEN EXISTS "
        "(SELECT 1 FROM up) THEN CAST(:payload AS TEXT) ELSE CAST(:key AS TEXT) END) "
        "WHERE (NOT CAST(:fenced AS BOOLEAN) OR EXISTS (SELECT 1 FROM h)) "
        "AND (CAST(:waiters_key AS BIGINT) IS NULL "
        "OR NOT pg_try_advisory_xact_lock(CAST(:waiters_key AS BIGINT)))) "
        "SELECT EXISTS (SELECT 1 FROM h) AS held, "
        "(SELECT count(*) FROM up) + 0 * (SELECT count(*) FROM n) AS stored"
    )


#: PostgreSQL refuses NOTIFY payloads of 8000 bytes or more; a result that fits travels with
#: its notification, a larger one is read back by the waiting client.
NOTIFY_LIMIT = 7900


def result_params(write: ResultWrite) -> dict[str, Any]:
    """``result_put``'s parameters. The payload carries the value when it fits, so a waiting
    client need not read it back."""
    row, fence = write.row, write.fence
    payload = row["key"]
    try:
        text_value = row["value"].decode("utf-8")
    except UnicodeDecodeError:
        text_value = None
    if text_value is not None and "\x00" not in text_value:
        candidate = f"{row['key']}\n{text_value}"
        if len(candidate.encode("utf-8")) < NOTIFY_LIMIT:
            payload = candidate
    params = dict(
        row,
        channel=write.channel,
        waiters_key=write.waiters_key,
        payload=payload,
        fenced=fence is not None,
        owner=None if fence is None else fence.owner,
        keep_success=write.keep_success,
        now=write.now,
    )
    if write.offer is not None and fence is not None:
        params.update(write.offer)
    return params
