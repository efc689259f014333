"""Riding out a database outage inside the transport while leases can still be held.

A connection error that reaches Celery makes it restart its consumer: it closes the
connection, and the close gives back every delivery the channels hold, running tasks
included (a fenced release each, or, with the database still down, a lease left to run out
unrenewed). A running task then loses its lease and is delivered again, though its lease
would have outlasted the outage: a PostgreSQL restart or failover takes seconds to a minute,
and the store's own retries give up after 20 s.

So while any delivery held in this process can still hold its lease (its lease clock has not
run out), a connection error stays in the transport: it is logged, the event loop goes on and
the next poll tries again; the heartbeat renews the leases once the database answers, and the
tasks' acks go through the same channels. Once no lease can be held any more (or none is
held), the error goes to Celery, which reconnects as it does for any broker.

An ack on its way to the database counts as well, until it is answered or its lease clock
runs out: its lease is no longer renewed (the ack took it off the heartbeat), but the database
still holds it for this process. A task that ends during the outage as the last one running
(one that stores no result, say) would otherwise let Celery reconnect, and the reconnect drops
the unwritten ack: the message would come back at the lease's expiry and run again, where the
ack, written once the database answers, ends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from sqlease.store import Fence

logger = logging.getLogger(__name__)

#: How often the outage is logged while it is ridden out.
LOG_EVERY_S = 10.0
#: Acks on their way beyond this many: those whose lease clock ran out are forgotten.
PRUNE_ABOVE = 4096


class Outage:
    """``alive()``: how many deliveries held in this process can still hold their lease
    (their lease clocks, on ``monotonic``)."""

    def __init__(
        self, alive: Callable[[], int], *, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._alive = alive
        self._monotonic = monotonic
        self._logged_at: float | None = None
        #: Acks sent or waiting to be, not yet answered: their lease clocks. Any thread may
        #: ack (an ack outside the event loop is written at once).
        self._leaving: dict[Fence, float] = {}
        self._lock = threading.Lock()

    def leaving(self, acks: Iterable[tuple[Fence, float]]) -> None:
        """These ``(fence, deadline)`` are acked: each lease, held until its deadline (its
        clock when it left the heartbeat), counts until its ack is answered."""
        with self._lock:
            self._leaving.update(acks)
            if len(self._leaving) > PRUNE_ABOVE:  # answers lost on a path not told: bounded
                self._prune(self._monotonic())

    def answered(self, fences: Iterable[Fence]) -> None:
        """The database answered these acks (written or refused), or they were given up."""
        with self._lock:
            for fence in fences:
                self._leaving.pop(fence, None)

    def alive(self) -> int:
        """Deliveries held here that can still hold their leases, acks on their way
        included."""
        alive = self._alive()
        if self._leaving:
            now = self._monotonic()
            with self._lock:
                self._prune(now)
                alive += len(self._leaving)
        return alive

    def _prune(self, now: float) -> None:
        """(Under the lock.) Acks whose lease clock ran out no longer count."""
        for fence in [f for f, deadline in self._leaving.items() if deadline < now]:
            del self._leaving[fence]

    def holds_back(self, error: BaseException) -> bool:
        """Whether the connection error ``error`` stays here (True: it was logged) rather than
        going to Celery."""
        alive = self.alive()
        if alive == 0:
            self._logged_at = None
            return False
        now = self._monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            logger.warning(
                "sqlease: the database cannot be reached (%s: %s); %d %s held here can still "
                "hold %s, so the transport retries instead of reconnecting (a reconnect "
                "would give %s back)",
                type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
                alive,
                *(
                    ("delivery", "its lease", "it")
                    if alive == 1
                    else ("deliveries", "their leases", "them")
                ),
            )
        return True
