"""The Kombu ``Transport``: options, owner, store, connect and close, publish, ``as_uri``."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

import psycopg
import sqlalchemy
import sqlalchemy.exc
from kombu.transport import virtual
from sqlalchemy.engine import URL

from ..background import BackgroundCalls, Job, Outcome
from ..delivery import fence_of
from ..errors import ConfigurationError, DatabaseUnavailable
from ..handoff import Handoff, lock_key_for
from ..handoff import split as split_notifications
from ..heartbeat import heartbeat
from ..loop_calls import LoopCalls
from ..options import TransportOptions
from ..registry import CONNECT_RETRY_SECONDS, store_for
from ..results_store import ResultStore
from ..store import Fence, Message, Prepared, Store
from ..urls import client_url, display_url, to_sqlalchemy_url
from ..wakeup import PostgresListener, SqliteWatcher, Waker
from .codec import decode, new_message
from .completion import hold
from .drain import ChannelDrain, DrainState
from .qos import QoS

logger = logging.getLogger(__name__)

# The name ``QoS`` is the Channel's class attribute inside its body: annotations use this one.
SqlQoS = QoS


#: Most messages one claim statement takes (the prefetch credit usually bounds it first).
CLAIM_BATCH = 128
#: Most messages one delete-on-fetch statement takes for consumers that never ack.
TAKE_BATCH = 64
#: Acks in the worker's event loop are written together: after this many seconds, or at once
#: when this many are waiting.
ACK_DELAY = 0.005
ACK_BATCH = 32
#: SQLite: the longest an idle worker waits between looks at the file's ``data_version`` (a
#: read of a counter in shared memory, about 20 microseconds): new work starts within this.
SQLITE_IDLE_CHECK = 0.005

#: The key of ack writes on the transport's background thread (claims are keyed by channel).
ACKS: Any = object()


class Channel(virtual.Channel):
    """A virtual channel whose deliveries are SQL leases."""

    QoS = QoS
    supports_fanout = True
    do_restore = True
    connection: Transport
    qos: SqlQoS

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        #: What this channel knows of its queues (sqlease.transport.drain).
        self.drain = ChannelDrain()

    @property
    def store(self) -> Store:
        return self.connection.store

    def close(self) -> None:
        if not self.closed:
            self.drain.close()
            if self.drain.claiming and self.connection is not None:
                # Its messages are given back (attempt refunded) before the channel's
                # unacked ones are restored, so a warm shutdown leaves no lease behind.
                self.connection.finish_background_claims()
        super().close()

    # ---- publishing --------------------------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.connection.publish([(queue, message)])

    def _put_fanout(
        self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any
    ) -> None:
        if exchange.endswith(".pidbox"):
            self.connection.durable_revoke(message)
        queues = sorted({queue for _, _, queue in self.get_table(exchange)})
        if queues:
            self.connection.publish([(queue, message) for queue in queues])

    # ---- consuming ---------------------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        self.drain.consume(queue, no_ack=no_ack)
        self.connection.wake_soon()
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        if self.connection is not None and consumer_tag in self._consumers:
            # The next idle look offers the queues still consumed. (A channel Kombu already
            # closed has no connection: Celery cancels its consumers after a connection loss.)
            self.connection.withdraw_offers()
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self.drain.cancel(queue)
        return result

    def _claim(self, queues: list[str], limit: int) -> tuple[list[Message], bool]:
        """Lease up to ``limit`` messages; also whether the store had fewer than asked."""
        transport = self.connection
        messages = self.store.claim(
            queues,
            transport.owner,
            lease_ms=transport.options.lease_ms,
            limit=limit,
            on_exhausted=transport.record_exhausted,
        )
        return self._hold(messages), len(messages) < limit

    def claim_with_acks(
        self, queues: list[str], limit: int, fences: list[Fence]
    ) -> tuple[set[int], list[Message], bool]:
        """Ack ``fences`` and claim as ``_claim`` does, in one statement on PostgreSQL: the ids
        acked, the messages claimed, and whether the store had fewer than asked. (Never
        "fewer" when acks went with it: the claim may not have seen them free a run's next
        message, so the queues are not known to be drained.)"""
        acked, messages = self.store.ack_and_claim(fences, queues, **self._claim_terms(limit))
        return acked, self._hold(messages), not fences and len(messages) < limit

    def prepare_claim_with_acks(
        self, queues: list[str], limit: int, fences: list[Fence]
    ) -> Prepared[tuple[set[int], list[Message], bool]] | None:
        """``claim_with_acks`` as one statement to run (None where it is not one)."""
        prepared = self.store.prepare_ack_and_claim(fences, queues, **self._claim_terms(limit))
        if prepared is None:
            return None

        def finish(rows: list[dict[str, Any]]) -> tuple[set[int], list[Message], bool]:
            acked, messages = prepared.finish(rows)
            return acked, self._hold(messages), not fences and len(messages) < limit

        return Prepared(prepared.statement, prepared.params, finish)

    def _claim_terms(self, limit: int) -> dict[str, Any]:
        transport = self.connection
        return {
            "owner": transport.owner,
            "lease_ms": transport.options.lease_ms,
            "limit": limit,
            "on_exhausted": transport.record_exhausted,
        }

    def _hold(self, messages: list[Message]) -> list[Message]:
        """The heartbeat keeps the leases of what will be delivered from now on."""
        return hold(self.connection, messages)

    def take_noack(self, callback: Any) -> int:
        """Deliver one delete-on-fetch batch of the no-ack queues (remote control, events)
        if it is time to look at them; how many were delivered."""
        part = self.drain
        noack = [q for q in self._active_queues if q in part.noack_queues]
        if not noack or not part.may_take():
            return 0
        transport = self.connection
        delivered = 0
        taken = self.store.take(noack, limit=TAKE_BATCH)
        part.took(len(taken), postgresql=transport.is_postgresql)
        if len(taken) == TAKE_BATCH:
            transport.drain.wake()
        for message in taken:
            payload = decode(transport, message, self.decode_body, leased=False)
            if payload is not None:
                callback(payload, message.queue)
                delivered += 1
        return delivered

    def drain_events(self, timeout: float | None = None, callback: Any = None) -> int:
        """Deliver what is ready on this channel's queues: one delete-on-fetch batch for
        no-ack consumers and one claim batch, sized by the free prefetch credit."""
        if not self._consumers:
            raise Empty()
        callback = callback or self.connection._deliver
        transport = self.connection
        delivered = self.take_noack(callback)
        noack = self.drain.noack_queues
        acked = [q for q in self._active_queues if q not in noack]
        if acked and transport.drain.should_claim(
            self.drain, self.qos, postgresql=transport.is_postgresql
        ):
            credit = self.qos.can_consume_max_estimate() if self.qos.prefetch_count else None
            limit = min(credit or CLAIM_BATCH, CLAIM_BATCH)
            if transport.can_claim_in_background(self):
                transport.claim_in_background(self, acked, limit)
            else:
                claimed, short = transport.claim_in_loop(self, acked, limit)
                delivered += self.after_claim(claimed, short, limit, callback)
        if not delivered:
            raise Empty()
        return delivered

    def after_claim(self, claimed: list[Message], short: bool, limit: int, callback: Any) -> int:
        """Note what a claim of ``limit`` found, and deliver it."""
        transport = self.connection
        transport.drain.claimed(self.drain, len(claimed), limit, short=short)
        offer = transport.offer_with_result(claimed)
        return self._deliver_claimed(claimed, callback, offer=offer)

    def _refill_later(self) -> bool:
        return self.qos.refill_later()

    def _deliver_claimed(
        self, claimed: list[Message], callback: Any, *, offer: dict[str, Any] | None = None
    ) -> int:
        delivered = 0
        for index, message in enumerate(claimed):
            try:
                payload = decode(
                    self.connection, message, self.decode_body, leased=True, offer=offer
                )
                if payload is not None:
                    callback(payload, message.queue)
                    delivered += 1
            except BaseException:
                # The consumer failed mid-batch: the rest of the batch never reached it (nor
                # QoS, so no close would release it). Give it back now, attempt refunded.
                rest = [m.fence for m in claimed[index + 1 :]]
                if rest:
                    heartbeat().drop(rest)
                    try:
                        self.store.release(rest, refund=True)
                    except Exception:
                        logger.exception(
                            "sqlease: could not release %d undelivered message(s)", len(rest)
                        )
                raise
        return delivered

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        # Rows that are not readable messages are failed and skipped: keep looking.
        while True:
            claimed, _ = self._claim([queue], 1)
            if not claimed:
                raise Empty()
            payload = decode(self.connection, claimed[0], self.decode_body, leased=True)
            if payload is not None:
                return payload

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        if no_ack:
            payload = None
            while payload is None:
                taken = self.store.take([queue], limit=1)
                if not taken:
                    break
                payload = decode(self.connection, taken[0], self.decode_body, leased=False)
        else:
            try:
                payload = self._get(queue)
            except Empty:
                payload = None
        if payload is None:
            return None
        message = self.Message(payload, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    # ---- acknowledgement (fenced) --------------------------------------------------------

    def _fence_for_tag(self, delivery_tag: str) -> Fence | None:
        return self.qos.fence_for(delivery_tag)

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        fence = self._fence_for_tag(delivery_tag)
        if fence is not None and self._in_a_run(delivery_tag):
            self.connection.look_again()  # the ack lets the run's next message go
        try:
            if fence is not None:
                heartbeat().drop([fence])
                if not self.connection.defer_ack(fence, self) and not self.store.ack([fence]):
                    self._report_refused_ack(fence)
        finally:
            super().basic_ack(delivery_tag, multiple=multiple)

    def _in_a_run(self, delivery_tag: str) -> bool:
        return self.qos.in_a_run(delivery_tag)

    def unacked_count(self) -> int:
        """Deliveries this channel holds: prefetched or running, not yet acked."""
        return self.qos.unacked_count()

    def _report_refused_ack(self, fence: Fence) -> None:
        # Never raised into Celery: the delivery that holds the message now is the one that
        # counts. Parked (paused, waiting for a person) and cancelled tasks are expected here.
        current = self.store.get_message(fence.message_id)
        if current is not None and current.state in ("parked", "dead"):
            logger.info(
                "sqlease: ack of message %s not applied: the task is %s (%s)",
                fence.message_id,
                current.state,
                current.reason,
            )
            return
        logger.warning(
            "sqlease: stale ack refused for message %s attempt %s: the lease was lost "
            "(expired or taken over); the message stays with its new holder",
            fence.message_id,
            fence.attempt,
            extra={"message_id": fence.message_id, "attempt": fence.attempt},
        )

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        fence = self._fence_for_tag(delivery_tag)
        try:
            if fence is not None:
                heartbeat().drop([fence])
                if requeue:
                    done = bool(self.store.release([fence]))
                    self.connection.look_again()
                else:
                    # Rejected without requeue: kept as failed (inspectable, requeueable),
                    # never silently dropped.
                    done = self.store.fail(fence, "rejected")
                if not done:
                    logger.warning(
                        "sqlease: stale reject ignored for message %s attempt %s",
                        fence.message_id,
                        fence.attempt,
                    )
        finally:
            # Our SQL did the requeue; the base class would publish a copy.
            self.qos.reject(delivery_tag, requeue=False)

    def _restore(self, message: Any) -> None:
        """Give an unacked delivery back (channel close, warm shutdown): a fenced release
        that refunds the attempt, never a re-published copy."""
        fence = fence_of(message.delivery_info)
        if fence is None:
            return super()._restore(message)
        heartbeat().drop([fence])
        self.store.release([fence], refund=True)
        self.connection.look_again()
        return None

    def _restore_at_beginning(self, message: Any) -> None:
        self._restore(message)

    # ---- queues and bindings -----------------------------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.connection.declare_queue(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        connection = self.connection._caller_transaction()  # before the store is touched
        self.store.bind(exchange, queue, routing_key or "", pattern or "", connection=connection)

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        return self.store.bindings(exchange)

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        self.state.binding_delete(queue, exchange, routing_key)
        self.store.unbind_key(exchange or "", queue, routing_key or "")

    def _delete(
        self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any
    ) -> None:
        self.store.unbind(exchange, queue, routing_key or "", pattern or "")

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> int | None:
        if if_empty and self._size(queue):
            return None
        super().queue_delete(queue, if_unused=if_unused, if_empty=if_empty, **kwargs)
        self.store.delete_queue(queue)
        self.connection.forget_queue(queue)
        return None


def _celery_holds_tasks() -> bool:
    """In a Celery worker process: tasks received and not finished, whatever their ack mode
    (Celery's own bookkeeping; empty elsewhere)."""
    try:
        from celery.worker import state
    except ImportError:  # pragma: no cover - celery is a dependency
        return False
    return bool(state.active_requests or state.reserved_requests or state.scheduled_requests)


# The name ``Channel`` is the Transport's class attribute inside its body: annotations there use
# this one.
SqlChannel = Channel


def _acks_and_first_claim(jobs: list[Job]) -> tuple[list[Fence], Job | None]:
    """The acks of every waiting call, and the first waiting claim (they go as one statement)."""
    fences = [fence for job in jobs for fence, _ in job.context["pending"]]
    first = next((job for job in jobs if job.key is not ACKS), None)
    return fences, first


def _outcomes(
    jobs: list[Job], first: Job | None, acked: set[int], claimed: list[Message], *, short: bool
) -> list[Outcome]:
    """One outcome per waiting call, once the acks went with the first claim's statement."""
    outcomes: list[Outcome] = []
    for job in jobs:
        if job is first:
            outcome = Outcome(job.key, value=(claimed, short), context=job.context)
        elif job.key is ACKS:
            outcome = Outcome(job.key, context=job.context)
        else:
            outcome = job.run()  # a second claim (another channel): on its own
        outcome.acked = acked
        outcomes.append(outcome)
    return outcomes


class Transport(virtual.Transport):
    """Kombu transport ``sqlease``: SQLite or PostgreSQL through SQLAlchemy."""

    Channel = Channel

    driver_type = "sqlease"  # never 'sql': Celery turns events off for that driver type
    driver_name = "sqlalchemy"
    can_parse_url = True
    default_port = None
    polling_interval = 1.0

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = (  # type: ignore[assignment]
        *virtual.Transport.connection_errors,
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.TimeoutError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        DatabaseUnavailable,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.options = TransportOptions.parse(client.transport_options)
        self.polling_interval = self.options.polling_interval
        hostname = client_url(
            client.hostname,
            transport=client.transport_cls,
            userid=client.userid,
            password=client.password,
            port=client.port,
            virtual_host=client.virtual_host,
        )
        if not hostname or hostname == "localhost":
            raise ConfigurationError(
                "the sqlease transport needs a database URL, e.g. broker_url = "
                "'sqlease+sqlite:///app.db' or 'sqlease+postgresql://user@host/db'"
            )
        self.url: URL = to_sqlalchemy_url(hostname)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: The advisory lock this transport's listening connection holds (handoff liveness).
        self.lock_key = lock_key_for(self.owner)
        #: Offers were made (handoff): withdraw them, and release what they brought, at close.
        self._offered = False
        #: The queues an offer of ours may stand for now (made, not known used or withdrawn).
        self._offer_queues: set[str] = set()
        #: Per queue, the highest offer number of the handoffs we have read: an offer a
        #: publish used stands again only once we have heard of it (Store.offer's ``seen``).
        self._handoffs_heard: dict[str, int] = {}
        #: The listening connection (its generation) whose handoffs we hear.
        self._listening_generation = 0
        self._closing_connection = False
        self._store: Store | None = None
        self._results: ResultStore | None = None
        self._waker: Waker | None = None
        self._declared: set[str] = set()
        self.drain = DrainState()
        self._loop: Any = None
        self._loop_thread = 0
        self._pending_acks: list[tuple[Fence, Any]] = []
        self._pipe: tuple[int, int] | None = None
        self._ack_timer: Any = None
        self._kicked = False
        self._reader_fd: int | None = None
        self._poll_entry: Any = None
        self._due_entry: Any = None
        self._idle_delay = 0.0
        self._last_full_poll = 0.0
        self._maintenance: Any = None
        self._background: BackgroundCalls | LoopCalls | None = None

    # ---- the store -----------------------------------------------------------------------

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = store_for(
                self.url, self.options, connect_retry_seconds=CONNECT_RETRY_SECONDS
            )
        return self._store

    @property
    def results(self) -> ResultStore:
        if self._results is None:
            self._results = ResultStore(self.store)
        return self._results

    @property
    def is_postgresql(self) -> bool:
        return self.url.get_backend_name() == "postgresql"

    def driver_version(self) -> str:
        return str(sqlalchemy.__version__)

    def establish_connection(self) -> Any:
        self._closing_connection = False
        self._caller_transaction()  # inside sqlease.transaction(): check on its connection
        self.store  # noqa: B018  (connects, checks or migrates the schema: fails fast)
        return super().establish_connection()

    def publish(self, items: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Store Kombu messages (one transaction)."""
        connection = self._caller_transaction()  # before the store is touched
        batch = [new_message(queue, message) for queue, message in items]
        self.store.enqueue_many(batch, connection=connection)

    def durable_revoke(self, message: dict[str, Any]) -> None:
        """A pidbox broadcast being published: if it is a revoke (by ids or by stamped
        headers), also write it to the database (``sqlease.revokes``), so it survives worker
        restarts and reaches tasks no worker has received yet."""
        from .. import revokes
        from ..admin import Admin

        revoke = revokes.parse(message)
        if revoke is not None:
            revokes.apply(self.store, Admin(self.url, store=self.store), revoke)

    def forward_revoke(self, task_id: str) -> None:
        """A task delivered again (its earlier worker died or gave it back): if a revoke
        reached it while that worker held it, put it in this worker's revoked list, so Celery
        discards it (REVOKED result, ack, ``task-revoked`` event) instead of running it."""
        worker_state = sys.modules.get("celery.worker.state")
        if worker_state is None:
            return  # not a Celery worker: no revoked list to tell
        from .. import revokes

        if revokes.requested(self.store, task_id):
            logger.info("sqlease: task %s was revoked while another worker held it", task_id)
            worker_state.revoked.add(task_id)

    def record_exhausted(self, messages: list[Message]) -> None:
        """Exhausted tasks get a FAILURE result (AttemptsExhausted), so that clients waiting
        on them are answered instead of waiting forever."""
        for message in messages:
            logger.error(
                "sqlease: task %s (message %s) failed attempts_exhausted after %d deliveries; "
                "kept for inspection ('sqlease show %s', 'sqlease requeue %s')",
                message.task_id,
                message.id,
                message.attempt,
                message.task_id,
                message.task_id,
            )
            if message.task_id is not None:
                self.record_failure(
                    message.task_id, "AttemptsExhausted", [message.task_id, message.attempt]
                )

    def record_failure(
        self, task_id: str, exc_type: str, args: list[Any], module: str = "sqlease.errors"
    ) -> None:
        try:
            self.results.record_final(task_id, "FAILURE", exc_type, args, module)
        except Exception:
            logger.warning(
                "sqlease: could not record the failure of task %s", task_id, exc_info=True
            )

    def defer_ack(self, fence: Fence, channel: Any) -> bool:
        """In the worker's event loop, acks made during one loop iteration are written
        together, in one statement, at the start of the next. (Elsewhere: False, ack now.)"""
        if self._loop is None or threading.get_ident() != self._loop_thread:
            return False
        self._pending_acks.append((fence, channel))
        if len(self._pending_acks) == 1 and self._unacked_total() <= 1:
            # Nothing else is running or buffered: no ack could join this one, so write it
            # now (and keep the next task's start free of it).
            self.flush_acks()
            return True
        if len(self._pending_acks) >= ACK_BATCH:
            self._kick()  # the self-pipe handler writes them in the next iteration
        elif len(self._pending_acks) == 1:
            # Gather the acks of the next few milliseconds into one statement (one commit).
            self._ack_timer = self._loop.call_later(ACK_DELAY, self.flush_acks)
            self._kick()  # so the hub recomputes its poll timeout with this timer
        return True

    def _unacked_total(self) -> int:
        """Deliveries not yet acked on this connection's channels (the one being acked
        included)."""
        return sum(c.unacked_count() for c in self.channels if isinstance(c, Channel))

    def flush_acks(self, *, in_background: bool = True) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        pending, self._pending_acks = self._pending_acks, []
        if not pending:
            return
        fences = [fence for fence, _ in pending]
        if self._acks_leave_idle(fences):
            # The acks that leave the worker idle also leave its handoff offer (one
            # statement), so a publish right after the task finished is handed over too.
            queues = self._active_ack_queues()
            acked, due_ms = self.store.ack_and_offer(
                fences,
                queues,
                self.owner,
                **self._offer_terms(),
            )
            self._offer_queues = set(queues)
            self._offered = True
            for channel in self.channels:
                if isinstance(channel, Channel):
                    channel.drain.due_read()  # the due time came with the acks
            self._set_due_timer(None if due_ms is None else due_ms / 1000.0)
            self._after_acks(pending, acked)
            return
        if in_background and self._background_possible():
            # Like a busy worker's claims, and in order with them: a claim submitted after
            # these acks runs after them or together with them. (Together, it cannot see them
            # free a run's next message; it then never reports its queues drained, so the
            # next look claims that message.)
            self._background_calls().submit(ACKS, lambda: self.store.ack(fences), pending=pending)
            return
        self._after_acks(pending, self.store.ack(fences))

    def _acks_leave_idle(self, fences: list[Fence]) -> bool:
        return (
            self.is_postgresql
            and self._loop is not None
            and threading.get_ident() == self._loop_thread
            and self._can_offer()
            and all(f.owner == self.owner for f in fences)
            and self._holds_nothing(besides=fences)
            and bool(self._active_ack_queues())
        )

    def _after_acks(self, pending: list[tuple[Fence, Any]], acked: set[int]) -> None:
        for fence, channel in pending:
            if fence.message_id not in acked:
                channel._report_refused_ack(fence)
        if acked and self._loop is not None:
            # An ack frees prefetch credit and may unblock the next task of a run: look for
            # work in the next iteration rather than at the next poll.
            self.drain.wake()
            self._kick()

    # ---- claims off the event loop's thread (PostgreSQL, while tasks run) ----------------

    def can_claim_in_background(self, channel: SqlChannel) -> bool:
        """While the channel holds deliveries (tasks running or buffered), its refill claim
        runs on a background thread, so the loop keeps feeding the pool during the claim's
        round trip and commit. An idle worker claims in the loop: nothing else is waiting
        for it, and the hop to a thread would only delay the new task's start. (SQLite's
        claims have no network round trip and commit without an fsync: in the loop.)"""
        return self._background_possible() and channel.unacked_count() > 0

    def _background_possible(self) -> bool:
        return (
            self.is_postgresql
            and self._pipe is not None
            and threading.get_ident() == self._loop_thread
        )

    def _background_calls(self) -> BackgroundCalls | LoopCalls:
        if self._background is None:
            fast = self.store.fast_leases
            if fast is not None and sys.modules[__package__].NONBLOCKING and self._loop is not None:
                # The loop sends the statements itself and reads their rows when they come.
                self._background = LoopCalls(
                    self._loop,
                    fast,
                    self._wake_from_background,
                    self._prepare_background,
                    self._combine_background,
                )
            else:  # a psycopg without the generator the loop drives: a thread waits instead
                self._background = BackgroundCalls(
                    self._wake_from_background,
                    self._combine_background,
                    # The thread runs one statement after another: it keeps its connection.
                    on_start=None if fast is None else fast.pin_thread,
                    on_exit=None if fast is None else fast.release_thread,
                )
        return self._background

    def _take_pending_acks(self) -> list[tuple[Fence, Any]]:
        """The acks waiting to be written, for a claim to take with it (their timer stops)."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        pending, self._pending_acks = self._pending_acks, []
        return pending

    def claim_in_loop(
        self, channel: SqlChannel, queues: list[str], limit: int
    ) -> tuple[list[Message], bool]:
        """The channel's claim, in the loop. SQLite: the acks waiting to be written go with it,
        in one transaction (one write lock, one commit instead of two; the claim sees them
        free a run's next message). PostgreSQL claims here only when idle, with no acks
        waiting: as they are."""
        if self.is_postgresql or not self._pending_acks:
            return channel._claim(queues, limit)
        pending = self._take_pending_acks()
        try:
            acked, claimed, short = channel.claim_with_acks(
                queues, limit, [fence for fence, _ in pending]
            )
        except BaseException:
            # Nothing of it was written: the acks wait for the next write, as before.
            self._pending_acks[:0] = pending
            if self._loop is not None and self._ack_timer is None:
                self._ack_timer = self._loop.call_later(ACK_DELAY, self.flush_acks)
            raise
        self._after_acks(pending, acked)
        return claimed, short

    def claim_in_background(self, channel: SqlChannel, queues: list[str], limit: int) -> None:
        """Submit the channel's refill claim, with the acks waiting to be written: the acks of
        the tasks whose completion freed the credit go with it, in one statement."""
        pending = self._take_pending_acks()
        channel.drain.claim_started()
        self._background_calls().submit(
            channel,
            lambda: channel._claim(queues, limit),
            limit=limit,
            queues=queues,
            pending=pending,
        )

    def _combine_background(self, jobs: list[Job]) -> list[Outcome]:
        """The waiting calls, run now (on the background thread, or in the loop where they
        are not one statement): the acks of every waiting call are written with the first
        waiting claim, in one statement (or together, when no claim waits)."""
        fences, first = _acks_and_first_claim(jobs)
        try:
            if first is not None:
                acked, claimed, short = first.key.claim_with_acks(
                    first.context["queues"], first.context["limit"], fences
                )
            else:
                acked, claimed, short = (self.store.ack(fences) if fences else set()), [], False
        except BaseException as exc:  # none of it is known to be written: all report it
            return [Outcome(job.key, error=exc, context=job.context) for job in jobs]
        return _outcomes(jobs, first, acked, claimed, short=short)

    def _prepare_background(self, jobs: list[Job]) -> Prepared[list[Outcome]] | None:
        """The same as one statement for the loop to send (None where it is not one)."""
        fences, first = _acks_and_first_claim(jobs)
        if first is None:
            acks = self.store.prepare_ack(fences) if fences else None
            if acks is None:
                return None
            return Prepared(
                acks.statement,
                acks.params,
                lambda rows: _outcomes(jobs, None, acks.finish(rows), [], short=False),
            )
        channel: SqlChannel = first.key
        queues, limit = first.context["queues"], first.context["limit"]
        claim = channel.prepare_claim_with_acks(queues, limit, fences)
        if claim is None:
            return None

        def finish(rows: list[dict[str, Any]]) -> list[Outcome]:
            acked, claimed, short = claim.finish(rows)
            return _outcomes(jobs, first, acked, claimed, short=short)

        return Prepared(claim.statement, claim.params, finish)

    def _wake_from_background(self) -> None:
        # Called on the background thread: always write (the loop's _kicked flag is the loop
        # thread's own, and a wake-up lost to a race would leave the claim undelivered).
        pipe = self._pipe
        if pipe is not None:
            try:
                os.write(pipe[1], b"c")
            except OSError:
                pass

    def deliver_background_claims(self) -> None:
        """In the loop: report the background thread's acks and deliver its claims (or give
        them back if their channel is closing); raise the first error as the call in the loop
        would have (a connection error makes Celery reconnect)."""
        background = self._background
        if background is None:
            return
        error: BaseException | None = None
        for outcome in background.collect():
            if outcome.acked is not None:
                self._after_acks(outcome.context["pending"], outcome.acked)
            if outcome.key is not ACKS:
                channel: SqlChannel = outcome.key
                channel.drain.claim_finished()
            if outcome.error is not None:
                error = error or outcome.error
            if outcome.key is ACKS or outcome.error is not None:
                continue
            claimed, short = outcome.value
            if error is not None or channel.closed or channel.drain.closing or self._loop is None:
                self._give_back(claimed)
                continue
            self.drain.begin_pass()
            if channel.after_claim(claimed, short, outcome.context["limit"], self._deliver):
                self._kick()  # let the pool pick the new jobs up in the next iteration
            elif self.drain.found_nothing:
                self._schedule_due()
        if error is not None:
            if isinstance(error, self.connection_errors):
                raise error
            logger.error("sqlease: error while fetching messages", exc_info=error)

    def finish_background_claims(self, timeout: float = 30.0) -> None:
        """Wait for the background thread's calls; report their acks and give back what
        their claims leased (channels are closing: nothing more is delivered). Leases it
        could not give back expire."""
        background = self._background
        if background is None:
            return
        if not background.wait_idle(timeout):
            logger.warning(
                "sqlease: a background claim did not finish within %.0f s; its messages come "
                "back when their leases expire",
                timeout,
            )
        for outcome in background.collect():
            if outcome.acked is not None:
                self._after_acks(outcome.context["pending"], outcome.acked)
            elif outcome.context.get("pending"):
                logger.warning(
                    "sqlease: could not write %d ack(s); their messages come back when "
                    "their leases expire",
                    len(outcome.context["pending"]),
                    exc_info=outcome.error,
                )
            if outcome.key is not ACKS:
                outcome.key.drain.claim_finished()
                if outcome.error is None:
                    self._give_back(outcome.value[0])

    def _give_back(self, claimed: list[Message]) -> None:
        fences = [m.fence for m in claimed]
        if not fences:
            return
        heartbeat().drop(fences)
        try:
            self.store.release(fences, refund=True)
        except Exception:
            logger.exception("sqlease: could not release %d undelivered message(s)", len(fences))

    def _caller_transaction(self) -> Any:
        """The caller's ``sqlease.transaction()`` connection, if any, checked before this
        process opens its own connections to the database."""
        from ..transactions import current_connection

        conn = current_connection(self.url)
        if conn is None or self._store is not None:
            return conn
        if not self.is_postgresql:
            # A SQLite writer holds the file's write lock: creating sqlease's tables (or
            # switching the file to WAL) from another connection now would wait it out.
            from ..schema import build_tables, read_version

            if read_version(conn, build_tables(self.options.table_prefix)) is None:
                raise ConfigurationError(
                    "sqlease's tables do not exist yet in this SQLite database, and they cannot "
                    "be created while your transaction holds the write lock: run 'sqlease "
                    "migrate --url …' (or publish once outside a transaction) first"
                )
        return conn

    def declare_queue(self, queue: str) -> None:
        if queue not in self._declared:
            # In a transactional enqueue the declaration joins the caller's transaction too:
            # on SQLite a second connection would wait for the caller's write lock.
            connection = self._caller_transaction()
            self.store.declare_queue(queue, connection=connection)
            if connection is None:
                self._declared.add(queue)

    def forget_queue(self, queue: str) -> None:
        self._declared.discard(queue)

    # ---- wake-ups --------------------------------------------------------------------------

    @property
    def waker(self) -> Waker:
        if self._waker is None:
            if self.is_postgresql:
                self._waker = PostgresListener(
                    self.url,
                    self.store.notify_channel,
                    lock_key=self.lock_key if self.options.handoff else None,
                )
            else:
                self._waker = SqliteWatcher(str(self.url.database))
        return self._waker

    def wake_soon(self) -> None:
        self.drain.wake()

    def _active_ack_queues(self, *, with_credit: bool = False) -> list[str]:
        queues: set[str] = set()
        for channel in self.channels:
            if isinstance(channel, Channel) and channel._consumers:
                noack = channel.drain.noack_queues
                if with_credit and (channel.drain.closing or not channel.qos.can_consume()):
                    continue
                queues.update(q for q in channel._active_queues if q not in noack)
        return sorted(queues)

    def _next_due_delay(self, *, offer: bool = False) -> float | None:
        """Seconds until the next delayed message of the consumed queues is due. With
        ``offer`` (an idle worker in its event loop, PostgreSQL, handoff on), the same
        statement leaves an offer for the queues whose channel has prefetch credit."""
        queues = self._active_ack_queues()
        if offer and self._can_offer():
            # Only a worker that holds nothing offers (and one that holds something again
            # withdraws): a busy or stalled worker is never handed a message another could
            # start now.
            idle = not self._pending_acks and self._holds_nothing()
            open_queues = self._active_ack_queues(with_credit=True) if idle else []
            if open_queues or self._offer_queues:
                due_ms = self.store.offer(
                    open_queues,
                    self.owner,
                    **self._offer_terms(),
                )
                self._offer_queues = set(open_queues)
                self._offered = self._offered or bool(open_queues)
                if open_queues and set(open_queues) == set(queues):
                    return None if due_ms is None else due_ms / 1000.0
        if not queues:
            return None
        due_ms = self.store.next_due_in_ms(queues)
        return None if due_ms is None else due_ms / 1000.0

    def _holds_nothing(self, besides: Iterable[Fence] = ()) -> bool:
        """No delivery held on any channel (but ``besides``, being acked), no claim under way,
        and, in a Celery worker, no task received and not finished (one acked early is still
        running, or waiting for a pool process)."""
        if any(isinstance(c, Channel) and c.drain.claiming for c in self.channels):
            return False
        acking = {f"{f.message_id}.{f.attempt}" for f in besides}
        for channel in self.channels:
            if isinstance(channel, Channel) and channel.qos.holds_besides(acking):
                return False
        return not _celery_holds_tasks()

    def _can_offer(self) -> bool:
        waker = self._waker
        return (
            self.options.handoff
            and not self._closing_connection
            and isinstance(waker, PostgresListener)
            and waker.connected
            and self._loop is not None
        )

    def _offer_terms(self) -> dict[str, Any]:
        """This worker's offer, as the store's offer calls (and a result's stamp) take it."""
        return {
            "lease_ms": self.options.lease_ms,
            "lock_key": self.lock_key,
            "ttl_ms": self._offer_ttl_ms(),
            "seen": dict(self._handoffs_heard),
        }

    def _offer_ttl_ms(self) -> int:
        # Refreshed by every idle look (the safety poll runs each polling_interval); the
        # margin covers a slow loop. Liveness itself is the listener's advisory lock.
        return int(max(3.0 * self.polling_interval, 2.0) * 1000)

    @contextmanager
    def _errors_logged(self, doing: str) -> Iterator[None]:
        """In the event loop: a connection error goes up (Celery reconnects); any other error
        is logged and the loop goes on."""
        try:
            yield
        except self.connection_errors:
            raise
        except Exception:
            logger.exception("sqlease: error while %s", doing)

    def _take_noack_now(self) -> None:
        with self._errors_logged("fetching messages"):
            self._take_noack_first()

    def _take_noack_first(self) -> int:
        """Remote control before tasks: every channel's no-ack queues (pidbox, events) are
        looked at (when their throttle allows) before any channel claims, so a revoke (by id
        or by stamped headers) broadcast before a task was published reaches Celery before
        that task, whichever channel the fair cycle would come to first. How many came."""
        delivered = 0
        for channel in self.channels:
            if isinstance(channel, Channel) and channel._consumers:
                delivered += channel.take_noack(self._deliver)
        return delivered

    def _accept_handoffs(self, handoffs: list[Handoff], notified: set[str] | None = None) -> None:
        """Deliver messages a publish leased to this worker (its idle offer), as a claim's
        would be. One for a queue no channel consumes any more is given back at once.
        ``notified``: queues named by plain notifications read with these handoffs (their
        messages wait for a claim)."""
        delivered = 0
        for handoff in handoffs:
            # Heard, whatever becomes of the message: the offer it used may stand again.
            heard = self._handoffs_heard.get(handoff.queue, 0)
            self._handoffs_heard[handoff.queue] = max(heard, handoff.offer_seq)
            message = handoff.message
            if message is None:  # too long for the notification: read it back, fenced
                row = self.store.get_message(handoff.message_id)
                if (
                    row is None
                    or row.lease_owner != self.owner
                    or row.attempt != handoff.attempt
                    or row.state != "ready"
                ):
                    continue
                message = row
            self._offer_queues.discard(message.queue)  # a publish used that queue's offer up
            channel = self._channel_for(message.queue)
            if channel is None:
                self.store.release([message.fence], refund=True)
                continue
            held = channel._hold([message])
            # It came because the queues were idle: nothing more to claim until something
            # notifies them (unless something just did); after its ack, the idle look offers
            # again.
            channel.drain.handed_off(
                named=bool(notified and not notified.isdisjoint(channel._active_queues))
            )
            offer = self.offer_with_result(held)
            delivered += channel._deliver_claimed(held, self._deliver, offer=offer)
        if delivered:
            self._kick()  # let the pool pick the new job up in the next iteration

    def offer_with_result(self, claimed: list[Message]) -> dict[str, Any] | None:
        """For the one message an idle worker is about to deliver: the offer its final result
        will write (handoff on, PostgreSQL, in the event loop, nothing else held), else None."""
        if len(claimed) != 1 or not self._can_offer() or not self._holds_nothing():
            return None
        queues = self._active_ack_queues()
        if not queues:
            return None
        self._offered = True
        self._offer_queues.update(queues)
        return {"queues": queues, **self._offer_terms()}

    def _channel_for(self, queue: str) -> SqlChannel | None:
        for channel in self.channels:
            if (
                isinstance(channel, Channel)
                and not channel.closed
                and not channel.drain.closing
                and queue in channel._active_queues
                and queue not in channel.drain.noack_queues
            ):
                return channel
        return None

    def withdraw_offers(self) -> None:
        """No more handoffs to this worker until its next idle look (a consumer cancelled).
        A failure is only logged: the offer then expires, and what it brings is released at
        close or taken over after its lease."""
        if not self._offer_queues:
            return
        self._offer_queues = set()
        try:
            self.store.withdraw_offers(self.owner)
        except Exception:
            logger.warning("sqlease: could not withdraw the handoff offer", exc_info=True)

    def _drain_ready(self) -> bool:
        """Deliver until nothing more is ready or credit runs out; True if anything came."""
        got = self._take_noack_first() > 0
        drain = self.drain
        for _ in range(50):  # bounded, so the event loop stays responsive
            drain.begin_round()
            assert self.cycle is not None
            try:
                self.cycle.get(self._deliver)
            except Empty:
                drain.round_found_nothing()
                break
            got = True
            if not drain.more:
                break
        return got

    # ---- the worker's event loop -----------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._unregister_from_loop()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._start_maintenance()
        loop.on_tick.add(self._on_tick)
        self._add_reader()
        self._open_self_pipe()
        self._schedule_poll(0)

    # The self-pipe: a byte written to it makes the hub run another iteration at once. Used
    # when acks are waiting to be written and when a tick delivered tasks (the pool registers
    # its writers for new jobs at the start of an iteration, so without a wake-up a job
    # delivered late in an iteration would wait for the next timer).
    def _open_self_pipe(self) -> None:
        if self._loop is None or self._pipe is not None:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._loop.add_reader(read_fd, self._on_self_pipe)

    def _close_self_pipe(self) -> None:
        if self._pipe is None:
            return
        read_fd, write_fd = self._pipe
        self._pipe = None
        if self._loop is not None:
            try:
                self._loop.remove_reader(read_fd)
            except Exception:
                pass
        for fd in (read_fd, write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _kick(self) -> None:
        if self._pipe is not None and not self._kicked:
            self._kicked = True
            try:
                os.write(self._pipe[1], b"k")
            except (BlockingIOError, OSError):
                pass

    def _on_self_pipe(self) -> None:
        if self._pipe is not None:
            try:
                while os.read(self._pipe[0], 512):
                    pass
            except (BlockingIOError, OSError):
                pass
        self._kicked = False
        if self._background is not None:
            self.deliver_background_claims()
        if len(self._pending_acks) >= ACK_BATCH:
            self.flush_acks()

    def _start_maintenance(self) -> None:
        # Only consuming workers run it (they register with an event loop); producers don't.
        if self._maintenance is None and self.options.maintenance_interval > 0:
            from ..maintenance import MaintenanceThread

            self._maintenance = MaintenanceThread(
                self.store,
                self.owner,
                interval=self.options.maintenance_interval,
                event_retention_ms=self.options.event_retention_ms,
            ).start()

    def _add_reader(self) -> None:
        if self._loop is None or self._reader_fd is not None:
            return
        waker = self.waker
        fd = waker.fileno()
        if fd is not None:
            self._reader_fd = fd
            self._loop.add_reader(fd, self._on_readable)
            if isinstance(waker, PostgresListener):
                self._after_listening(waker.generation)

    def _after_listening(self, generation: int) -> None:
        """On a new listening connection (a reconnect): the handoffs of used offers whose
        notifications went to the old one will never be heard, so those offers are removed
        (none could be used while no connection held the lock) and offered afresh. The
        messages they brought come back when their leases expire."""
        previous, self._listening_generation = self._listening_generation, generation
        if previous == 0 or previous == generation or not self._offered:
            return
        try:
            self.store.withdraw_offers(self.owner, handed_too=True)
            self._offer_queues = set()
        except Exception:
            logger.warning(
                "sqlease: could not clear handoff offers after relistening", exc_info=True
            )

    def _remove_reader(self) -> None:
        if self._loop is not None and self._reader_fd is not None:
            try:
                self._loop.remove_reader(self._reader_fd)
            except Exception:
                pass
        self._reader_fd = None

    def _unregister_from_loop(self) -> None:
        if self._loop is None:
            return
        self._loop.on_tick.discard(self._on_tick)
        self._remove_reader()
        self._close_self_pipe()
        for entry in (self._poll_entry, self._due_entry):
            if entry is not None:
                entry.cancel()
        self._poll_entry = self._due_entry = None
        self._loop = None
        self.finish_background_claims()
        if isinstance(self._background, LoopCalls):
            # It watches this loop's hub: a loop registered later gets calls of its own.
            self._background.stop()
            self._background = None
        self.flush_acks(in_background=False)

    def _look_everywhere(self, queues: set[str] | None = None) -> None:
        """Something was published: no-ack queues must be looked at now, not after their
        quiet-interval throttle, and drained queues claimed from again. ``queues``: the ones
        notified (None: any of them)."""
        for channel in self.channels:
            if isinstance(channel, Channel):
                channel.drain.notified(queues, channel._active_queues)

    def look_again(self) -> None:
        """Messages may have become ready (released, or the next of a run after an ack)."""
        for channel in self.channels:
            if isinstance(channel, Channel):
                channel.drain.look_again()

    def _on_readable(self) -> None:
        waker = self.waker
        if isinstance(waker, PostgresListener):
            payloads = waker.pending()
            if not waker.connected:
                # The LISTEN connection broke (server restart): re-listen on the next poll.
                self._remove_reader()
            queues: set[str] | None = None
            if payloads is not None:
                handoffs, queues = split_notifications(payloads, self.owner)
                if handoffs:
                    if queues:
                        # No-ack queues named in the same batch first: a revoke or other
                        # remote control command broadcast before a task was published must
                        # reach Celery before the task does (the payloads' order is lost).
                        # Named task queues are claimed from in the next iteration.
                        self._look_everywhere(queues)
                        self._take_noack_now()
                        self.drain.wake()
                    with self._errors_logged("taking handed-off messages"):
                        self._accept_handoffs(handoffs, queues)
                    return
                if payloads and not queues:
                    return  # only handoffs to other workers: nothing to look at
            # Only the no-ack queues a notification names are looked at: a published task
            # goes straight to its claim, without a look at the remote-control queue first.
            self._look_everywhere(queues)
        else:
            waker.ready()
            self._look_everywhere()
        self.drain.wake()
        self._drain_in_loop()

    def _on_tick(self) -> None:
        if self._background is not None:
            self.deliver_background_claims()
        if len(self._pending_acks) >= ACK_BATCH:
            self.flush_acks()
        if self.drain.more:
            self._drain_in_loop()

    def _drain_in_loop(self) -> None:
        with self._errors_logged("fetching messages"):
            self.drain.begin_pass()
            got = self._drain_ready()
            if got:
                self._kick()  # let the pool pick the new jobs up in the next iteration
            elif self.drain.found_nothing:  # a claim ran and found nothing due
                self._schedule_due()

    def _schedule_due(self) -> None:
        if self._loop is None:
            return
        self._set_due_timer(self._next_due_delay(offer=True))

    def _set_due_timer(self, delay: float | None) -> None:
        if self._loop is None:
            return
        if self._due_entry is not None:
            self._due_entry.cancel()
            self._due_entry = None
        if delay is not None and delay < self.polling_interval:
            self._due_entry = self._loop.call_later(delay + 0.001, self._on_due)

    def _on_due(self) -> None:
        self._due_entry = None
        self.look_again()
        self.drain.wake()
        self._drain_in_loop()

    def _schedule_poll(self, delay: float) -> None:
        if self._loop is not None:
            self._poll_entry = self._loop.call_later(delay, self._on_poll)

    def _on_poll(self) -> None:
        """The safety poll. PostgreSQL: every polling_interval (notifications do the rest).
        SQLite: a cheap data_version check every few milliseconds when busy, backing off to
        5 ms when idle, and a full look every polling_interval."""
        self._poll_entry = None
        try:
            now = time.monotonic()
            if self.is_postgresql:
                if self._reader_fd is None:
                    self._add_reader()
                self.drain.wake()
                self._look_everywhere()
                next_delay = self.polling_interval
            else:
                changed = self.waker.ready()
                if changed:
                    self._look_everywhere()
                if changed or now - self._last_full_poll >= self.polling_interval:
                    self.drain.wake()
                    self._last_full_poll = now
                if changed:
                    self._idle_delay = 0.002
                else:
                    self._idle_delay = min(
                        max(self._idle_delay * 2, 0.002), SQLITE_IDLE_CHECK, self.polling_interval
                    )
                next_delay = self._idle_delay
            if self.drain.more:
                self._drain_in_loop()
        finally:
            if self._loop is not None:
                self._schedule_poll(next_delay if "next_delay" in locals() else 1.0)

    # ---- clients without an event loop (synchronous drain) --------------------------------

    def drain_events(  # type: ignore[override]
        self, connection: Any, timeout: float | None = None
    ) -> None:
        start = time.monotonic()
        waker = self.waker
        waker.fileno()  # listen before looking, so no notification falls in between
        assert self.cycle is not None
        while True:
            if self._take_noack_first():
                return
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                pass
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise TimeoutError()
            wait = self.polling_interval
            if timeout is not None:
                wait = min(wait, timeout - elapsed)
            due = self._next_due_delay()
            if due is not None:
                wait = min(wait, due + 0.001)
            waker.wait(max(wait, 0.0))
            # Woken or not (then this is the safety poll): look at every queue again.
            self._look_everywhere()

    def close_connection(self, connection: Any) -> None:
        self._closing_connection = True  # no more offers: what they bring is released below
        self.finish_background_claims()
        try:
            self.flush_acks(in_background=False)
        except Exception:
            logger.warning("sqlease: could not write deferred acks at close", exc_info=True)
        try:
            super().close_connection(connection)
            self._release_handoffs()
        finally:
            self._unregister_from_loop()
            if self._maintenance is not None:
                self._maintenance.stop()
                self._maintenance = None
            if self._background is not None:
                self._background.stop()
                self._background = None
            if self._waker is not None:
                self._waker.close()
                self._waker = None

    def _release_handoffs(self) -> None:
        """At close, after the channels gave back what they held: withdraw the offers, and
        release (attempt refunded) any message a publish handed over that was never
        delivered (its notification not yet read), instead of leaving it to lease expiry."""
        if not self._offered:
            return
        try:
            self.store.withdraw_offers(self.owner, handed_too=True)
            self._offer_queues = set()
            leftover = self.store.leased_to(self.owner)
            if leftover:
                heartbeat().drop(leftover)
                self.store.release(leftover, refund=True)
        except Exception:
            logger.warning("sqlease: could not withdraw handoff offers at close", exc_info=True)
        self._offered = False

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        if "://" not in (uri or ""):
            # after Connection.switch() (failover) the client holds the URL in parts
            text = "sqlease+" + self.url.render_as_string(hide_password=False)
        else:
            prefix = "" if uri.startswith("sqlease") else "sqlease+"
            text = prefix + uri
        return text if include_password else display_url(text)
