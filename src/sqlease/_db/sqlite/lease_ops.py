"""SQLite's lease operations for ``SqliteDriver`` (sqlease._db.sqlite.driver, whose base this
is): claim, ack, ack + claim, renew and transition, each one transaction
(sqlease._db.sqlite.leases) with its bookkeeping (sqlease._db.sqlite.bookkeeping)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection

from sqlease._db.driver import Change, Claim, Lane, Op, by_owner
from sqlease._db.rows import Acked, row_to_message
from sqlease._db.sqlite.bookkeeping import SqliteBookkeeping
from sqlease.types import Fence, Message


def _fence_params(fences: Sequence[Fence]) -> dict[str, Any]:
    ordered = sorted(fences, key=lambda f: f.message_id)
    return {"fences": json.dumps([[f.message_id, f.attempt] for f in ordered])}


class SqliteLeaseOps(SqliteBookkeeping):
    """SQLite's claims, acks, renewals and transitions."""

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
        terms = change.params(now)

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
