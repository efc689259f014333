"""The SQLite driver: every hot operation one short transaction, bookkeeping beside it.

Each op is a ``BEGIN IMMEDIATE`` transaction on a kept sqlite3 connection (sqlease._db.sqlite
.direct) inside the fork guard; an engine a user passed in is used through SQLAlchemy. SQLite
has no data-modifying CTEs, so the run locks, task rows, rate limits and timeline events that
PostgreSQL writes inside a statement are written here, in the same transaction, under the one
write lock: one ``executemany`` per table.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Table, literal
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import (
    Admit,
    Change,
    Claim,
    Driver,
    Lane,
    Offer,
    Op,
    ResultWrite,
    by_owner,
    event_params,
    publish_each,
)
from sqlease._db.ops import batch_json
from sqlease._db.rows import Acked, row_to_message
from sqlease._db.sqlite import SqliteStatements, statements
from sqlease._db.sqlite.dialect import CAPABILITIES
from sqlease._db.sqlite.direct import DirectTransactions
from sqlease._db.sqlite.fork_guard import sqlite_section
from sqlease._db.sqlite.watcher import SqliteWatcher
from sqlease._db.tables import Tables
from sqlease._db.wakeup import Waker
from sqlease.errors import ConfigurationError
from sqlease.types import Fence, Message, Outcome

T = TypeVar("T")


def _fence_params(fences: Sequence[Fence]) -> dict[str, Any]:
    ordered = sorted(fences, key=lambda f: f.message_id)
    return {"fences": json.dumps([[f.message_id, f.attempt] for f in ordered])}


class SqliteDriver(Driver):
    name = "sqlite"
    caps = CAPABILITIES
    sql: SqliteStatements

    def __init__(self, url: str | URL | Engine, engine: Engine, tables: Tables) -> None:
        super().__init__(engine, tables)
        self.sql = statements(tables)
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

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        pass  # watchers see the commit change the file's data_version

    def waker(self, channel: str, *, lock_key: int | None = None) -> Waker:
        return SqliteWatcher(str(self.engine.url.database))

    def queues_param(self, queues: Sequence[str]) -> Any:
        # json_each and json_extract. Each name once: the claim reads each of its first
        # queues in a scan of its own (sqlease._db.sqlite.leases), and a name given twice
        # would deliver its rows twice over in one claim's candidates.
        return json.dumps(list(dict.fromkeys(queues)))

    # ---- bookkeeping beside the statements -------------------------------------------

    def _events(self, conn: Connection, events: list[dict[str, Any]]) -> None:
        if events:
            conn.execute(self.sql.event_insert, events)

    def _promote_on(self, conn: Connection, run_ids: Iterable[str], now: int | None) -> list[int]:
        """The runs' heads made ready where they wait parked behind their run (in the
        caller's transaction, after the statement that finished their earlier message)."""
        runs = sorted(set(run_ids))
        if not runs:
            return []
        params = {"runs": json.dumps(runs), "now": now}
        conn.execute(self.sql.bump_runs, params)
        return [int(r.id) for r in conn.execute(self.sql.promote_runs, params)]

    def _promote_gates_on(
        self, conn: Connection, gates: Iterable[str | None], now: int | None
    ) -> list[int]:
        """Of each gate, as many messages parked there made ready as it has room for (in
        the caller's transaction: no sweep can park between the two)."""
        promoted: list[int] = []
        for gate in sorted({g for g in gates if g is not None}):
            [room] = conn.execute(self.sql.gate_limit, {"gate": gate, "now": now}).fetchall()
            n = -1 if room.lim is None else max(0, room.lim - room.running - room.waiting)
            if n:
                params = {"gate": gate, "n": n, "now": now}
                promoted += [int(r.id) for r in conn.execute(self.sql.promote_gate, params)]
        return promoted

    def _after_transitions(
        self,
        conn: Connection,
        rows: list[Any],
        kind: str,
        data: str | None,
        now: int | None,
        *,
        left: bool = True,
    ) -> None:
        """``left``: the messages left their runs (acked or failed), whose next messages are
        made ready."""
        runs = [
            {"run_id": m["run_id"], "message_id": m["id"]} for m in rows if m["run_id"] is not None
        ]
        if runs:
            conn.execute(self.sql.release_run, runs)
            if left:
                self._promote_on(conn, (r["run_id"] for r in runs), now)
        self._promote_gates_on(conn, (m["gate"] for m in rows), now)
        self._events(
            conn,
            [event_params(m["task_id"], m["id"], m["attempt"], kind, data, now) for m in rows],
        )

    def _after_claim(
        self, conn: Connection, claimed: list[Message], owner: str, now: int | None
    ) -> None:
        live = [m for m in claimed if m.state != "dead"]
        run_locks = [
            {
                "run_id": m.run_id,
                "message_id": m.id,
                "attempt": m.attempt,
                "owner": owner,
                "lease_expires_at_ms": m.lease_expires_at_ms,
            }
            for m in live
            if m.run_id is not None
        ]
        if run_locks:
            conn.execute(self.sql.claim_runs, run_locks)
        attempts = [{"task_id": m.task_id, "attempt": m.attempt} for m in live if m.task_id]
        if attempts:  # the task rows' attempts (sqlease._db.task_rows)
            conn.execute(self.sql.task_attempts, attempts)
        owner_data = json.dumps({"owner": owner})
        self._events(
            conn,
            [
                event_params(
                    m.task_id,
                    m.id,
                    m.attempt,
                    "attempts_exhausted" if m.state == "dead" else "claimed",
                    None if m.state == "dead" else owner_data,
                    now,
                )
                for m in claimed
            ],
        )

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

    def _claim_on(self, conn: Connection, claim: Claim) -> list[Message]:
        params: dict[str, Any] = {
            "owner": claim.owner,
            "lease_ms": int(claim.lease_ms),
            "limit": int(claim.limit),
            "now": claim.now,
        }
        if len(claim.queues) == 1:
            params["queue"] = claim.queues[0]
            statement = self.sql.claim_single
        else:
            params["queues"] = self.queues_param(claim.queues)
            statement = self.sql.claim
        rows = conn.execute(statement, params).fetchall()
        claimed = [row_to_message(r) for r in rows]
        self._after_claim(conn, claimed, claim.owner, claim.now)
        rated = Counter(
            r._mapping["rate_gate"]
            for r, m in zip(rows, claimed, strict=True)
            if m.state == "ready" and r._mapping.get("rate_gate") is not None
        )
        if rated:
            conn.execute(
                self.sql.rate_take,
                [{"name": n, "n": k, "now": claim.now} for n, k in rated.items()],
            )
        return claimed

    def message_claim(self, claim: Claim) -> Op[list[Message]]:
        return Op(Lane.LEASES, body=lambda conn: self._claim_on(conn, claim), statements=1)

    def _ack_on(self, conn: Connection, fences: Sequence[Fence], now: int | None) -> Acked:
        done = Acked()
        for owner, group in by_owner(fences).items():
            params = {**_fence_params(group), "owner": owner, "now": now}
            rows = [row._mapping for row in conn.execute(self.sql.ack, params).fetchall()]
            done.update(int(m["id"]) for m in rows)
            self._after_transitions(conn, rows, "acked", None, now)
        return done

    def message_ack(self, fences: Sequence[Fence], now: int | None) -> Op[Acked]:
        if not fences:
            return Op.answer(Acked())
        return Op(Lane.LEASES, body=lambda conn: self._ack_on(conn, fences, now))

    def message_ack_claim(
        self, fences: Sequence[Fence], claim: Claim
    ) -> Op[tuple[Acked, list[Message]]]:
        # One transaction (one write lock, one commit). The claim sees the acks, so the next
        # message of a run just acked can come with it.
        def body(conn: Connection) -> tuple[Acked, list[Message]]:
            acked = self._ack_on(conn, fences, claim.now) if fences else Acked()
            return acked, self._claim_on(conn, claim)

        return Op(Lane.LEASES, body=body)

    def message_renew(
        self, fences: Sequence[Fence], lease_ms: int, now: int | None
    ) -> Op[dict[int, int]]:
        groups = by_owner(fences)
        if not groups:
            return Op.answer({})

        def body(conn: Connection) -> dict[int, int]:
            held: dict[int, int] = {}
            for owner, group in groups.items():
                params = {**_fence_params(group), "owner": owner, "lease_ms": lease_ms, "now": now}
                for row in conn.execute(self.sql.renew, params).fetchall():
                    m = row._mapping
                    held[int(m["id"])] = int(m["lease_expires_at_ms"])
                    if m["run_id"] is not None:
                        lock = {
                            "run_id": m["run_id"],
                            "message_id": m["id"],
                            "lease_expires_at_ms": m["lease_expires_at_ms"],
                        }
                        conn.execute(self.sql.renew_runs, lock)
            return held

        return Op(Lane.LEASES, body=body)

    def message_transition(
        self,
        fences: Sequence[Fence],
        change: Change,
        now: int | None,
        also: Callable[[Connection], None] | None = None,
    ) -> Op[Acked]:
        groups = by_owner(fences)
        if not groups:
            return Op.answer(Acked())
        terms = {
            "now": now,
            "delay_ms": max(0, int(change.delay_ms)),
            "refund": 1 if change.refund else 0,
            "new_state": change.new_state,
            "reason": change.reason,
            "error": change.error,
            "kind": change.kind,
            "data": change.data,
        }

        def body(conn: Connection) -> Acked:
            changed = Acked()
            for owner, group in groups.items():
                params = {**_fence_params(group), "owner": owner, **terms}
                rows = [r._mapping for r in conn.execute(self.sql.transition, params).fetchall()]
                changed.update(int(m["id"]) for m in rows)
                self._after_transitions(
                    conn, rows, change.kind, change.data, now, left=change.new_state == "dead"
                )
            if changed and also is not None:
                also(conn)  # the caller's write, in the same transaction
            return changed

        return Op(Lane.DEFAULT, body=body)

    # ---- operations: results ---------------------------------------------------------

    def result_put(self, write: ResultWrite) -> Op[Outcome]:
        results, row, fence = self.tables.results, write.row, write.fence
        insert = sqlite_insert(results).values(**row)
        upsert = insert.on_conflict_do_update(
            index_elements=[results.c.key],
            set_={k: insert.excluded[k] for k in row if k != "key"},
            where=results.c.state.is_distinct_from("SUCCESS") if write.keep_success else None,
        ).returning(results.c.key)

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
            if conn.execute(upsert).first() is None:
                return Outcome.KEPT_SUCCESS
            return Outcome.UPDATED

        return Op(Lane.DEFAULT, body=body)

    # ---- operations: offers (none: no LISTEN to hand a message over) -------------------

    def offer_put(self, offer: Offer) -> Op[tuple[int | None, int | None]]:
        raise ConfigurationError("handoff offers need PostgreSQL")

    def offer_ack(
        self, fences: Sequence[Fence], offer: Offer
    ) -> Op[tuple[Acked, int | None, int | None]]:
        raise ConfigurationError("handoff offers need PostgreSQL")

    def offer_withdraw(self, owner: str, *, handed_too: bool = False) -> Op[None]:
        return Op.answer(None)
