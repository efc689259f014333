"""Idle workers' standing offers (the handoff, where the driver's ``caps.offers``; see
sqlease._core.handoff)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlease._core.base import Aggregate, StoreParts
from sqlease._core.leases import Leases, promote_owed
from sqlease._db.driver import Offer, Op
from sqlease._db.retry import transient
from sqlease._db.rows import Acked
from sqlease.errors import ConfigurationError
from sqlease.types import Fence, Message


class Offers(Aggregate):
    """Standing offers of idle workers."""

    def __init__(self, parts: StoreParts, leases: Leases) -> None:
        super().__init__(parts)
        self._leases = leases

    def offer(
        self,
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None = None,
        now: int | None = None,
    ) -> int | None:
        """An idle worker's standing offer to take the next message published to ``queues``
        (PostgreSQL): until ``ttl_ms`` from now, a publish to one of them that finds the offer
        leases the message to ``owner`` for ``lease_ms`` and hands it over in its notification
        (``sqlease._core.handoff``). The offer counts only while a connection holds the advisory
        lock ``lock_key``. Live offers for queues not listed are withdrawn.

        An offer a publish used stands again only once the worker has heard of that handoff:
        ``seen`` maps a queue to the highest ``offer_seq`` of the handoffs the worker has
        read for it. Returns, as ``next_due_in_ms`` does, when the next delayed message of
        ``queues`` is due."""
        if not queues:
            self.withdraw_offers(owner)
            return None
        terms = self._offer(queues, owner, lease_ms, lock_key, ttl_ms, seen, now)
        due, _db_now = self.driver.execute(self.driver.offer_put(terms))
        return due

    def _offer(
        self,
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None,
        now: int | None,
    ) -> Offer:
        for name, value in (("lease_ms", lease_ms), ("ttl_ms", ttl_ms)):
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer, not {value!r}")
        names = list(dict.fromkeys(queues))  # one write per queue: a name given twice is one
        heard = [int((seen or {}).get(q, 0)) for q in names]
        return Offer(names, heard, owner, lease_ms, int(lock_key), ttl_ms, self._now(now))

    def ack_and_offer(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None = None,
        now: int | None = None,
    ) -> tuple[Acked, int | None]:
        """``ack(fences)`` and ``offer(queues, owner, …)`` in one commit (PostgreSQL: one
        statement when every fence is ``owner``'s): the ack that leaves a worker idle also
        leaves its offer. Returns the ids acked and when the next delayed message of
        ``queues`` is due."""
        if not fences or not queues:
            acked = self._leases.ack(fences, now=now) if fences else Acked()
            due = self.offer(
                queues,
                owner,
                lease_ms=lease_ms,
                lock_key=lock_key,
                ttl_ms=ttl_ms,
                seen=seen,
                now=now,
            )
            return acked, due
        terms = self._offer(queues, owner, lease_ms, lock_key, ttl_ms, seen, now)
        acked, due, _db_now = self.driver.execute(self.driver.offer_ack(list(fences), terms))
        return promote_owed(self.driver, acked, terms.now), due

    def offer_op(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None = None,
        now: int | None = None,
        keep_live: bool = False,
    ) -> Op[tuple[Acked, int | None, int | None]]:
        """``ack_and_offer`` (or, without fences, ``offer``) as one op, for the worker's event
        loop: the ids acked, when the next delayed message is due, and the database's time
        (None when the offers were withdrawn). No queues: the offers are withdrawn (and there
        must be no fences). ``keep_live``: as the acks' offer, a live offer is left as it
        stands (not refreshed, so not locked while a publish may be looking for it)."""
        if not queues:
            if fences:
                raise ValueError("acks go with an offer for queues, or with a claim")
            op = self.driver.offer_withdraw(owner)
            return op.then(lambda _none: (Acked(), None, None))
        terms = self._offer(queues, owner, lease_ms, lock_key, ttl_ms, seen, now)
        if fences or keep_live:
            return self.driver.offer_ack(list(fences), terms)
        return self.driver.offer_put(terms).then(lambda found: (Acked(), found[0], found[1]))

    def handed(self, messages: Sequence[Message]) -> None:
        """Messages a publish leased to an offer reached their worker, which delivers them:
        the driver notes what they are for their acks (no statement is run)."""
        self.driver.offer_handed(messages)

    @transient
    def withdraw_offers(self, owner: str, *, handed_too: bool = False) -> None:
        """Remove ``owner``'s offers: no publish hands it a message from now on. Offers a
        publish used stay (no publish takes them) until the worker has heard of their
        handoffs, unless ``handed_too`` (the worker is closing)."""
        self.driver.execute(self.driver.offer_withdraw(owner, handed_too=handed_too))

    @transient
    def leased_to(self, owner: str) -> list[Fence]:
        """The fences of every message ``owner`` holds now, expired leases included."""
        with self.driver.reading() as conn:
            rows = conn.execute(self.sql.leased_to_owner, {"owner": owner}).fetchall()
        return [Fence(int(r.id), owner, int(r.attempt)) for r in rows]
