"""Handoffs on the transport's side (PostgreSQL, ``handoff`` on): an idle worker in its event
loop offers its queues; a publish that finds the offer leases the message to it in the publish
itself and names it in its notification (sqlease._core.handoff), and the worker delivers it as
if it had claimed it. Only a worker that can start the message at once offers: in a Celery
worker, one with a pool process free of every task it holds (sqlease._celery.pool_room);
elsewhere, one holding nothing. A full or stalled one is never handed a message another could
start now (an offer is good for one message per queue; what stands for other queues is
withdrawn at the next idle look). Liveness is the listening connection's advisory lock.

This is the offers' state and the decisions about them; it does no database work. The
fetcher sends the offers (with the acks that leave the worker idle, or on an idle look),
delivers what handoffs bring and withdraws offers, and tells this what came of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlease._core.handoff import Handoff
from sqlease._db.wakeup import Waker
from sqlease.store import Fence
from sqlease.transport._looks import Consumer
from sqlease.transport._qos import celery_pool_load


def _celery_holds_tasks() -> bool:
    """In a Celery worker process: tasks received and not finished, whatever their ack mode
    (Celery's own bookkeeping; empty elsewhere)."""
    try:
        from celery.worker import state
    except ImportError:  # pragma: no cover - celery is a dependency
        return False
    return bool(state.active_requests or state.reserved_requests or state.scheduled_requests)


class Handoffs:
    """A transport's offers, and the handoffs they bring.

    ``channels()``: the transport's channels; ``waker()``: its waker, if one was made;
    ``in_loop()``: whether registered with an event loop; ``closing()``: whether the
    connection is closing (no more offers)."""

    def __init__(
        self,
        *,
        enabled: bool,
        owner: str,
        lock_key: int,
        lease_ms: int,
        polling_interval: float,
        channels: Callable[[], Sequence[Consumer]],
        waker: Callable[[], Waker | None],
        in_loop: Callable[[], bool],
        closing: Callable[[], bool],
    ) -> None:
        self._enabled = enabled
        self._owner = owner
        self._lock_key = lock_key
        self._lease_ms = lease_ms
        self._polling_interval = polling_interval
        self._channels = channels
        self._waker = waker
        self._in_loop = in_loop
        self._closing = closing
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
        waker = self._waker()
        return (
            self._enabled
            and not self._closing()
            and waker is not None
            and waker.pushes
            and waker.connected
            and self._in_loop()
        )

    def holds_nothing(self, besides: Iterable[Fence] = ()) -> bool:
        """No delivery held on any channel (but ``besides``, being acked), no claim under way,
        and, in a Celery worker, no task received and not finished (one acked early is still
        running, or waiting for a pool process)."""
        channels = self._channels()
        if any(c.look.claiming for c in channels):
            return False
        acking = {f"{f.message_id}.{f.attempt}" for f in besides}
        if any(c.holds_besides(acking) for c in channels):
            return False
        return not _celery_holds_tasks()

    def has_room(self, besides: Iterable[Fence] = ()) -> bool:
        """The worker can start one more message now: no claim under way, and, in a Celery
        worker whose pool is known, a pool process free of every delivery held (but
        ``besides``, being acked) and of every task received and not finished; elsewhere,
        nothing held at all (``holds_nothing``)."""
        load = celery_pool_load()
        if load is None:
            return self.holds_nothing(besides)
        channels = self._channels()
        if any(c.look.claiming for c in channels):
            return False
        size, tasks = load
        acking = {f"{f.message_id}.{f.attempt}" for f in besides}
        held = sum(c.held_besides(acking) for c in channels)
        # A running task acked late is both a delivery held and a task received: the larger
        # count covers both (a task acked early is only the latter).
        return max(held, tasks) < size

    def terms(self) -> dict[str, Any]:
        """This worker's offer, as the store's offer calls (and a result's stamp) take it."""
        return {
            "lease_ms": self._lease_ms,
            "lock_key": self._lock_key,
            "ttl_ms": self.ttl_ms(),
            "seen": dict(self.heard),
        }

    def ttl_ms(self) -> int:
        # Refreshed by every idle look (the safety poll runs each polling_interval); the
        # margin covers a slow loop. Liveness itself is the listener's advisory lock.
        return int(max(3.0 * self._polling_interval, 2.0) * 1000)

    # ---- offering ----------------------------------------------------------------------

    def acks_leave_idle(self, fences: Sequence[Fence], queues: Sequence[str]) -> bool:
        """These acks, once written, leave the worker room for a message: they go with its
        offer."""
        return (
            bool(queues)
            and self.can_offer()
            and all(f.owner == self._owner for f in fences)
            and self.has_room(besides=fences)
        )

    def idle_queues(self, *, acks_pending: bool, open_queues: Callable[[], list[str]]) -> list[str]:
        """The queues an idle look offers: those consumed with prefetch credit when the worker
        has room (and no ack waits), else none (an offer that stands is withdrawn)."""
        if acks_pending or not self.has_room():
            return []
        return open_queues()

    def worth_an_offer(self, queues: Sequence[str]) -> bool:
        """An idle look's offer is worth sending: it stands for queues, or one stands that it
        withdraws."""
        return bool(queues or self._offer_queues)

    def stood(self, queues: Sequence[str], heard: Mapping[str, int]) -> None:
        """An offer for exactly ``queues`` was written (none: they were withdrawn);
        ``heard``: what ``heard`` was when it was sent. A queue whose handoff was heard since
        has had that offer used (a publish took it while the statement was on its way)."""
        self._offer_queues = {q for q in queues if self.heard.get(q, 0) == heard.get(q, 0)}
        self.offered = self.offered or bool(queues)

    def offer_with_result(
        self, claimed: Sequence[Any], queues: Sequence[str]
    ) -> dict[str, Any] | None:
        """For the one message a worker with room is about to deliver: the offer its final
        result will write (handoff on, PostgreSQL, in the event loop), else None."""
        if len(claimed) != 1 or not queues or not self.can_offer() or not self.has_room():
            return None
        self.offered = True
        self._offer_queues.update(queues)
        return {"queues": list(queues), **self.terms()}

    def withdrawn(self) -> bool:
        """No more handoffs to this worker until its next idle look (a consumer cancelled):
        whether an offer may stand that the caller must withdraw."""
        if not self._offer_queues:
            return False
        self._offer_queues = set()
        return True

    # ---- handoffs ----------------------------------------------------------------------

    def heard_of(self, handoff: Handoff) -> None:
        """A handoff was read (whatever becomes of its message): the offer it used may stand
        again, and no longer stands for its queue."""
        self.heard[handoff.queue] = max(self.heard.get(handoff.queue, 0), handoff.offer_seq)
        self._offer_queues.discard(handoff.queue)

    def channel_for(self, queue: str) -> Consumer | None:
        """An open channel consuming ``queue`` with acks."""
        for channel in self._channels():
            if channel.consumes(queue):
                return channel
        return None

    def listening_again(self, generation: int) -> bool:
        """A new listening connection (a reconnect): whether the offers of before must all be
        withdrawn (the handoffs of used offers whose notifications went to the old one will
        never be heard; none could be used while no connection held the lock). The messages
        they brought come back when their leases expire."""
        previous, self._listening_generation = self._listening_generation, generation
        if previous == 0 or previous == generation or not self.offered:
            return False
        self._offer_queues = set()
        return True

    def closing(self) -> bool:
        """At close: whether offers were made (the caller withdraws them and releases what a
        publish handed over that was never delivered)."""
        offered, self.offered = self.offered, False
        self._offer_queues = set()
        return offered
