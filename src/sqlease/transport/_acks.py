"""Ack batching: in the worker's event loop, the acks of one loop iteration are written
together, in one statement, at the start of the next (or with the next claim); elsewhere an ack
is written at once. An ack the store refuses is reported, never raised into Celery."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from sqlease.store import Fence, Store
from sqlease.transport._runners import ACKS

if TYPE_CHECKING:
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)

#: Acks in the worker's event loop are written together: after this many seconds, or at once
#: when this many are waiting.
ACK_DELAY = 0.005
ACK_BATCH = 32


class AckBatcher:
    """The acks waiting to be written (loop thread only)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: The acks waiting, oldest first.
        self.pending: list[Fence] = []
        self._timer: Any = None

    @property
    def timer_set(self) -> bool:
        return self._timer is not None

    @property
    def full(self) -> bool:
        """Enough are waiting to be written now, in this iteration."""
        return len(self.pending) >= ACK_BATCH

    def defer(self, fence: Fence) -> bool:
        """Keep the ack of ``fence`` for the batch if in the worker's event loop (True);
        False elsewhere: the caller writes it now."""
        transport = self._transport
        loop = transport.loop
        if loop.hub is None or threading.get_ident() != loop.thread:
            return False
        pending = self.pending
        pending.append(fence)
        if len(pending) == 1 and self._unacked_total() <= 1:
            # Nothing else is running or buffered: no ack could join this one, so write it
            # now (and keep the next task's start free of it).
            self.flush()
            return True
        if len(pending) >= ACK_BATCH:
            loop.kick()  # the self-pipe handler writes them in the next iteration
        elif len(pending) == 1:
            # Gather the acks of the next few milliseconds into one statement (one commit).
            self._timer = loop.hub.call_later(ACK_DELAY, self.flush)
            loop.kick()  # so the hub recomputes its poll timeout with this timer
        return True

    def _unacked_total(self) -> int:
        """Deliveries not yet acked on the transport's channels (the one being acked
        included)."""
        return sum(c.qos.unacked_count() for c in self._transport.sql_channels())

    def take(self) -> list[Fence]:
        """The acks waiting to be written, for a write to take with it (their timer stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self.pending = self.pending, []
        return pending

    def put_back(self, pending: list[Fence]) -> None:
        """A write that took ``pending`` failed before anything was written: they wait for
        the next write, as before, with their timer."""
        self.pending[:0] = pending
        hub = self._transport.loop.hub
        if hub is not None and self._timer is None:
            self._timer = hub.call_later(ACK_DELAY, self.flush)

    def flush(self, *, in_background: bool = True) -> None:
        pending = self.take()
        if not pending:
            return
        transport = self._transport
        handoffs = transport.handoffs
        if handoffs.acks_leave_idle(pending):
            # The acks that leave the worker idle also leave its handoff offer (one
            # statement), so a publish right after the task finished is handed over too.
            self.report(pending, handoffs.ack_and_offer(pending))
            return
        refill = transport.refill
        if in_background and refill.possible():
            # Like a busy worker's claims, and in order with them: a claim submitted after
            # these acks runs after them or together with them. (Together, it cannot see them
            # free a run's next message; it then never reports its queues drained, so the
            # next look claims that message.)
            leases = transport.leases
            refill.runner_for_loop().submit(ACKS, lambda: leases.ack(pending), pending=pending)
            return
        self.report(pending, transport.leases.ack(pending))

    def report(self, pending: list[Fence], acked: set[int]) -> None:
        """Report the acks of ``pending`` the store refused; an ack frees prefetch credit and
        may unblock the next task of a run: look for work in the next iteration rather than
        at the next poll."""
        transport = self._transport
        for fence in pending:
            if fence.message_id not in acked:
                report_refused_ack(transport.store, fence)
        if acked and transport.loop.hub is not None:
            transport.drain.wake()
            transport.loop.kick()


def report_refused_ack(store: Store, fence: Fence) -> None:
    # Never raised into Celery: the delivery that holds the message now is the one that
    # counts. Parked (paused, waiting for a person) and cancelled tasks are expected here.
    current = store.get_message(fence.message_id)
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
