"""Publishing and reading messages: enqueue, take (no-ack consumers), requeue, sizes."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from sqlease._core.base import Aggregate, StoreParts
from sqlease._core.flow import check_concurrency
from sqlease._core.leases import promote_runs
from sqlease._core.names import MAX_INT, check_id, check_name, is_count
from sqlease._core.timeline import Timeline
from sqlease._core.uniques import Uniques, check_unique
from sqlease._db.driver import Op
from sqlease._db.retry import retry_transient, transient
from sqlease._db.rows import row_to_message
from sqlease.errors import ConfigurationError, PayloadTooLarge
from sqlease.types import Message, NewMessage

#: How far the database's clock may run ahead of the time the client measured between a
#: publish's first try and its check (another server after a failover), in milliseconds.
#: Small: the window is also where another publish of the task id could be taken for it.
PUBLISH_CLOCK_SLACK_MS = 1000


def describe_member(msg: NewMessage, index: int, count: int | None) -> str:
    """How an error names the message at ``index`` of a batch of ``count`` (if known)."""
    task = "" if msg.task_id is None else f", task {msg.task_name or '?'}[{msg.task_id}]"
    of = "" if count is None else f" of {count}"
    return f"message {index + 1}{of} in the batch (queue {msg.queue!r}{task})"


def _delivery_key(message: Message) -> tuple[int, int, int]:
    return (-message.priority, message.available_at_ms, message.id)


class Messages(Aggregate):
    """Publishing and reading messages."""

    def __init__(self, parts: StoreParts, uniques: Uniques, timeline: Timeline) -> None:
        super().__init__(parts)
        self._uniques = uniques
        self._timeline = timeline

    def _check_new(self, msg: NewMessage) -> dict[str, Any]:
        """The one check of a new message (whoever publishes it: the transport passes the
        headers on as they came), and its row. A bad value raises an error that names the
        field (as the header is named) and says that nothing was enqueued."""
        if not isinstance(msg.queue, str) or not msg.queue:
            raise ConfigurationError(f"queue name must be a non-empty string, not {msg.queue!r}")
        try:
            check_name("queue name", msg.queue)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{exc}; the message was not enqueued") from None
        if not isinstance(msg.payload, str):
            raise TypeError(f"payload must be str, not {type(msg.payload).__name__}")
        size = len(msg.payload.encode("utf-8"))
        if size > self.parts.max_payload_bytes:
            raise PayloadTooLarge(
                f"message for queue {msg.queue!r} is {size} bytes, over max_payload_bytes="
                f"{self.parts.max_payload_bytes}; it was not enqueued"
            )
        try:
            return self._row(msg)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"{exc}; the message for queue {msg.queue!r} was not enqueued"
            ) from None

    def check_member(self, msg: NewMessage, index: int) -> None:
        """Refuse now a message that ``enqueue_many`` would refuse, named as the message at
        ``index`` of a batch (``sqlease.batch()`` checks each when it is sent)."""
        self._check_member(msg, index, None)

    def _check_member(self, msg: NewMessage, index: int, count: int | None) -> dict[str, Any]:
        """``_check_new`` of the message at ``index`` of ``count``: in a batch, a refused
        message's error names it (its place, task id and name) and says that nothing of
        the batch was enqueued."""
        if count == 1:
            return self._check_new(msg)
        try:
            return self._check_new(msg)
        except (ConfigurationError, PayloadTooLarge, TypeError) as exc:
            raise type(exc)(
                f"{describe_member(msg, index, count)}: {exc}; nothing of the batch was enqueued"
            ) from None

    def _row(self, msg: NewMessage) -> dict[str, Any]:
        priority = msg.priority
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigurationError(f"priority must be a small integer, not {priority!r}")
        if not -32768 <= priority <= 32767:
            raise ConfigurationError(f"priority must be a small integer, not {priority!r}")
        max_attempts = self.parts.max_attempts if msg.max_attempts is None else msg.max_attempts
        if not is_count(max_attempts):
            raise ConfigurationError(
                f"'max_attempts' must be an integer from 1 to {MAX_INT}, not {max_attempts!r}"
            )
        key, limit = check_concurrency(msg.concurrency_key, msg.concurrency_limit)
        if msg.task_name is not None and not isinstance(msg.task_name, str):
            raise ConfigurationError(f"task name must be a string, not {msg.task_name!r}")
        if msg.group_id is not None and not isinstance(msg.group_id, str):
            raise ConfigurationError(f"group id must be a string, not {msg.group_id!r}")
        check_id("task name", msg.task_name)
        check_id("group id", msg.group_id)
        check_id("task id", msg.task_id)
        check_id("run id", msg.run_id)
        unique_key, scope, for_ms = check_unique(
            msg.unique_key, msg.unique_scope, msg.unique_for_ms
        )
        return {
            "unique_key": unique_key,
            "unique_scope": scope,
            "unique_for_ms": for_ms,
            "group_id": msg.group_id,
            "task_name": msg.task_name,
            "gate_key": key,
            "gate_limit": limit,
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
        task_name: str | None = None,
        group_id: str | None = None,
        now: int | None = None,
        connection: Connection | None = None,
    ) -> int:
        """Add one message; returns its id. With ``connection`` it joins that transaction.
        ``task_name`` (a Celery task's name) and ``group_id`` (its Celery group) are kept in
        the task row of ``task_id``."""
        ids = self.enqueue_many(
            [
                NewMessage(
                    queue,
                    payload,
                    priority,
                    delay_ms,
                    run_id,
                    task_id,
                    max_attempts,
                    record,
                    task_name,
                    group_id=group_id,
                )
            ],
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
        """Add messages in one transaction, all or nothing; returns their ids in order.
        Several go as a batch (``Driver.message_publish_batch``: statements of many rows,
        never handed to an idle worker; a refused one's error names it). A unique task whose
        key holds enqueues nothing: its id in the list is the original's message, or 0 once
        that message is gone (``sqlease._core.uniques``). With ``connection`` the messages
        join that transaction (never handed to an idle worker: the offer's row would stay
        locked until it ends). Without it, a lost connection is retried (``retry_transient``),
        and a retry first looks for what the try before may have committed before its answer
        was lost (``_stored_by_earlier_try``), so the publish is stored once."""
        rows = [self._check_member(m, i, len(messages)) for i, m in enumerate(messages)]
        if not rows:
            return []
        at = self._now(now)
        if connection is not None:
            return self.driver.run_on(connection, self._publish_op(rows, at, handoff=False))
        began = time.monotonic()
        tries = 0

        def publish() -> list[int]:
            nonlocal tries
            tries += 1
            if tries > 1:
                # The try before may have committed with its answer lost (the server
                # restarted or the connection dropped at the commit): a publish stored
                # twice would run its task twice.
                stored = self._stored_by_earlier_try(rows, at, began)
                if stored is not None:
                    return stored
            return self.driver.execute(self._publish_op(rows, at, handoff=True))

        return retry_transient(publish)()

    def _publish_op(
        self, rows: list[dict[str, Any]], at: int | None, *, handoff: bool
    ) -> Op[list[int]]:
        unique = any(r["unique_key"] is not None for r in rows)
        admit = self._admit_id if unique else None
        if len(rows) > 1:
            # A batch: its plain messages in statements of many rows (sqlease._db.ops).
            return self.driver.message_publish_batch(rows, at, admit=admit)
        return self.driver.message_publish(rows, at, handoff=handoff, admit=admit)

    def _stored_by_earlier_try(
        self, rows: Sequence[Mapping[str, Any]], at: int | None, began: float
    ) -> list[int] | None:
        """The ids ``rows`` got if an earlier try of their publish committed, else None.

        A publish is one transaction, so one of its messages tells: the first with a task id
        (its payload carries Kombu's delivery tag, unique to this publish), looked for among
        the messages published since the first try began (``published_since``). Found, each
        message's id is looked up the same way (0 for one already gone: delivered and acked).
        A publish with no task id cannot be told from another: it is tried again (stored
        twice if its first try did commit). A message already gone is known by its task id
        alone, so another publish of the same task id, delivered and acked within the
        window, would be taken for this one: Celery's task ids are one per publish (a
        retry's original is acked only after its republish is stored), so that needs a
        task id reused on purpose within a second or so."""
        probe = next((r for r in rows if r["task_id"] is not None), None)
        if probe is None:
            return None
        window_ms = int((time.monotonic() - began) * 1000) + PUBLISH_CLOCK_SLACK_MS
        with self.driver.reading() as conn:

            def find(row: Mapping[str, Any]) -> int | None:
                params = {
                    "task_id": row["task_id"],
                    "payload": row["payload"],
                    "queue": row["queue"],
                    "window_ms": window_ms,
                    "now": at,
                }
                found = conn.execute(self.sql.published_since, params).scalar()
                return None if found is None else int(found)

            if find(probe) is None:
                return None
            return [(find(r) or 0) if r["task_id"] is not None else 0 for r in rows]

    def _admit_id(self, conn: Connection, row: Mapping[str, Any], now: int | None) -> int | None:
        duplicate = self._uniques.admit(conn, dict(row), now)
        return None if duplicate is None else duplicate.message_id or 0

    @transient
    def take(
        self, queues: Sequence[str], *, limit: int = 1, now: int | None = None
    ) -> list[Message]:
        """Delete and return up to ``limit`` ready messages (for consumers that never ack)."""
        if not queues or limit < 1:
            return []
        return self.driver.execute(self.take_op(queues, limit=limit, now=now))

    def take_op(
        self, queues: Sequence[str], *, limit: int = 1, now: int | None = None
    ) -> Op[list[Message]]:
        """``take`` as one op (``queues`` not empty, ``limit`` at least 1), in delivery
        order."""
        op = self.driver.message_take(queues, int(limit), self._now(now))
        return op.then(lambda taken: sorted(taken, key=_delivery_key))

    def next_due_op(self, queues: Sequence[str], *, now: int | None = None) -> Op[int | None]:
        """``next_due_in_ms`` as one op (``queues`` not empty)."""
        return self.driver.message_next_due(queues, self._now(now))

    @transient
    def next_due_in_ms(self, queues: Sequence[str], *, now: int | None = None) -> int | None:
        """Milliseconds until the next scheduled message of ``queues`` becomes due, if any."""
        if not queues:
            return None
        return self.driver.execute(self.next_due_op(queues, now=now))

    @transient
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
        budget = self.parts.max_attempts if max_attempts is None else max_attempts
        most = MAX_INT // 2  # counted on from the attempts made
        if not is_count(budget, most):
            raise ConfigurationError(
                f"max_attempts must be an integer from 1 to {most}, not {budget!r}"
            )
        now = self._now(now)
        with self.driver.writing() as conn:
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
            self._timeline.insert(conn, m["task_id"], m["id"], m["attempt"], "requeued", None, now)
        return True

    @transient
    def get_message(self, message_id: int) -> Message | None:
        with self.driver.reading() as conn:
            row = conn.execute(self.sql.message_get, {"id": message_id}).first()
        return None if row is None else row_to_message(row)

    @transient
    def size(self, queue: str, *, now: int | None = None) -> int:
        """Messages queued now: ready to be delivered (not leased, not scheduled for later),
        or held back only by their run, their gate or their rate (parked, or given their
        rate's turn), as a broker counts its ready messages."""
        with self.driver.reading() as conn:
            value = conn.execute(self.sql.size, {"queue": queue, "now": self._now(now)}).scalar()
        return int(value or 0)

    @transient
    def purge(self, queue: str, *, now: int | None = None) -> int:
        """Delete the queue's undelivered messages (leased ones are left to their holders)."""
        now = self._now(now)
        with self.driver.writing() as conn:
            rows = conn.execute(self.sql.purge, {"queue": queue, "now": now}).fetchall()
            for r in rows:
                self._timeline.insert(conn, r.task_id, r.id, r.attempt, "purged", None, now)
        # A purged head of a run: the run's next message goes on (in its own queue).
        promote_runs(self.driver, (r.run_id for r in rows if r.run_id is not None), now)
        return len(rows)
