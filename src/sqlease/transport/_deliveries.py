"""Fetched messages to their consumer: the one way a claim's, a take's, a handoff's or a
``basic_get``'s messages reach Kombu (sqlease.transport._fetcher).

A leased message is held by the heartbeat from the time its lease was sent, a redelivered one
settled first (sqlease.transport._completion), then decoded and delivered; one that cannot be
read is refused (kept as failed, or its payload kept in the timeline); what will not be
delivered is given back, its attempt refunded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sqlease._core.heartbeat import heartbeat
from sqlease._core.lease_clock import deadline_after
from sqlease._core.results import ResultStore
from sqlease.options import TransportOptions
from sqlease.store import Message, Store
from sqlease.transport._codec import decode
from sqlease.transport._completion import (
    SideCalls,
    forward_revokes,
    record_failure,
    settle_redelivered,
    split_redelivered,
)
from sqlease.transport._looks import Consumer
from sqlease.transport._loop import EventLoop
from sqlease.transport._runners import Kind

logger = logging.getLogger(__name__)


class Deliveries:
    """How fetched messages are handed to their consumer, or given back.

    ``store()`` / ``results()``: the transport's stores; ``deliver(payload, queue)``: Kombu's
    delivery to the consumer; ``side``: the database work off the loop; ``loop``: the
    event-loop glue; ``submit(kind, **context)``: a job for the fetcher's runner;
    ``closing()``: whether the connection is closing; ``queue_ttl(queue)``: the queue's
    ``x-message-ttl`` as this process declared it (ms; None: none)."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        results: Callable[[], ResultStore],
        options: TransportOptions,
        deliver: Callable[[Any, str], None],
        side: SideCalls,
        loop: EventLoop,
        submit: Callable[..., int],
        closing: Callable[[], bool],
        queue_ttl: Callable[[str], int | None] = lambda queue: None,
    ) -> None:
        self._store = store
        self._queue_ttl = queue_ttl
        self._results = results
        self._options = options
        self._deliver = deliver
        self._side = side
        self._loop = loop
        self._submit = submit
        self._closing = closing

    def got(self, channel: Consumer, message: Message, sent_at: float) -> dict[str, Any] | None:
        """A message ``basic_get`` leased (outside the loop): held, settled if redelivered,
        decoded; None if it is not to be delivered."""
        heartbeat().hold(
            self._store(),
            message.fence,
            lease_ms=self._options.lease_ms,
            interval=self._options.heartbeat_seconds,
            sent_at=sent_at,
            task_id=message.task_id,
            holder=channel.qos.holder,
        )
        if split_redelivered([message])[0]:
            try:
                done, revoked = settle_redelivered(self._store(), self._results(), [message])
            except BaseException:
                heartbeat().drop([message.fence])  # its lease runs out: claimed again later
                raise
            if done:
                heartbeat().drop([message.fence])
                return None
            forward_revokes(revoked)
        return self.decode(channel, message, leased=True)

    def hold_and_deliver(
        self,
        channel: Consumer,
        messages: list[Message],
        offer: dict[str, Any] | None,
        sent_at: float,
    ) -> int:
        """The heartbeat keeps their leases from now on, their lease clocks counted from
        ``sent_at`` (when the statement that leased them was sent, at the latest); those
        delivered before are settled first (their result may be stored, a revoke may wait for
        them), off the loop. Leases whose clock ran out before they arrived (the claim took
        longer than a lease: retried through an outage) are given back, never delivered."""
        beat, store, options = heartbeat(), self._store(), self._options
        if messages and deadline_after(sent_at, options.lease_seconds) <= time.monotonic():
            logger.warning(
                "sqlease: %d message(s) arrived after their lease could have ended; given back",
                len(messages),
            )
            self.give_back(messages)
            return 0
        refs = beat.hold_all(
            store,
            [(m.fence, m.task_id) for m in messages],
            lease_ms=options.lease_ms,
            interval=options.heartbeat_seconds,
            sent_at=sent_at,
            holder=channel.qos.holder,
        )
        clocks = {m.id: ref for m, ref in zip(messages, refs, strict=True)}
        again, fresh = split_redelivered(messages)
        delivered = [self._deliver_to(channel, fresh, offer, clocks)]
        if again:
            results = self._results()

            def settle() -> tuple[set[int], set[str]] | None:
                try:
                    return settle_redelivered(store, results, again)
                except Exception as exc:  # the database went away meanwhile
                    logger.warning(
                        "sqlease: could not tell whether %d redelivered message(s) already "
                        "finished (%s); their leases are let run out and they are claimed "
                        "again",
                        len(again),
                        exc,
                    )
                    return None

            # In the loop the answer comes later (``_settled`` delivers then); elsewhere now.
            # Until then the channel's credit counts them as taken.
            qos = channel.qos
            qos.settling += len(again)

            def settled(found: tuple[set[int], set[str]] | None) -> None:
                qos.settling -= len(again)
                delivered.append(self._settled(channel, again, found, offer))

            self._side.run(settle, settled)
        return sum(delivered)

    def _settled(
        self,
        channel: Consumer,
        again: list[Message],
        found: tuple[set[int], set[str]] | None,
        offer: dict[str, Any] | None,
    ) -> int:
        if found is None:
            # Not known whether they finished: delivering could run a finished task again,
            # and holding them on would keep them for ever (nothing would deliver them).
            # Their leases run out instead, and the next claim settles them again.
            heartbeat().drop([m.fence for m in again])
            return 0
        done, revoked = found
        heartbeat().drop([m.fence for m in again if m.id in done])
        forward_revokes(revoked)
        rest = [m for m in again if m.id not in done]
        if not channel.accepts_deliveries():
            self.give_back(rest)
            return 0
        delivered = self._deliver_to(channel, rest, offer)
        if delivered and self._loop.registered:
            self._loop.kick()
        return delivered

    def _deliver_to(
        self,
        channel: Consumer,
        messages: list[Message],
        offer: dict[str, Any] | None,
        clocks: dict[int, str] | None = None,
    ) -> int:
        """``clocks``: where each message's lease clock is published, by id (else asked of
        the heartbeat)."""
        delivered = 0
        for index, message in enumerate(messages):
            try:
                clock = clocks.get(message.id) if clocks is not None else None
                payload = self.decode(channel, message, leased=True, offer=offer, clock=clock)
                if payload is not None:
                    self._deliver(payload, message.queue)
                    delivered += 1
            except BaseException:
                # The consumer failed mid-batch: the rest never reached it (nor QoS, so no
                # close would release it). Given back now, attempt refunded.
                self.give_back(messages[index + 1 :])
                raise
        return delivered

    def deliver_taken(self, channel: Consumer, taken: list[Message]) -> int:
        """Messages deleted on fetch (no lease to hold or give back): decoded and delivered.
        Their own TTLs are judged at one time, the database's, read once for the batch if
        one has a TTL. Their queue's TTL is not applied: a consumer that never acks takes
        what is there (Celery's remote control, events and gossip, whose stale copies the
        maintenance pass deletes); judging it would cost a read on the loop per take."""
        delivered = 0
        read: list[int] = []

        def now_ms() -> int:
            if not read:
                try:
                    read.append(self._store().now_ms())
                except Exception as exc:
                    # Deleted on fetch: delivered rather than lost on a guess (0 is before
                    # any message was published: none has waited past its TTL).
                    logger.warning("sqlease: TTLs not judged, the time unread (%s)", exc)
                    read.append(0)
            return read[0]

        for message in taken:
            payload = self.decode(channel, message, leased=False, now_ms=now_ms)
            if payload is not None:
                self._deliver(payload, message.queue)
                delivered += 1
        return delivered

    def decode(
        self,
        channel: Consumer,
        message: Message,
        *,
        leased: bool,
        offer: dict[str, Any] | None = None,
        clock: str | None = None,
        now_ms: Callable[[], int] | None = None,
    ) -> dict[str, Any] | None:
        """``clock``: where its lease clock is published (None: asked of the heartbeat);
        ``now_ms``: the time its TTL is judged at, if not leased (None: the database's)."""
        store = self._store()
        if leased and clock is None:
            clock = heartbeat().clock_ref(message.fence)
        return decode(
            message,
            channel.decode_body,
            lease_ms=self._options.lease_ms,
            now_ms=now_ms or store.now_ms,
            leased=leased,
            refuse=lambda m, reason, error: self._refuse(m, reason, error, leased=leased),
            offer=offer,
            clock=clock if leased else None,
            queue_ttl=self._queue_ttl(message.queue) if leased else None,
        )

    def _refuse(self, message: Message, reason: str, error: str, *, leased: bool) -> None:
        """A fetched message that will not reach its consumer: a leased one is kept as failed
        ``reason`` (an undecodable task also gets its FAILURE result); one deleted on fetch
        leaves its payload in the timeline."""
        store, results = self._store(), self._results()

        def write() -> None:
            if not leased:
                data = {"error": error, "payload": message.payload[:1000]}
                store.record_event(reason, data, task_id=message.task_id, message_id=message.id)
                return
            store.fail(message.fence, reason, error=error)
            if reason == "undecodable" and message.task_id is not None:
                args = [f"undecodable message: {error}"]
                record_failure(
                    results, message.task_id, "ContentDisallowed", args, "kombu.exceptions"
                )

        if leased:
            heartbeat().drop([message.fence])
        self._side.run(write)

    def give_back(self, messages: list[Message]) -> None:
        """Release what was claimed and will not be delivered, attempt refunded."""
        fences = [m.fence for m in messages]
        if not fences:
            return
        heartbeat().drop(fences)
        if self._closing() or not self._loop.in_loop_thread():
            try:
                self._store().release(fences, refund=True)
            except Exception:
                logger.exception("sqlease: could not release %d message(s)", len(fences))
            return
        op = self._store().release_op(fences, refund=True)
        self._submit(Kind.CHANGE, op=op, fences=fences, what="release")
