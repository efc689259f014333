"""Claims, acks and renewals: the hot path of every delivery.

Each hot operation is built once as an :class:`~sqlease._db.driver.Op` (``claim_op``,
``ack_op``, ``ack_and_claim_op``): the blocking methods here execute it on the driver, and the
worker's event loop may send the same op without blocking (sqlease.transport). On
PostgreSQL each op is one autocommit statement (claim with its run locks and events, ack,
ack + claim); on SQLite one short transaction with the bookkeeping beside the statement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.sql.elements import TextClause

from sqlease._core.base import StoreBase, by_owner
from sqlease._core.rows import message_from, row_to_message
from sqlease._db.driver import Lane, Op
from sqlease._db.retry import transient
from sqlease.errors import ConfigurationError
from sqlease.types import Fence, Message

OnExhausted = Callable[[list[Message]], None] | None
Acked = set[int]


def _delivery_order(messages: list[Message]) -> list[Message]:
    messages.sort(key=lambda m: (-m.priority, m.available_at_ms, m.id))
    return messages


def _check_lease(lease_ms: int) -> None:
    if lease_ms < 1:
        raise ConfigurationError(f"lease_ms must be positive, not {lease_ms!r}")


def _acked_ids(rows: list[dict[str, Any]]) -> Acked:
    return {int(row["id"]) for row in rows}


class Leases(StoreBase):
    """Claims, acks and renewals."""

    # ---- claim -------------------------------------------------------------------------

    @transient
    def claim(
        self,
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int = 1,
        now: int | None = None,
        on_exhausted: OnExhausted = None,
    ) -> list[Message]:
        """Lease up to ``limit`` ready messages from ``queues`` to ``owner``.

        Messages whose delivery budget is spent are marked dead (``attempts_exhausted``)
        instead of being delivered; they are not returned but passed to ``on_exhausted``.
        """
        if not queues or limit < 1:
            return []
        _check_lease(lease_ms)
        now = self._now(now)
        delivered: list[Message] = []
        while len(delivered) < limit:
            claimed = self.driver.execute(
                self.claim_op(queues, owner, lease_ms, limit - len(delivered), now)
            )
            delivered.extend(m for m in claimed if m.state == "ready")
            exhausted = [m for m in claimed if m.state != "ready"]
            if exhausted and on_exhausted is not None:
                on_exhausted(exhausted)
            # Only when the batch was spent on exhausted messages is another look useful:
            # a delivery must not wait a polling interval behind a dead message.
            if not exhausted:
                break
        return _delivery_order(delivered)

    def _claim_statement(
        self, queues: Sequence[str], owner: str, lease_ms: int, limit: int, now: int | None
    ) -> tuple[TextClause, dict[str, Any]]:
        params: dict[str, Any] = {
            "owner": owner,
            "lease_ms": int(lease_ms),
            "limit": int(limit),
            "now": now,
        }
        if len(queues) == 1:
            params["queue"] = queues[0]
            return self.sql.claim_single, params
        params["queues"] = self.driver.queues_param(queues)
        return self.sql.claim, params

    def claim_op(
        self, queues: Sequence[str], owner: str, lease_ms: int, limit: int, now: int | None
    ) -> Op[list[Message]]:
        """One claim (exhausted messages included, as the statement marks them)."""
        statement, params = self._claim_statement(queues, owner, lease_ms, limit, now)
        if self.driver.caps.one_statement:  # claim, run locks, events: autocommit
            return Op(Lane.LEASES, statement, params, finish=self._claimed_rows)
        return Op(
            Lane.LEASES,
            body=lambda conn: self._claim_on(conn, statement, params, owner, now),
            statements=1,
        )

    @staticmethod
    def _claimed_rows(rows: list[dict[str, Any]]) -> list[Message]:
        return [message_from(r, has_last_error="last_error" in r) for r in rows]

    def _claim_on(
        self,
        conn: Connection,
        statement: TextClause,
        params: dict[str, Any],
        owner: str,
        now: int | None,
    ) -> list[Message]:
        rows = conn.execute(statement, params).fetchall()
        claimed = [row_to_message(r) for r in rows]
        self.driver.after_claim(conn, claimed, owner, now)
        rated = Counter(
            r._mapping["rate_gate"]
            for r, m in zip(rows, claimed, strict=True)
            if m.state == "ready" and r._mapping.get("rate_gate") is not None
        )
        if rated and self.sql.rate_take is not None:
            conn.execute(
                self.sql.rate_take, [{"name": n, "n": k, "now": now} for n, k in rated.items()]
            )
        return claimed

    # ---- ack and claim together --------------------------------------------------------

    @transient
    def ack_and_claim(
        self,
        fences: Iterable[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int,
        now: int | None = None,
        on_exhausted: OnExhausted = None,
    ) -> tuple[Acked, list[Message]]:
        """``ack(fences)`` and ``claim(queues, owner, ...)`` together: the ids acked and the
        messages delivered. On PostgreSQL, when every fence is ``owner``'s, one statement
        (one commit): the claim then does not see the acks' effects, so the next message of
        a run whose message was just acked is not among those claimed. On SQLite, one
        transaction, whose claim sees them. Otherwise the two operations one after the
        other."""
        fences = list(fences)
        op = self.ack_and_claim_op(
            fences,
            queues,
            owner,
            lease_ms=lease_ms,
            limit=limit,
            now=now,
            on_exhausted=on_exhausted,
        )
        if op is not None:
            return self.driver.execute(op)
        acked = self.ack(fences, now=now) if fences else set()
        claimed = self.claim(
            queues, owner, lease_ms=lease_ms, limit=limit, now=now, on_exhausted=on_exhausted
        )
        return acked, claimed

    def ack_and_claim_op(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int,
        now: int | None = None,
        on_exhausted: OnExhausted = None,
    ) -> Op[tuple[Acked, list[Message]]] | None:
        """``ack_and_claim`` as one op, or None where it is two (nothing to claim; on
        PostgreSQL a fence of another owner; on SQLite no fence)."""
        if not queues or limit < 1:
            return None
        one_statement = self.driver.caps.one_statement
        if one_statement and not all(f.owner == owner for f in fences):
            return None
        if not one_statement and not fences:
            return None
        _check_lease(lease_ms)
        now = self._now(now)

        def finish(found: tuple[Acked, list[Message]]) -> tuple[Acked, list[Message]]:
            acked, claimed = found
            return acked, self._past_exhausted(
                claimed, queues, owner, lease_ms, limit, now, on_exhausted
            )

        if one_statement:
            return self._ack_and_claim_statement(
                fences, queues, owner, lease_ms, limit, now, finish
            )
        # SQLite: one transaction (one write lock, one commit). The claim sees the acks, so
        # the next message of a run just acked can come with it.
        groups = by_owner(fences)
        statement, params = self._claim_statement(queues, owner, lease_ms, limit, now)

        def body(conn: Connection) -> tuple[Acked, list[Message]]:
            acked = self._ack_on(conn, groups, now)
            return acked, self._claim_on(conn, statement, params, owner, now)

        return Op(Lane.LEASES, body=body, finish=finish)

    def _ack_and_claim_statement(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        limit: int,
        now: int | None,
        then: Callable[[tuple[Acked, list[Message]]], tuple[Acked, list[Message]]],
    ) -> Op[tuple[Acked, list[Message]]]:
        # Without fences, the plain claim.
        claim, params = self._claim_statement(queues, owner, lease_ms, limit, now)
        if not fences:
            return Op(
                Lane.LEASES, claim, params, lambda rows: then((set(), self._claimed_rows(rows)))
            )
        statement = self.sql.ack_claim_single if len(queues) == 1 else self.sql.ack_claim
        assert statement is not None  # every one-statement dialect has it
        params.update(self.driver.fence_params(fences))

        def finish(rows: list[dict[str, Any]]) -> tuple[Acked, list[Message]]:
            acked = {int(i) for i in (rows[0]["acked_ids"] or [])} if rows else set()
            found = [r for r in rows if r["id"] is not None]
            return then((acked, self._claimed_rows(found)))

        return Op(Lane.LEASES, statement, params, finish)

    def _past_exhausted(
        self,
        found: list[Message],
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        limit: int,
        now: int | None,
        on_exhausted: OnExhausted,
    ) -> list[Message]:
        """The ready messages a combined claim found, in delivery order; exhausted ones go to
        ``on_exhausted``, and, as claim() does, the claim goes on past them (a delivery must
        not wait a polling interval behind dead rows)."""
        delivered = [m for m in found if m.state == "ready"]
        exhausted = [m for m in found if m.state != "ready"]
        if exhausted and on_exhausted is not None:
            on_exhausted(exhausted)
        if exhausted and len(delivered) < limit:
            delivered += self.claim(
                queues,
                owner,
                lease_ms=lease_ms,
                limit=limit - len(delivered),
                now=now,
                on_exhausted=on_exhausted,
            )
        return _delivery_order(delivered)

    # ---- renew -------------------------------------------------------------------------

    @transient
    def renew(
        self, fences: Iterable[Fence], *, lease_ms: int, now: int | None = None
    ) -> dict[int, int]:
        """Extend every lease still held; returns ``{message_id: new expiry}`` for those.

        A fence missing from the answer is lost (expired, taken over, parked or acked).
        """
        now = self._now(now)
        held: dict[int, int] = {}
        groups = by_owner(fences)
        if not groups:
            return held
        with self._writing_hot(statements=len(groups)) as conn:
            for owner, group in groups.items():
                params = {
                    **self.driver.fence_params(group),
                    "owner": owner,
                    "lease_ms": int(lease_ms),
                    "now": now,
                }
                for row in conn.execute(self.sql.renew, params).fetchall():
                    m = row._mapping
                    held[int(m["id"])] = int(m["lease_expires_at_ms"])
                    self.driver.after_renew(conn, m)
        return held

    # ---- ack ---------------------------------------------------------------------------

    @transient
    def ack(self, fences: Iterable[Fence], *, now: int | None = None) -> Acked:
        """Finish deliveries (the rows leave the table); returns the ids actually acked."""
        op = self.ack_op(fences, now)
        return set() if op is None else self.driver.execute(op)

    def ack_op(
        self, fences: Iterable[Fence] | Mapping[str, list[Fence]], now: int | None = None
    ) -> Op[Acked] | None:
        """``ack`` as one op (None: no fences). One statement where the dialect has it and
        the fences are one owner's."""
        groups = fences if isinstance(fences, Mapping) else by_owner(fences)
        if not groups:
            return None
        now = self._now(now)
        if self.driver.caps.one_statement and len(groups) == 1:
            ((owner, group),) = groups.items()
            params = {**self.driver.fence_params(group), "owner": owner, "now": now}
            return Op(Lane.LEASES, self.sql.ack, params, _acked_ids)
        return Op(
            Lane.LEASES, body=lambda conn: self._ack_on(conn, groups, now), statements=len(groups)
        )

    def _ack_on(
        self, conn: Connection, groups: Mapping[str, list[Fence]], now: int | None
    ) -> Acked:
        done: Acked = set()
        for owner, group in groups.items():
            params = {**self.driver.fence_params(group), "owner": owner, "now": now}
            rows = [row._mapping for row in conn.execute(self.sql.ack, params).fetchall()]
            done.update(int(m["id"]) for m in rows)
            self.driver.after_transitions(conn, rows, "acked", None, now)
        return done
