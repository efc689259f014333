"""SQLite's bookkeeping beside the statements, for ``SqliteDriver``
(sqlease._db.sqlite.driver): SQLite has no data-modifying CTEs, so the run locks, the task
rows' attempts, the runs' and gates' next messages made ready and the timeline events that
PostgreSQL writes inside a statement are written here, in the statement's transaction, under
the one write lock: one ``executemany`` per table."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection

from sqlease._db.driver import Driver, event_params
from sqlease._db.sqlite import SqliteStatements
from sqlease.types import Message


class SqliteBookkeeping(Driver):
    """The writes that follow SQLite's statements, in their transaction."""

    sql: SqliteStatements

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
