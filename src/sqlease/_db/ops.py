"""What a driver operation takes and returns: the :class:`Op` (one unit of database work,
built without I/O), the lane it runs on, its parameters (``Claim``, ``Change``,
``ResultWrite``, ``Offer``), and what an event loop sends it on (``Line``, ``Pending``)."""

from __future__ import annotations

import enum
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from sqlalchemy import Connection
from sqlalchemy.sql.elements import TextClause

if TYPE_CHECKING:
    from sqlease.types import Fence

T = TypeVar("T")
U = TypeVar("U")

#: What a statement sent without blocking waits for on its socket (``Pending.waits_for``).
WAIT_READ = 1
WAIT_WRITE = 2

#: Admits a unique task's row inside the publish's transaction: None, or the message id it
#: duplicates (0 once that message is gone). sqlease._core.uniques.
Admit = Callable[[Connection, Mapping[str, Any], "int | None"], "int | None"]


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


def by_owner(fences: Iterable[Fence]) -> dict[str, list[Fence]]:
    """Fences grouped by owner (the fenced statements take one owner each)."""
    groups: dict[str, list[Fence]] = defaultdict(list)
    for fence in fences:
        groups[fence.owner].append(fence)
    return groups


def publish_each(
    conn: Connection,
    rows: Sequence[Mapping[str, Any]],
    now: int | None,
    admit: Admit | None,
    insert: Callable[[Mapping[str, Any]], int],
) -> list[int]:
    """A publish of several rows in one transaction: each unique row admitted first (a
    duplicate inserts nothing: its original's id stands in its place), each other inserted by
    the dialect's ``insert``."""
    ids: list[int] = []
    for row in rows:
        if admit is not None and row["unique_key"] is not None:
            duplicate = admit(conn, row, now)
            if duplicate is not None:
                ids.append(duplicate)
                continue
        ids.append(insert(row))
    return ids


#: At most this many rows in one statement of a batch publish (``publish_batch``). The rows
#: are bound as one JSON text (``batch_json``), so no batch meets a bind-parameter limit
#: (SQLite's 32,766, PostgreSQL's 65,535); a larger batch is split into several statements in
#: the same transaction all the same, so that one statement's parameter stays of a bounded
#: size.
BATCH_ROWS = 5000


#: The fields of each row of a batch statement, in order: the rows travel as one JSON array
#: of arrays (one bind parameter; parsed by the database, far cheaper for the client than
#: binding a list per column).
BATCH_FIELDS = (
    "queue",
    "payload",
    "priority",
    "delay_ms",
    "task_id",
    "max_attempts",
    "task_name",
    "group_id",
    "record",
)


def batch_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows of a batch statement as its one parameter (``BATCH_FIELDS``)."""
    return json.dumps([[row[name] for name in BATCH_FIELDS] for row in rows])


def batch_row(row: Mapping[str, Any]) -> bool:
    """A checked row the batch statement inserts: one with no run (its parking reads the
    run's earlier members, row by row), no uniqueness key (admitted one by one under the
    key's lock) and no concurrency key. Any other row is published by the single publish's
    statement, in its place in the same transaction."""
    return row["run_id"] is None and row["unique_key"] is None and row["gate_key"] is None


def publish_batch(
    rows: Sequence[Mapping[str, Any]],
    bulk: Callable[[Sequence[Mapping[str, Any]]], list[int]],
    one: Callable[[Mapping[str, Any]], int],
) -> list[int]:
    """The ids of ``rows`` published in order, in the caller's transaction: runs of
    consecutive batch rows (``batch_row``, at most ``BATCH_ROWS`` each) by ``bulk``, each
    other row by ``one`` where it stands, so ids (the enqueue order) follow the list."""
    ids: list[int] = []
    plain: list[Mapping[str, Any]] = []
    for row in rows:
        if batch_row(row):
            plain.append(row)
            if len(plain) < BATCH_ROWS:
                continue
        if plain:
            ids.extend(bulk(plain))
            plain = []
        if not batch_row(row):
            ids.append(one(row))
    if plain:
        ids.extend(bulk(plain))
    return ids


class Lane(enum.Enum):
    """Which pool, and so which commit level, an op runs on. A one-statement op runs in
    autocommit on its lane; a transaction on ``DEFAULT`` runs through SQLAlchemy (it may
    execute SQLAlchemy constructs), on the other lanes the fastest way the dialect has."""

    #: sqlease's hot-path pool: results, withdrawals (commits wait for the flush)
    DEFAULT = "default"
    #: the main engine's pool, whose plans depend on the values: offers, takes, renewals
    PLANNED = "planned"
    #: claims and acks: commits need not wait for the WAL flush unless lease_sync_commit
    LEASES = "leases"
    #: publishes: the no-flush pool when publish_sync_commit is off
    PUBLISH = "publish"
    #: reads: a read-only transaction (SQLite: a deferred one, no write lock); on PostgreSQL
    #: the main engine's pool, as PLANNED
    READ = "read"


@dataclass(frozen=True, slots=True)
class Op(Generic[T]):
    """One unit of database work, built without I/O.

    One statement that runs alone in autocommit on ``lane`` (``statement`` and ``params``;
    ``finish(rows)`` says what its rows, as dicts, mean), or a short write transaction
    (``body(connection)``, with ``statements`` saying how many statements it runs; ``finish``,
    if given, turns the body's return into the op's, after the commit), or nothing to run at
    all (``finish(None)`` is the answer)."""

    lane: Lane
    statement: TextClause | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    finish: Callable[[Any], T] | None = None
    body: Callable[[Connection], Any] | None = None
    statements: int = 2
    #: A claim's ``(owner, mark)``: what it leased, should its answer be lost, is released
    #: before it is sent again (``Driver.release_lost_claims``).
    claim_mark: tuple[str, str] | None = None

    @property
    def sendable(self) -> bool:
        """One statement: an event loop can send it without blocking (``Driver.line``)."""
        return self.statement is not None

    def then(self, after: Callable[[T], U]) -> Op[U]:
        """The same work, ``after`` applied to what it means."""
        first = self.finish
        finish: Callable[[Any], U] = after if first is None else (lambda done: after(first(done)))
        return Op(
            self.lane,
            self.statement,
            self.params,
            finish,
            self.body,
            self.statements,
            self.claim_mark,
        )

    @staticmethod
    def answer(value: U) -> Op[U]:
        """An op with nothing to run that means ``value``."""
        return Op(Lane.DEFAULT, finish=lambda _none: value)


@dataclass(frozen=True, slots=True)
class Claim:
    """What a claim asks for: up to ``limit`` ready messages of ``queues``, leased to
    ``owner`` for ``lease_ms``."""

    queues: Sequence[str]
    owner: str
    lease_ms: int
    limit: int
    now: int | None


@dataclass(frozen=True, slots=True)
class Change:
    """A fenced transition of held messages: release (``ready``), park or fail (``dead``)."""

    new_state: str
    kind: str
    reason: str | None = None
    delay_ms: int = 0
    refund: bool = False
    error: str | None = None
    #: the event's data, already JSON
    data: str | None = None

    def params(self, now: int | None) -> dict[str, Any]:
        """The transition statement's parameters (both dialects')."""
        return {
            "now": now,
            "delay_ms": max(0, int(self.delay_ms)),
            "refund": 1 if self.refund else 0,
            "new_state": self.new_state,
            "reason": self.reason,
            "error": self.error,
            "kind": self.kind,
            "data": self.data,
        }


@dataclass(frozen=True, slots=True)
class ResultWrite:
    """One result row and how it may be written: ``fence`` (only while its lease is held),
    ``keep_success`` (never over a stored SUCCESS), ``offer`` (PostgreSQL: the holder's next
    handoff offer, written if the lease held), ``now`` (the clock the lease check reads; None:
    the database's); ``channel`` is notified only while a waiting client holds the advisory
    lock ``waiters_key`` (PostgreSQL; None: always)."""

    row: Mapping[str, Any]
    fence: Fence | None
    keep_success: bool
    offer: Mapping[str, Any] | None
    now: int | None
    channel: str
    waiters_key: int | None = None


@dataclass(frozen=True, slots=True)
class Offer:
    """An idle worker's standing offer for ``queues`` (see sqlease._core.offers), validated."""

    queues: list[str]
    #: per queue, the highest ``offer_seq`` of the handoffs the worker has heard of
    seen: list[int]
    owner: str
    lease_ms: int
    lock_key: int
    ttl_ms: int
    now: int | None

    def params(self) -> dict[str, Any]:
        return {
            "queues": self.queues,
            "seen": self.seen,
            "owner": self.owner,
            "lease_ms": self.lease_ms,
            "lock_key": self.lock_key,
            "ttl_ms": self.ttl_ms,
            "now": self.now,
        }


class Pending(Protocol):
    """One statement under way on a line: wait until the socket ``fileno`` is ready as
    ``waits_for`` says (``WAIT_READ``, with ``WAIT_WRITE`` set while the request is not all
    sent), then ``resume(ready)``; once ``waits_for`` is 0 it is done: ``rows`` are its rows,
    or ``error`` is what to raise."""

    fileno: int
    waits_for: int
    rows: list[dict[str, Any]]
    error: BaseException | None

    def resume(self, ready: int) -> int: ...


class Line(Protocol):
    """A connection an event loop keeps, to send one-statement ops on without blocking.
    ``connect`` (blocking, so called off the loop) makes sure it holds one, which
    ``holds_connection`` tells; ``send`` on a line that holds none connects first."""

    @property
    def holds_connection(self) -> bool: ...

    def connect(self) -> None: ...

    def send(self, op: Op[Any]) -> Pending: ...

    def close(self, *, busy: bool = False) -> None: ...
