"""The one dialect seam: a driver per dialect behind one interface.

The lease core builds each unit of hot database work once, without I/O, as an :class:`Op`,
and hands it to the store's :class:`Driver`: ``execute`` runs it blocking; the worker's event
loop may instead send a one-statement op without blocking (``Driver.lane`` gives the pool
and ``Op.statement`` / ``Op.params`` what to send) and call ``Op.finish`` on its rows. So the
thread runner and the event-loop runner run the very same op.

A driver says which pool and commit level a statement runs on (its :class:`Lane`), what the
dialect can do (:class:`Capabilities`), and does the few things the dialects do differently
around a statement: how a batch of fences or queue names is bound, and the bookkeeping that
PostgreSQL writes inside the statement itself while SQLite writes it beside the statement in
the same transaction.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import Connection, Table
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import TextClause

from sqlease._db.statements import Capabilities

if TYPE_CHECKING:
    from sqlease._db.postgresql.fastpath import FastPath
    from sqlease._db.wakeup import Waker
    from sqlease.types import Fence, Message

T = TypeVar("T")
U = TypeVar("U")


def event_params(
    task_id: str | None,
    message_id: int | None,
    attempt: int | None,
    kind: str,
    data: str | None,
    now: int | None,
) -> dict[str, Any]:
    """The parameters of the event insert (``data`` already JSON)."""
    return {
        "task_id": task_id,
        "message_id": message_id,
        "attempt": attempt,
        "kind": kind,
        "data": data,
        "now": now,
    }


class Lane(enum.Enum):
    """Which pool, and so which commit level, a statement runs on."""

    #: sqlease's hot-path pool: publishes in transactions, results (commits wait for the flush)
    DEFAULT = "default"
    #: the main engine's pool, whose plans depend on the values: the idle worker's offers
    PLANNED = "planned"
    #: claims and acks: commits need not wait for the WAL flush unless lease_sync_commit
    LEASES = "leases"
    #: one-row publishes: the no-flush pool when publish_sync_commit is off
    PUBLISH = "publish"


@dataclass(frozen=True, slots=True)
class Op(Generic[T]):
    """One unit of database work, built without I/O.

    Either one statement that runs alone in autocommit on ``lane`` (``statement`` and
    ``params``; ``finish(rows)`` says what its rows mean), or a short write transaction
    (``body(connection)``, with ``statements`` saying how many statements it runs: one needs
    no BEGIN/COMMIT on PostgreSQL; ``finish``, if given, then turns the body's return into
    the op's, after the commit)."""

    lane: Lane
    statement: TextClause | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    finish: Callable[[Any], T] | None = None
    body: Callable[[Connection], Any] | None = None
    statements: int = 2

    @property
    def sendable(self) -> bool:
        """One statement: the worker's event loop can send it without blocking."""
        return self.statement is not None

    def then(self, after: Callable[[T], U]) -> Op[U]:
        """The same work, ``after`` applied to what it means."""
        first = self.finish
        finish: Callable[[Any], U] = after if first is None else (lambda done: after(first(done)))
        return Op(self.lane, self.statement, self.params, finish, self.body, self.statements)


class Driver(ABC):
    """One database: its engine, its lanes and the dialect's differences."""

    name: str
    caps: Capabilities

    @property
    def is_postgresql(self) -> bool:
        return self.name == "postgresql"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # ---- running ---------------------------------------------------------------------

    def execute(self, op: Op[T]) -> T:
        """Run ``op``, blocking, and return what it means."""
        if op.statement is not None:
            fast = self.lane(op.lane)
            assert fast is not None and op.finish is not None
            return op.finish(fast.rows(op.statement, op.params))
        assert op.body is not None
        with self.writing_hot(op.statements) as conn:
            done = op.body(conn)
        return done if op.finish is None else op.finish(done)

    def lane(self, lane: Lane) -> FastPath | None:
        """The pool a one-statement op on ``lane`` runs on (None: the dialect runs every op
        as a transaction)."""
        return None

    @abstractmethod
    def writing(self, statements: int = 2) -> AbstractContextManager[Connection]:
        """A write transaction through SQLAlchemy."""

    def writing_hot(self, statements: int = 2) -> AbstractContextManager[Connection]:
        """A write transaction for the per-task operations (the fastest way the dialect has)."""
        return self.writing(statements)

    def publishing(self, rows: int) -> AbstractContextManager[Connection]:
        """The transaction a publish of ``rows`` messages runs in."""
        return self.writing_hot(rows)

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A read-only transaction (on SQLite a deferred one: no write lock)."""
        with self.fork_section(), self.engine.connect() as conn:
            conn.execution_options(sqlease_read_only=True)
            try:
                yield conn
            finally:
                conn.rollback()

    @abstractmethod
    def fork_section(self) -> AbstractContextManager[None]:
        """A block a fork of this process waits for (SQLite's mutexes), or nothing."""

    # ---- dialect constructs ----------------------------------------------------------

    @abstractmethod
    def insert(self, table: Table) -> Any:
        """The dialect's INSERT construct for ``table`` (with ``on_conflict_do_…``)."""

    def one_of(self, column: Any, keys: Any) -> Any:
        """``column`` is one of the keys the SELECT ``keys`` (one column, with a LIMIT)
        returns: the condition a batch delete takes its rows by."""
        return column.in_(keys.scalar_subquery())

    @abstractmethod
    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        """Inside ``conn``'s transaction: wake the listeners of ``channel`` at commit."""

    @abstractmethod
    def waker(self, channel: str, *, lock_key: int | None = None) -> Waker:
        """What an idle client waits on: a LISTEN connection on ``channel`` (holding the
        advisory lock ``lock_key``, if given), or a watch of the database file."""

    # ---- binding ---------------------------------------------------------------------

    @abstractmethod
    def queues_param(self, queues: Sequence[str]) -> Any:
        """Queue names bound as one parameter (``:queues``)."""

    @abstractmethod
    def fence_params(self, fences: Sequence[Fence]) -> dict[str, Any]:
        """A batch of fences bound as the statements' fence parameters."""

    # ---- bookkeeping PostgreSQL does inside the statement ------------------------------

    @abstractmethod
    def after_enqueue(
        self, conn: Connection, row: Mapping[str, Any], message_id: int, now: int | None
    ) -> None:
        """After one message was inserted (its ``enqueued`` event)."""

    @abstractmethod
    def after_claim(
        self, conn: Connection, claimed: list[Message], owner: str, now: int | None
    ) -> None:
        """After a claim (run locks, ``claimed`` and ``attempts_exhausted`` events)."""

    @abstractmethod
    def after_transitions(
        self, conn: Connection, rows: list[Any], kind: str, data: str | None, now: int | None
    ) -> None:
        """After fenced transitions (acks, releases, parks): run locks and events."""

    @abstractmethod
    def after_renew(self, conn: Connection, row: Mapping[Any, Any]) -> None:
        """After one lease was renewed (its run lock's expiry)."""
