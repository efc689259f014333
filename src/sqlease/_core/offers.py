"""Idle workers' standing offers (PostgreSQL handoff, see sqlease._core.handoff)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlease._core.base import due_ms
from sqlease._core.leases import Leases
from sqlease._db.driver import Lane
from sqlease._db.retry import transient
from sqlease.errors import ConfigurationError
from sqlease.types import Fence


class Offers(Leases):
    """Standing offers of idle workers."""

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
        planned = self.driver.lane(Lane.PLANNED)
        if not self.driver.caps.offers or planned is None:
            raise ConfigurationError("handoff offers need PostgreSQL")
        params = self._offer_params(queues, owner, lease_ms, lock_key, ttl_ms, seen, now)
        assert self.sql.offer_and_next_due is not None
        rows = planned.rows(self.sql.offer_and_next_due, params)
        return due_ms(rows)

    def _offer_params(
        self,
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None,
        now: int | None,
    ) -> dict[str, Any]:
        for name, value in (("lease_ms", lease_ms), ("ttl_ms", ttl_ms)):
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer, not {value!r}")
        names = list(dict.fromkeys(queues))  # one write per queue: a name given twice is one
        return {
            "queues": names,
            "seen": [int((seen or {}).get(q, 0)) for q in names],
            "owner": owner,
            "lease_ms": lease_ms,
            "lock_key": int(lock_key),
            "ttl_ms": ttl_ms,
            "now": self._now(now),
        }

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
    ) -> tuple[set[int], int | None]:
        """``ack(fences)`` and ``offer(queues, owner, …)`` in one statement (PostgreSQL): the
        ack that leaves a worker idle also leaves its offer. Returns the ids acked and when
        the next delayed message of ``queues`` is due. Fences of another owner, or no
        queues: the two run separately."""
        if (
            not self.driver.caps.offers
            or not fences
            or not queues
            or any(f.owner != owner for f in fences)
        ):
            acked = self.ack(fences, now=now) if fences else set()
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
        params = {
            **self.driver.fence_params(fences),
            **self._offer_params(queues, owner, lease_ms, lock_key, ttl_ms, seen, now),
        }
        planned = self.driver.lane(Lane.PLANNED)
        assert planned is not None and self.sql.ack_offer is not None
        rows = planned.rows(self.sql.ack_offer, params)
        acked = {int(i) for i in (rows[0]["acked_ids"] or [])} if rows else set()
        return acked, due_ms(rows)

    @transient
    def withdraw_offers(self, owner: str, *, handed_too: bool = False) -> None:
        """Remove ``owner``'s offers: no publish hands it a message from now on. Offers a
        publish used stay (no publish takes them) until the worker has heard of their
        handoffs, unless ``handed_too`` (the worker is closing)."""
        statement = self.sql.offer_withdraw_all if handed_too else self.sql.offer_withdraw
        default = self.driver.lane(Lane.DEFAULT)
        if self.driver.caps.offers and default is not None and statement is not None:
            default.rows(statement, {"owner": owner})

    @transient
    def leased_to(self, owner: str) -> list[Fence]:
        """The fences of every message ``owner`` holds now, expired leases included."""
        if not self.driver.caps.offers or self.sql.leased_to_owner is None:
            return []
        with self._reading() as conn:
            rows = conn.execute(self.sql.leased_to_owner, {"owner": owner}).fetchall()
        return [Fence(int(r.id), owner, int(r.attempt)) for r in rows]
