"""SQLite: a batch of schedule slots fired with four statements (``ScheduleFires``).

The fires arrive as one JSON array (``json_each``): one statement text whatever the batch's
size, and no bind-parameter limit to size it by. The compare-and-set of every entry first
(``UPDATE … FROM``, returning the entries whose revision and slot still hold), then for those
only: their messages, their events in the order a fire writes them one by one (``fired``,
``enqueued``, ``sent_by_schedule``) and their task rows, all under the one write lock the
leader's transaction holds. Workers see the commit as they see any other (the file changed)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, TextClause, text

from sqlease._db import sql_common as c
from sqlease._db import task_rows
from sqlease._db.schedules import FIRE_FIELDS, PreparedFire
from sqlease._db.sqlite.dialect import NOW
from sqlease._db.tables import Tables


def _field(name: str) -> str:
    return f"value ->> '$.{name}'"


def fire_statements(t: Tables) -> dict[str, TextClause]:
    s = t.schedules.name
    fires = "FROM json_each(:fires)"
    return {
        "claim": text(
            f"UPDATE {s} SET next_run_at_ms = v.next, last_run_at_ms = v.slot, "
            "last_task_id = v.task_id, total_run_count = total_run_count + 1 "
            f"FROM (SELECT {_field('name')} AS name, {_field('revision')} AS revision, "
            f"{_field('slot')} AS slot, {_field('next')} AS next, "
            f"{_field('task_id')} AS task_id {fires}) AS v "
            f"WHERE {s}.name = v.name AND {s}.revision = v.revision "
            f"AND {s}.next_run_at_ms = v.slot RETURNING name"
        ),
        "messages": text(
            f"INSERT INTO {t.messages.name} ({c.INSERT_COLS}) "
            f"SELECT {_field('queue')}, {_field('payload')}, {_field('priority')}, {NOW}, "
            f"{NOW}, NULL, {_field('task_id')}, 'ready', 0, {_field('max_attempts')}, "
            f"{_field('task_name')}, NULL, NULL {fires} ORDER BY key RETURNING id, task_id"
        ),
        "events": text(
            f"INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
            f"SELECT {_field('task_id')}, {_field('message_id')}, {_field('attempt')}, "
            f"{_field('kind')}, {_field('data')}, {NOW} FROM json_each(:events) ORDER BY key"
        ),
        "tasks": text(
            f"INSERT INTO {t.tasks.name} ({task_rows.COLS}) "
            f"SELECT {_field('task_id')}, {_field('task_name')}, {_field('queue')}, 0, NULL, "
            f"NULL, '{{}}', 0, {NOW}, {NOW}, {_field('group_id')} {fires} WHERE true "
            f"{task_rows.on_conflict(t)}"
        ),
    }


@dataclass(frozen=True, slots=True)
class SqliteFire:
    name: str
    task_id: str
    #: The entry's timeline and the task id, as JSON strings.
    timeline_json: str
    task_id_json: str
    #: What the compare-and-set reads, as a JSON object.
    claim: str
    #: The fire as a JSON object (what the message and the task row read).
    whole: str
    #: The ``sent_by_schedule`` event, as a JSON object.
    sent: str


class SqliteScheduleFires:
    """``sqlease._db.schedules.ScheduleFires`` on SQLite: four statements per batch."""

    def __init__(self, t: Tables, timeline_prefix: str) -> None:
        self._sql = fire_statements(t)
        self._timeline_prefix = timeline_prefix

    def prepare(self, fire: Mapping[str, Any]) -> SqliteFire:
        claim = {f: fire[f] for f in ("name", "revision", "slot", "next", "task_id")}
        sent = _event(fire["task_id"], None, None, "sent_by_schedule", fire["sent"])
        return SqliteFire(
            fire["name"],
            fire["task_id"],
            json.dumps(self._timeline_prefix + fire["name"]),
            json.dumps(fire["task_id"]),
            _json(claim),
            _json({f: fire[f] for f in FIRE_FIELDS}),
            _json(sent),
        )

    def fire(
        self, conn: Connection, fires: Sequence[tuple[PreparedFire, str]], now: int | None
    ) -> list[str]:
        if not fires:
            return []
        sql = self._sql
        mine = [(f, fired) for f, fired in fires if isinstance(f, SqliteFire)]
        assert len(mine) == len(fires)
        claims = _array(f.claim for f, _ in mine)
        won = {r[0] for r in conn.execute(sql["claim"], {"fires": claims})}
        if not won:
            return []
        firing = [(f, fired) for f, fired in mine if f.name in won]
        rows = _array(f.whole for f, _ in firing)
        ids = {r[1]: r[0] for r in conn.execute(sql["messages"], {"fires": rows, "now": now})}
        # In the order a fire writes them one by one, fire after fire: every ``fired``
        # (entry timelines), then every ``enqueued`` and ``sent_by_schedule`` (a task's
        # timeline: those two in that order).
        # (Formatted, not dumped: 20,000 json.dumps calls cost a quarter of the batch.)
        events = [
            f'{{"task_id":{f.timeline_json},"message_id":null,"attempt":null,'
            f'"kind":"fired","data":{json.dumps(fired)}}}'
            for f, fired in firing
        ]
        events += [
            f'{{"task_id":{f.task_id_json},"message_id":{int(ids[f.task_id])},"attempt":0,'
            '"kind":"enqueued","data":null}'
            for f, _ in firing
        ]
        events += [f.sent for f, _ in firing]
        conn.execute(sql["events"], {"events": _array(events), "now": now})
        conn.execute(sql["tasks"], {"fires": rows, "now": now})
        return [f.name for f, _ in firing]

    def statements(self) -> dict[str, TextClause]:
        return dict(self._sql)


def _event(
    task_id: str, message_id: int | None, attempt: int | None, kind: str, data: str | None
) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "message_id": message_id,
        "attempt": attempt,
        "kind": kind,
        "data": data,
    }


def _json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


def _array(items: Iterable[str]) -> str:
    """A JSON array of JSON texts."""
    return f"[{','.join(items)}]"
