"""The PostgreSQL driver's lanes: which pool each runs on (``build_lanes``), a lane of
transactions that skip the WAL flush by ``SET LOCAL`` (no no-flush pool of sqlease's: an
engine passed in, a pooler), and the kept connection an event loop sends ops on."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.engine import URL, Engine
from sqlalchemy.sql.elements import TextClause

from sqlease._db.ops import Lane, Op
from sqlease._db.postgresql.direct import DirectLane, Sending
from sqlease._db.postgresql.pooler import Pooling


class NoFlushLane:
    """Each one-statement op in a transaction of its own whose commit does not wait for the
    WAL flush (``SET LOCAL`` changes this transaction's commit only: a pooled session, and a
    pooler's, keeps its setting)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.engine = engine

    def rows(self, statement: TextClause, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        with self._engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")
            return [dict(r._mapping) for r in conn.execute(statement, params)]


class KeptLine:
    """One pooled connection an event loop keeps, in autocommit, to send one-statement ops
    on without blocking (``Driver.line``). A failed statement gives its connection back (or
    drops it); the next send takes a fresh one."""

    def __init__(self, lane: DirectLane) -> None:
        self._lane = lane
        self._fairy: Any = None
        self._sending: Sending | None = None

    def connect(self) -> None:
        """Hold a connection (blocking: a pool checkout, perhaps a new connection)."""
        if self._sending is not None and self._sending.error is not None:
            self._fairy = None  # given back (or dropped) by that failure
        self._sending = None
        if self._fairy is None:
            self._fairy = self._lane.kept_connection()

    def send(self, op: Op[Any]) -> Sending:
        assert op.statement is not None  # a line is handed sendable ops only
        self.connect()
        try:
            self._sending = self._lane.send(op.statement, op.params, self._fairy)
        except BaseException:  # the connection is in an unknown state: dropped
            self._lane.give_back(self._fairy, busy=True)
            self._fairy = None
            raise
        return self._sending

    @property
    def holds_connection(self) -> bool:
        """A connection is kept for the next send (none after a failed statement)."""
        failed = self._sending is not None and self._sending.error is not None
        return self._fairy is not None and not failed

    def close(self, *, busy: bool = False) -> None:
        """Give the connection back; ``busy``: a statement is still under way on it (it is
        dropped)."""
        if self._sending is not None and self._sending.error is not None:
            self._fairy = None
        self._sending = None
        if self._fairy is not None:
            self._lane.give_back(self._fairy, busy=busy)
            self._fairy = None


#: What a one-statement op on a lane runs on.
LaneRunner = DirectLane | NoFlushLane


def build_lanes(
    url: str | URL | Engine,
    engine: Engine,
    pooling: Pooling,
    *,
    lease_sync_commit: bool,
    publish_sync_commit: bool,
    engines: Callable[..., Engine],
) -> dict[Lane, LaneRunner]:
    """The pool, and so the commit level, of each lane: the per-task statements on an engine
    of their own whose sessions use generic plans (DEFAULT); offers, takes and renewals on
    the main engine, whose plans follow the values (PLANNED); claims and acks on a pool whose
    commits do not wait for the WAL flush unless ``lease_sync_commit`` (LEASES); publishes
    there too when ``publish_sync_commit`` is off (PUBLISH). An engine a user passed in, or
    ``shared_pool=true``, serves every lane."""
    ours = not isinstance(url, Engine)  # sqlease's own engines keep spare connections
    if pooling.transaction or pooling.shared:
        # Behind a pooler the no-flush pool would be a session setting (a publish that skips
        # the flush does it with SET LOCAL in its transaction instead), and shared_pool=true
        # means one engine, the URL's: claims and acks wait for the flush as publishes do.
        lease_sync_commit = True
    single = isinstance(url, Engine) or pooling.shared
    hot = engine if isinstance(url, Engine) or single else engines(url, generic_plans=True)
    default = DirectLane(hot, spares=ours)
    no_flush = (
        DirectLane(engines(url, generic_plans=True, wait_for_flush=False), spares=True)
        if not isinstance(url, Engine)
        and not single
        and not (lease_sync_commit and publish_sync_commit)
        and not pooling.transaction
        else None
    )
    leases = default if no_flush is None or lease_sync_commit else no_flush
    publish: LaneRunner = default
    if not publish_sync_commit:
        # Without a no-flush pool of sqlease's (an engine passed in, a pooler), a publish
        # skips the flush by SET LOCAL in a transaction of its own.
        publish = no_flush if no_flush is not None else NoFlushLane(engine)
    planned = DirectLane(engine, spares=ours)
    return {
        Lane.DEFAULT: default,
        Lane.PLANNED: planned,
        Lane.LEASES: leases,
        Lane.PUBLISH: publish,
        Lane.READ: planned,
    }
