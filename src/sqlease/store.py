"""The lease store: durable messages held by fenced SQL leases.

Every operation is one statement or one short transaction that commits at once; nothing is
held open across client-side work. Every write to a leased message carries its fence
``(message_id, owner, attempt)`` and is refused (reported, not raised) when the fence no longer
matches a live lease, so a stale worker can never ack, renew or overwrite work that another
worker now holds. Each state change appends an event in the same transaction.

``now`` (epoch milliseconds) may be passed to any operation; by default the store asks its
``clock`` and, without one, the database's clock.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from sqlalchemy import Connection, Row
from sqlalchemy.engine import URL, Engine
from sqlalchemy.sql.elements import TextClause

from ._db.dialects import dialect_for
from ._db.statements import Capabilities
from .engine import get_engine
from .errors import ConfigurationError, PayloadTooLarge
from .fastpath import FastPath
from .fork_guard import sqlite_section
from .resilience import RETRY_SECONDS, retry_transient, retrying
from .schema import Tables, build_tables, ensure_schema
from .sqlite_fast import SqliteFast
from .types import CasResult, Event, Fence, Message, NewMessage, Outcome, TaskRecord

__all__ = [
    "CasResult",
    "Event",
    "Fence",
    "Message",
    "NewMessage",
    "Outcome",
    "Prepared",
    "Store",
    "TaskRecord",
]

Clock = Callable[[], int]
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared(Generic[T]):
    """One hot-path statement (PostgreSQL, autocommit) split from what its rows mean, so that
    the caller decides how to wait for it: ``finish(rows)`` once it has run. (The worker's
    event loop sends it without blocking; see sqlease.loop_calls.)"""

    statement: TextClause
    params: dict[str, Any]
    finish: Callable[[list[dict[str, Any]]], T]


def expand_event_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Raw ``events`` rows, each PostgreSQL batch row (the ``claimed`` or ``acked`` events
    of one statement, see ``docs/leases.md`` §3.7) expanded into one row per listed message,
    as ``Store.events`` returns them. For tools and tests that read the table directly."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if row.get("task_ids") is None:
            out.append(dict(row))
            continue
        for task_id, message_id, attempt in zip(
            row["task_ids"], row["message_ids"], row["attempts"], strict=True
        ):
            out.append({**row, "task_id": task_id, "message_id": message_id, "attempt": attempt})
    return out


def _row_to_message(row: Row[Any]) -> Message:
    # By name only when selected (RowMapping.get on a missing key raises inside).
    return _message_from(row._mapping, has_last_error="last_error" in row._fields)


def _message_from(mapping: Mapping[Any, Any], *, has_last_error: bool) -> Message:
    return Message(
        id=int(mapping["id"]),
        queue=mapping["queue"],
        payload=mapping["payload"],
        priority=int(mapping["priority"]),
        available_at_ms=int(mapping["available_at_ms"]),
        created_at_ms=int(mapping["created_at_ms"]),
        run_id=mapping["run_id"],
        task_id=mapping["task_id"],
        state=mapping["state"],
        reason=mapping["reason"],
        lease_owner=mapping["lease_owner"],
        lease_expires_at_ms=(
            None if mapping["lease_expires_at_ms"] is None else int(mapping["lease_expires_at_ms"])
        ),
        attempt=int(mapping["attempt"]),
        max_attempts=int(mapping["max_attempts"]),
        last_error=mapping["last_error"] if has_last_error else None,
    )


def _due_ms(rows: list[dict[str, Any]]) -> int | None:
    """The ``due`` column of an offer statement: milliseconds until the next delayed message."""
    due = rows[0]["due"] if rows else None
    return None if due is None else max(0, int(due))


def _by_owner(fences: Iterable[Fence]) -> dict[str, list[Fence]]:
    groups: dict[str, list[Fence]] = defaultdict(list)
    for fence in fences:
        groups[fence.owner].append(fence)
    return groups


def _event_params(
    task_id: str | None,
    message_id: int | None,
    attempt: int | None,
    kind: str,
    data: str | None,
    now: int | None,
) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "message_id": message_id,
        "attempt": attempt,
        "kind": kind,
        "data": data,
        "now": now,
    }


def _dump(data: Any) -> str | None:
    return None if data is None else json.dumps(data, sort_keys=True, default=str)


@retrying(
    "now_ms",
    "enqueue_many",
    "claim",
    "take",
    "next_due_in_ms",
    "renew",
    "ack",
    "ack_and_claim",
    "withdraw_offers",
    "leased_to",
    "_transition",
    "requeue",
    "compare_and_set",
    "append_event",
    "record_event",
    "is_held",
    "get_message",
    "get_task",
    "events",
    "size",
    "purge",
    "declare_queue",
    "has_queue",
    "delete_queue",
    "bind",
    "unbind",
    "unbind_key",
    "bindings",
)
class Store:
    """Lease operations on one database (SQLite file or PostgreSQL) and table prefix."""

    def __init__(
        self,
        url: str | URL | Engine,
        *,
        table_prefix: str = "sqlease_",
        auto_migrate: bool = True,
        max_attempts: int = 3,
        max_payload_bytes: int = 16 * 1024 * 1024,
        sqlite_synchronous: str = "NORMAL",
        lease_sync_commit: bool = False,
        publish_sync_commit: bool = True,
        clock: Clock | None = None,
        connect_retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, not {max_attempts!r}")
        if not isinstance(max_payload_bytes, int) or max_payload_bytes < 1:
            raise ConfigurationError(
                f"max_payload_bytes must be a positive integer, not {max_payload_bytes!r}"
            )
        self.engine: Engine = (
            url
            if isinstance(url, Engine)
            else get_engine(url, sqlite_synchronous=sqlite_synchronous)
        )
        self.tables: Tables = build_tables(table_prefix)
        self.dialect = dialect_for(self.engine.dialect.name)
        #: What the dialect does in one statement; where it cannot, Store runs several.
        self.caps: Capabilities = self.dialect.caps
        #: PostgreSQL: the per-task statements bypass SQLAlchemy's execution layer, on an
        #: engine of their own whose sessions use generic plans (see engine.py). An engine
        #: passed in is used as it is.
        self.fast: FastPath | None = None
        #: The same, on the main engine: for the idle worker's offers, whose best plan
        #: depends on the values (when is the next delayed message due).
        self.fast_planned: FastPath | None = None
        #: The same for the lease traffic (claims and acks), whose commits need not wait for
        #: the WAL flush unless ``lease_sync_commit`` (see engine.postgresql_connect_args).
        self.fast_leases: FastPath | None = None
        #: PostgreSQL: where a one-row publish runs in autocommit. It waits for the WAL flush
        #: unless ``publish_sync_commit`` is off; then it runs on the no-flush pool. None: in
        #: a transaction (SQLite; or an engine passed in, whose transaction then skips the
        #: flush by ``SET LOCAL``).
        self.fast_publish: FastPath | None = None
        self.publish_sync_commit = publish_sync_commit
        if self.dialect.is_postgresql:
            # sqlease's own engines keep a few connections between calls (FastPath spares);
            # an engine passed in is left to its own pool.
            ours = not isinstance(url, Engine)
            self.fast = FastPath(
                self.engine if isinstance(url, Engine) else get_engine(url, generic_plans=True),
                spares=ours,
            )
            self.fast_planned = FastPath(self.engine, spares=ours)
            # The pool whose commits do not wait for the flush, if anything uses it.
            no_flush = (
                FastPath(get_engine(url, generic_plans=True, wait_for_flush=False), spares=True)
                if not isinstance(url, Engine) and not (lease_sync_commit and publish_sync_commit)
                else None
            )
            self.fast_leases = self.fast if no_flush is None or lease_sync_commit else no_flush
            self.fast_publish = self.fast if publish_sync_commit else no_flush
        #: SQLite: the per-task write transactions straight through sqlite3 (sqlite_fast), on
        #: sqlease's own engines (an engine passed in is used through SQLAlchemy).
        self.fast_sqlite: SqliteFast | None = (
            SqliteFast(self.engine)
            if not self.dialect.is_postgresql and not isinstance(url, Engine)
            else None
        )
        self.sql = self.dialect.statements(self.tables)
        self.max_attempts = max_attempts
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        # PostgreSQL channel that enqueue notifies and idle workers LISTEN on.
        self.notify_channel = f"{self.tables.prefix}wakeup"
        # A pooled connection killed by a restart fails once: ride it out here too, for up to
        # ``connect_retry_seconds`` (the transport keeps it short: Kombu retries connecting).
        retry_transient(ensure_schema, connect_retry_seconds)(
            self.engine, self.tables, auto_migrate=auto_migrate
        )

    @property
    def is_postgresql(self) -> bool:
        return self.dialect.is_postgresql

    def _queues_param(self, queues: Sequence[str]) -> list[str] | str:
        # PostgreSQL takes a text[] array; SQLite a JSON array (json_each).
        return list(queues) if self.is_postgresql else json.dumps(list(queues))

    def _fence_params(self, fences: Sequence[Fence]) -> dict[str, Any]:
        # Sorted by id, so concurrent batches tend to lock rows in one order (fewer deadlocks).
        ordered = sorted(fences, key=lambda f: f.message_id)
        if self.is_postgresql:
            return {
                "ids": [f.message_id for f in ordered],
                "attempts": [f.attempt for f in ordered],
            }
        return {"fences": json.dumps([[f.message_id, f.attempt] for f in ordered])}

    @contextmanager
    def _writing(self, statements: int = 2) -> Iterator[Connection]:
        """A write transaction. On PostgreSQL one statement runs in autocommit: the same
        atomicity, without the BEGIN and COMMIT round trips. (SQLite always takes the write
        lock with BEGIN IMMEDIATE.)"""
        if statements == 1 and self.is_postgresql:
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                yield conn
            return
        with self.fork_section(), self.engine.begin() as conn:
            yield conn

    def fork_section(self) -> AbstractContextManager[None]:
        """On SQLite, a block a fork waits for (sqlease.fork_guard); elsewhere nothing."""
        return nullcontext() if self.is_postgresql else sqlite_section()

    @contextmanager
    def _writing_hot(self, statements: int = 2) -> Iterator[Connection]:
        """``_writing`` for the per-task operations (enqueue, claim, ack, take, renew): on
        SQLite straight through sqlite3 (sqlease.sqlite_fast), whose Transaction provides the
        part of Connection's API these operations use."""
        if self.fast_sqlite is None:
            with self._writing(statements) as conn:
                yield conn
            return
        with self.fast_sqlite.begin() as transaction:
            yield cast(Connection, transaction)

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        """A read-only transaction (on SQLite a deferred one: no write lock)."""
        with self.fork_section(), self.engine.connect() as conn:
            conn.execution_options(sqlease_read_only=True)
            try:
                yield conn
            finally:
                conn.rollback()

    # ---- time --------------------------------------------------------------------------

    def _now(self, now: int | None) -> int | None:
        if now is not None:
            return int(now)
        return None if self.clock is None else int(self.clock())

    def now_ms(self) -> int:
        """The time the store compares leases against (the clock, else the database's)."""
        if self.clock is not None:
            return int(self.clock())
        with self._reading() as conn:
            value = conn.execute(self.sql.now, {"now": None}).scalar_one()
        return int(value)

    # ---- enqueue -----------------------------------------------------------------------

    def _check_new(self, msg: NewMessage) -> dict[str, Any]:
        if not isinstance(msg.queue, str) or not msg.queue:
            raise ConfigurationError(f"queue name must be a non-empty string, not {msg.queue!r}")
        if not isinstance(msg.payload, str):
            raise TypeError(f"payload must be str, not {type(msg.payload).__name__}")
        size = len(msg.payload.encode("utf-8"))
        if size > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"message for queue {msg.queue!r} is {size} bytes, over max_payload_bytes="
                f"{self.max_payload_bytes}; it was not enqueued"
            )
        if not isinstance(msg.priority, int) or not -32768 <= msg.priority <= 32767:
            raise ConfigurationError(f"priority must be a small integer, not {msg.priority!r}")
        max_attempts = self.max_attempts if msg.max_attempts is None else msg.max_attempts
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, not {max_attempts!r}")
        return {
            "queue": msg.queue,
            "payload": msg.payload,
            "priority": msg.priority,
            "delay_ms": max(0, int(msg.delay_ms)),
            "run_id": msg.run_id,
            "task_id": msg.task_id,
            "max_attempts": max_attempts,
            "record": bool(msg.record),
        }

    def enqueue(
        self,
        queue: str,
        payload: str,
        *,
        priority: int = 0,
        delay_ms: int = 0,
        run_id: str | None = None,
        task_id: str | None = None,
        max_attempts: int | None = None,
        record: bool = True,
        now: int | None = None,
        connection: Connection | None = None,
    ) -> int:
        """Add one message; returns its id. With ``connection`` it joins that transaction."""
        ids = self.enqueue_many(
            [NewMessage(queue, payload, priority, delay_ms, run_id, task_id, max_attempts, record)],
            now=now,
            connection=connection,
        )
        return ids[0]

    def enqueue_many(
        self,
        messages: Sequence[NewMessage],
        *,
        now: int | None = None,
        connection: Connection | None = None,
    ) -> list[int]:
        """Add messages in one transaction; returns their ids in order."""
        rows = [self._check_new(m) for m in messages]
        if not rows:
            return []
        if connection is not None:
            return self._enqueue_on(connection, rows, self._now(now), handoff=False)
        if self.fast_publish is not None and len(rows) == 1:  # one statement: autocommit
            params = dict(rows[0], now=self._now(now), channel=self.notify_channel)
            return [int(self.fast_publish.rows(self.sql.enqueue, params)[0]["id"])]
        no_flush = self.is_postgresql and not self.publish_sync_commit
        # SET LOCAL needs a transaction: a single row too must not run in autocommit.
        with self._writing_hot(statements=max(len(rows), 2 if no_flush else 1)) as conn:
            if no_flush:
                # This transaction's commit only: the pooled session keeps its setting.
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")
            return self._enqueue_on(conn, rows, self._now(now))

    def _enqueue_on(
        self, conn: Connection, rows: list[dict[str, Any]], now: int | None, *, handoff: bool = True
    ) -> list[int]:
        ids: list[int] = []
        statement = self.sql.enqueue if handoff else self.sql.enqueue_plain
        for row in rows:
            params = dict(row, now=now, channel=self.notify_channel)
            message_id = int(conn.execute(statement, params).scalar_one())
            ids.append(message_id)
            if not self.caps.bookkeeping_in_statement and row["record"]:
                self._insert_event(conn, row["task_id"], message_id, 0, "enqueued", None, now)
        return ids

    # ---- claim -------------------------------------------------------------------------

    def claim(
        self,
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int = 1,
        now: int | None = None,
        on_exhausted: Callable[[list[Message]], None] | None = None,
    ) -> list[Message]:
        """Lease up to ``limit`` ready messages from ``queues`` to ``owner``.

        Messages whose delivery budget is spent are marked dead (``attempts_exhausted``)
        instead of being delivered; they are not returned but passed to ``on_exhausted``.
        """
        if not queues or limit < 1:
            return []
        if lease_ms < 1:
            raise ConfigurationError(f"lease_ms must be positive, not {lease_ms!r}")
        now = self._now(now)
        delivered: list[Message] = []
        while len(delivered) < limit:
            claimed = self._claim_once(queues, owner, lease_ms, limit - len(delivered), now)
            delivered.extend(m for m in claimed if m.state == "ready")
            exhausted = [m for m in claimed if m.state != "ready"]
            if exhausted and on_exhausted is not None:
                on_exhausted(exhausted)
            # Only when the batch was spent on exhausted messages is another look useful:
            # a delivery must not wait a polling interval behind a dead message.
            if not exhausted:
                break
        delivered.sort(key=lambda m: (-m.priority, m.available_at_ms, m.id))
        return delivered

    def _claim_once(
        self,
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        limit: int,
        now: int | None,
        conn: Connection | None = None,
    ) -> list[Message]:
        params: dict[str, Any] = {
            "owner": owner,
            "lease_ms": int(lease_ms),
            "limit": int(limit),
            "now": now,
        }
        if len(queues) == 1:
            statement = self.sql.claim_single
            params["queue"] = queues[0]
        else:
            statement = self.sql.claim
            params["queues"] = self._queues_param(queues)
        if self.fast_leases is not None:  # one statement (claim, run locks, events): autocommit
            found = self.fast_leases.rows(statement, params)
            return [_message_from(r, has_last_error="last_error" in r) for r in found]
        with self._writing_hot(statements=1) if conn is None else nullcontext(conn) as conn:
            rows = conn.execute(statement, params).fetchall()
            claimed = [_row_to_message(r) for r in rows]
            if not self.caps.bookkeeping_in_statement:
                self._claim_bookkeeping_sqlite(conn, claimed, owner, now)
        return claimed

    def ack_and_claim(
        self,
        fences: Iterable[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int,
        now: int | None = None,
        on_exhausted: Callable[[list[Message]], None] | None = None,
    ) -> tuple[set[int], list[Message]]:
        """``ack(fences)`` and ``claim(queues, owner, ...)`` together: the ids acked and the
        messages delivered. On PostgreSQL, when every fence is ``owner``'s, one statement
        (one commit): the claim then does not see the acks' effects, so the next message of
        a run whose message was just acked is not among those claimed. On SQLite, one
        transaction, whose claim sees them. Otherwise the two operations one after the
        other."""
        fences = list(fences)
        prepared = self.prepare_ack_and_claim(
            fences,
            queues,
            owner,
            lease_ms=lease_ms,
            limit=limit,
            now=now,
            on_exhausted=on_exhausted,
        )
        if prepared is not None:
            assert self.fast_leases is not None
            return prepared.finish(self.fast_leases.rows(prepared.statement, prepared.params))
        # The two operations: where ack_claim exists but did not apply (a fence of another
        # owner), or where there is nothing to combine.
        if self.caps.ack_claim_in_one_statement or not fences or not queues or limit < 1:
            acked = self.ack(fences, now=now) if fences else set()
            claimed = self.claim(
                queues, owner, lease_ms=lease_ms, limit=limit, now=now, on_exhausted=on_exhausted
            )
            return acked, claimed
        # SQLite: one transaction (one write lock, one commit). The claim sees the acks, so
        # the next message of a run just acked can come with it.
        if lease_ms < 1:
            raise ConfigurationError(f"lease_ms must be positive, not {lease_ms!r}")
        now = self._now(now)
        with self._writing_hot() as conn:
            acked = self._ack_on(conn, _by_owner(fences), now)
            found = self._claim_once(queues, owner, lease_ms, limit, now, conn=conn)
        return acked, self._past_exhausted(found, queues, owner, lease_ms, limit, now, on_exhausted)

    def _past_exhausted(
        self,
        found: list[Message],
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        limit: int,
        now: int | None,
        on_exhausted: Callable[[list[Message]], None] | None,
    ) -> list[Message]:
        """The ready messages a combined claim found, in delivery order; exhausted ones go to
        ``on_exhausted``, and, as claim() does, the claim goes on past them (a delivery must
        not wait a polling interval behind dead rows)."""
        delivered = [m for m in found if m.state == "ready"]
        exhausted = [m for m in found if m.state != "ready"]
        if exhausted and on_exhausted is not None:
            on_exhausted(exhausted)
        if exhausted and len(delivered) < limit:
            delivered += self.claim(
                queues,
                owner,
                lease_ms=lease_ms,
                limit=limit - len(delivered),
                now=now,
                on_exhausted=on_exhausted,
            )
        delivered.sort(key=lambda m: (-m.priority, m.available_at_ms, m.id))
        return delivered

    def prepare_ack_and_claim(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        limit: int,
        now: int | None = None,
        on_exhausted: Callable[[list[Message]], None] | None = None,
    ) -> Prepared[tuple[set[int], list[Message]]] | None:
        """``ack_and_claim`` as one statement to run (without fences, the plain claim), or
        None where it is not one (SQLite, a fence of another owner, nothing to claim)."""
        single = len(queues) == 1
        if self.fast_leases is None or not all(f.owner == owner for f in fences):
            return None
        if not queues or limit < 1:
            return None
        if fences:
            statement = self.sql.ack_claim_single if single else self.sql.ack_claim
        else:
            statement = self.sql.claim_single if single else self.sql.claim
        assert statement is not None  # PostgreSQL has every one of them
        if lease_ms < 1:
            raise ConfigurationError(f"lease_ms must be positive, not {lease_ms!r}")
        params: dict[str, Any] = {
            **(self._fence_params(fences) if fences else {}),
            "owner": owner,
            "lease_ms": int(lease_ms),
            "limit": int(limit),
            "now": self._now(now),
        }
        if len(queues) == 1:
            params["queue"] = queues[0]
        else:
            params["queues"] = self._queues_param(queues)

        def finish(rows: list[dict[str, Any]]) -> tuple[set[int], list[Message]]:
            acked = {int(i) for i in (rows[0]["acked_ids"] or [])} if fences and rows else set()
            found = [
                _message_from(r, has_last_error="last_error" in r)
                for r in rows
                if r["id"] is not None
            ]
            delivered = self._past_exhausted(
                found, queues, owner, lease_ms, limit, now, on_exhausted
            )
            return acked, delivered

        return Prepared(statement, params, finish)

    def _claim_bookkeeping_sqlite(
        self, conn: Connection, claimed: list[Message], owner: str, now: int | None
    ) -> None:
        assert self.sql.claim_runs is not None
        # One executemany per table: a claim of 32 is three statements, not 64.
        run_locks = [
            {
                "run_id": msg.run_id,
                "message_id": msg.id,
                "attempt": msg.attempt,
                "owner": owner,
                "lease_expires_at_ms": msg.lease_expires_at_ms,
            }
            for msg in claimed
            if msg.run_id is not None and msg.state != "dead"
        ]
        if run_locks:
            conn.execute(self.sql.claim_runs, run_locks)
        owner_data = json.dumps({"owner": owner})
        self._insert_events(
            conn,
            [
                _event_params(
                    msg.task_id,
                    msg.id,
                    msg.attempt,
                    "attempts_exhausted" if msg.state == "dead" else "claimed",
                    None if msg.state == "dead" else owner_data,
                    now,
                )
                for msg in claimed
            ],
        )

    def next_due_in_ms(self, queues: Sequence[str], *, now: int | None = None) -> int | None:
        """Milliseconds until the next scheduled message of ``queues`` becomes due, if any."""
        if not queues:
            return None
        with self._reading() as conn:
            value = conn.execute(
                self.sql.next_due, {"queues": self._queues_param(queues), "now": self._now(now)}
            ).scalar()
        return None if value is None else max(0, int(value))

    # ---- handoff (PostgreSQL) -------------------------------------------------------------

    def offer(
        self,
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None = None,
        now: int | None = None,
    ) -> int | None:
        """An idle worker's standing offer to take the next message published to ``queues``
        (PostgreSQL): until ``ttl_ms`` from now, a publish to one of them that finds the offer
        leases the message to ``owner`` for ``lease_ms`` and hands it over in its notification
        (``sqlease.handoff``). The offer counts only while a connection holds the advisory
        lock ``lock_key``. Live offers for queues not listed are withdrawn.

        An offer a publish used stands again only once the worker has heard of that handoff:
        ``seen`` maps a queue to the highest ``offer_seq`` of the handoffs the worker has
        read for it. Returns, as ``next_due_in_ms`` does, when the next delayed message of
        ``queues`` is due."""
        if not queues:
            self.withdraw_offers(owner)
            return None
        if not self.caps.offers:
            raise ConfigurationError("handoff offers need PostgreSQL")
        params = self._offer_params(queues, owner, lease_ms, lock_key, ttl_ms, seen, now)
        assert self.fast_planned is not None and self.sql.offer_and_next_due is not None
        rows = self.fast_planned.rows(self.sql.offer_and_next_due, params)
        return _due_ms(rows)

    def _offer_params(
        self,
        queues: Sequence[str],
        owner: str,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None,
        now: int | None,
    ) -> dict[str, Any]:
        for name, value in (("lease_ms", lease_ms), ("ttl_ms", ttl_ms)):
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer, not {value!r}")
        names = list(dict.fromkeys(queues))  # one write per queue: a name given twice is one
        return {
            "queues": names,
            "seen": [int((seen or {}).get(q, 0)) for q in names],
            "owner": owner,
            "lease_ms": lease_ms,
            "lock_key": int(lock_key),
            "ttl_ms": ttl_ms,
            "now": self._now(now),
        }

    def ack_and_offer(
        self,
        fences: Sequence[Fence],
        queues: Sequence[str],
        owner: str,
        *,
        lease_ms: int,
        lock_key: int,
        ttl_ms: int,
        seen: Mapping[str, int] | None = None,
        now: int | None = None,
    ) -> tuple[set[int], int | None]:
        """``ack(fences)`` and ``offer(queues, owner, …)`` in one statement (PostgreSQL): the
        ack that leaves a worker idle also leaves its offer. Returns the ids acked and when
        the next delayed message of ``queues`` is due. Fences of another owner, or no
        queues: the two run separately."""
        if (
            self.fast is None
            or not self.caps.offers
            or not fences
            or not queues
            or any(f.owner != owner for f in fences)
        ):
            acked = self.ack(fences, now=now) if fences else set()
            due = self.offer(
                queues,
                owner,
                lease_ms=lease_ms,
                lock_key=lock_key,
                ttl_ms=ttl_ms,
                seen=seen,
                now=now,
            )
            return acked, due
        params = {
            **self._fence_params(fences),
            **self._offer_params(queues, owner, lease_ms, lock_key, ttl_ms, seen, now),
        }
        assert self.fast_planned is not None and self.sql.ack_offer is not None
        rows = self.fast_planned.rows(self.sql.ack_offer, params)
        acked = {int(i) for i in (rows[0]["acked_ids"] or [])} if rows else set()
        return acked, _due_ms(rows)

    def withdraw_offers(self, owner: str, *, handed_too: bool = False) -> None:
        """Remove ``owner``'s offers: no publish hands it a message from now on. Offers a
        publish used stay (no publish takes them) until the worker has heard of their
        handoffs, unless ``handed_too`` (the worker is closing)."""
        if not self.caps.offers:
            return
        statement = self.sql.offer_withdraw_all if handed_too else self.sql.offer_withdraw
        assert self.fast is not None and statement is not None
        self.fast.rows(statement, {"owner": owner})

    def leased_to(self, owner: str) -> list[Fence]:
        """The fences of every message ``owner`` holds now, expired leases included."""
        if not self.caps.offers:  # only a handoff leases a message without a claim
            return []
        assert self.sql.leased_to_owner is not None
        with self._reading() as conn:
            rows = conn.execute(self.sql.leased_to_owner, {"owner": owner}).fetchall()
        return [Fence(int(r.id), owner, int(r.attempt)) for r in rows]

    def take(
        self, queues: Sequence[str], *, limit: int = 1, now: int | None = None
    ) -> list[Message]:
        """Delete and return up to ``limit`` ready messages (for consumers that never ack)."""
        if not queues or limit < 1:
            return []
        params = {"queues": self._queues_param(queues), "limit": int(limit), "now": self._now(now)}
        with self._writing_hot(statements=1) as conn:
            rows = conn.execute(self.sql.take, params).fetchall()
        taken = [_row_to_message(r) for r in rows]
        taken.sort(key=lambda m: (-m.priority, m.available_at_ms, m.id))
        return taken

    # ---- renew -------------------------------------------------------------------------

    def renew(
        self, fences: Iterable[Fence], *, lease_ms: int, now: int | None = None
    ) -> dict[int, int]:
        """Extend every lease still held; returns ``{message_id: new expiry}`` for those.

        A fence missing from the answer is lost (expired, taken over, parked or acked).
        """
        now = self._now(now)
        held: dict[int, int] = {}
        groups = _by_owner(fences)
        if not groups:
            return held
        with self._writing_hot(statements=len(groups)) as conn:
            for owner, group in groups.items():
                params = {
                    **self._fence_params(group),
                    "owner": owner,
                    "lease_ms": int(lease_ms),
                    "now": now,
                }
                rows = conn.execute(self.sql.renew, params).fetchall()
                for row in rows:
                    m = row._mapping
                    held[int(m["id"])] = int(m["lease_expires_at_ms"])
                    if not self.caps.bookkeeping_in_statement and m["run_id"] is not None:
                        assert self.sql.renew_runs is not None
                        conn.execute(
                            self.sql.renew_runs,
                            {
                                "run_id": m["run_id"],
                                "message_id": m["id"],
                                "lease_expires_at_ms": m["lease_expires_at_ms"],
                            },
                        )
        return held

    # ---- ack / release / park / fail ---------------------------------------------------

    def ack(self, fences: Iterable[Fence], *, now: int | None = None) -> set[int]:
        """Finish deliveries (the rows leave the table); returns the ids actually acked."""
        now = self._now(now)
        done: set[int] = set()
        groups = _by_owner(fences)
        if not groups:
            return done
        prepared = self.prepare_ack(groups, now)
        if prepared is not None:
            assert self.fast_leases is not None
            return prepared.finish(self.fast_leases.rows(prepared.statement, prepared.params))
        with self._writing_hot(statements=len(groups)) as conn:
            return self._ack_on(conn, groups, now)

    def _ack_on(
        self, conn: Connection, groups: Mapping[str, list[Fence]], now: int | None
    ) -> set[int]:
        done: set[int] = set()
        for owner, group in groups.items():
            params = {**self._fence_params(group), "owner": owner, "now": now}
            rows = [row._mapping for row in conn.execute(self.sql.ack, params).fetchall()]
            done.update(int(m["id"]) for m in rows)
            if not self.caps.bookkeeping_in_statement:
                self._after_transitions_sqlite(conn, rows, "acked", None, now)
        return done

    def prepare_ack(
        self, fences: Iterable[Fence] | Mapping[str, list[Fence]], now: int | None = None
    ) -> Prepared[set[int]] | None:
        """``ack`` as one statement to run, or None where it is not one (SQLite, no fences,
        fences of several owners)."""
        groups = fences if isinstance(fences, Mapping) else _by_owner(fences)
        if self.fast_leases is None or len(groups) != 1:
            return None
        ((owner, group),) = groups.items()
        params = {**self._fence_params(group), "owner": owner, "now": self._now(now)}
        return Prepared(self.sql.ack, params, lambda rows: {int(row["id"]) for row in rows})

    def _after_transitions_sqlite(
        self, conn: Connection, rows: list[Any], kind: str, data: str | None, now: int | None
    ) -> None:
        """The run locks and events of changed messages (PostgreSQL writes them in the
        statement itself): one executemany each."""
        runs = [
            {"run_id": m["run_id"], "message_id": m["id"]} for m in rows if m["run_id"] is not None
        ]
        if runs:
            conn.execute(self.sql.release_run, runs)
        self._insert_events(
            conn,
            [_event_params(m["task_id"], m["id"], m["attempt"], kind, data, now) for m in rows],
        )

    def _transition(
        self,
        fences: Iterable[Fence],
        *,
        new_state: str,
        kind: str,
        reason: str | None = None,
        delay_ms: int = 0,
        refund: bool = False,
        error: str | None = None,
        data: Any = None,
        now: int | None = None,
        also: Callable[[Connection], None] | None = None,
    ) -> set[int]:
        now = self._now(now)
        changed: set[int] = set()
        groups = _by_owner(fences)
        if not groups:
            return changed
        data_text = _dump(data)
        with self._writing(statements=len(groups) + (also is not None)) as conn:
            for owner, group in groups.items():
                params = {
                    **self._fence_params(group),
                    "owner": owner,
                    "now": now,
                    "delay_ms": max(0, int(delay_ms)),
                    "refund": 1 if refund else 0,
                    "new_state": new_state,
                    "reason": reason,
                    "error": error,
                    "kind": kind,
                    "data": data_text,
                    "channel": self.notify_channel,
                }
                rows = [r._mapping for r in conn.execute(self.sql.transition, params).fetchall()]
                changed.update(int(m["id"]) for m in rows)
                if not self.caps.bookkeeping_in_statement:
                    self._after_transitions_sqlite(conn, rows, kind, data_text, now)
            if changed and also is not None:
                also(conn)  # the caller's write, in the same transaction
        return changed

    def release(
        self,
        fences: Iterable[Fence],
        *,
        delay_ms: int = 0,
        refund: bool = False,
        error: str | None = None,
        now: int | None = None,
    ) -> set[int]:
        """Give leases back so the messages can be claimed again (after ``delay_ms``).

        ``refund`` returns the delivery to the attempt budget: use it for deliveries that
        never started (warm shutdown, prefetched messages). The attempt number itself never
        goes back, so the old fence stays stale.
        """
        return self._transition(
            fences,
            new_state="ready",
            kind="released",
            delay_ms=delay_ms,
            refund=refund,
            error=error,
            data={"delay_ms": delay_ms, "refund": refund} if (delay_ms or refund) else None,
            now=now,
        )

    def park(
        self,
        fence: Fence,
        reason: str,
        *,
        data: Any = None,
        now: int | None = None,
        also: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Take a held message out of circulation (paused, waiting for input, …) until
        ``requeue``; the event kind is ``reason``. Its run stays blocked behind it. ``also``
        runs in the same transaction when the park succeeded."""
        return bool(
            self._transition(
                [fence],
                new_state="parked",
                kind=reason,
                reason=reason,
                data=data,
                now=now,
                also=also,
            )
        )

    def fail(
        self,
        fence: Fence,
        reason: str,
        *,
        error: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Mark a held message dead (kept, listable, requeueable)."""
        return bool(
            self._transition(
                [fence],
                new_state="dead",
                kind="failed",
                reason=reason,
                error=error,
                data={"reason": reason},
                now=now,
            )
        )

    def requeue(
        self,
        message_id: int,
        *,
        delay_ms: int = 0,
        max_attempts: int | None = None,
        now: int | None = None,
    ) -> bool:
        """Make a parked or dead message claimable again with a fresh attempt budget. The
        attempt counter keeps growing (it is the fence), the budget is counted from it."""
        budget = self.max_attempts if max_attempts is None else max_attempts
        if not isinstance(budget, int) or budget < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, not {budget!r}")
        now = self._now(now)
        with self.engine.begin() as conn:
            row = conn.execute(
                self.sql.requeue,
                {
                    "message_id": message_id,
                    "delay_ms": max(0, delay_ms),
                    "budget": budget,
                    "now": now,
                },
            ).first()
            if row is None:
                return False
            m = row._mapping
            # A requeued message must run again, not be completed from a result one of its
            # earlier deliveries stored (see the transport's lost-ack completion).
            results = self.tables.results
            conn.execute(
                results.update().where(results.c.message_id == m["id"]).values(message_id=None)
            )
            self._insert_event(conn, m["task_id"], m["id"], m["attempt"], "requeued", None, now)
        return True

    # ---- fenced task state -------------------------------------------------------------

    def compare_and_set(
        self,
        fence: Fence,
        task_id: str,
        expected_revision: int,
        *,
        checkpoint: Mapping[str, Any] | None = None,
        state: str | None = None,
        reason: str | None = None,
        lease_ms: int = 0,
        event: str | None = "checkpoint",
        event_data: Any = None,
        run_id: str | None = None,
        now: int | None = None,
    ) -> CasResult:
        """Write the task's checkpoint and/or state if this delivery still holds its lease
        and the task is at ``expected_revision``. Renews the lease by ``lease_ms``."""
        now = self._now(now)
        checkpoint_text = None if checkpoint is None else json.dumps(dict(checkpoint))
        with self.engine.begin() as conn:
            held = conn.execute(
                self.sql.hold,
                {
                    "message_id": fence.message_id,
                    "attempt": fence.attempt,
                    "owner": fence.owner,
                    "lease_ms": int(lease_ms),
                    "task_id": task_id,
                    "now": now,
                },
            ).first()
            if held is None:
                return CasResult(Outcome.LEASE_LOST)
            expires = int(held._mapping["lease_expires_at_ms"])
            if held._mapping["run_id"] is not None:
                conn.execute(
                    self.sql.hold_run,
                    {
                        "run_id": held._mapping["run_id"],
                        "message_id": fence.message_id,
                        "lease_expires_at_ms": expires,
                    },
                )
            conn.execute(self.sql.task_ensure, {"task_id": task_id, "run_id": run_id, "now": now})
            revision = conn.execute(
                self.sql.task_cas,
                {
                    "task_id": task_id,
                    "expected": int(expected_revision),
                    "state": state,
                    "reason": reason,
                    "checkpoint": checkpoint_text,
                    "now": now,
                },
            ).scalar()
            if revision is None:
                return CasResult(Outcome.REVISION_CONFLICT, lease_expires_at_ms=expires)
            if event is not None:
                data = (
                    event_data
                    if event_data is not None
                    else (
                        {"revision": int(revision)}
                        if checkpoint is None
                        else {"revision": int(revision), "checkpoint": dict(checkpoint)}
                    )
                )
                self._insert_event(
                    conn, task_id, fence.message_id, fence.attempt, event, _dump(data), now
                )
        return CasResult(Outcome.UPDATED, int(revision), expires)

    def append_event(
        self,
        fence: Fence,
        kind: str,
        data: Any = None,
        *,
        task_id: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Append a timeline event under the lease; False (nothing written) if it is lost."""
        now = self._now(now)
        with self.engine.begin() as conn:
            if not self.holds_on(conn, fence, task_id, now):
                return False
            self._insert_event(
                conn, task_id, fence.message_id, fence.attempt, kind, _dump(data), now
            )
        return True

    def _insert_event(
        self,
        conn: Connection,
        task_id: str | None,
        message_id: int | None,
        attempt: int | None,
        kind: str,
        data: str | None,
        now: int | None,
    ) -> None:
        """Append one event (``data`` already JSON) inside the caller's transaction."""
        conn.execute(
            self.sql.event_insert, _event_params(task_id, message_id, attempt, kind, data, now)
        )

    def _insert_events(self, conn: Connection, events: list[dict[str, Any]]) -> None:
        if events:
            conn.execute(self.sql.event_insert, events)

    def _event_on(
        self,
        conn: Connection,
        task_id: str | None,
        fence: Fence | None,
        kind: str,
        data: Any,
        now: int | None,
    ) -> None:
        """Append an event inside the caller's transaction."""
        self._insert_event(
            conn,
            task_id,
            None if fence is None else fence.message_id,
            None if fence is None else fence.attempt,
            kind,
            _dump(data),
            now,
        )

    def holds_on(
        self,
        conn: Connection,
        fence: Fence,
        task_id: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Inside the caller's transaction: does ``fence`` hold a live lease (for a delivery
        of ``task_id``, when given)? Locks the message row until that transaction ends, so
        no takeover can slip in before the caller's write."""
        row = conn.execute(
            self.sql.hold,
            {
                "message_id": fence.message_id,
                "attempt": fence.attempt,
                "owner": fence.owner,
                "lease_ms": 0,
                "task_id": task_id,
                "now": self._now(now),
            },
        ).first()
        return row is not None

    def record_event(
        self,
        kind: str,
        data: Any = None,
        *,
        task_id: str | None = None,
        message_id: int | None = None,
        attempt: int | None = None,
        now: int | None = None,
    ) -> None:
        """Append an observation that needs no lease (e.g. ``lease_lost`` seen by a worker)."""
        with self.engine.begin() as conn:
            self._insert_event(
                conn, task_id, message_id, attempt, kind, _dump(data), self._now(now)
            )

    def is_held(self, fence: Fence, *, now: int | None = None) -> bool:
        """Does this delivery still hold its lease, by the database's answer?"""
        with self.engine.begin() as conn:
            return self.holds_on(conn, fence, None, now)

    # ---- reads -------------------------------------------------------------------------

    def get_message(self, message_id: int) -> Message | None:
        with self._reading() as conn:
            row = conn.execute(self.sql.message_get, {"id": message_id}).first()
        return None if row is None else _row_to_message(row)

    def get_task(self, task_id: str) -> TaskRecord | None:
        with self._reading() as conn:
            row = conn.execute(self.sql.task_get, {"task_id": task_id}).first()
        if row is None:
            return None
        m = row._mapping
        return TaskRecord(
            task_id=m["task_id"],
            state=m["state"],
            reason=m["reason"],
            checkpoint=json.loads(m["checkpoint"] or "{}"),
            revision=int(m["revision"]),
            run_id=m["run_id"],
            created_at_ms=int(m["created_at_ms"]),
            updated_at_ms=int(m["updated_at_ms"]),
        )

    def events(self, *, task_id: str | None = None, message_id: int | None = None) -> list[Event]:
        if (task_id is None) == (message_id is None):
            raise ValueError("pass exactly one of task_id or message_id")
        stmt = self.sql.events_for_task if task_id is not None else self.sql.events_for_message
        params = {"task_id": task_id} if task_id is not None else {"message_id": message_id}
        with self._reading() as conn:
            rows = conn.execute(stmt, params).fetchall()
        return [
            Event(
                int(r.id),
                r.task_id,
                None if r.message_id is None else int(r.message_id),
                None if r.attempt is None else int(r.attempt),
                r.kind,
                None if r.data is None else json.loads(r.data),
                int(r.at_ms),
            )
            for r in rows
        ]

    # ---- queues ------------------------------------------------------------------------

    def size(self, queue: str, *, now: int | None = None) -> int:
        """Messages ready to be delivered now (not leased, not scheduled for later)."""
        with self._reading() as conn:
            value = conn.execute(self.sql.size, {"queue": queue, "now": self._now(now)}).scalar()
        return int(value or 0)

    def purge(self, queue: str, *, now: int | None = None) -> int:
        """Delete the queue's undelivered messages (leased ones are left to their holders)."""
        now = self._now(now)
        with self.engine.begin() as conn:
            rows = conn.execute(self.sql.purge, {"queue": queue, "now": now}).fetchall()
            for r in rows:
                self._insert_event(conn, r.task_id, r.id, r.attempt, "purged", None, now)
        return len(rows)

    def declare_queue(self, queue: str, *, connection: Connection | None = None) -> None:
        params = {"queue": queue, "now": self._now(None)}
        if connection is not None:  # inside the caller's transaction (transactional enqueue)
            connection.execute(self.sql.declare_queue, params)
            return
        with self.engine.begin() as conn:
            conn.execute(self.sql.declare_queue, params)

    def has_queue(self, queue: str) -> bool:
        with self._reading() as conn:
            found = conn.execute(self.sql.has_queue, {"queue": queue}).first() is not None
        return found

    def delete_queue(self, queue: str, *, now: int | None = None) -> None:
        """Forget a queue: its bindings and undelivered messages."""
        with self.engine.begin() as conn:
            params = {"queue": queue, "now": self._now(now)}
            conn.execute(self.sql.delete_queue_messages, params)
            conn.execute(self.sql.delete_queue_bindings, params)
            conn.execute(self.sql.delete_queue, params)

    def bind(
        self,
        exchange: str,
        queue: str,
        routing_key: str = "",
        pattern: str = "",
        *,
        connection: Connection | None = None,
    ) -> None:
        params = {
            "exchange": exchange,
            "queue": queue,
            "routing_key": routing_key or "",
            "pattern": pattern or "",
        }
        if connection is not None:  # inside the caller's transaction
            connection.execute(self.sql.bind, params)
            return
        with self.engine.begin() as conn:
            conn.execute(self.sql.bind, params)

    def unbind(self, exchange: str, queue: str, routing_key: str = "", pattern: str = "") -> None:
        with self.engine.begin() as conn:
            conn.execute(
                self.sql.unbind,
                {
                    "exchange": exchange,
                    "queue": queue,
                    "routing_key": routing_key or "",
                    "pattern": pattern or "",
                },
            )

    def unbind_key(self, exchange: str, queue: str, routing_key: str = "") -> None:
        """Remove a binding whatever its pattern (the unbinding side may not know the
        exchange's type, and so not the pattern it was bound with)."""
        b = self.tables.bindings
        with self.engine.begin() as conn:
            conn.execute(
                b.delete().where(
                    b.c.exchange == exchange,
                    b.c.queue == queue,
                    b.c.routing_key == (routing_key or ""),
                )
            )

    def bindings(self, exchange: str) -> list[tuple[str, str, str]]:
        """``(routing_key, pattern, queue)`` for every binding of ``exchange``."""
        with self._reading() as conn:
            rows = conn.execute(self.sql.bindings_for, {"exchange": exchange}).fetchall()
        return [(r.routing_key, r.pattern, r.queue) for r in rows]
