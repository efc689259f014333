"""PostgreSQL's lease operations for ``PostgresDriver`` (sqlease._db.postgresql.driver, whose
base this is): claim, ack, ack + claim, renew and transition, each one autocommit statement
that also writes the run locks and the events (sqlease._db.postgresql.leases), or a
transaction of one statement per owner when a batch names several."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from sqlease._db.driver import Change, Claim, Driver, Lane, Op, by_owner
from sqlease._db.postgresql import PgStatements
from sqlease._db.postgresql.dialect import fence_params
from sqlease._db.postgresql.lost_claims import window_ms
from sqlease._db.rows import (
    Acked,
    acked_ids_of,
    acked_of,
    expiries_of,
    messages_of,
    plain_claimed,
)
from sqlease.types import Fence, Message

#: Each claim's mark (``Op.claim_mark``), unique to its owner: a count from a random start,
#: should a forked process carry an owner on.
_MARKS = itertools.count(random.getrandbits(48))

#: Seconds a set of queues is claimed with the full statement after a claim of plain
#: messages met a held one at its front: a queue of runs or limits pays one short claim
#: per spell, a queue of plain tasks none.
FULL_SPELL = 2.0


class ClaimPlans:
    """Which claim statement a set of queues gets: the one for plain messages
    (sqlease._db.postgresql.plain_claims), unless such a claim of those queues stopped in
    front of a held message less than ``FULL_SPELL`` seconds ago. Only the statement's cost
    depends on it, never what is claimed."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        #: Until when (monotonic) each set of queues is claimed in full.
        self._full_until: dict[frozenset[str], float] = {}

    def plain(self, queues: Sequence[str]) -> bool:
        until = self._full_until.get(frozenset(queues))
        return until is None or self._monotonic() >= until

    def held_ahead(self, queues: Sequence[str]) -> None:
        self._full_until[frozenset(queues)] = self._monotonic() + FULL_SPELL


#: Most deliveries ``OutsideRuns`` keeps: beyond, it forgets them all (their acks, if they
#: come, take the full statement).
OUTSIDE_RUNS_KEPT = 65_536


class OutsideRuns:
    """The deliveries this driver leased outside any run, by id (and attempt), until their
    ack: those its claims returned and the handoffs its worker delivered
    (``offer_handed``). Acks that are all of those take the statement without the runs'
    promotion (``leases.ack_outside_runs_ctes``). A message's run is fixed when it is
    published, so a fence whose attempt matches is outside any run; anything not known
    (another process's delivery, one forgotten) takes the full ack. Only the statement's
    cost depends on it, never what is written."""

    def __init__(self, kept: int = OUTSIDE_RUNS_KEPT) -> None:
        self._kept = kept
        self._attempts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._attempts)

    def leased(self, messages: Sequence[Message]) -> None:
        attempts = self._attempts
        for m in messages:
            if m.run_id is None and m.lease_owner is not None:
                attempts[m.id] = m.attempt
        if len(attempts) > self._kept:  # deliveries never acked here (lost, released)
            attempts.clear()

    def all_outside(self, fences: Sequence[Fence]) -> bool:
        """Whether every fence is a delivery leased outside any run; each is forgotten (it
        is being acked)."""
        pop, outside = self._attempts.pop, True
        for f in fences:
            if pop(f.message_id, None) != f.attempt:
                outside = False
        return outside

    def forget(self, fences: Sequence[Fence]) -> None:
        """Deliveries that leave without an ack (released, parked, failed)."""
        for f in fences:
            self._attempts.pop(f.message_id, None)


class PostgresLeaseOps(Driver):
    """PostgreSQL's claims, acks, renewals and transitions."""

    sql: PgStatements
    plans: ClaimPlans
    outside_runs: OutsideRuns

    def _claim(self, claim: Claim, *, plain: bool) -> tuple[Any, dict[str, Any]]:
        params: dict[str, Any] = {
            "owner": claim.owner,
            "claim": format(next(_MARKS), "x"),
            "lease_ms": int(claim.lease_ms),
            "limit": int(claim.limit),
            "now": claim.now,
        }
        sql = self.sql
        if len(claim.queues) == 1:
            params["queue"] = claim.queues[0]
            return (sql.claim_plain_single if plain else sql.claim_single), params
        params["queues"] = list(claim.queues)
        return (sql.claim_plain if plain else sql.claim), params

    def _ack_claim_statement(self, claim: Claim, *, plain: bool, outside_runs: bool) -> Any:
        sql, single = self.sql, len(claim.queues) == 1
        if plain and outside_runs:
            if single:
                return sql.ack_outside_runs_claim_plain_single
            return sql.ack_outside_runs_claim_plain
        if plain:
            return sql.ack_claim_plain_single if single else sql.ack_claim_plain
        if outside_runs:
            return sql.ack_outside_runs_claim_single if single else sql.ack_outside_runs_claim
        return sql.ack_claim_single if single else sql.ack_claim

    def _plain_claimed(self, claim: Claim, rows: list[dict[str, Any]]) -> list[Message]:
        claimed = plain_claimed(rows)
        if claimed.held_ahead:
            self.plans.held_ahead(claim.queues)
        self.outside_runs.leased(claimed)
        return claimed

    def _claimed(self, rows: list[dict[str, Any]]) -> list[Message]:
        claimed = messages_of([r for r in rows if r["id"] is not None])
        self.outside_runs.leased(claimed)
        return claimed

    def message_claim(self, claim: Claim) -> Op[list[Message]]:
        plain = self.plans.plain(claim.queues)
        statement, params = self._claim(claim, plain=plain)
        mark = (claim.owner, params["claim"])
        if not plain:
            return Op(Lane.LEASES, statement, params, self._claimed, claim_mark=mark)
        finish = lambda rows: self._plain_claimed(claim, rows)  # noqa: E731
        return Op(Lane.LEASES, statement, params, finish, claim_mark=mark)

    def release_lost_claims(self, owner: str, marks: Sequence[str], since: float) -> Op[Acked]:
        # The released messages are ready at once, each its run's head and in its gate's
        # line again: nothing is owed to a run or a gate that their next ack does not pay.
        change = Change("ready", "released", None, 0, True, None, '{"refund": true}')
        params = {**change.params(None), "owner": owner, "claims": list(marks)}
        params.update(window_ms=window_ms(since), channel=self.wakeup_channel)
        return Op(Lane.LEASES, self.sql.release_lost, params, acked_of)

    def _each_owner(
        self,
        conn: Connection,
        statement: Any,
        groups: Mapping[str, list[Fence]],
        terms: Mapping[str, Any],
    ) -> Acked:
        """``statement`` once per owner's fences: the ids changed, the runs owed."""
        ids: set[int] = set()
        owed: list[str] = []
        gates: list[str] = []
        for owner, group in groups.items():
            params = {**fence_params(group), "owner": owner, **terms}
            done = acked_of([dict(r._mapping) for r in conn.execute(statement, params)])
            ids.update(done)
            owed.extend(done.owed_runs)
            gates.extend(done.owed_gates)
        return Acked(ids, owed, gates)

    def _ack_all(
        self, conn: Connection, groups: Mapping[str, list[Fence]], now: int | None
    ) -> Acked:
        terms = {"now": now, "channel": self.wakeup_channel}
        return self._each_owner(conn, self.sql.ack, groups, terms)

    def message_ack(self, fences: Sequence[Fence], now: int | None) -> Op[Acked]:
        groups = by_owner(fences)
        if not groups:
            return Op.answer(Acked())
        if len(groups) == 1:
            ((owner, group),) = groups.items()
            params = {**fence_params(group), "owner": owner, "now": now}
            params["channel"] = self.wakeup_channel
            outside = self.outside_runs.all_outside(group)
            statement = self.sql.ack_outside_runs if outside else self.sql.ack
            return Op(Lane.LEASES, statement, params, acked_of)
        self.outside_runs.forget(fences)
        return Op(
            Lane.LEASES, body=lambda conn: self._ack_all(conn, groups, now), statements=len(groups)
        )

    def message_ack_claim(
        self, fences: Sequence[Fence], claim: Claim
    ) -> Op[tuple[Acked, list[Message]]]:
        if not fences:
            return self.message_claim(claim).then(lambda claimed: (Acked(), claimed))
        groups = by_owner(fences)
        if list(groups) == [claim.owner]:
            # One statement: the claim does not see the acks' effects (a run's next message
            # waits for the next claim).
            plain = self.plans.plain(claim.queues)
            outside = self.outside_runs.all_outside(fences)
            combined = self._ack_claim_statement(claim, plain=plain, outside_runs=outside)
            params = self._claim(claim, plain=plain)[1]
            params.update(fence_params(fences), channel=self.wakeup_channel)

            def finish(rows: list[dict[str, Any]]) -> tuple[Acked, list[Message]]:
                if plain:
                    return acked_ids_of(rows), self._plain_claimed(claim, rows)
                return acked_ids_of(rows), self._claimed(rows)

            mark = (claim.owner, params["claim"])
            return Op(Lane.LEASES, combined, params, finish, claim_mark=mark)

        self.outside_runs.forget(fences)
        statement, params = self._claim(claim, plain=False)

        def body(conn: Connection) -> tuple[Acked, list[Message]]:
            acked = self._ack_all(conn, groups, claim.now)
            rows = [dict(r._mapping) for r in conn.execute(statement, params)]
            return acked, self._claimed(rows)

        mark = (claim.owner, params["claim"])
        return Op(Lane.LEASES, body=body, statements=len(groups) + 1, claim_mark=mark)

    def message_renew(
        self, fences: Sequence[Fence], lease_ms: int, now: int | None
    ) -> Op[dict[int, int]]:
        groups = by_owner(fences)
        each = [
            {**fence_params(group), "owner": owner, "lease_ms": int(lease_ms), "now": now}
            for owner, group in groups.items()
        ]
        if len(each) <= 1:
            if not each:
                return Op.answer({})
            return Op(Lane.PLANNED, self.sql.renew, each[0], expiries_of)

        def body(conn: Connection) -> dict[int, int]:
            held: dict[int, int] = {}
            for params in each:
                held.update(
                    expiries_of([dict(r._mapping) for r in conn.execute(self.sql.renew, params)])
                )
            return held

        return Op(Lane.PLANNED, body=body, statements=len(each))

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
        self.outside_runs.forget(fences)
        terms = {**change.params(now), "channel": self.wakeup_channel}

        if len(groups) == 1 and also is None:
            # One statement in autocommit, on the main engine as a transaction would be.
            ((owner, group),) = groups.items()
            params = {**fence_params(group), "owner": owner, **terms}
            return Op(Lane.PLANNED, self.sql.transition, params, acked_of)

        def body(conn: Connection) -> Acked:
            changed = self._each_owner(conn, self.sql.transition, groups, terms)
            if changed and also is not None:
                also(conn)  # the caller's write, in the same transaction
            return changed

        return Op(Lane.DEFAULT, body=body, statements=len(groups) + (also is not None))
