"""The one dialect seam: a driver per dialect, one method per database operation.

Shaped like River's driver (``riverdriver``): each hot operation is a method named noun then
verb (``message_claim``, ``message_ack``, ``message_ack_claim``, ``message_publish``,
``result_put``, ``offer_put``, …) that takes its parameters and returns an :class:`Op`: the
unit of database work, built without I/O, with the dialect's own statements and bookkeeping
inside it. PostgreSQL's ops are one statement each (data-modifying CTEs write the run locks,
events and task rows), SQLite's one short transaction (the bookkeeping beside the statement,
under the one write lock); the lease core calls the operation and never asks which.

An op runs three ways, always the same op: ``execute`` (blocking, in its own transaction or in
autocommit), ``run_on`` (inside a caller's transaction: the outbox), or, where it is one
statement and the driver can (``nonblocking``), sent from the worker's event loop on a
:class:`Line` and finished when its rows arrive.

Every write transaction goes through ``writing`` (on SQLite inside the fork guard), every read
through ``reading``: nothing outside ``sqlease._db`` opens a connection of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Table
from sqlalchemy.engine import Engine

from sqlease._db.ops import (
    WAIT_READ,
    WAIT_WRITE,
    Admit,
    Change,
    Claim,
    Lane,
    Line,
    Offer,
    Op,
    Pending,
    ResultWrite,
    by_owner,
    event_params,
    publish_batch,
    publish_each,
)
from sqlease._db.rows import Acked
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables

if TYPE_CHECKING:
    from sqlalchemy import Select
    from sqlalchemy.sql.dml import Delete, Update

    from sqlease._db.wakeup import Waker
    from sqlease.types import Fence, Message, Outcome

__all__ = [
    "WAIT_READ",
    "WAIT_WRITE",
    "Admit",
    "Change",
    "Claim",
    "Driver",
    "Lane",
    "Line",
    "Offer",
    "Op",
    "Pending",
    "ResultWrite",
    "by_owner",
    "event_params",
    "publish_each",
]

T = TypeVar("T")


class Driver(ABC):
    """One database: its engine, its transactions and its operations."""

    name: str
    caps: Capabilities
    sql: Statements
    #: Statements cross a network: a round trip that an event loop should not wait for.
    remote: bool = False
    #: An op's statement can be sent from an event loop without blocking (``line``).
    nonblocking: bool = False
    #: How long after an event id is visible a lower one may still commit (the statistics'
    #: settling time): ids are taken before commit, in parallel, on a server with many writers.
    event_settle_ms: int = 0
    #: The lease of the store it serves (milliseconds): the connections it opens besides its
    #: engines' (a LISTEN connection) follow it as theirs do (TCP keepalives).
    lease_ms: int = 60_000

    def __init__(self, engine: Engine, tables: Tables) -> None:
        self.engine = engine
        self.tables = tables
        #: The channel publishes notify and idle workers listen on.
        self.wakeup_channel = f"{tables.prefix}wakeup"

    # ---- transactions ----------------------------------------------------------------

    @abstractmethod
    def writing(self, statements: int = 2) -> AbstractContextManager[Connection]:
        """A short write transaction (one statement needs no BEGIN/COMMIT on PostgreSQL; on
        SQLite it is inside the fork guard)."""

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

    # ---- running ops -----------------------------------------------------------------

    @abstractmethod
    def execute(self, op: Op[T]) -> T:
        """Run ``op``, blocking, and return what it means."""

    def run_on(self, conn: Connection, op: Op[T]) -> T:
        """Run ``op`` inside the caller's transaction ``conn`` (it commits with it)."""
        if op.statement is not None:
            done: Any = [dict(r._mapping) for r in conn.execute(op.statement, op.params)]
        elif op.body is not None:
            done = op.body(conn)
        else:
            done = None
        return done if op.finish is None else op.finish(done)

    def line(self, lane: Lane) -> Line:
        """A connection on ``lane`` for an event loop to send ops on (``nonblocking``)."""
        raise NotImplementedError(f"{self.name} sends no statement without blocking")

    def line_key(self, lane: Lane) -> object:
        """Lanes with one key share a line (the same pool and commit level): a loop keeps
        one connection for them."""
        return lane

    def pin_thread(self, lane: Lane) -> None:  # noqa: B027 (most dialects keep none)
        """The calling thread keeps one connection of ``lane`` between ops (a thread that
        does nothing else), until ``release_thread``."""

    def release_thread(self, lane: Lane) -> None:  # noqa: B027
        """Give back the calling thread's kept connection."""

    # ---- dialect constructs ----------------------------------------------------------

    @abstractmethod
    def insert(self, table: Table) -> Any:
        """The dialect's INSERT construct for ``table`` (with ``on_conflict_do_…``)."""

    def one_of(self, column: Any, keys: Any) -> Any:
        """``column`` is one of the keys the SELECT ``keys`` (one column, with a LIMIT)
        returns: the condition a batch delete takes its rows by."""
        return column.in_(keys.scalar_subquery())

    @abstractmethod
    def events_per_row(self) -> Any:
        """How many messages' events one row of the events table stands for (a column
        expression over ``tables.events``)."""

    def batch_event_deletes(self, old: Select[Any], batch: int) -> dict[str, Delete]:
        """The retention's deletes of the events rows that list several messages (those of a
        dialect that writes them), by kind: of the rows ``old`` selects (ids, oldest), at most
        ``batch`` a statement, once none of their tasks has a message left."""
        return {}

    def leftovers(self, now: int) -> dict[str, Delete | Update]:
        """The maintenance pass's cleanups of what only this dialect writes or leaves, by
        kind."""
        return {}

    @abstractmethod
    def notify(self, conn: Connection, channel: str, payload: str) -> None:
        """Inside ``conn``'s transaction: wake the listeners of ``channel`` at commit."""

    @abstractmethod
    def waker(
        self, channel: str, *, lock_key: int | None = None, shared_keys: Sequence[int] = ()
    ) -> Waker:
        """What an idle client waits on: a LISTEN connection on ``channel`` (holding the
        advisory lock ``lock_key``, if given, and ``shared_keys`` shared, taken once it
        listens), or a watch of the database file."""

    @abstractmethod
    def queues_param(self, queues: Sequence[str]) -> Any:
        """Queue names bound as one parameter (``:queues``)."""

    # ---- operations: messages --------------------------------------------------------

    @abstractmethod
    def message_publish(
        self,
        rows: Sequence[Mapping[str, Any]],
        now: int | None,
        *,
        handoff: bool = True,
        admit: Admit | None = None,
    ) -> Op[list[int]]:
        """Insert checked message rows (``sqlease._core.messages``), with their ``enqueued``
        events and task rows, waking listeners at commit; their ids in order. ``handoff``: a
        message an idle worker's offer can take is leased to it (never inside a caller's
        transaction). ``admit``: a unique task's row is admitted first (its duplicate's id
        stands in the list instead)."""

    def message_publish_batch(
        self,
        rows: Sequence[Mapping[str, Any]],
        now: int | None,
        *,
        admit: Admit | None = None,
    ) -> Op[list[int]]:
        """Insert checked message rows as one batch, all or nothing, in one transaction; their
        ids in order (a unique duplicate's: its original's, as ``message_publish``). The rows
        with no run and no uniqueness or concurrency key go in statements of up to
        ``BATCH_ROWS`` rows (``publish_bulk``); each other row by the single publish's
        statement, in its place, so its run's parking and its key's admission are the single
        publish's. Never handed to an idle worker's offer; each queue is woken at commit."""

        def body(conn: Connection) -> list[int]:
            def one(row: Mapping[str, Any]) -> int:
                single = self.message_publish([row], now, handoff=False, admit=admit)
                return self.run_on(conn, single)[0]

            return publish_batch(rows, lambda chunk: self.publish_bulk(conn, chunk, now), one)

        return Op(Lane.PUBLISH, body=body)

    @abstractmethod
    def publish_bulk(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]], now: int | None
    ) -> list[int]:
        """Insert batch rows (``ops.batch_row``), with their ``enqueued`` events and task
        rows, in the caller's transaction ``conn``; their ids in order."""

    @abstractmethod
    def message_take(self, queues: Sequence[str], limit: int, now: int | None) -> Op[list[Message]]:
        """Delete and return up to ``limit`` ready messages (consumers that never ack)."""

    def message_next_due(self, queues: Sequence[str], now: int | None) -> Op[int | None]:
        """Milliseconds until the next delayed message of ``queues`` is due (a closed rate
        limit's reopening counts), if any."""
        params = {"queues": self.queues_param(queues), "now": now}

        def due(rows: list[dict[str, Any]]) -> int | None:
            value = next(iter(rows[0].values())) if rows else None
            return None if value is None else max(0, int(value))

        return Op(Lane.READ, self.sql.next_due, params, due)

    @abstractmethod
    def message_claim(self, claim: Claim) -> Op[list[Message]]:
        """Lease ready messages (exhausted ones come back marked dead), with their run locks,
        gate slots, rate limits, task attempts and ``claimed`` events. A claim may stop in
        front of a message it does not judge and say so (``rows.held_ahead`` of its answer,
        PostgreSQL's claim of plain messages): its caller claims again at once."""

    @abstractmethod
    def message_ack(self, fences: Sequence[Fence], now: int | None) -> Op[Acked]:
        """Finish deliveries (the rows leave the table); the ids acked. The next message of a
        run one of them left is made ready if it waited parked behind its run; the runs the
        statement could not judge are ``Acked.owed_runs``, for ``run_promote``."""

    @abstractmethod
    def message_ack_claim(
        self, fences: Sequence[Fence], claim: Claim
    ) -> Op[tuple[Acked, list[Message]]]:
        """``message_ack`` and ``message_claim`` in one commit: the ids acked and the messages
        claimed (whether the claim sees the acks free a run's next message is the
        dialect's: PostgreSQL's one statement does not, SQLite's transaction does)."""

    @abstractmethod
    def message_renew(
        self, fences: Sequence[Fence], lease_ms: int, now: int | None
    ) -> Op[dict[int, int]]:
        """Extend every lease still held: ``{message_id: new expiry}`` for those."""

    @abstractmethod
    def message_transition(
        self,
        fences: Sequence[Fence],
        change: Change,
        now: int | None,
        also: Callable[[Connection], None] | None = None,
    ) -> Op[Acked]:
        """Release, park or fail held messages (fenced); the ids changed. ``also`` runs in
        the same transaction when something changed. A failed message's run goes on as after
        an ack (``message_ack``)."""

    def release_lost_claims(self, owner: str, marks: Sequence[str], since: float) -> Op[Acked]:
        """Release (attempt refunded) what the claims ``marks`` of ``owner`` (``Op.claim_mark``)
        sent before ``since`` (monotonic) leased and ``owner`` still holds: their answers were
        lost. A dialect whose claims carry no mark has none."""
        return Op.answer(Acked())

    @abstractmethod
    def run_promote(self, run_ids: Sequence[str], now: int | None) -> Op[list[int]]:
        """The heads of the runs ``run_ids`` made ready where they wait parked behind their
        run, safe against an enqueue into them at the same time; the ids made ready."""

    @abstractmethod
    def gate_promote(self, gates: Sequence[str], now: int | None) -> Op[list[int]]:
        """Of each gate of ``gates``, as many messages parked there made ready as it has
        room for (all of a task's or queue's gate whose limit is gone); the ids."""

    @abstractmethod
    def gate_park(self, queue: str, scan: int, now: int | None) -> Op[list[int]]:
        """Of the first ``scan`` ready messages of ``queue``, those whose gate is full
        parked at it (out of the claim's way, their order kept); the ids."""

    @abstractmethod
    def rate_project(
        self, queue: str, scan: int, horizon_ms: int, now: int | None
    ) -> Op[list[int]]:
        """Of the first ``scan`` ready messages of ``queue``, those a rate limit holds for
        more than ``horizon_ms`` given the time it lets them through as their due time
        (reason ``rate``); the ids."""

    @abstractmethod
    def rate_release(self, rates: Sequence[str], now: int | None) -> Op[list[int]]:
        """The messages given a due time by the rates ``rates``, due now again."""

    # ---- operations: results ---------------------------------------------------------

    @abstractmethod
    def result_put(self, write: ResultWrite) -> Op[Outcome]:
        """Store a result row (fenced, see ``ResultWrite``) and wake its waiting clients."""

    # ---- operations: offers (the handoff, where ``caps.offers``) ---------------------

    @abstractmethod
    def offer_put(self, offer: Offer) -> Op[tuple[int | None, int | None]]:
        """Stand the offer (withdrawing the owner's offers for other queues); when the next
        delayed message of its queues is due, in milliseconds, and the database's time the
        offer was written at (epoch milliseconds)."""

    @abstractmethod
    def offer_ack(
        self, fences: Sequence[Fence], offer: Offer
    ) -> Op[tuple[Acked, int | None, int | None]]:
        """The acks that leave a worker idle, with its offer: the ids acked, when the next
        delayed message is due, and the database's time."""

    @abstractmethod
    def offer_handed(self, messages: Sequence[Message]) -> None:
        """Messages a publish leased to an offer were delivered: noted by a driver that picks
        an ack's statement by what its deliveries are (no statement is run)."""

    @abstractmethod
    def offer_withdraw(self, owner: str, *, handed_too: bool = False) -> Op[None]:
        """Remove ``owner``'s offers (those a publish used too, with ``handed_too``)."""
