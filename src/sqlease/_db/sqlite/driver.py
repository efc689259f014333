"""The SQLite driver: every hot operation one short transaction, bookkeeping beside it.

Each op is a ``BEGIN IMMEDIATE`` transaction on a kept sqlite3 connection (sqlease._db.sqlite
.direct) inside the fork guard; an engine a user passed in is used through SQLAlchemy. SQLite
has no data-modifying CTEs, so the run locks, task rows, rate limits and timeline events that
PostgreSQL writes inside a statement are written here, in the same transaction, under the one
write lock: one ``executemany`` per table. The lease operations (claim, ack, renew,
transition) are in ``lease_ops.py`` and those writes in ``bookkeeping.py``, its bases.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Table, bindparam, literal, literal_column, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Engine
from sqlalchemy.sql.dml import Delete, Update

from sqlease._db.driver import (
    Admit,
    Lane,
    Offer,
    Op,
    ResultWrite,
    event_params,
    publish_each,
)
from sqlease._db.ops import batch_json
from sqlease._db.rows import Acked, row_to_message
from sqlease._db.sqlite import SqliteStatements, statements
from sqlease._db.sqlite.dialect import CAPABILITIES
from sqlease._db.sqlite.direct import DirectTransactions
from sqlease._db.sqlite.fork_guard import sqlite_section
from sqlease._db.sqlite.lease_ops import SqliteLeaseOps
from sqlease._db.sqlite.watcher import SqliteWatcher
from sqlease._db.tables import Tables
from sqlease._db.wakeup import Waker
from sqlease.errors import ConfigurationError
from sqlease.types import Fence, Message, Outcome

T = TypeVar("T")


class SqliteDriver(SqliteLeaseOps):
    name = "sqlite"
    caps = CAPABILITIES
    sql: SqliteStatements

    def __init__(self, url: str | URL | Engine, engine: Engine, tables: Tables) -> None:
        super().__init__(engine, tables)
        self.sql = statements(tables)
        self._upserts: dict[tuple[tuple[str, ...], bool], Any] = {}
        #: sqlease's own engines: the per-task transactions through sqlite3.
        self.direct: DirectTransactions | None = (
            None if isinstance(url, Engine) else DirectTransactions(engine)
        )

    # ---- transactions ----------------------------------------------------------------

    @contextmanager
    def writing(self, statements: int = 2) -> Iterator[Connection]:
        # SQLite always takes the write lock up front (BEGIN IMMEDIATE, see engine.py).
        with sqlite_section(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _writing_hot(self) -> Iterator[Connection]:
        if self.direct is None:
            with self.writing() as conn:
                yield conn
            return
        # The direct Transaction provides the part of Connection's API the operations use.
        with self.direct.begin() as transaction:
            yield cast(Connection, transaction)

    def fork_section(self) -> AbstractContextManager[None]:
        return sqlite_section()

    def _transaction(self, lane: Lane) -> AbstractContextManager[Connection]:
        if lane is Lane.READ:
            return self.reading()
        return self.writing() if lane is Lane.DEFAULT else self._writing_hot()

    def execute(self, op: Op[T]) -> T:
        # Every op is a transaction of its own: a read a deferred one, on DEFAULT through
        # SQLAlchemy (its body may run SQLAlchemy constructs), on the other lanes on the kept
        # sqlite3 connection.
        if op.statement is None and op.body is None:
            done: Any = None
        else:
            with self._transaction(op.lane) as conn:
                if op.statement is not None:
                    done = [dict(r._mapping) for r in conn.execute(op.statement, op.params)]
                else:
                    assert op.body is not None
                    done = op.body(conn)
        return done if op.finish is None else op.finish(done)

    # ---- dialect constructs ----------------------------------------------------------

    def insert(self, table: Table) -> Any:
        return sqlite_insert(table)

    def events_per_row(self) -> Any:
        return literal(1)  # one row per message's event

    def leftovers(self, now: int) -> dict[str, Delete | Update]:
        # Leases left on rows that are no longer ready, through their own partial index (not
        # on PostgreSQL, where that index would keep claims from being HOT updates, and
        # nothing leaves them).
        m = self.tables.messages
        stray = (
            update(m)
            .where(m.c.state != "ready", m.c.lease_owner.isnot(None))
            .values(lease_owner=None, lease_expires_at_ms=None)
        )
        return {"stray_leases_cleared": stray}

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        pass  # watchers see the commit change the file's data_version

    def waker(
        self, channel: str, *, lock_key: int | None = None, shared_keys: Sequence[int] = ()
    ) -> Waker:
        return SqliteWatcher(str(self.engine.url.database))

    def queues_param(self, queues: Sequence[str]) -> Any:
        # json_each and json_extract. Each name once: the claim reads each of its first
        # queues in a scan of its own (sqlease._db.sqlite.leases), and a name given twice
        # would deliver its rows twice over in one claim's candidates.
        return json.dumps(list(dict.fromkeys(queues)))

    # ---- operations: messages --------------------------------------------------------

    def message_publish(
        self,
        rows: Sequence[Mapping[str, Any]],
        now: int | None,
        *,
        handoff: bool = True,
        admit: Admit | None = None,
    ) -> Op[list[int]]:
        def body(conn: Connection) -> list[int]:
            def insert(row: Mapping[str, Any]) -> int:
                params = {**row, "now": now}
                message_id = int(conn.execute(self.sql.enqueue, params).scalar_one())
                if row["record"]:
                    event = event_params(row["task_id"], message_id, 0, "enqueued", None, now)
                    conn.execute(self.sql.event_insert, event)
                if row["task_id"] is not None:  # its task row (sqlease._db.task_rows)
                    conn.execute(self.sql.task_publish, params)
                return message_id

            return publish_each(conn, rows, now, admit, insert)

        return Op(Lane.PUBLISH, body=body)

    def publish_bulk(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]], now: int | None
    ) -> list[int]:
        params = {"rows": batch_json(rows), "now": now}
        # One writer, the rows inserted in the list's order: the ids, sorted, are the list's.
        ids = sorted(int(row[0]) for row in conn.execute(self.sql.enqueue_batch, params))
        pairs = zip(rows, ids, strict=True)
        self._events(
            conn,
            [
                event_params(r["task_id"], i, 0, "enqueued", None, now)
                for r, i in pairs
                if r["record"]
            ],
        )
        tasks = [{**r, "now": now} for r in rows if r["task_id"] is not None]
        if tasks:
            conn.execute(self.sql.task_publish, tasks)
        return ids

    def run_promote(self, run_ids: Sequence[str], now: int | None) -> Op[list[int]]:
        return Op(Lane.DEFAULT, body=lambda conn: self._promote_on(conn, run_ids, now))

    def gate_promote(self, gates: Sequence[str], now: int | None) -> Op[list[int]]:
        return Op(Lane.DEFAULT, body=lambda conn: self._promote_gates_on(conn, gates, now))

    def gate_park(self, queue: str, scan: int, now: int | None) -> Op[list[int]]:
        def body(conn: Connection) -> list[int]:
            params = {"queue": queue, "scan": int(scan), "now": now}
            held = [{"id": r.id, "gate": r.gate} for r in conn.execute(self.sql.park_find, params)]
            if held:
                conn.execute(self.sql.park_set, held)
            return [int(h["id"]) for h in held]

        return Op(Lane.DEFAULT, body=body)

    def rate_project(
        self, queue: str, scan: int, horizon_ms: int, now: int | None
    ) -> Op[list[int]]:
        def body(conn: Connection) -> list[int]:
            params = {"queue": queue, "scan": int(scan), "horizon": int(horizon_ms), "now": now}
            later = [
                {"id": r.id, "rate": r.rate, "due": r.due}
                for r in conn.execute(self.sql.project_find, params)
            ]
            if later:
                conn.execute(self.sql.project_set, later)
            return [int(x["id"]) for x in later]

        return Op(Lane.DEFAULT, body=body)

    def rate_release(self, rates: Sequence[str], now: int | None) -> Op[list[int]]:
        params = {"rates": json.dumps(sorted(set(rates))), "now": now}
        return Op(
            Lane.DEFAULT,
            body=lambda conn: [int(r.id) for r in conn.execute(self.sql.release_rates, params)],
        )

    def message_take(self, queues: Sequence[str], limit: int, now: int | None) -> Op[list[Message]]:
        params = {"queues": self.queues_param(queues), "limit": int(limit), "now": now}

        def body(conn: Connection) -> list[Message]:
            return [row_to_message(r) for r in conn.execute(self.sql.take, params).fetchall()]

        return Op(Lane.PLANNED, body=body, statements=1)

    # ---- operations: results ---------------------------------------------------------

    def _result_upsert(self, columns: tuple[str, ...], keep_success: bool) -> Any:
        """The result write's upsert of ``columns`` (bound as ``v_<column>``), built once:
        built for each write, it cost more than running it. Its one constant is literal SQL:
        the kept sqlite3 connection binds only the op's own parameters."""
        cached = self._upserts.get((columns, keep_success))
        if cached is None:
            results = self.tables.results
            insert = sqlite_insert(results).values(
                {c: bindparam(f"v_{c}", type_=results.c[c].type) for c in columns}
            )
            cached = insert.on_conflict_do_update(
                index_elements=[results.c.key],
                set_={c: insert.excluded[c] for c in columns if c != "key"},
                where=(
                    results.c.state.is_distinct_from(literal_column("'SUCCESS'"))
                    if keep_success
                    else None
                ),
            ).returning(results.c.key)
            self._upserts[(columns, keep_success)] = cached
        return cached

    def result_put(self, write: ResultWrite) -> Op[Outcome]:
        row, fence = write.row, write.fence
        upsert = self._result_upsert(tuple(row), write.keep_success)
        values = {f"v_{c}": v for c, v in row.items()}

        def body(conn: Connection) -> Outcome:
            if fence is not None:
                held = {
                    "message_id": fence.message_id,
                    "attempt": fence.attempt,
                    "owner": fence.owner,
                    "lease_ms": 0,
                    "task_id": row["task_id"],
                    "now": write.now,
                }
                if conn.execute(self.sql.lease_check, held).first() is None:
                    return Outcome.LEASE_LOST
            if conn.execute(upsert, values).first() is None:
                return Outcome.KEPT_SUCCESS
            return Outcome.UPDATED

        # A lane other than DEFAULT: the transaction runs on the kept sqlite3 connection, as
        # a claim's or an ack's does (SQLAlchemy's execution layer cost more than the write;
        # on SQLite a lane sets no commit level).
        return Op(Lane.LEASES, body=body)

    # ---- operations: offers (none: no LISTEN to hand a message over) -------------------

    def offer_put(self, offer: Offer) -> Op[tuple[int | None, int | None]]:
        raise ConfigurationError("handoff offers need PostgreSQL")

    def offer_ack(
        self, fences: Sequence[Fence], offer: Offer
    ) -> Op[tuple[Acked, int | None, int | None]]:
        raise ConfigurationError("handoff offers need PostgreSQL")

    def offer_handed(self, messages: Sequence[Message]) -> None:
        raise ConfigurationError("handoff offers need PostgreSQL")

    def offer_withdraw(self, owner: str, *, handed_too: bool = False) -> Op[None]:
        return Op.answer(None)
