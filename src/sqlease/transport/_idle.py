"""The idle look: what the fetcher sends when a claim found nothing, or when acks leave the
worker idle (sqlease.transport._fetcher), and what it does with the answer.

Idle with handoffs on (PostgreSQL, sqlease.transport._handoff), the worker offers its queues,
with the acks that left it idle if any, and the offer's answer says when the next delayed
message is due; otherwise the look reads that due time alone. The event loop wakes at it, if
it comes before the next safety poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlease.store import Fence, Store
from sqlease.transport._handoff import Handoffs
from sqlease.transport._looks import Consumer
from sqlease.transport._loop import EventLoop
from sqlease.transport._runners import Kind


class IdleLook:
    """Offers and due-time reads.

    ``store()``: the transport's store; ``owner``: this worker's lease owner;
    ``polling_interval``: the safety poll's; ``channels()``: the transport's channels;
    ``consumed_queues(with_credit=False)``: the queues consumed with acks; ``acks_pending()``:
    whether acks wait to be written; ``submit(kind, **context)``: a job for the fetcher's
    runner; ``notifications``: publishes name their queues to idle clients."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        owner: str,
        polling_interval: float,
        channels: Callable[[], Sequence[Consumer]],
        consumed_queues: Callable[..., list[str]],
        acks_pending: Callable[[], bool],
        handoffs: Handoffs,
        loop: EventLoop,
        submit: Callable[..., int],
        notifications: bool,
    ) -> None:
        self._store = store
        self._owner = owner
        self._polling_interval = polling_interval
        self._channels = channels
        self._consumed_queues = consumed_queues
        self._acks_pending = acks_pending
        self._handoffs = handoffs
        self._loop = loop
        self._submit = submit
        self._notifications = notifications

    def look_ahead(self) -> None:
        """A claim found nothing: when is the next delayed message due (and, idle, the
        worker's offer for its queues, with which that time comes back)."""
        queues = self._consumed_queues()
        handoffs = self._handoffs
        if self._notifications and handoffs.can_offer():
            open_queues = handoffs.idle_queues(
                acks_pending=self._acks_pending(),
                open_queues=lambda: self._consumed_queues(with_credit=True),
            )
            if handoffs.worth_an_offer(open_queues):
                store = self._store()
                op = store.offer_op([], open_queues, self._owner, **handoffs.terms())
                covers = bool(open_queues) and set(open_queues) == set(queues)
                heard = dict(handoffs.heard)
                self._submit(
                    Kind.OFFER,
                    op=op,
                    fences=[],
                    queues=open_queues,
                    covers=covers,
                    heard=heard,
                    sent_at=time.monotonic(),
                )
                return
        if queues:
            self._submit(Kind.DUE, op=self._store().next_due_op(queues))

    def offer_while_room(self) -> None:
        """After a claim that emptied its queues: a worker with a pool process still free
        offers at once, so a publish right after is handed over and starts in the free
        process. (Not after a handoff: the task's ack or result carries the next offer; one
        written beside the delivery made the next idle start slower, 1.2 against 0.7 ms in
        benchmarks/b2b_split.py with 10 ms gaps.) A live offer is left as it stands, unlocked
        for the publish that may be looking for it."""
        handoffs = self._handoffs
        if not self._notifications or not handoffs.can_offer():
            return
        if self._acks_pending() or not handoffs.has_room():  # acks go with the next offer
            return
        queues = self._consumed_queues(with_credit=True)
        if not queues:
            return
        store = self._store()
        op = store.offer_op([], queues, self._owner, keep_live=True, **handoffs.terms())
        self._submit(
            Kind.OFFER,
            op=op,
            fences=[],
            queues=queues,
            covers=set(queues) == set(self._consumed_queues()),
            heard=dict(handoffs.heard),
            sent_at=time.monotonic(),
        )

    def offer_with_acks(self, fences: list[Fence]) -> bool:
        """Acks that leave the worker idle also leave its handoff offer (one statement), so a
        publish right after the task finished is handed over too: whether they went so."""
        queues = self._consumed_queues()
        handoffs = self._handoffs
        if not (self._notifications and handoffs.acks_leave_idle(fences, queues)):
            return False
        store = self._store()
        op = store.offer_op(fences, queues, self._owner, **handoffs.terms())
        for channel in self._channels():
            channel.look.due_read()  # the due time comes back with it: no look meanwhile
        heard = dict(handoffs.heard)
        self._submit(
            Kind.OFFER,
            op=op,
            fences=fences,
            queues=queues,
            covers=True,
            heard=heard,
            sent_at=time.monotonic(),
        )
        return True

    def offered(self, context: dict[str, Any], due_ms: int | None) -> None:
        """An offer was written (its acks are reported by the caller): it stands for its
        queues; the due time it read counts if it covered every queue consumed."""
        self._handoffs.stood(context["queues"], context["heard"])
        if context["covers"]:
            self.set_due(due_ms)
        elif self._consumed_queues():
            self._submit(Kind.DUE, op=self._store().next_due_op(self._consumed_queues()))

    def set_due(self, due_ms: int | None) -> None:
        """Wake up when the next delayed message is due, if before the next safety poll."""
        delay = None if due_ms is None else due_ms / 1000.0
        if delay is not None and delay >= self._polling_interval:
            delay = None
        self._loop.set_due_timer(delay)
