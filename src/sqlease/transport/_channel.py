"""The Kombu ``Channel``: publishing, consuming (claims and delete-on-fetch), fenced ack,
reject and restore, queues and bindings persisted in SQL."""

from __future__ import annotations

import logging
from queue import Empty
from typing import TYPE_CHECKING, Any

from kombu.transport import virtual

from sqlease._core.heartbeat import heartbeat
from sqlease.delivery import fence_of
from sqlease.store import Message, Store
from sqlease.transport._acks import report_refused_ack
from sqlease.transport._codec import decode
from sqlease.transport._control import durable_revoke
from sqlease.transport._drain import ChannelDrain
from sqlease.transport._qos import QoS

if TYPE_CHECKING:
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)

# The name ``QoS`` is the Channel's class attribute inside its body: annotations use this one.
SqlQoS = QoS

#: Most messages one claim statement takes (the prefetch credit usually bounds it first).
CLAIM_BATCH = 128
#: Most messages one delete-on-fetch statement takes for consumers that never ack.
TAKE_BATCH = 64


class Channel(virtual.Channel):
    """A virtual channel whose deliveries are SQL leases."""

    QoS = QoS
    supports_fanout = True
    do_restore = True
    connection: Transport
    qos: SqlQoS

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        #: What this channel knows of its queues (sqlease.transport._drain).
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
                self.connection.refill.finish()
        super().close()

    # ---- what the transport asks -------------------------------------------------------

    @property
    def consuming(self) -> bool:
        return bool(self._consumers)

    def active_queues(self) -> list[str]:
        return self._active_queues

    def acked_queues(self) -> list[str]:
        """The consumed queues whose consumers ack (their messages are claimed)."""
        noack = self.drain.noack_queues
        return [q for q in self._active_queues if q not in noack]

    def accepts_deliveries(self) -> bool:
        return not self.closed and not self.drain.closing

    def consumes(self, queue: str) -> bool:
        """Open, and ``queue`` consumed with acks here."""
        return (
            self.accepts_deliveries()
            and queue in self._active_queues
            and queue not in self.drain.noack_queues
        )

    def notified(self, queues: set[str] | None) -> None:
        self.drain.notified(queues, self._active_queues)

    # ---- publishing --------------------------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.connection.publish([(queue, message)])

    def _put_fanout(
        self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any
    ) -> None:
        if exchange.endswith(".pidbox"):
            durable_revoke(self.connection, message)
        queues = sorted({queue for _, _, queue in self.get_table(exchange)})
        if queues:
            self.connection.publish([(queue, message) for queue in queues])

    # ---- consuming ---------------------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        self.drain.consume(queue, no_ack=no_ack)
        self.connection.drain.wake()
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        if self.connection is not None and consumer_tag in self._consumers:
            # The next idle look offers the queues still consumed. (A channel Kombu already
            # closed has no connection: Celery cancels its consumers after a connection loss.)
            self.connection.handoffs.withdraw()
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self.drain.cancel(queue)
        return result

    def take_noack(self, callback: Any) -> int:
        """Deliver one delete-on-fetch batch of the no-ack queues (remote control, events)
        if it is time to look at them; how many were delivered."""
        part = self.drain
        noack = [q for q in self._active_queues if q in part.noack_queues]
        if not noack or not part.may_take():
            return 0
        transport = self.connection
        delivered = 0
        taken = transport.leases.take(noack, TAKE_BATCH)
        if taken:
            part.took_some()
        else:
            part.took_none(notified=transport.caps.notifications)
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
        transport = self.connection
        callback = callback or transport._deliver
        delivered = self.take_noack(callback)
        acked = self.acked_queues()
        if acked and transport.drain.should_claim(self.drain, self.qos, transport):
            credit = self.qos.can_consume_max_estimate() if self.qos.prefetch_count else None
            limit = min(credit or CLAIM_BATCH, CLAIM_BATCH)
            refill = transport.refill
            if refill.in_background(self):
                refill.claim_in_background(self, acked, limit)
            else:
                claimed, short = refill.claim_in_loop(self, acked, limit)
                delivered += self.after_claim(claimed, short, limit, callback)
        if not delivered:
            raise Empty()
        return delivered

    def after_claim(self, claimed: list[Message], short: bool, limit: int, callback: Any) -> int:
        """Note what a claim of ``limit`` found, and deliver it."""
        transport = self.connection
        transport.drain.claimed(self.drain, len(claimed), limit, short=short)
        offer = transport.handoffs.offer_with_result(claimed)
        return self.deliver_claimed(claimed, callback, offer=offer)

    def deliver_claimed(
        self, claimed: list[Message], callback: Any, *, offer: dict[str, Any] | None = None
    ) -> int:
        transport = self.connection
        decode_body = self.decode_body
        delivered = 0
        for index, message in enumerate(claimed):
            try:
                payload = decode(transport, message, decode_body, leased=True, offer=offer)
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
        transport = self.connection
        while True:
            claimed, _ = transport.leases.claim([queue], 1)
            if not claimed:
                raise Empty()
            payload = decode(transport, claimed[0], self.decode_body, leased=True)
            if payload is not None:
                return payload

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        if no_ack:
            payload = None
            while payload is None:
                taken = self.connection.leases.take([queue], 1)
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

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        qos = self.qos
        fence = qos.fence_for(delivery_tag)
        transport = self.connection
        if fence is not None and qos.in_a_run(delivery_tag):
            transport.look_again()  # the ack lets the run's next message go
        try:
            if fence is not None:
                heartbeat().drop([fence])
                if not transport.acks.defer(fence) and not transport.leases.ack([fence]):
                    report_refused_ack(self.store, fence)
        finally:
            super().basic_ack(delivery_tag, multiple=multiple)

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        fence = self.qos.fence_for(delivery_tag)
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
        # auto_delete / exclusive / x-expires (Celery's reply, event and remote-control
        # queues): the queue expires once idle (TransportOptions.idle_queue_expiry).
        self.connection.declare_queue(
            queue,
            auto_delete=bool(kwargs.get("auto_delete") or kwargs.get("exclusive")),
            arguments=kwargs.get("arguments"),
        )

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
        connection = self.connection.caller_transaction()  # before the store is touched
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
