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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: How often the outage is logged while it is ridden out.
LOG_EVERY_S = 10.0


class Outage:
    """``alive()``: how many deliveries held in this process can still hold their lease."""

    def __init__(
        self, alive: Callable[[], int], *, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._alive = alive
        self._monotonic = monotonic
        self._logged_at: float | None = None

    def holds_back(self, error: BaseException) -> bool:
        """Whether the connection error ``error`` stays here (True: it was logged) rather than
        going to Celery."""
        alive = self._alive()
        if alive == 0:
            self._logged_at = None
            return False
        now = self._monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            logger.warning(
                "sqlease: the database cannot be reached (%s: %s); %d %s held here can still "
                "hold their leases, so the transport retries instead of reconnecting (a "
                "reconnect would give them back)",
                type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
                alive,
                "delivery" if alive == 1 else "deliveries",
            )
        return True
