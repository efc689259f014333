"""Handoffs accepted: messages a publish leased to this idle worker (its offer,
sqlease.transport._handoff) delivered as a claim's would be (sqlease.transport._fetcher).

A handoff whose message fit in the notification is delivered from it; a longer one is read
back, fenced, off the loop. Either is delivered only if it is still this worker's lease of that
attempt, and only once the database's clock is known (its lease was written on that clock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from sqlease._core.handoff import Handoff
from sqlease._core.lease_clock import DatabaseTime
from sqlease._db.driver import Op
from sqlease.store import Message, Store
from sqlease.transport._completion import SideCalls
from sqlease.transport._deliveries import Deliveries
from sqlease.transport._handoff import Handoffs
from sqlease.transport._looks import Consumer
from sqlease.transport._loop import EventLoop
from sqlease.transport._runners import Kind

logger = logging.getLogger(__name__)


class Handed:
    """The handoffs a transport's offers bring.

    ``store()``: the transport's store; ``owner``/``lease_ms``: this worker's leases;
    ``channels()``: the transport's channels; ``consumed_queues()``: the queues consumed with
    acks; ``db_time``: the database's clock as this worker knows it; ``submit(kind,
    **context)``: a job for the fetcher's runner; ``side``: the database work off the loop."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        owner: str,
        lease_ms: int,
        channels: Callable[[], Sequence[Consumer]],
        consumed_queues: Callable[[], list[str]],
        handoffs: Handoffs,
        deliveries: Deliveries,
        db_time: DatabaseTime,
        side: SideCalls,
        loop: EventLoop,
        submit: Callable[..., int],
    ) -> None:
        self._store = store
        self._owner = owner
        self._lease_ms = lease_ms
        self._channels = channels
        self._consumed_queues = consumed_queues
        self._handoffs = handoffs
        self._deliveries = deliveries
        self._db_time = db_time
        self._side = side
        self._loop = loop
        self._submit = submit

    def accept(self, handoffs: list[Handoff], notified: set[str] | None = None) -> None:
        """Deliver messages a publish leased to this worker (its idle offer), as a claim's
        would be. ``notified``: queues named by plain notifications read with these handoffs
        (their messages wait for a claim). A take under way goes first (remote control
        before tasks): then they wait for it on the runner."""
        if any(c.look.taking for c in self._channels()):
            self._submit(Kind.HANDED, op=Op.answer(handoffs), notified=notified)
            return
        self.accept_now(handoffs, notified)

    def accept_now(self, handoffs: list[Handoff], notified: set[str] | None) -> None:
        for handoff in handoffs:
            self._handoffs.heard_of(handoff)
            if handoff.message is not None:
                self._handed(handoff, handoff.message, notified)
                continue
            # Too long for the notification: read back, fenced, off the loop.
            self._read_back(handoff, notified)

    def _read_back(self, handoff: Handoff, notified: set[str] | None) -> None:
        store = self._store()

        def read() -> Message | None:
            return store.get_message(handoff.message_id)

        def then(row: Message | None) -> None:
            self._handed(handoff, row, notified)

        self._side.run(read, then)

    def _handed(self, handoff: Handoff, row: Message | None, notified: set[str] | None) -> None:
        owner = self._owner
        if row is None or row.lease_owner != owner or row.attempt != handoff.attempt:
            return
        if row.state != "ready":
            return
        channel = self._handoffs.channel_for(row.queue)
        if channel is None:  # no channel consumes it any more
            self._deliveries.give_back([row])
            return
        if not channel.qos.can_consume():
            # No prefetch credit left: the offer stood while a claim filled the worker (it is
            # withdrawn at the next idle look). Kept, the message would wait here beyond the
            # prefetch limit, out of another worker's and a purge's reach.
            logger.info(
                "sqlease: message %s handed over to a consumer without prefetch credit; given back",
                row.id,
            )
            self._deliveries.give_back([row])
            return
        # It came because the queues were idle: nothing more to claim until something
        # notifies them (unless something just did). The next offer goes with its result
        # or with the ack that leaves the worker idle.
        named = bool(notified and not notified.isdisjoint(channel.active_queues()))
        channel.look.handed_off(named=named)
        # A publish leased it, on the database's clock: counted from the time that clock's
        # expiry stands for here (the offers' answers tell it).
        assert row.lease_expires_at_ms is not None
        sent_at = self._db_time.sent_equivalent(
            row.lease_expires_at_ms, self._lease_ms, time.monotonic()
        )
        if sent_at is None:  # no statement told the database's time yet: not deliverable
            logger.info(
                "sqlease: message %s handed over before any statement told the database's "
                "time; given back to be claimed",
                row.id,
            )
            self._deliveries.give_back([row])
            return
        self._store().offers.handed([row])  # its ack may skip a run's promotion
        offer = self._handoffs.offer_with_result([row], self._consumed_queues())
        if self._deliveries.hold_and_deliver(channel, [row], offer, sent_at):
            self._loop.kick()  # let the pool pick the new job up in the next iteration
