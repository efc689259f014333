"""Handoffs on the transport's side (PostgreSQL, ``handoff`` on): an idle worker in its event
loop offers its queues; a publish that finds the offer leases the message to it in the publish
itself and names it in its notification (sqlease._core.handoff), and the worker delivers it as if it
had claimed it. Only a worker holding nothing offers: a busy or stalled one is never handed a
message another could start now. Liveness is the listening connection's advisory lock."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlease._core.handoff import Handoff
from sqlease._core.heartbeat import heartbeat
from sqlease.store import Fence
from sqlease.transport._completion import hold

if TYPE_CHECKING:
    from sqlease.transport._channel import Channel
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)


def _celery_holds_tasks() -> bool:
    """In a Celery worker process: tasks received and not finished, whatever their ack mode
    (Celery's own bookkeeping; empty elsewhere)."""
    try:
        from celery.worker import state
    except ImportError:  # pragma: no cover - celery is a dependency
        return False
    return bool(state.active_requests or state.reserved_requests or state.scheduled_requests)


class Handoffs:
    """A transport's offers, and the handoffs they bring."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: Offers were made: withdraw them, and release what they brought, at close.
        self.offered = False
        #: The queues an offer of ours may stand for now (made, not known used or withdrawn).
        self._offer_queues: set[str] = set()
        #: Per queue, the highest offer number of the handoffs we have read: an offer a
        #: publish used stands again only once we have heard of it (Store.offer's ``seen``).
        self.heard: dict[str, int] = {}
        #: The listening connection (its generation) whose handoffs we hear.
        self._listening_generation = 0

    def can_offer(self) -> bool:
        transport = self._transport
        waker = transport.current_waker
        return (
            transport.options.handoff
            and not transport.closing_connection
            and waker is not None
            and waker.pushes
            and waker.connected
            and transport.loop.hub is not None
        )

    def holds_nothing(self, besides: Iterable[Fence] = ()) -> bool:
        """No delivery held on any channel (but ``besides``, being acked), no claim under way,
        and, in a Celery worker, no task received and not finished (one acked early is still
        running, or waiting for a pool process)."""
        channels = self._transport.sql_channels()
        if any(c.drain.claiming for c in channels):
            return False
        acking = {f"{f.message_id}.{f.attempt}" for f in besides}
        if any(c.qos.holds_besides(acking) for c in channels):
            return False
        return not _celery_holds_tasks()

    def offer_terms(self) -> dict[str, Any]:
        """This worker's offer, as the store's offer calls (and a result's stamp) take it."""
        transport = self._transport
        return {
            "lease_ms": transport.options.lease_ms,
            "lock_key": transport.lock_key,
            "ttl_ms": self.offer_ttl_ms(),
            "seen": dict(self.heard),
        }

    def offer_ttl_ms(self) -> int:
        # Refreshed by every idle look (the safety poll runs each polling_interval); the
        # margin covers a slow loop. Liveness itself is the listener's advisory lock.
        return int(max(3.0 * self._transport.polling_interval, 2.0) * 1000)

    # ---- offering ----------------------------------------------------------------------

    def acks_leave_idle(self, fences: list[Fence]) -> bool:
        transport = self._transport
        return (
            transport.caps.offers
            and transport.loop.in_loop_thread()
            and self.can_offer()
            and all(f.owner == transport.owner for f in fences)
            and self.holds_nothing(besides=fences)
            and bool(transport.consumed_queues())
        )

    def ack_and_offer(self, fences: list[Fence]) -> set[int]:
        """Write the acks that leave the worker idle with its next offer (one statement);
        the ids acked. The due time comes with them."""
        transport = self._transport
        queues = transport.consumed_queues()
        acked, due_ms = transport.leases.ack_and_offer(fences, queues, self.offer_terms())
        self._offer_queues = set(queues)
        self.offered = True
        for channel in transport.sql_channels():
            channel.drain.due_read()
        transport.loop.set_due_timer(None if due_ms is None else due_ms / 1000.0)
        return acked

    def offer_if_idle(self, queues: list[str]) -> tuple[bool, int | None]:
        """The idle look's offer: a worker holding nothing offers the consumed queues that
        have prefetch credit, one holding something again withdraws. Whether the offer stands
        for every queue in ``queues`` (then also the milliseconds until the next delayed
        message is due, which came with it)."""
        transport = self._transport
        idle = not transport.acks.pending and self.holds_nothing()
        open_queues = transport.consumed_queues(with_credit=True) if idle else []
        if not (open_queues or self._offer_queues):
            return False, None
        due_ms = transport.leases.offer(open_queues, self.offer_terms())
        self._offer_queues = set(open_queues)
        self.offered = self.offered or bool(open_queues)
        return bool(open_queues) and set(open_queues) == set(queues), due_ms

    def offer_with_result(self, claimed: list[Any]) -> dict[str, Any] | None:
        """For the one message an idle worker is about to deliver: the offer its final result
        will write (handoff on, PostgreSQL, in the event loop, nothing else held), else None."""
        if len(claimed) != 1 or not self.can_offer() or not self.holds_nothing():
            return None
        queues = self._transport.consumed_queues()
        if not queues:
            return None
        self.offered = True
        self._offer_queues.update(queues)
        return {"queues": queues, **self.offer_terms()}

    def withdraw(self) -> None:
        """No more handoffs to this worker until its next idle look (a consumer cancelled).
        A failure is only logged: the offer then expires, and what it brings is released at
        close or taken over after its lease."""
        if not self._offer_queues:
            return
        self._offer_queues = set()
        try:
            self._transport.store.withdraw_offers(self._transport.owner)
        except Exception:
            logger.warning("sqlease: could not withdraw the handoff offer", exc_info=True)

    # ---- handoffs ----------------------------------------------------------------------

    def accept(self, handoffs: list[Handoff], notified: set[str] | None = None) -> int:
        """Deliver messages a publish leased to this worker (its idle offer), as a claim's
        would be; how many. One for a queue no channel consumes any more is given back at
        once. ``notified``: queues named by plain notifications read with these handoffs
        (their messages wait for a claim)."""
        transport = self._transport
        delivered = 0
        for handoff in handoffs:
            # Heard, whatever becomes of the message: the offer it used may stand again.
            heard = self.heard.get(handoff.queue, 0)
            self.heard[handoff.queue] = max(heard, handoff.offer_seq)
            message = handoff.message
            if message is None:  # too long for the notification: read it back, fenced
                row = transport.store.get_message(handoff.message_id)
                if (
                    row is None
                    or row.lease_owner != transport.owner
                    or row.attempt != handoff.attempt
                    or row.state != "ready"
                ):
                    continue
                message = row
            self._offer_queues.discard(message.queue)  # a publish used that queue's offer up
            channel = self._channel_for(message.queue)
            if channel is None:
                transport.store.release([message.fence], refund=True)
                continue
            held = hold(transport, [message])
            # It came because the queues were idle: nothing more to claim until something
            # notifies them (unless something just did); after its ack, the idle look offers
            # again.
            channel.drain.handed_off(
                named=bool(notified and not notified.isdisjoint(channel.active_queues()))
            )
            offer = self.offer_with_result(held)
            delivered += channel.deliver_claimed(held, transport._deliver, offer=offer)
        return delivered

    def _channel_for(self, queue: str) -> Channel | None:
        """An open channel consuming ``queue`` with acks."""
        for channel in self._transport.sql_channels():
            if channel.consumes(queue):
                return channel
        return None

    def after_listening(self, generation: int) -> None:
        """On a new listening connection (a reconnect): the handoffs of used offers whose
        notifications went to the old one will never be heard, so those offers are removed
        (none could be used while no connection held the lock) and offered afresh. The
        messages they brought come back when their leases expire."""
        previous, self._listening_generation = self._listening_generation, generation
        if previous == 0 or previous == generation or not self.offered:
            return
        try:
            self._transport.store.withdraw_offers(self._transport.owner, handed_too=True)
            self._offer_queues = set()
        except Exception:
            logger.warning(
                "sqlease: could not clear handoff offers after relistening", exc_info=True
            )

    def release_at_close(self) -> None:
        """At close, after the channels gave back what they held: withdraw the offers, and
        release (attempt refunded) any message a publish handed over that was never
        delivered (its notification not yet read), instead of leaving it to lease expiry."""
        if not self.offered:
            return
        try:
            store, owner = self._transport.store, self._transport.owner
            store.withdraw_offers(owner, handed_too=True)
            self._offer_queues = set()
            leftover = store.leased_to(owner)
            if leftover:
                heartbeat().drop(leftover)
                store.release(leftover, refund=True)
        except Exception:
            logger.warning("sqlease: could not withdraw handoff offers at close", exc_info=True)
        self.offered = False
