"""PostgreSQL: a batch of schedule slots fired in one statement (``ScheduleFires``).

The fires arrive as one JSON array (``json_to_recordset``): one statement text whatever the
batch's size, no bind-parameter limit to size it by, and one string to send (psycopg dumps a
text array escaping every element through a regular expression: slower than the statement
itself for a batch of 1,000 messages). Data-modifying CTEs do the rest, as the publish does:
the compare-and-set of every entry (``won``: only the rows whose revision and slot still
hold), then for those only the messages, their task rows, the events in the order a fire
writes them one by one (``fired``, ``enqueued``, ``sent_by_schedule``), and one notification
per queue."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, TextClause, text

from sqlease._db import sql_common as c
from sqlease._db import task_rows
from sqlease._db.postgresql.dialect import NOW
from sqlease._db.schedules import FIRE_FIELDS, PreparedFire
from sqlease._db.tables import Tables

#: The SQL type of each field of a fire.
_TYPES = {
    "name": "TEXT",
    "revision": "BIGINT",
    "slot": "BIGINT",
    "next": "BIGINT",
    "task_id": "TEXT",
    "queue": "TEXT",
    "payload": "TEXT",
    "priority": "SMALLINT",
    "max_attempts": "INTEGER",
    "task_name": "TEXT",
    "group_id": "TEXT",
    "fired": "TEXT",
    "sent": "TEXT",
    "ord": "INTEGER",
}


def fire_statement(t: Tables, timeline_prefix: str) -> TextClause:
    columns = ", ".join(f"{f} {_TYPES[f]}" for f in (*FIRE_FIELDS, "fired", "ord"))
    won_cols = ", ".join(f"v.{f}" for f in (*FIRE_FIELDS, "fired") if f not in ("revision", "next"))
    return text(
        "WITH v AS (SELECT * FROM json_to_recordset(CAST(:fires AS json)) "
        f"AS v({columns})), "
        f"won AS (UPDATE {t.schedules.name} s SET next_run_at_ms = v.next, "
        "last_run_at_ms = v.slot, last_task_id = v.task_id, "
        "total_run_count = s.total_run_count + 1 FROM v "
        "WHERE s.name = v.name AND s.revision = v.revision AND s.next_run_at_ms = v.slot "
        f"RETURNING {won_cols}, v.ord), "
        f"ins AS (INSERT INTO {t.messages.name} ({c.INSERT_COLS}) "
        f"SELECT queue, payload, priority, {NOW}, {NOW}, NULL, task_id, 'ready', 0, "
        "max_attempts, task_name, NULL, NULL FROM won ORDER BY ord "
        "RETURNING id, task_id, queue), "
        # The events in the order a fire writes them one by one, fire after fire: every
        # ``fired`` (entry timelines), then every ``enqueued`` and ``sent_by_schedule`` (a
        # task's timeline: those two in that order). No join of ``ins`` to ``won``: its
        # planner knows neither's size, and a nested loop of 1,000 by 1,000 cost 0.4 s.
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT x.task_id, x.message_id, x.attempt, x.kind, x.data, {NOW} FROM ("
        f"SELECT '{timeline_prefix}' || name AS task_id, CAST(NULL AS BIGINT) AS message_id, "
        "CAST(NULL AS INTEGER) AS attempt, 'fired' AS kind, fired AS data, 0 AS step, "
        "CAST(ord AS BIGINT) AS pos FROM won UNION ALL "
        "SELECT task_id, id, 0, 'enqueued', NULL, 1, id FROM ins UNION ALL "
        "SELECT task_id, NULL, NULL, 'sent_by_schedule', sent, 2, ord FROM won"
        ") x ORDER BY x.step, x.pos), "
        f"k AS (INSERT INTO {t.tasks.name} ({task_rows.COLS}) "
        "SELECT task_id, task_name, queue, 0, NULL, NULL, '{}', 0, "
        f"{NOW}, {NOW}, group_id FROM won {task_rows.on_conflict(t)}), "
        "n AS (SELECT count(pg_notify(CAST(:channel AS TEXT), q)) AS woken "
        "FROM (SELECT DISTINCT queue AS q FROM ins) d) "
        "SELECT won.name FROM won CROSS JOIN n"
    )


@dataclass(frozen=True, slots=True)
class PgFire:
    name: str
    #: The fire as a JSON object, open at its end (``fired`` and ``ord`` follow).
    head: str


class PgScheduleFires:
    """``sqlease._db.schedules.ScheduleFires`` on PostgreSQL: one statement per batch."""

    def __init__(self, t: Tables, timeline_prefix: str, channel: str) -> None:
        self._fire = fire_statement(t, timeline_prefix)
        self._channel = channel

    def prepare(self, fire: Mapping[str, Any]) -> PgFire:
        head = json.dumps({f: fire[f] for f in FIRE_FIELDS}, separators=(",", ":"))
        return PgFire(fire["name"], head[:-1])

    def fire(
        self, conn: Connection, fires: Sequence[tuple[PreparedFire, str]], now: int | None
    ) -> list[str]:
        if not fires:
            return []
        items = []
        for i, (prepared, fired) in enumerate(fires):
            assert isinstance(prepared, PgFire)
            items.append(f'{prepared.head},"fired":{json.dumps(fired)},"ord":{i}}}')
        params = {"fires": f"[{','.join(items)}]", "now": now, "channel": self._channel}
        return [row[0] for row in conn.execute(self._fire, params)]

    def statements(self) -> dict[str, TextClause]:
        return {"fire": self._fire}
