"""The PostgreSQL driver: psycopg pools per lane, one-statement hot operations.

The per-task statements bypass SQLAlchemy's execution layer (sqlease._db.postgresql.fastpath)
on an engine of their own whose sessions use generic plans; the idle worker's offers run on
the main engine, whose plans follow the values; claims and acks run on a pool whose commits
do not wait for the WAL flush unless ``lease_sync_commit``; one-row publishes on that pool
too when ``publish_sync_commit`` is off. An engine a user passed in serves every lane.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import Connection, Table, any_, func, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import Driver, Lane
from sqlease._db.engine import get_engine
from sqlease._db.postgresql import pooler
from sqlease._db.postgresql.dialect import CAPABILITIES
from sqlease._db.postgresql.fastpath import FastPath
from sqlease._db.wakeup import PollingWaker, PostgresListener, Waker
from sqlease.types import Fence, Message
from sqlease.urls import to_sqlalchemy_url

NOTIFY = text("SELECT pg_notify(:channel, :key)")


class PostgresDriver(Driver):
    name = "postgresql"
    caps = CAPABILITIES

    def __init__(
        self,
        url: str | URL | Engine,
        engine: Engine,
        *,
        lease_sync_commit: bool,
        publish_sync_commit: bool,
    ) -> None:
        super().__init__(engine)
        self.publish_sync_commit = publish_sync_commit
        ours = not isinstance(url, Engine)  # sqlease's own engines keep spare connections
        #: What the URL says about a pooler in front of the server (see pooler.py).
        self.pooling = pooler.split(
            engine.url if isinstance(url, Engine) else to_sqlalchemy_url(url)
        )[1]
        if self.pooling.transaction:
            # The no-flush pool is a session setting; behind the pooler a publish that skips
            # the flush does it with SET LOCAL in its transaction (Lane.PUBLISH None), and the
            # claims and acks wait for the flush as publishes do.
            lease_sync_commit = True
        # shared_pool=true: one engine (the URL's) serves every lane, as an engine passed in
        # does: a third of the connections, for generic plans and the no-flush claims.
        single = isinstance(url, Engine) or self.pooling.shared
        if self.pooling.shared:
            lease_sync_commit = True
        hot = engine
        if not isinstance(url, Engine) and not single:
            hot = get_engine(url, generic_plans=True)
        default = FastPath(hot, spares=ours)
        # The pool whose commits do not wait for the flush, if anything uses it.
        no_flush = (
            FastPath(get_engine(url, generic_plans=True, wait_for_flush=False), spares=True)
            if not single
            and not isinstance(url, Engine)
            and not (lease_sync_commit and publish_sync_commit)
            and not self.pooling.transaction
            else None
        )
        self._lanes: dict[Lane, FastPath | None] = {
            Lane.DEFAULT: default,
            Lane.PLANNED: FastPath(engine, spares=ours),
            Lane.LEASES: default if no_flush is None or lease_sync_commit else no_flush,
            # None: a one-row publish runs in a transaction, which skips the flush by
            # SET LOCAL (an engine passed in has no no-flush pool of sqlease's).
            Lane.PUBLISH: default if publish_sync_commit else no_flush,
        }

    def lane(self, lane: Lane) -> FastPath | None:
        return self._lanes[lane]

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
    def publishing(self, rows: int) -> Iterator[Connection]:
        if self.publish_sync_commit:
            with self.writing_hot(rows) as conn:
                yield conn
            return
        # SET LOCAL needs a transaction (a single row too must not run in autocommit), and
        # changes this transaction's commit only: the pooled session keeps its setting.
        with self.writing_hot(max(rows, 2)) as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")
            yield conn

    def fork_section(self) -> AbstractContextManager[None]:
        return nullcontext()

    def insert(self, table: Table) -> Any:
        return pg_insert(table)

    def one_of(self, column: Any, keys: Any) -> Any:
        # ``= ANY(ARRAY(subquery))``: the batch's keys become one array, looked up through
        # the key's index. With ``IN (subquery)`` the planner may join instead, and on a
        # table it thinks small it hashes the batch and reads the whole table.
        return column == any_(func.array(keys.scalar_subquery()))

    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        conn.execute(NOTIFY, {"channel": channel, "key": payload})

    def waker(self, channel: str, *, lock_key: int | None = None) -> Waker:
        if not self.pooling.transaction:
            return PostgresListener(self.engine.url, channel, lock_key=lock_key)
        if self.pooling.listen_url is not None:
            # Past the pooler: LISTEN and the handoff's session lock on a connection of
            # their own, as without a pooler (NOTIFY from pooled sessions reaches it).
            return PostgresListener(self.pooling.listen_url, channel, lock_key=lock_key)
        return PollingWaker()

    # PostgreSQL writes run locks and events inside the statements themselves.

    def after_enqueue(
        self, conn: Connection, row: Mapping[str, Any], message_id: int, now: int | None
    ) -> None:
        pass

    def after_claim(
        self, conn: Connection, claimed: list[Message], owner: str, now: int | None
    ) -> None:
        pass

    def after_transitions(
        self, conn: Connection, rows: list[Any], kind: str, data: str | None, now: int | None
    ) -> None:
        pass

    def after_renew(self, conn: Connection, row: Mapping[Any, Any]) -> None:
        pass

    def queues_param(self, queues: Sequence[str]) -> Any:
        return list(queues)  # text[]

    def fence_params(self, fences: Sequence[Fence]) -> dict[str, Any]:
        # Arrays (unnest), sorted by id so that concurrent batches tend to lock rows in one
        # order (fewer deadlocks).
        ordered = sorted(fences, key=lambda f: f.message_id)
        return {"ids": [f.message_id for f in ordered], "attempts": [f.attempt for f in ordered]}
