"""The Kombu ``Channel``: publishing, consuming (through the transport's fetcher), fenced
ack, reject and restore, queues and bindings persisted in SQL."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from contextlib import AbstractContextManager
from queue import Empty
from typing import Any, Protocol

from amqp.exceptions import RecoverableConnectionError
from kombu.transport import virtual

from sqlease._core.heartbeat import heartbeat
from sqlease._core.names import check_name
from sqlease._core.results import ResultStore
from sqlease.delivery import fence_of
from sqlease.errors import ConfigurationError
from sqlease.store import Fence, Store
from sqlease.transport._completion import settle_redelivered
from sqlease.transport._control import drop_stale_commands, durable_revoke
from sqlease.transport._events import EVENT_EXCHANGE, LaterEvents
from sqlease.transport._fetcher import Fetcher
from sqlease.transport._looks import ChannelLook
from sqlease.transport._loop import on_a_loop_thread
from sqlease.transport._qos import QoS
from sqlease.transport._queues import queue_arguments

logger = logging.getLogger(__name__)

# The name ``QoS`` is the Channel's class attribute inside its body: annotations use this one.
SqlQoS = QoS


class ChannelHost(Protocol):
    """What a channel asks of its connection (``sqlease.transport.Transport``)."""

    store: Store
    fetcher: Fetcher
    exchange_types: dict[str, str]

    def publish(
        self, items: Iterable[tuple[str, dict[str, Any]]], *, hold: bool = True
    ) -> None: ...

    def declare_queue(
        self, queue: str, *, auto_delete: bool = False, arguments: Any = None
    ) -> None: ...

    def forget_queue(self, queue: str) -> None: ...

    def caller_transaction(self) -> AbstractContextManager[Any]: ...

    def withdraw_offers(self) -> None: ...

    @property
    def results(self) -> ResultStore: ...


class Channel(virtual.Channel):
    """A virtual channel whose deliveries are SQL leases."""

    QoS = QoS
    supports_fanout = True
    do_restore = True
    connection: ChannelHost
    qos: SqlQoS

    def __init__(self, connection: ChannelHost, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        #: What this channel knows of its queues (sqlease.transport._looks).
        self.look = ChannelLook()
        #: The events this channel left to the events thread (``basic_publish``).
        self._events = LaterEvents()

    @property
    def store(self) -> Store:
        return self.connection.store

    def close(self) -> None:
        if not self.closed:
            self._events.flush()
            self.look.close()
            if self.look.claiming and self.connection is not None:
                # Its messages are given back (attempt refunded) before the channel's
                # unacked ones are restored, so a warm shutdown leaves no lease behind.
                self.connection.fetcher.settle()
        super().close()

    # ---- what the transport asks -------------------------------------------------------

    @property
    def consuming(self) -> bool:
        return bool(self._consumers)

    def active_queues(self) -> list[str]:
        return self._active_queues

    def acked_queues(self) -> list[str]:
        """The consumed queues whose consumers ack (their messages are claimed)."""
        noack = self.look.noack_queues
        return [q for q in self._active_queues if q not in noack]

    def accepts_deliveries(self) -> bool:
        return not self.closed and not self.look.closing

    def consumes(self, queue: str) -> bool:
        """Open, and ``queue`` consumed with acks here."""
        noack = self.look.noack_queues
        return self.accepts_deliveries() and queue in self._active_queues and queue not in noack

    def holds_besides(self, acking: Collection[str]) -> bool:
        """Whether a delivery is held other than those with the tags ``acking``."""
        return self.qos.holds_besides(acking)

    def held_besides(self, acking: Collection[str]) -> int:
        """How many deliveries are held other than those with the tags ``acking``."""
        return int(self.qos.held_besides(acking))

    # ---- publishing --------------------------------------------------------------------

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any
    ) -> Any:
        if exchange == EVENT_EXCHANGE and on_a_loop_thread():
            publish = super().basic_publish  # off the loop (sqlease.transport._events)
            self._events.publish(lambda: publish(message, exchange, routing_key, **kwargs))
            return None
        return super().basic_publish(message, exchange, routing_key, **kwargs)

    # ---- exchanges: their types kept in the database, as a broker keeps them -------------

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Any = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        if passive:
            if exchange and self._declared_elsewhere(exchange):
                return None  # declared by another process: it exists
            return super().exchange_declare(exchange, type, passive=True)
        type = type or "direct"
        if type not in self.exchange_types:
            # Kombu would take it and fail later, at a bind or publish, with a bare KeyError.
            raise ConfigurationError(
                f"exchange {exchange!r}: type {type!r} is not supported; sqlease routes "
                f"{', '.join(sorted(self.exchange_types))} exchanges"
            )
        super().exchange_declare(exchange, type, durable, auto_delete, arguments, nowait)
        name = exchange or f"amq.{type}"
        if self.connection.exchange_types.get(name) != type:
            with self.connection.caller_transaction() as connection:
                self.store.declare_exchange(name, type, connection=connection)
            if connection is None:  # a caller's transaction may yet roll it back
                self.connection.exchange_types[name] = type
        return None

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        """The exchange's type as declared here, else as stored by the process that declared
        it (Kombu alone would route an exchange it never declared as direct)."""
        stored = self._declared_elsewhere(exchange) if exchange else None
        if stored is not None:
            return self.exchange_types[stored]
        return super().typeof(exchange, default)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        stored = self._declared_elsewhere(exchange) if exchange else None
        if exchange and stored is not None:
            # Bound to as it is (Kombu alone knows only the exchanges declared here, and
            # fails with a KeyError).
            self.state.exchanges[exchange] = {
                "type": stored,
                "durable": True,
                "auto_delete": False,
                "arguments": {},
                "table": [],
            }
        super().queue_bind(queue, exchange, routing_key, arguments, **kwargs)

    def _declared_elsewhere(self, exchange: str) -> str | None:
        """The type another process declared ``exchange`` with, when this process has not
        declared it itself (None: declared here, or nowhere, or of a type Kombu lacks)."""
        if exchange in self.state.exchanges:
            return None
        known = self.connection.exchange_types.get(exchange)
        if known is None:
            known = self.store.exchange_type(exchange)
            if known is not None:
                self.connection.exchange_types[exchange] = known
        return known if known in self.exchange_types else None

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        super().exchange_delete(exchange, if_unused=if_unused, nowait=nowait)
        self.store.delete_exchange(exchange)
        self.connection.exchange_types.pop(exchange, None)

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.connection.publish([(queue, message)])

    def _put_fanout(
        self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any
    ) -> None:
        if exchange.endswith(".pidbox"):
            durable_revoke(self.connection.store, message)
        queues = sorted({queue for _, _, queue in self.get_table(exchange)})
        if queues:
            # A broadcast (remote control, events) is no task: never held by a batch.
            self.connection.publish([(queue, message) for queue in queues], hold=False)

    # ---- consuming ---------------------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        check_name("queue name", queue)  # an undeclared queue (no_declare) comes here first
        drop_stale_commands(self, queue, no_ack)
        self.look.consume(queue, no_ack=no_ack)
        self.connection.fetcher.looks.wake()
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        if self.connection is not None and consumer_tag in self._consumers:
            # The next idle look offers the queues still consumed. (A channel Kombu already
            # closed has no connection: Celery cancels its consumers after a connection loss.)
            self.connection.withdraw_offers()
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self.look.cancel(queue)
        return result

    def drain_events(self, timeout: float | None = None, callback: Any = None) -> int:
        """Deliver what is ready on this channel's queues (the fetcher's look: in the event
        loop the messages come when its runner has them)."""
        if not self._consumers:
            raise Empty()
        delivered = self.connection.fetcher.fetch(self)
        if not delivered:
            raise Empty()
        return delivered

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        payload = self.connection.fetcher.get(self, queue, no_ack=False)
        if payload is None:
            raise Empty()
        return payload

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        payload = self.connection.fetcher.get(self, queue, no_ack=no_ack)
        if payload is None:
            return None
        message = self.Message(payload, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    # ---- acknowledgement (fenced) --------------------------------------------------------

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        if self.connection is None:
            # A connection error, as py-amqp raises, so that Celery's ``ack_log_error`` logs
            # it: the close gave the message back, and it is delivered again.
            raise RecoverableConnectionError(
                f"channel closed: delivery {delivery_tag} was given back when its channel "
                "closed and cannot be acked; it is delivered again"
            )
        qos = self.qos
        fence = qos.fence_for(delivery_tag)
        fetcher = self.connection.fetcher
        if fence is not None and qos.in_a_run(delivery_tag):
            fetcher.look_again()  # the ack lets the run's next message go
        try:
            if fence is not None:
                # Renewed until it leaves (sqlease.transport._acks.stop_renewing), which does
                # not send it if its lease is known lost here.
                fetcher.acks.add(fence)
        finally:
            super().basic_ack(delivery_tag, multiple=multiple)

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        fence = self.qos.fence_for(delivery_tag)
        try:
            if fence is not None:
                self.connection.fetcher.reject(fence, requeue=requeue)
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
        if self._finished_meanwhile(fence):
            return None
        self.store.release([fence], refund=True)
        self.connection.fetcher.look_again()
        return None

    def _finished_meanwhile(self, fence: Fence) -> bool:
        """Celery stops its consumer before its pool: a task that stored its final result as
        the channel closed has its ack still on its way, and given back it would wait for
        its next worker to complete it from that result (its state "queued" until then). It
        is acked here instead, as that worker would (``settle_redelivered``)."""
        try:
            row = self.store.get_message(fence.message_id)
            if row is None or row.task_id is None:
                return False  # gone, or no task
            if (row.lease_owner, row.attempt) != (fence.owner, fence.attempt):
                return False  # released, or held by another worker or attempt now
            done, _ = settle_redelivered(self.store, self.connection.results, [row])
        except Exception:
            logger.warning("sqlease: could not look for a stored result at close", exc_info=True)
            return False
        return row.id in done

    def _restore_at_beginning(self, message: Any) -> None:
        self._restore(message)

    # ---- queues and bindings -----------------------------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        # auto_delete, exclusive, x-expires: it expires once idle (idle_queue_expiry).
        self.connection.declare_queue(
            queue,
            auto_delete=bool(kwargs.get("auto_delete") or kwargs.get("exclusive")),
            arguments=kwargs.get("arguments"),
        )

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        return queue_arguments(arguments, **kwargs)

    def bind_again(self, queue: str) -> None:
        """Write this channel's bindings of ``queue`` again (after the queue expired)."""
        for exchange, routing_key, arguments in self.state.queue_bindings(queue):
            meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
            self._queue_bind(exchange, *meta)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        with self.connection.caller_transaction() as connection:  # before the store is touched
            self.store.bind(
                exchange, queue, routing_key or "", pattern or "", connection=connection
            )

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
