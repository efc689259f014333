"""Key/value storage for Celery results and chord counters (sqlease._core.chord_counters),
fenced by delivery leases.

A write made from inside a task delivered by sqlease carries the delivery's fence: it is
applied only if that delivery still holds its lease, in the same transaction that checks it,
so a worker that lost its lease can neither overwrite the new holder's result nor advance a
chord. PostgreSQL writers NOTIFY ``<prefix>results`` so waiting clients wake at once (a task's
result only while a client waits: sqlease._core.waiters).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Connection,
    String,
    Table,
    bindparam,
    delete,
    func,
    literal_column,
    or_,
    select,
    union_all,
    update,
)

from sqlease._core.chord_counters import ChordCounters, FenceRefused
from sqlease._core.chord_sql import ChordStatements
from sqlease._core.names import MAX_ID_BYTES
from sqlease._core.store import Store
from sqlease._core.waiters import waiter_key, waiter_keys
from sqlease._db.driver import ResultWrite
from sqlease._db.retry import transient
from sqlease.errors import ConfigurationError
from sqlease.types import Fence, Outcome

__all__ = ["TERMINAL_STATES", "FenceRefused", "ResultStore", "exception_meta"]

TERMINAL_STATES = ("SUCCESS", "FAILURE", "REVOKED")
#: Longest result key, in bytes of UTF-8: a task id's (sqlease._core.names.MAX_ID_BYTES)
#: with Celery's longest prefix, and room to spare. A key is an index key (PostgreSQL's
#: entries hold at most 2704 bytes) and its notification's payload (fewer than 8000).
MAX_KEY_BYTES = 1100


def check_key(key: str) -> None:
    """A clear error for a result key too long to be stored."""
    size = len(key.encode("utf-8"))
    if size > MAX_KEY_BYTES:
        raise ConfigurationError(
            f"result key {key[:60]!r}... is {size} bytes of UTF-8, over {MAX_KEY_BYTES} "
            f"(a task id holds at most {MAX_ID_BYTES}); it was not stored"
        )


def exception_meta(
    task_id: str, status: str, exc_type: str, args: list[Any], module: str = "sqlease.errors"
) -> bytes:
    """A Celery result record (JSON serializer) for a task that ended with an exception, so
    ``AsyncResult(task_id)`` shows ``status`` and ``.get()`` raises ``exc_type(*args)``."""
    meta: dict[str, Any] = {
        "status": status,
        "result": {"exc_type": exc_type, "exc_message": list(args), "exc_module": module},
        "traceback": None,
        "children": [],
        "date_done": datetime.now(UTC).isoformat(),
        "task_id": task_id,
    }
    return json.dumps(meta).encode("utf-8")


class ResultStore(ChordCounters):
    def __init__(self, store: Store) -> None:
        self.store = store
        self.results = store.tables.results
        self.counters = store.tables.counters
        self.notify_channel = f"{store.tables.prefix}results"
        #: The advisory locks a waiting client's LISTEN connection holds (shared).
        self.waiter_keys = waiter_keys(self.notify_channel)
        self._insert = store.driver.insert
        self._sql = ChordStatements(self.counters, self.results, self._insert)
        self._read_through = _read_through(self.results, store.tables.duplicates)

    def _now(self) -> int:
        return int(self.store.clock()) if self.store.clock else int(time.time() * 1000)

    def _held(self, conn: Any, fence: Fence, task_id: str | None) -> bool:
        return self.store.holds_on(conn, fence, task_id)

    def _notify(self, conn: Connection, key: str) -> None:
        """Inside the caller's transaction: wake the clients waiting on ``key`` at commit."""
        self.store.driver.notify(conn, self.notify_channel, key)  # (checked: it fits)

    # ---- values ----------------------------------------------------------------------

    def put_on(
        self, conn: Connection, key: str, value: bytes, *, state: str, task_id: str, now: int
    ) -> None:
        """Inside the caller's transaction, unfenced: set ``key``'s value, state and task (a
        result the broker decides, such as REVOKED on cancel) and wake its waiting clients at
        commit. The delivery that wrote an earlier value stays recorded."""
        check_key(key)
        row = {"key": key, "value": value, "state": state, "task_id": task_id, "updated_at_ms": now}
        insert = self._insert(self.results).values(**row)
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=[self.results.c.key],
                set_={k: insert.excluded[k] for k in row if k != "key"},
            )
        )
        self._notify(conn, key)

    @transient
    def put(
        self,
        key: str,
        value: bytes,
        *,
        state: str | None = None,
        task_id: str | None = None,
        expires_ms: int | None = None,
        fence: Fence | None = None,
        keep_success: bool = False,
        offer: Mapping[str, Any] | None = None,
    ) -> Outcome:
        """Store ``value`` under ``key``; with a fence, only while its lease is held; with
        ``keep_success``, never over a stored SUCCESS (Celery's rule: a late duplicate must
        not overwrite the result that stands). Returns ``Outcome.UPDATED``, ``LEASE_LOST`` or
        ``KEPT_SUCCESS``. ``offer`` (PostgreSQL, fenced writes): the holder's handoff offer,
        written in the same statement if the lease held (``sqlease.transport.OFFER_KEY``)."""
        check_key(key)
        now = self._now()
        row = {
            "key": key,
            "value": value,
            "state": state,
            "task_id": task_id,
            "message_id": None if fence is None else fence.message_id,
            "attempt": None if fence is None else fence.attempt,
            "expires_at_ms": None if not expires_ms else now + expires_ms,
            "updated_at_ms": now,
        }
        write = ResultWrite(
            row=row,
            fence=fence,
            keep_success=keep_success,
            offer=_offer_params(offer, fence),
            now=None if self.store.clock is None else now,
            channel=self.notify_channel,
            waiters_key=waiter_key(self.waiter_keys, key),
        )
        return self.store.driver.execute(self.store.driver.result_put(write))

    def _live(self) -> Any:
        return or_(
            self.results.c.expires_at_ms.is_(None), self.results.c.expires_at_ms > self._now()
        )

    @transient
    def get(self, key: str) -> bytes | None:
        with self.store.driver.reading() as conn:
            value = conn.execute(
                select(self.results.c.value).where(self.results.c.key == key, self._live())
            ).scalar()
        return None if value is None else bytes(value)

    @transient
    def exists(self, key: str) -> bool:
        """Whether a live value is stored under ``key`` (without reading it)."""
        with self.store.driver.reading() as conn:
            found = conn.execute(
                select(self.results.c.key).where(self.results.c.key == key, self._live())
            ).first()
        return found is not None

    @transient
    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self.store.driver.reading() as conn:
            rows = conn.execute(
                select(self.results.c.key, self.results.c.value).where(
                    self.results.c.key.in_(list(keys)), self._live()
                )
            ).fetchall()
        found = {r.key: bytes(r.value) for r in rows}
        return [found.get(k) for k in keys]

    def get_or_original(self, key: str, prefix: str) -> bytes | None:
        """``mget_or_originals`` of one key."""
        return self.mget_or_originals([key], prefix)[0]

    @transient
    def mget_or_originals(self, keys: Sequence[str], prefix: str) -> list[bytes | None]:
        """``mget``, where a key ``prefix + task_id`` with no value reads as the original's
        (``prefix + original_id``) when that task id was a unique task's duplicate publish,
        which never runs (sqlease._core.uniques). One statement: a pending result is read
        as often as its client polls it."""
        direct: dict[str, bytes] = {}
        original: dict[str, bytes] = {}
        now = self._now()
        with self.store.driver.reading() as conn:
            # A statement per 1,000 keys: each key is up to two parameters (SQLite allows
            # 32,766 in a statement), and a join may ask for a group of any size.
            for at in range(0, len(keys), _READ_CHUNK):
                chunk = list(keys[at : at + _READ_CHUNK])
                ids = [k[len(prefix) :] for k in chunk if k.startswith(prefix)]
                params = {"keys": chunk, "ids": ids, "prefix": prefix, "now": now}
                for r in conn.execute(self._read_through, params):
                    (original if r.via else direct)[r.asked] = bytes(r.value)
        return [direct.get(k, original.get(k)) for k in keys]

    @transient
    def delete(self, key: str) -> None:
        with self.store.driver.writing() as conn:
            conn.execute(delete(self.results).where(self.results.c.key == key))
            conn.execute(delete(self.counters).where(self.counters.c.key == key))

    @transient
    def expire(self, key: str, seconds: float | None) -> None:
        expires = None if not seconds else self._now() + int(seconds * 1000)
        with self.store.driver.writing() as conn:
            # Counters first: every transaction that writes a key in both tables takes them in
            # this order (reset_counter), so two of them on one key cannot deadlock.
            for table in (self.counters, self.results):
                conn.execute(update(table).where(table.c.key == key).values(expires_at_ms=expires))

    @transient
    def expire_many(self, expiries: Sequence[tuple[str, float | None]]) -> None:
        """``expire`` for each ``(key, seconds)``, in one transaction."""
        now = self._now()
        by_time: dict[int | None, list[str]] = {}
        for key, seconds in expiries:
            by_time.setdefault(None if not seconds else now + int(seconds * 1000), []).append(key)
        with self.store.driver.writing() as conn:
            for expires, keys in by_time.items():
                for at in range(0, len(keys), 1000):
                    chunk = keys[at : at + 1000]
                    for table in (self.counters, self.results):  # as ``expire``
                        conn.execute(
                            update(table)
                            .where(table.c.key.in_(chunk))
                            .values(expires_at_ms=expires)
                        )

    @transient
    def record_final(
        self,
        task_id: str,
        status: str,
        exc_type: str,
        args: list[Any],
        module: str = "sqlease.errors",
    ) -> bool:
        """Write a final Celery result for a task the broker itself finished (exhausted,
        undecodable, cancelled), unless it already has a final result."""
        key = f"celery-task-meta-{task_id}"
        with self.store.driver.reading() as conn:
            state = conn.execute(
                select(self.results.c.state).where(self.results.c.key == key)
            ).scalar()
        if state in TERMINAL_STATES:
            return False
        return (
            self.put(
                key,
                exception_meta(task_id, status, exc_type, args, module),
                state=status,
                task_id=task_id,
            )
            is Outcome.UPDATED
        )

    @transient
    def cleanup(self) -> int:
        """Delete expired results and counters; returns how many rows went."""
        now = self._now()
        removed = 0
        with self.store.driver.writing() as conn:
            for table in (self.results, self.counters):
                result = conn.execute(
                    delete(table).where(
                        table.c.expires_at_ms.isnot(None), table.c.expires_at_ms <= now
                    )
                )
                removed += result.rowcount or 0
        return removed

    @transient
    def completed_messages(self, message_ids: Iterable[int]) -> set[int]:
        """Which of these messages already have a final result stored under their lease
        (a result written, then the ack lost)."""
        ids = list(message_ids)
        if not ids:
            return set()
        with self.store.driver.reading() as conn:
            rows = conn.execute(
                select(self.results.c.message_id).where(
                    self.results.c.message_id.in_(ids),
                    self.results.c.state.in_(TERMINAL_STATES),
                )
            ).fetchall()
        return {int(r.message_id) for r in rows}

    @transient
    def count(self) -> int:
        with self.store.driver.reading() as conn:
            return int(conn.execute(select(func.count()).select_from(self.results)).scalar_one())


#: Keys per statement of ``mget_or_originals``.
_READ_CHUNK = 1000


def _read_through(results: Table, duplicates: Table) -> Any:
    """``mget_or_originals``' statement (keys, ids, prefix, now): the live values stored
    under ``keys`` (``via`` 0), and those of the originals of ``ids`` that were duplicate
    publishes, under ``prefix`` + the duplicate's id (``via`` 1)."""
    now: Any = bindparam("now")
    prefix: Any = bindparam("prefix", type_=String())
    original = results.alias("original")
    direct = select(
        results.c.key.label("asked"), results.c.value, literal_column("0").label("via")
    ).where(
        results.c.key.in_(bindparam("keys", expanding=True)),
        results.c.expires_at_ms.is_(None) | (results.c.expires_at_ms > now),
    )
    through = (
        select(
            (prefix + duplicates.c.task_id).label("asked"),
            original.c.value,
            literal_column("1").label("via"),
        )
        .select_from(duplicates.join(original, original.c.key == prefix + duplicates.c.original_id))
        .where(
            duplicates.c.task_id.in_(bindparam("ids", expanding=True)),
            original.c.expires_at_ms.is_(None) | (original.c.expires_at_ms > now),
        )
    )
    return union_all(direct, through)


def _offer_params(offer: Mapping[str, Any] | None, fence: Fence | None) -> dict[str, Any] | None:
    """The offer a delivery asked its final result to write, as statement parameters; None
    when there is none or it is not as the transport writes it (a result is never failed
    for its offer: the worker's ack offers again anyway)."""
    if offer is None or fence is None:
        return None
    try:
        queues = list(dict.fromkeys(str(q) for q in offer["queues"]))
        lease_ms, ttl_ms = int(offer["lease_ms"]), int(offer["ttl_ms"])
        lock_key = int(offer["lock_key"])
        # Per queue, the highest offer number of the handoffs the worker had heard of: only
        # those used offers stand again (sqlease._db.postgresql.offers.offer_writes).
        heard = offer.get("seen") or {}
        seen = [int(heard.get(q, 0)) for q in queues]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if not queues or lease_ms < 1 or ttl_ms < 1:
        return None
    return {
        "offer_queues": queues,
        "offer_seen": seen,
        "offer_lease_ms": lease_ms,
        "offer_lock_key": lock_key,
        "offer_ttl_ms": ttl_ms,
    }
