"""A leader lease: one row per name, renewed by heartbeat, fenced by ``(owner, term)``.

The term grows by one at every takeover, as a task's attempt does at every claim. Every write
a leader makes starts by renewing its lease in the same transaction (``ScheduleStore.firing`` in
``sqlease._core.schedules``), so a leader whose lease was taken over writes nothing. A lease
that expired with no takeover yet is renewed by its holder: only a takeover lets another beat
write, and it bumps the term, so the term is the fence. Refusing that renewal would make a
leader whose transaction waited on a lock, or ran past its lease, give the lease up and take
it again with nobody else there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from sqlease._core.store import Store
from sqlease._db.leaders import LeaderStatements


@dataclass(frozen=True)
class Term:
    """A leader lease held: who holds it and since which takeover."""

    owner: str
    term: int


class LeaderLease:
    """The lease named ``leader`` on one store."""

    def __init__(
        self,
        store: Store,
        leader: str,
        *,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.leader = leader
        #: The time leases and events are written at: the database's unless a test gives a
        #: clock (the store's own, else this one).
        self.clock = clock or store.clock
        self._leaders: LeaderStatements = store.sql.leaders

    def _at(self, now: int | None) -> int | None:
        """``now`` for a statement: given, the clock's, or None (the database's clock)."""
        if now is not None:
            return int(now)
        return None if self.clock is None else int(self.clock())

    def _now(self, now: int | None) -> int:
        given = self._at(now)
        return self.store.now_ms() if given is None else given

    def acquire(self, owner: str, lease_ms: int, *, now: int | None = None) -> Term | None:
        """Take the lease if nobody holds it (or its holder's lease expired): the new term."""
        params = {"name": self.leader, "owner": owner, "lease_ms": lease_ms, "now": self._at(now)}
        with self.store.driver.writing() as conn:
            row = conn.execute(self._leaders.create, params).first()
            if row is None:
                row = conn.execute(self._leaders.take, params).first()
        return None if row is None else Term(owner, int(row[0]))

    def renew(self, term: Term, lease_ms: int, *, now: int | None = None) -> bool:
        with self.store.driver.writing() as conn:
            return self._renew_on(conn, term, lease_ms, now)

    def _renew_on(
        self, conn: Connection, term: Term, lease_ms: int, now: int | None = None
    ) -> bool:
        params = {
            "name": self.leader,
            "owner": term.owner,
            "term": term.term,
            "lease_ms": lease_ms,
            "now": self._at(now),
        }
        return conn.execute(self._leaders.renew, params).first() is not None

    def release(self, term: Term, *, now: int | None = None) -> bool:
        params = {"name": self.leader, "owner": term.owner, "term": term.term, "now": self._at(now)}
        with self.store.driver.writing() as conn:
            return bool(conn.execute(self._leaders.release, params).rowcount == 1)

    def publish_info(self, term: Term, info: Mapping[str, Any], *, now: int | None = None) -> bool:
        params = {
            "name": self.leader,
            "owner": term.owner,
            "term": term.term,
            "info": json.dumps(info, sort_keys=True),
            "now": self._at(now),
        }
        with self.store.driver.writing() as conn:
            return bool(conn.execute(self._leaders.publish_info, params).rowcount == 1)

    def leader_row(self) -> dict[str, Any] | None:
        """The lease row: owner, term, expiry, when taken, and the published info."""
        leaders = self.store.tables.leaders
        with self.store.driver.reading() as conn:
            row = (
                conn.execute(select(leaders).where(leaders.c.name == self.leader))
                .mappings()
                .first()
            )
        if row is None:
            return None
        found = dict(row)
        found["info"] = json.loads(found["info"]) if found["info"] else {}
        return found
