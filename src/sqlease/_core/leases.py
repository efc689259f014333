"""Claims, acks and renewals: the hot path of every delivery.

Each is one driver operation (``message_claim``, ``message_ack``, ``message_ack_claim``,
``message_renew``), returned here as an :class:`~sqlease._db.driver.Op` (``claim_op``,
``ack_op``, ``ack_and_claim_op``) that the blocking methods execute and the worker's event
loop may send without blocking (sqlease.transport). An op's ``finish`` only decodes rows:
what follows a claim (exhausted messages, another look past them) is the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence

from sqlalchemy import Connection

from sqlease._core.base import Aggregate
from sqlease._db.driver import Claim, Driver, Op
from sqlease._db.retry import transient
from sqlease._db.rows import Acked, held_ahead
from sqlease.errors import ConfigurationError
from sqlease.types import Fence, Message

OnExhausted = Callable[[list[Message]], None] | None

__all__ = ["Acked", "Leases", "delivery_order", "runs_left", "split_exhausted"]


def delivery_order(messages: list[Message]) -> list[Message]:
    messages.sort(key=lambda m: (-m.priority, m.available_at_ms, m.id))
    return messages


def split_exhausted(found: list[Message]) -> tuple[list[Message], list[Message]]:
    """What a claim found: the messages to deliver, and those whose attempts were spent
    (marked dead by the claim itself)."""
    delivered = [m for m in found if m.state == "ready"]
    exhausted = [m for m in found if m.state != "ready"]
    return delivered, exhausted


def runs_left(exhausted: list[Message]) -> list[str]:
    """The runs the claim's exhausted messages left (marked dead by the claim, which does
    not make their runs' next messages ready: ``promote_runs`` does)."""
    return sorted({m.run_id for m in exhausted if m.run_id is not None})


def promote_runs(driver: Driver, run_ids: Iterable[str], now: int | None) -> list[int]:
    """Each run's head made ready where it waits parked behind its run (its own
    transaction, after the one that finished the run's earlier message)."""
    runs = sorted(set(run_ids))
    return driver.execute(driver.run_promote(runs, now)) if runs else []


def promote_gates(driver: Driver, gates: Iterable[str | None], now: int | None) -> list[int]:
    """Of each gate, as many messages parked there made ready as it has room for (its own
    transaction, after the one that freed a place of it)."""
    named = sorted({g for g in gates if g is not None})
    return driver.execute(driver.gate_promote(named, now)) if named else []


def promote_owed(driver: Driver, acked: Acked, now: int | None) -> Acked:
    """The runs an ack or a transition could not judge get their heads made ready; the
    gates whose places it freed, their parked messages."""
    promote_runs(driver, acked.owed_runs, now)
    promote_gates(driver, acked.owed_gates, now)
    return acked


#: How many of a queue's first ready messages a sweep's statement looks at, and how many
#: statements one sweep may run on a queue while each parks all it looked at.
PARK_SCAN = 2000
PARK_ROUNDS = 50
#: A message whose rate limit lets it through within this many milliseconds stays due (a
#: claim reads past it until then); a later one gets its turn as its due time.
RATE_HORIZON_MS = 2000


def _check_lease(lease_ms: int) -> None:
    if lease_ms < 1:
        raise ConfigurationError(f"lease_ms must be positive, not {lease_ms!r}")


class Leases(Aggregate):
    """Claims, acks, renewals, and the lease check of a fenced write."""

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
            found = self.driver.execute(
                self.claim_op(queues, owner, lease_ms, limit - len(delivered), now)
            )
            ready, exhausted = split_exhausted(found)
            delivered.extend(ready)
            self._runs_go_on(exhausted, now)
            if exhausted and on_exhausted is not None:
                on_exhausted(exhausted)
            # Only when the batch was spent on exhausted messages, or stopped in front of a
            # message its run, gate or rate may hold back (the next claim judges it), is
            # another look useful: a delivery must not wait a polling interval behind it.
            if not exhausted and not held_ahead(found):
                break
        return delivery_order(delivered)

    def _runs_go_on(self, exhausted: list[Message], now: int | None) -> None:
        runs = runs_left(exhausted)
        if runs:
            self.promote_runs(runs, now=now)
        if exhausted:
            self.promote_gates_of([m.id for m in exhausted], now=now)

    @transient
    def promote_gates_of(self, message_ids: Iterable[int], *, now: int | None = None) -> list[int]:
        """The gates the messages ``message_ids`` were claimed under, as many messages parked
        at each made ready as it has room for: a message a claim found exhausted (marked
        dead by the claim, which does not promote) left its gate's place; the ids made
        ready."""
        ids = sorted({int(i) for i in message_ids})
        if not ids:
            return []
        with self.driver.reading() as conn:
            found = conn.execute(self.sql.gates_of, {"ids": json.dumps(ids)})
            gates = [str(row[0]) for row in found]
        return promote_gates(self.driver, gates, self._now(now))

    @transient
    def promote_gates(self, gates: Iterable[str], *, now: int | None = None) -> list[int]:
        """Of each gate, as many messages parked there made ready as it has room for (a
        place freed by a statement that could not do it: ``Acked.owed_gates``, a limit
        raised or removed, the maintenance pass's repair); the ids made ready."""
        return promote_gates(self.driver, gates, self._now(now))

    @transient
    def park_held(
        self, queues: Iterable[str], *, scan: int = PARK_SCAN, now: int | None = None
    ) -> list[int]:
        """The sweep: of the first ``scan`` ready messages of each queue, those whose gate is
        full are parked at it, and those a rate limit holds for more than
        ``RATE_HORIZON_MS`` get the time it lets them through as their due time: out of the
        claim's way (a claim steps over every one of them otherwise). The ids. A worker runs
        it about once a second while it claims."""
        at = self._now(now)
        parked: list[int] = []
        for queue in dict.fromkeys(queues):
            # A scan that was all parked may have more behind it: a deep backlog goes in one
            # sweep, a statement of ``scan`` rows at a time.
            for _ in range(PARK_ROUNDS):
                ids: list[int] = self.driver.execute(self.driver.gate_park(queue, scan, at))
                parked += ids
                if len(ids) < scan:
                    break
            for _ in range(PARK_ROUNDS):
                op = self.driver.rate_project(queue, scan, RATE_HORIZON_MS, at)
                timed: list[int] = self.driver.execute(op)
                parked += timed
                if len(timed) < scan:
                    break
        return parked

    @transient
    def promote_runs(self, run_ids: Iterable[str], *, now: int | None = None) -> list[int]:
        """Make each run's head ready where it waits parked behind its run (its earlier
        message left by a way whose statement could not do it: an exhausted claim, an
        ``Acked.owed_runs``); the ids made ready."""
        return promote_runs(self.driver, run_ids, self._now(now))

    def claim_op(
        self, queues: Sequence[str], owner: str, lease_ms: int, limit: int, now: int | None
    ) -> Op[list[Message]]:
        """One claim (exhausted messages included, as the claim marks them). When it
        stopped in front of a message it does not judge (``held_ahead`` of its answer),
        there may be more to claim at once."""
        return self.driver.message_claim(Claim(queues, owner, int(lease_ms), int(limit), now))

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
        """``ack(fences)`` and ``claim(queues, owner, ...)`` in one commit: the ids acked and
        the messages delivered. On PostgreSQL, when every fence is ``owner``'s, one
        statement, whose claim does not see the acks' effects (the next message of a run
        whose message was just acked is not among those claimed); on SQLite one transaction,
        whose claim sees them. As ``claim``, a batch spent on exhausted messages looks
        again."""
        fences = list(fences)
        if not queues or limit < 1:
            return (self.ack(fences, now=now) if fences else Acked()), []
        now = self._now(now)
        acked, found = self.driver.execute(
            self.ack_and_claim_op(fences, queues, owner, lease_ms=lease_ms, limit=limit, now=now)
        )
        promote_owed(self.driver, acked, now)
        delivered, exhausted = split_exhausted(found)
        self._runs_go_on(exhausted, now)
        if exhausted and on_exhausted is not None:
            on_exhausted(exhausted)
        if (exhausted or held_ahead(found)) and len(delivered) < limit:
            delivered += self.claim(
                queues,
                owner,
                lease_ms=lease_ms,
                limit=limit - len(delivered),
                now=now,
                on_exhausted=on_exhausted,
            )
        return acked, delivery_order(delivered)

    def ack_and_claim_op(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int,
        now: int | None = None,
    ) -> Op[tuple[Acked, list[Message]]]:
        """``ack_and_claim`` as one op (exhausted messages included, as the claim marks
        them); ``queues`` not empty and ``limit`` at least 1."""
        _check_lease(lease_ms)
        claim = Claim(queues, owner, int(lease_ms), int(limit), self._now(now))
        return self.driver.message_ack_claim(list(fences), claim)

    # ---- renew -------------------------------------------------------------------------

    @transient
    def renew(
        self, fences: Iterable[Fence], *, lease_ms: int, now: int | None = None
    ) -> dict[int, int]:
        """Extend every lease still held; returns ``{message_id: new expiry}`` for those.

        A fence missing from the answer is lost (expired, taken over, parked or acked).
        """
        return self.driver.execute(
            self.driver.message_renew(list(fences), int(lease_ms), self._now(now))
        )

    # ---- ack ---------------------------------------------------------------------------

    @transient
    def ack(self, fences: Iterable[Fence], *, now: int | None = None) -> Acked:
        """Finish deliveries (the rows leave the table); returns the ids actually acked."""
        now = self._now(now)
        return promote_owed(self.driver, self.driver.execute(self.ack_op(fences, now)), now)

    def ack_op(self, fences: Iterable[Fence], now: int | None = None) -> Op[Acked]:
        """``ack`` as one op."""
        return self.driver.message_ack(list(fences), self._now(now))

    # ---- the lease check of a fenced write ------------------------------------------

    def holds_on(
        self,
        conn: Connection,
        fence: Fence,
        task_id: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Inside the caller's transaction: does ``fence`` hold a live lease (for a delivery
        of ``task_id``, when given)? Locks the message row until that transaction ends, so
        no takeover can slip in before the caller's write."""
        row = conn.execute(
            self.sql.lease_check,
            {
                "message_id": fence.message_id,
                "attempt": fence.attempt,
                "owner": fence.owner,
                "lease_ms": 0,
                "task_id": task_id,
                "now": self._now(now),
            },
        ).first()
        return row is not None

    @transient
    def is_held(self, fence: Fence, *, now: int | None = None) -> bool:
        """Does this delivery still hold its lease, by the database's answer?"""
        with self.driver.writing() as conn:
            return self.holds_on(conn, fence, None, now)
