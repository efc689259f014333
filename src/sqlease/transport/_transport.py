"""The Kombu ``Transport``: options, owner, store, connect and close, publish, ``as_uri``. It
builds the parts that do the rest, each given what it needs and no more: the fetcher (claims,
acks, takes and what follows them), the handoffs' state, the queues it declared and keeps
alive (sqlease.transport._queues), the event-loop glue and what its events mean
(sqlease.transport._wakeups); and it closes them in one sequence."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from queue import Empty
from typing import Any

import sqlalchemy
import sqlalchemy.exc
from kombu.transport import virtual
from sqlalchemy.engine import URL

from sqlease._celery.registry import CONNECT_RETRY_SECONDS, store_for
from sqlease._celery.task_limits import write_limits
from sqlease._core.handoff import lock_key_for
from sqlease._core.heartbeat import heartbeat
from sqlease._core.results import ResultStore
from sqlease._db.dialects import CONNECTION_ERRORS, capabilities_of
from sqlease._db.wakeup import Waker
from sqlease.batches import open_batch
from sqlease.errors import ConfigurationError, DatabaseUnavailable
from sqlease.options import TransportOptions
from sqlease.store import Store
from sqlease.transport._channel import Channel
from sqlease.transport._codec import new_message
from sqlease.transport._fetcher import Fetcher
from sqlease.transport._handoff import Handoffs
from sqlease.transport._loop import EventLoop
from sqlease.transport._queues import DeclaredQueues
from sqlease.transport._wakeups import Wakeups
from sqlease.types import NewMessage
from sqlease.urls import client_url, display_url, to_sqlalchemy_url

logger = logging.getLogger(__name__)

#: A synchronous drain out of prefetch credit looks again after this many seconds, then after
#: twice as long each time it is still out, up to STARVED_RECHECK_MAX_S: see ``drain_events``.
STARVED_RECHECK_S = 0.01
STARVED_RECHECK_MAX_S = 0.25

# The name ``Channel`` is the Transport's class attribute inside its body: annotations there use
# this one.
SqlChannel = Channel


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
        *CONNECTION_ERRORS,
        DatabaseUnavailable,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.options = TransportOptions.parse(client.transport_options)
        self.polling_interval = self.options.polling_interval
        self._limits_written = False
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
        #: What the database can do, known from the URL before the first connection.
        self.caps = capabilities_of(self.url)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: The advisory lock this transport's listening connection holds (handoff liveness).
        self.lock_key = lock_key_for(self.owner)
        #: Closing: no more offers (what they brought is released at close).
        self.closing_connection = False
        self._store: Store | None = None
        self._results: ResultStore | None = None
        self._waker: Waker | None = None
        self._maintenance: Any = None
        self.loop = EventLoop()
        self.handoffs = Handoffs(
            enabled=self.options.handoff and self.caps.offers,
            owner=self.owner,
            lock_key=self.lock_key,
            lease_ms=self.options.lease_ms,
            polling_interval=self.polling_interval,
            channels=self.sql_channels,
            waker=lambda: self._waker,
            in_loop=lambda: self.loop.registered,
            closing=lambda: self.closing_connection,
        )
        self.fetcher = Fetcher(
            store=lambda: self.store,
            results=lambda: self.results,
            options=self.options,
            owner=self.owner,
            channels=self.sql_channels,
            deliver=self._deliver,
            loop=self.loop,
            handoffs=self.handoffs,
            notifications=self.caps.notifications,
            cycle=lambda: self.cycle,
            connection_errors=self.connection_errors,
            queue_ttl=lambda queue: self._queues.message_ttl(queue),
        )
        #: Exchange types this connection recorded in the database or read from it.
        self.exchange_types: dict[str, str] = {}
        self._queues = DeclaredQueues(
            store=lambda: self.store,
            options=self.options,
            caller_transaction=self.caller_transaction,
            channels=self.sql_channels,
            side=self.fetcher.side,
        )
        self.wakeups = Wakeups(
            fetcher=self.fetcher,
            handoffs=self.handoffs,
            loop=self.loop,
            waker=lambda: self.waker,
            owner=self.owner,
            polling_interval=self.polling_interval,
            keep_alive=self._queues.keep_alive,
            connection_errors=self.connection_errors,
        )

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

    def driver_version(self) -> str:
        return str(sqlalchemy.__version__)

    def establish_connection(self) -> Any:
        self.closing_connection = False
        self.fetcher.reopen()
        with self.caller_transaction():  # inside a caller's transaction: check on its connection
            pass
        self.store  # noqa: B018  (connects, checks or migrates the schema: fails fast)
        return super().establish_connection()

    def publish(self, items: Iterable[tuple[str, dict[str, Any]]], *, hold: bool = True) -> None:
        """Store Kombu messages (one transaction); inside ``sqlease.batch()`` (and ``hold``),
        checked now and written with the batch when its block ends."""
        batch = [new_message(queue, message) for queue, message in items]
        scope = open_batch() if hold else None
        if scope is not None:
            store = self.store
            scope.add(store, batch, self.publish_batch, store.check_member)
            return
        self.publish_batch(batch)

    def publish_batch(self, batch: Sequence[NewMessage]) -> None:
        """Write ``batch`` in one transaction: the caller's, if one is open."""
        with self.caller_transaction() as connection:  # before the store is touched
            self.store.enqueue_many(batch, connection=connection)

    @contextmanager
    def caller_transaction(self) -> Iterator[Any]:
        """The caller's transaction to publish in, if any (``sqlease.transaction()``'s
        connection, or one a framework adapter joins: Django's ``atomic()``), for as long as
        the block lasts; checked before this process opens its own connections to the
        database."""
        from sqlease.transactions import joined

        with joined(self.url) as conn:
            if conn is not None and self._store is None:
                self._check_tables(conn)
            yield conn

    def _check_tables(self, conn: Any) -> None:
        if self.caps.single_writer:
            # A SQLite writer holds the file's write lock: creating sqlease's tables (or
            # switching the file to WAL) from another connection now would wait it out.
            from sqlease._db.migrations import read_version
            from sqlease._db.tables import build_tables

            if read_version(conn, build_tables(self.options.table_prefix)) is None:
                raise ConfigurationError(
                    "sqlease's tables do not exist yet in this SQLite database, and they cannot "
                    "be created while your transaction holds the write lock: run 'sqlease "
                    "migrate --url …' (or publish once outside a transaction) first"
                )

    def declare_queue(
        self, queue: str, *, auto_delete: bool = False, arguments: Any = None
    ) -> None:
        self._queues.declare(queue, auto_delete=auto_delete, arguments=arguments)

    def forget_queue(self, queue: str) -> None:
        self._queues.forget(queue)

    def expires_when_idle(self, queue: str) -> bool:
        """Declared here auto-delete, exclusive or with ``x-expires``."""
        return self._queues.expires_when_idle(queue)

    # ---- wake-ups --------------------------------------------------------------------------

    @property
    def waker(self) -> Waker:
        if self._waker is None:
            self._waker = self.store.driver.waker(
                self.store.notify_channel,
                lock_key=self.lock_key if self.options.handoff else None,
            )
        return self._waker

    @property
    def current_waker(self) -> Waker | None:
        """The waker, if one was made (never makes one)."""
        return self._waker

    # ---- the channels, as the parts ask about them ---------------------------------------

    def sql_channels(self) -> list[SqlChannel]:
        return [c for c in self.channels if isinstance(c, Channel)]

    def withdraw_offers(self) -> None:
        """No more handoffs to this worker until its next idle look (a consumer cancelled).
        A failure is only logged: the offer then expires, and what it brings is released at
        close or taken over after its lease."""
        if not self.handoffs.withdrawn():
            return
        store, owner = self.store, self.owner

        def withdraw() -> None:
            try:
                store.withdraw_offers(owner)
            except Exception:
                logger.warning("sqlease: could not withdraw the handoff offer", exc_info=True)

        self.fetcher.side.run(withdraw)

    # ---- the worker's event loop -----------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._start_maintenance()
        self._write_limits()
        self.wakeups.register(loop)  # (leaving a loop registered before)

    def _write_limits(self) -> None:
        """At a consuming worker's start: its configured limits become the cluster's."""
        if not self._limits_written:
            self._limits_written = True
            write_limits(self.store, self.options)

    def _start_maintenance(self) -> None:
        # Only consuming workers run it (they register with an event loop); producers don't.
        if self._maintenance is None and self.options.maintenance_interval > 0:
            from sqlease._core.maintenance import MaintenanceThread

            self._maintenance = MaintenanceThread(
                self.store,
                self.owner,
                interval=self.options.maintenance_interval,
                event_retention_ms=self.options.event_retention_ms,
                dead_retention_ms=self.options.dead_retention_ms,
            ).start()

    # ---- clients without an event loop (synchronous drain) --------------------------------

    def drain_events(  # type: ignore[override]
        self, connection: Any, timeout: float | None = None
    ) -> None:
        start = time.monotonic()
        waker = self.waker
        waker.fileno()  # listen before looking, so no notification falls in between
        fetcher = self.fetcher
        assert self.cycle is not None
        looked_at = start  # the last look at every queue
        recheck = STARVED_RECHECK_S
        while True:
            self._queues.keep_alive()
            if fetcher.take_noack_first():
                return
            fetcher.looks.starved = False
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
            starved = fetcher.looks.starved
            if starved:
                # Out of prefetch credit. What frees it, an ack or (with
                # worker_disable_prefetch) a finished task, happens in another thread or
                # greenlet (the gevent and eventlet pools have no event loop) and sends no
                # notification: look again shortly, not at the safety poll, which would pace
                # the worker at its prefetch per polling interval; less and less often while
                # its tasks go on (long ones cost it a look or four a second, short ones a few
                # milliseconds each). Nothing can be claimed meanwhile: no due time is read.
                wait = min(wait, recheck)
                recheck = min(recheck * 2, STARVED_RECHECK_MAX_S)
            else:
                queues = fetcher.consumed_queues()
                due_ms = self.store.next_due_in_ms(queues) if queues else None
                if due_ms is not None:
                    wait = min(wait, due_ms / 1000.0 + 0.001)
            woken = waker.wait(max(wait, 0.0))
            now = time.monotonic()
            if woken or not starved or now - looked_at >= self.polling_interval:
                # Woken, or the safety poll: look at every queue again (the no-ack ones too,
                # which a short recheck for credit leaves to their throttle).
                fetcher.notified(None)
                looked_at = now

    def close_connection(self, connection: Any) -> None:
        """The one shutdown sequence: no more offers; the fetcher gives back what its claims
        brought, writes the acks waiting and stops its runner; the channels give back their
        unacked deliveries (Kombu's close, a fenced release each); the offers are withdrawn
        and what a publish handed over undelivered is released; the event loop, the
        maintenance thread and the waker go."""
        self.closing_connection = True
        try:
            self.fetcher.close()
            super().close_connection(connection)
            self._release_handoffs()
        finally:
            self.loop.unregister()
            if self._maintenance is not None:
                self._maintenance.stop()
                self._maintenance = None
            if self._waker is not None:
                self._waker.close()
                self._waker = None

    def _release_handoffs(self) -> None:
        """At close, after the channels gave back what they held: withdraw the offers, and
        release (attempt refunded) any message a publish handed over that was never
        delivered (its notification not yet read), instead of leaving it to lease expiry."""
        if not self.handoffs.closing():
            return
        try:
            store, owner = self.store, self.owner
            store.withdraw_offers(owner, handed_too=True)
            leftover = store.leased_to(owner)
            if leftover:
                heartbeat().drop(leftover)
                store.release(leftover, refund=True)
        except Exception:
            logger.warning("sqlease: could not withdraw handoff offers at close", exc_info=True)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        if "://" not in (uri or ""):
            # after Connection.switch() (failover) the client holds the URL in parts
            text = "sqlease+" + self.url.render_as_string(hide_password=False)
        else:
            prefix = "" if uri.startswith("sqlease") else "sqlease+"
            text = prefix + uri
        return text if include_password else display_url(text)
