"""Ack batching: in the worker's event loop, the acks of one loop iteration are written
together, in one statement, at the start of the next (or with the next claim); elsewhere an
ack is written at once. How a batch is written (with the idle worker's offer, on the runner,
or at once) is the ``write`` function's decision (sqlease.transport._acking): this is the
one place an ack enters, the fetcher the one place it leaves."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlease._core.heartbeat import heartbeat
from sqlease.store import Fence, Store

logger = logging.getLogger(__name__)

#: Acks in the worker's event loop are written together: after this many seconds, or at once
#: when this many are waiting.
ACK_DELAY = 0.005
ACK_BATCH = 32


class AckWriter:
    """The acks waiting to be written (loop thread only).

    ``write(fences)`` writes a batch; ``leaving(fences)`` is told which acks leave now (for
    the database or with a claim) and answers those that may be sent; ``in_loop()`` says
    whether the caller is the event loop's thread (elsewhere every ack is written at once);
    ``held()`` counts the deliveries not yet acked; ``timer(delay, callback)`` and ``wake()``
    are the loop's timer and self-pipe."""

    def __init__(
        self,
        *,
        write: Callable[[list[Fence]], None],
        leaving: Callable[[list[Fence]], list[Fence]],
        in_loop: Callable[[], bool],
        held: Callable[[], int],
        timer: Callable[[float, Callable[[], None]], Any],
        wake: Callable[[], None],
    ) -> None:
        self._write = write
        self._leaving = leaving
        self._in_loop = in_loop
        self._held = held
        self._timer_of = timer
        self._wake = wake
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

    def add(self, fence: Fence) -> None:
        """Ack ``fence``: in the event loop, with the batch; elsewhere at once."""
        if not self._in_loop():
            sendable = self._leaving([fence])
            if sendable:
                self._write(sendable)
            return
        pending = self.pending
        pending.append(fence)
        if len(pending) == 1 and self._held() <= 1:
            # Nothing else is running or buffered: no ack could join this one, so write it
            # now (and keep the next task's start free of it).
            self.flush()
        elif len(pending) >= ACK_BATCH:
            self._wake()  # written in the next iteration
        elif len(pending) == 1:
            # Gather the acks of the next few milliseconds into one statement (one commit).
            self._timer = self._timer_of(ACK_DELAY, self.flush)
            self._wake()  # so the hub recomputes its poll timeout with this timer

    def take(self) -> list[Fence]:
        """The acks waiting, for a write to take with it (their timer stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self.pending = self.pending, []
        return self._leaving(pending) if pending else pending

    def put_back(self, pending: list[Fence]) -> None:
        """A write that took ``pending`` failed before anything was written: they wait for
        the next write, as before, with their timer."""
        self.pending[:0] = pending
        if self._timer is None and self._in_loop():
            self._timer = self._timer_of(ACK_DELAY, self.flush)

    def flush(self) -> None:
        pending = self.take()
        if pending:
            self._write(pending)


def stop_renewing(
    fences: list[Fence], leaving: Callable[[list[tuple[Fence, float]]], None] | None = None
) -> list[Fence]:
    """Acks leaving for the database: their leases are no longer renewed from here (a renewal
    racing with the ack would take the acked row for a lost lease). Until then they were, so
    an ack waiting in a batch keeps its lease however long the loop is held up (Celery's soft
    shutdown sleeps in a signal handler, on the loop's thread). Those whose lease is known
    lost here are not sent (``Heartbeat.drop_all_for_ack``); ``leaving`` is told the
    ``(fence, deadline)`` of each one sent that was held here (sqlease.transport._outage)."""
    dropped = heartbeat().drop_all_for_ack(fences)
    if len(dropped) != len(fences):
        sent = {fence for fence, _ in dropped}
        for fence in fences:
            if fence not in sent:
                report_clock_refused_ack(fence)
    if leaving is not None:
        held = [(fence, deadline) for fence, deadline in dropped if deadline is not None]
        if held:
            leaving(held)
    return [fence for fence, _ in dropped]


def report_refused_ack(store: Store, fence: Fence) -> None:
    """An ack the store refused: logged, never raised into Celery (the delivery that holds
    the message now is the one that counts). Parked (paused, waiting for a person) and
    cancelled tasks are expected here."""
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


def report_clock_refused_ack(fence: Fence) -> None:
    """An ack not sent: the delivery's lease is known lost in this process (the database
    refused its renewal, or its lease clock ran out first)."""
    logger.warning(
        "sqlease: ack of message %s attempt %s not sent: its lease is lost (refused or out of "
        "time); the message comes back when the lease expires, or stays with its new holder",
        fence.message_id,
        fence.attempt,
        extra={"message_id": fence.message_id, "attempt": fence.attempt},
    )
