"""The SQLite driver: per-task transactions straight through sqlite3, bookkeeping beside them.

Every hot operation is a short ``BEGIN IMMEDIATE`` transaction on a kept sqlite3 connection
(sqlease._db.sqlite.fast) inside the fork guard; an engine a user passed in is used through
SQLAlchemy. SQLite has no data-modifying CTEs, so the run locks and timeline events that
PostgreSQL writes inside a claim or transition statement are written here, in the same
transaction, one ``executemany`` per table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Connection, Table
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import Driver, event_params
from sqlease._db.sqlite.dialect import CAPABILITIES
from sqlease._db.sqlite.fast import SqliteFast
from sqlease._db.sqlite.fork_guard import sqlite_section
from sqlease._db.wakeup import SqliteWatcher, Waker
from sqlease.types import Fence, Message

if TYPE_CHECKING:
    from sqlease._db.statements import Statements


class SqliteDriver(Driver):
    name = "sqlite"
    caps = CAPABILITIES

    def __init__(self, url: str | URL | Engine, engine: Engine, sql: Statements) -> None:
        super().__init__(engine)
        self.sql = sql
        #: sqlease's own engines: the per-task transactions through sqlite3.
        self.fast: SqliteFast | None = None if isinstance(url, Engine) else SqliteFast(engine)

    @contextmanager
    def writing(self, statements: int = 2) -> Iterator[Connection]:
        # SQLite always takes the write lock up front (BEGIN IMMEDIATE, see engine.py).
        with sqlite_section(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def writing_hot(self, statements: int = 2) -> Iterator[Connection]:
        if self.fast is None:
            with self.writing(statements) as conn:
                yield conn
            return
        # sqlite_fast's Transaction provides the part of Connection's API the hot
        # operations use.
        with self.fast.begin() as transaction:
            yield cast(Connection, transaction)

    def fork_section(self) -> AbstractContextManager[None]:
        return sqlite_section()

    def insert(self, table: Table) -> Any:
        return sqlite_insert(table)

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        pass  # watchers see the commit change the file's data_version

    def waker(self, channel: str, *, lock_key: int | None = None) -> Waker:
        return SqliteWatcher(str(self.engine.url.database))

    def queues_param(self, queues: Sequence[str]) -> Any:
        # json_each and json_extract. Each name once: the claim reads each of its first
        # queues in a scan of its own (sqlease._db.sqlite.leases), and a name given twice
        # would deliver its rows twice over in one claim's candidates.
        return json.dumps(list(dict.fromkeys(queues)))

    def fence_params(self, fences: Sequence[Fence]) -> dict[str, Any]:
        ordered = sorted(fences, key=lambda f: f.message_id)
        return {"fences": json.dumps([[f.message_id, f.attempt] for f in ordered])}

    def after_enqueue(
        self, conn: Connection, row: Mapping[str, Any], message_id: int, now: int | None
    ) -> None:
        if row["record"]:
            conn.execute(
                self.sql.event_insert,
                event_params(row["task_id"], message_id, 0, "enqueued", None, now),
            )
        if row["task_id"] is not None:  # its task row (sqlease._db.task_rows)
            assert self.sql.task_publish is not None
            conn.execute(self.sql.task_publish, {**row, "now": now})

    def after_claim(
        self, conn: Connection, claimed: list[Message], owner: str, now: int | None
    ) -> None:
        assert self.sql.claim_runs is not None
        # One executemany per table: a claim of 32 is three statements, not 64.
        run_locks = [
            {
                "run_id": msg.run_id,
                "message_id": msg.id,
                "attempt": msg.attempt,
                "owner": owner,
                "lease_expires_at_ms": msg.lease_expires_at_ms,
            }
            for msg in claimed
            if msg.run_id is not None and msg.state != "dead"
        ]
        if run_locks:
            conn.execute(self.sql.claim_runs, run_locks)
        attempts = [
            {"task_id": msg.task_id, "attempt": msg.attempt}
            for msg in claimed
            if msg.task_id is not None and msg.state != "dead"
        ]
        if attempts:  # the task rows' attempts (sqlease._db.task_rows)
            assert self.sql.task_attempts is not None
            conn.execute(self.sql.task_attempts, attempts)
        owner_data = json.dumps({"owner": owner})
        self._events(
            conn,
            [
                event_params(
                    msg.task_id,
                    msg.id,
                    msg.attempt,
                    "attempts_exhausted" if msg.state == "dead" else "claimed",
                    None if msg.state == "dead" else owner_data,
                    now,
                )
                for msg in claimed
            ],
        )

    def after_transitions(
        self, conn: Connection, rows: list[Any], kind: str, data: str | None, now: int | None
    ) -> None:
        runs = [
            {"run_id": m["run_id"], "message_id": m["id"]} for m in rows if m["run_id"] is not None
        ]
        if runs:
            conn.execute(self.sql.release_run, runs)
        self._events(
            conn,
            [event_params(m["task_id"], m["id"], m["attempt"], kind, data, now) for m in rows],
        )

    def after_renew(self, conn: Connection, row: Mapping[Any, Any]) -> None:
        if row["run_id"] is not None:
            assert self.sql.renew_runs is not None
            conn.execute(
                self.sql.renew_runs,
                {
                    "run_id": row["run_id"],
                    "message_id": row["id"],
                    "lease_expires_at_ms": row["lease_expires_at_ms"],
                },
            )

    def _events(self, conn: Connection, events: list[dict[str, Any]]) -> None:
        if events:
            conn.execute(self.sql.event_insert, events)
