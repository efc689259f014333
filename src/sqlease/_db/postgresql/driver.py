"""The PostgreSQL driver: every hot operation one statement, on the pool of its lane.

Data-modifying CTEs write a claim's run locks, gate slots, rate limits, task attempts and
events inside the claim itself, and likewise for publish, ack, ack + claim, renew, transition
and the result write, so each op is one autocommit statement: one round trip, one commit,
and the event loop can send it without blocking (``line``). Only a batch that names several
owners, or a publish of several rows, is a transaction of several statements. The lease
operations (claim, ack, renew, transition) are in ``lease_ops.py``, its base.

Lanes: the per-task statements bypass SQLAlchemy's execution layer (direct.py) on an engine
of their own whose sessions use generic plans; the idle worker's offers, takes and renewals
run on the main engine, whose plans follow the values; claims and acks on a pool whose
commits do not wait for the WAL flush unless ``lease_sync_commit``; publishes on that pool
too when ``publish_sync_commit`` is off. An engine a user passed in serves every lane.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from sqlalchemy import Connection, Select, Table, any_, delete, exists, func, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.dml import Delete, Update

from sqlease._db.driver import (
    Admit,
    Lane,
    Offer,
    Op,
    ResultWrite,
    by_owner,
    publish_each,
)
from sqlease._db.ops import batch_json
from sqlease._db.postgresql import PgStatements, pooler, statements
from sqlease._db.postgresql.dialect import (
    DEAD_OFFER_AFTER_MS,
    EVENT_SETTLE_MS,
    capabilities,
    fence_params,
)
from sqlease._db.postgresql.direct import NONBLOCKING, DirectLane
from sqlease._db.postgresql.engine import warn_if_jit
from sqlease._db.postgresql.gates import LOCK_TIMEOUT
from sqlease._db.postgresql.lanes import KeptLine, LaneRunner, build_lanes
from sqlease._db.postgresql.lease_ops import ClaimPlans, OutsideRuns, PostgresLeaseOps
from sqlease._db.postgresql.listener import PostgresListener
from sqlease._db.postgresql.lost_claims import LostClaims
from sqlease._db.postgresql.results import result_params
from sqlease._db.retry import lost_connection
from sqlease._db.rows import Acked, acked_ids_of, db_now_of, due_of, messages_of
from sqlease._db.tables import Tables
from sqlease._db.wakeup import PollingWaker, Waker
from sqlease.types import Fence, Message, Outcome
from sqlease.urls import to_sqlalchemy_url

T = TypeVar("T")

logger = logging.getLogger(__name__)

NOTIFY = text("SELECT pg_notify(:channel, :key)")


#: The engines passed in whose sessions were checked for JIT (once each).
_checked: weakref.WeakSet[Engine] = weakref.WeakSet()


class PostgresDriver(PostgresLeaseOps):
    name = "postgresql"
    remote = True
    nonblocking = NONBLOCKING
    event_settle_ms = EVENT_SETTLE_MS
    sql: PgStatements

    def __init__(
        self,
        url: str | URL | Engine,
        engine: Engine,
        tables: Tables,
        *,
        lease_sync_commit: bool,
        publish_sync_commit: bool,
        engines: Callable[..., Engine],
    ) -> None:
        super().__init__(engine, tables)
        self.sql = statements(tables)
        self.plans = ClaimPlans()
        self.outside_runs = OutsideRuns()
        self.lost_claims = LostClaims()
        self.results_channel = f"{tables.prefix}results"
        self.publish_sync_commit = publish_sync_commit
        #: What the URL says about a pooler in front of the server (see pooler.py).
        self.pooling = pooler.split(
            engine.url if isinstance(url, Engine) else to_sqlalchemy_url(url)
        )[1]
        self.caps = capabilities(self.pooling)
        if isinstance(url, Engine) and url not in _checked:
            # sqlease's own engines start their sessions with jit=off; one passed in may not.
            _checked.add(url)
            warn_if_jit(url)
        self._lanes = build_lanes(
            url,
            engine,
            self.pooling,
            lease_sync_commit=lease_sync_commit,
            publish_sync_commit=publish_sync_commit,
            engines=engines,
        )

    def lane(self, lane: Lane) -> LaneRunner:
        """The pool a one-statement op on ``lane`` runs on."""
        return self._lanes[lane]

    # ---- transactions ----------------------------------------------------------------

    @contextmanager
    def writing(self, statements: int = 2) -> Iterator[Connection]:
        # One statement runs in autocommit: the same atomicity, without the BEGIN and
        # COMMIT round trips.
        if statements == 1:
            with self.engine.connect() as conn:
                yield conn.execution_options(isolation_level="AUTOCOMMIT")
            return
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        # Under READ COMMITTED each statement has its own snapshot in a transaction too: in
        # autocommit a read sees the same, without BEGIN and ROLLBACK (half a one-row read).
        with self.writing(1) as conn:
            yield conn

    def fork_section(self) -> AbstractContextManager[None]:
        return nullcontext()

    @contextmanager
    def _transaction(self, lane: Lane, statements: int) -> Iterator[Connection]:
        if lane is not Lane.PUBLISH or self.publish_sync_commit:
            with self.writing(statements) as conn:
                yield conn
            return
        # SET LOCAL needs a transaction (one statement too), and changes this transaction's
        # commit only: the pooled session keeps its setting.
        with self.writing(max(statements, 2)) as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")
            yield conn

    # ---- running ops -----------------------------------------------------------------

    def execute(self, op: Op[T]) -> T:
        if self.lost_claims.owed:
            self._release_lost_claims()
        try:
            if op.statement is not None:
                done: Any = self._lanes[op.lane].rows(op.statement, op.params)
            elif op.body is not None:
                with self._transaction(op.lane, op.statements) as conn:
                    done = op.body(conn)
            else:
                done = None
        except DBAPIError as exc:
            if op.claim_mark is not None and lost_connection(exc):
                self.lost_claims.add(op.claim_mark)
            raise
        return done if op.finish is None else op.finish(done)

    def _release_lost_claims(self) -> None:
        """What blocking claims whose answers may have been lost leased, released before the
        next op (whose retry this usually is: sqlease._db.postgresql.lost_claims)."""
        for owner, marks, since in self.lost_claims.take():
            try:
                self.execute(self.release_lost_claims(owner, marks, since))
            except Exception as exc:
                if not lost_connection(exc):  # refused: never retried, the leases expire
                    logger.warning("sqlease: releasing unheard claims' leases failed: %s", exc)
                    continue
                for mark in marks:
                    self.lost_claims.add((owner, mark), since)
                raise

    def line(self, lane: Lane) -> KeptLine:
        runner = self._lanes[lane]
        assert isinstance(runner, DirectLane)  # only publishes may be SET LOCAL transactions
        return KeptLine(runner)

    def line_key(self, lane: Lane) -> object:
        return self._lanes[lane].engine  # lanes on one engine share a connection

    def pin_thread(self, lane: Lane) -> None:
        runner = self._lanes[lane]
        if isinstance(runner, DirectLane):
            runner.pin_thread()

    def release_thread(self, lane: Lane) -> None:
        runner = self._lanes[lane]
        if isinstance(runner, DirectLane):
            runner.release_thread()

    # ---- dialect constructs ----------------------------------------------------------

    def insert(self, table: Table) -> Any:
        return pg_insert(table)

    def one_of(self, column: Any, keys: Any) -> Any:
        # ``= ANY(ARRAY(subquery))``: the batch's keys become one array, looked up through
        # the key's index. With ``IN (subquery)`` the planner may join instead, and on a
        # table it thinks small it hashes the batch and reads the whole table.
        return column == any_(func.array(keys.scalar_subquery()))

    def events_per_row(self) -> Any:
        # A batch row (one statement's claimed or acked events) lists its messages.
        return func.coalesce(func.cardinality(self.tables.events.c.message_ids), 1)

    def batch_event_deletes(self, old: Select[Any], batch: int) -> dict[str, Delete]:
        ev, m = self.tables.events, self.tables.messages
        none_queued = ~exists().where(m.c.task_id == any_(ev.c.task_ids))
        rows = old.where(ev.c.task_ids.isnot(None), none_queued).limit(batch)
        return {"events_batch": delete(ev).where(self.one_of(ev.c.id, rows))}

    def leftovers(self, now: int) -> dict[str, Delete | Update]:
        offers = self.tables.offers
        # The lock test runs last (SQL does not promise an order; a live worker's lock only
        # makes the test fail, it never waits). A dead worker's offer: its listening
        # connection, which held the lock, is gone.
        lock_free = func.pg_try_advisory_xact_lock_shared(offers.c.lock_key)
        stale = offers.c.expires_at_ms < now - DEAD_OFFER_AFTER_MS
        return {"dead_offers_dropped": delete(offers).where(stale, lock_free)}

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        conn.execute(NOTIFY, {"channel": channel, "key": payload})

    def waker(
        self, channel: str, *, lock_key: int | None = None, shared_keys: Sequence[int] = ()
    ) -> Waker:
        # Past a transaction pooler, LISTEN and session locks go direct (listen_url).
        url = self.pooling.listen_url if self.pooling.transaction else self.engine.url
        if url is None:
            return PollingWaker()
        return PostgresListener(url, channel, lock_key, shared_keys, lease_ms=self.lease_ms)

    def queues_param(self, queues: Sequence[str]) -> Any:
        return list(queues)  # text[]

    # ---- operations: messages --------------------------------------------------------

    def message_publish(
        self,
        rows: Sequence[Mapping[str, Any]],
        now: int | None,
        *,
        handoff: bool = True,
        admit: Admit | None = None,
    ) -> Op[list[int]]:
        channel = self.wakeup_channel
        plain = self.sql.enqueue_plain
        if len(rows) == 1 and admit is None:
            row = rows[0]
            statement = self._publish_statement(row) if handoff else plain
            params = {**row, "now": now, "channel": channel}
            return Op(Lane.PUBLISH, statement, params, lambda done: [int(done[0]["id"])])

        def body(conn: Connection) -> list[int]:
            def insert(row: Mapping[str, Any]) -> int:
                statement = self._publish_statement(row) if handoff else plain
                params = {**row, "now": now, "channel": channel}
                return int(conn.execute(statement, params).scalar_one())

            return publish_each(conn, rows, now, admit, insert)

        # A unique task's admission is a few statements more: never in autocommit.
        return Op(Lane.PUBLISH, body=body, statements=len(rows) + (2 if admit else 0))

    def publish_bulk(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]], now: int | None
    ) -> list[int]:
        params = {"rows": batch_json(rows), "now": now, "channel": self.wakeup_channel}
        return [int(row[0]) for row in conn.execute(self.sql.enqueue_batch, params)]

    def _publish_statement(self, row: Mapping[str, Any]) -> Any:
        """The publish with the handoff lookup only for a message an idle worker's offer could
        take: one with a run, a delay or a concurrency key never can (a claim must check its
        run, due time or gate), and the lookup costs such a publish about 50 us of server
        time for nothing (benchmarks/publish_floor.py)."""
        if row["run_id"] is None and row["delay_ms"] <= 0 and row["gate_key"] is None:
            return self.sql.enqueue
        return self.sql.enqueue_plain

    def run_promote(self, run_ids: Sequence[str], now: int | None) -> Op[list[int]]:
        params = {"runs": sorted(set(run_ids)), "now": now, "channel": self.wakeup_channel}

        def body(conn: Connection) -> list[int]:
            # Two statements: the second's snapshot is taken after the first's row locks
            # (sqlease._db.postgresql.held).
            conn.execute(self.sql.bump_runs, params)
            return [int(r.id) for r in conn.execute(self.sql.promote_runs, params)]

        return Op(Lane.DEFAULT, body=body, statements=2)

    def gate_promote(self, gates: Sequence[str], now: int | None) -> Op[list[int]]:
        params = {"gates": sorted(set(gates)), "now": now, "channel": self.wakeup_channel}
        return Op(Lane.DEFAULT, self.sql.promote_gates, params, lambda r: [int(x["id"]) for x in r])

    def gate_park(self, queue: str, scan: int, now: int | None) -> Op[list[int]]:
        params = {"queue": queue, "scan": int(scan), "now": now}

        def body(conn: Connection) -> list[int]:
            conn.execute(text(LOCK_TIMEOUT))
            return [int(r.id) for r in conn.execute(self.sql.park_gates, params)]

        return Op(Lane.DEFAULT, body=body, statements=2)

    def rate_project(
        self, queue: str, scan: int, horizon_ms: int, now: int | None
    ) -> Op[list[int]]:
        params = {"queue": queue, "scan": int(scan), "horizon": int(horizon_ms), "now": now}

        def body(conn: Connection) -> list[int]:
            conn.execute(text(LOCK_TIMEOUT))
            return [int(r.id) for r in conn.execute(self.sql.project_rates, params)]

        return Op(Lane.DEFAULT, body=body, statements=2)

    def rate_release(self, rates: Sequence[str], now: int | None) -> Op[list[int]]:
        params = {"rates": sorted(set(rates)), "now": now}
        return Op(Lane.DEFAULT, self.sql.release_rates, params, lambda r: [int(x["id"]) for x in r])

    def message_take(self, queues: Sequence[str], limit: int, now: int | None) -> Op[list[Message]]:
        params = {"queues": list(queues), "limit": int(limit), "now": now}
        return Op(Lane.PLANNED, self.sql.take, params, messages_of)

    # ---- operations: results ---------------------------------------------------------

    def result_put(self, write: ResultWrite) -> Op[Outcome]:
        # One statement in autocommit (one round trip, one commit): the lease check locks the
        # message row, the upsert writes only if it held, and the notification goes out with
        # the commit.
        fence = write.fence
        statement = self.sql.result_put
        if write.offer is not None and fence is not None:
            statement = self.sql.result_put_offer

        def outcome(rows: list[dict[str, Any]]) -> Outcome:
            (found,) = rows
            if fence is not None and not found["held"]:
                return Outcome.LEASE_LOST
            return Outcome.UPDATED if found["stored"] else Outcome.KEPT_SUCCESS

        return Op(Lane.DEFAULT, statement, result_params(write), outcome)

    # ---- operations: offers ----------------------------------------------------------

    def offer_put(self, offer: Offer) -> Op[tuple[int | None, int | None]]:
        return Op(
            Lane.PLANNED,
            self.sql.offer_and_next_due,
            offer.params(),
            lambda r: (due_of(r), db_now_of(r)),
        )

    def offer_ack(
        self, fences: Sequence[Fence], offer: Offer
    ) -> Op[tuple[Acked, int | None, int | None]]:
        groups = by_owner(fences)
        if list(groups) == [offer.owner] or not fences:
            # Without acks: only the offers a publish used stand again (and missing ones are
            # made); a live one is left unlocked for the publish that may be looking for it.
            # Not durable (an offer lost in a crash is only a claim more): no flush wait, so
            # the offer stands a millisecond sooner.
            params = {**fence_params(fences), **offer.params(), "channel": self.wakeup_channel}
            outside = self.outside_runs.all_outside(fences)
            return Op(
                Lane.LEASES,
                self.sql.ack_outside_runs_offer if outside else self.sql.ack_offer,
                params,
                lambda r: (acked_ids_of(r), due_of(r), db_now_of(r)),
            )
        self.outside_runs.forget(fences)

        def body(conn: Connection) -> tuple[Acked, int | None, int | None]:
            acked = self._ack_all(conn, groups, offer.now)
            rows = [
                dict(r._mapping) for r in conn.execute(self.sql.offer_and_next_due, offer.params())
            ]
            return acked, due_of(rows), db_now_of(rows)

        return Op(Lane.PLANNED, body=body, statements=len(groups) + 1)

    def offer_handed(self, messages: Sequence[Message]) -> None:
        self.outside_runs.leased(messages)

    def offer_withdraw(self, owner: str, *, handed_too: bool = False) -> Op[None]:
        statement = self.sql.offer_withdraw_all if handed_too else self.sql.offer_withdraw
        return Op(Lane.DEFAULT, statement, {"owner": owner}, lambda _rows: None)
