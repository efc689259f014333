"""PostgreSQL: the release of what a claim leased when its answer never came back.

A claim that reached the server and committed, but whose answer was lost on the way back (the
network cut between the commit and the reply, a statement given up after a lease without an
answer), leased its messages to a worker that never learnt of them. Sent again, the claim
leases others; the lost ones waited out their lease and came back with one delivery more
spent: with the default budget of three, two such losses in an outage failed a task
``attempts_exhausted`` that never ran.

Every claim marks its batch event with a mark of its own (``JSON_CLAIM``: the owner and
``:claim``). Before a claim whose outcome is unknown is sent again, this statement finds the
batch events of its marks and releases the deliveries they list that its owner still holds,
with the attempt refunded (as a warm shutdown's prefetched messages are): they are claimable
at once, by this worker's next claim or any other's. A try that did not commit left no event
and releases nothing."""

from __future__ import annotations

import threading
import time

from sqlalchemy import TextClause

from sqlease._db.postgresql import leases
from sqlease._db.postgresql.dialect import NOW
from sqlease._db.tables import Tables


def lost_fences(t: Tables) -> str:
    """The deliveries (``id, attempt``) of the claims marked ``:claims`` by ``:owner`` in the
    last ``:window_ms`` (the events' time index bounds the search)."""
    return (
        "SELECT u.id, u.attempt "
        f"FROM {t.events.name} ev CROSS JOIN LATERAL unnest(ev.message_ids, ev.attempts) "
        "AS u(id, attempt) "
        f"WHERE ev.at_ms >= {NOW} - CAST(:window_ms AS BIGINT) AND ev.kind = 'claimed' "
        "AND ev.data IN (SELECT json_build_object('owner', CAST(:owner AS TEXT), 'claim', x)"
        "::text FROM unnest(CAST(:claims AS TEXT[])) AS x)"
    )


def release_lost(t: Tables) -> TextClause:
    """The transition (``leases.transition``) of the lost claims' deliveries its owner holds."""
    return leases.transition(t, lost_fences(t))


#: Milliseconds the search reaches back before the lost try was noticed: its statement may
#: have waited that long for its answer (a statement is given up after a lease, at most a
#: minute by default).
MARGIN_MS = 120_000


class LostClaims:
    """The marks of blocking claims whose connection dropped under them, by owner, until a
    release of what they leased has run (the driver runs it before its next op)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: owner -> (marks, monotonic time the first was noticed)
        self._owed: dict[str, tuple[list[str], float]] = {}

    @property
    def owed(self) -> bool:
        return bool(self._owed)

    def add(self, mark: tuple[str, str], since: float | None = None) -> None:
        owner, claim = mark
        with self._lock:
            marks, first = self._owed.get(owner, ([], time.monotonic()))
            self._owed[owner] = ([*marks, claim], first if since is None else min(first, since))

    def take(self) -> list[tuple[str, list[str], float]]:
        """Each owner's marks, and since when (monotonic) one was owed; forgotten here until
        ``add`` gives them back (their release failed too)."""
        with self._lock:
            owed, self._owed = self._owed, {}
        return [(owner, marks, since) for owner, (marks, since) in owed.items()]


def window_ms(since: float) -> int:
    """How far back (ms) the search for claims noticed lost at ``since`` (monotonic) reaches."""
    return int((time.monotonic() - since) * 1000) + MARGIN_MS
