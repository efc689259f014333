"""Acks and rejects leaving the worker (sqlease.transport._fetcher), and what their answers ask.

A batch of acks (sqlease.transport._acks) is written with the offer of a worker it leaves
idle, else on the fetcher's runner (with the next claim if one waits); outside the loop, and
closing, at once. An answer's refused acks are reported, its acks free prefetch credit (and
maybe a run's next message), and runs or gates it could not judge are promoted; a batch that
was not written waits for the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlease._core.heartbeat import heartbeat
from sqlease.store import Fence, Store
from sqlease.transport._acks import AckWriter, report_refused_ack
from sqlease.transport._completion import SideCalls
from sqlease.transport._looks import LookState
from sqlease.transport._loop import EventLoop
from sqlease.transport._runners import Kind

logger = logging.getLogger(__name__)


class Acking:
    """How acks and rejects are written, and their answers followed up.

    ``store()``: the transport's store; ``acks``: the acks waiting; ``looks``: the drain
    state; ``side``: the database work off the loop; ``loop``: the event-loop glue;
    ``submit(kind, **context)``: a job for the fetcher's runner; ``closing()``: whether the
    connection is closing; ``offer_with_acks(fences)``: sends them with the idle worker's
    offer, if they leave it idle (whether they went); ``look_again()``: messages may have
    become ready; ``answered(fences)``: these acks are no longer on their way (written,
    refused or given up: sqlease.transport._outage counts those that are)."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        acks: AckWriter,
        looks: LookState,
        side: SideCalls,
        loop: EventLoop,
        submit: Callable[..., int],
        closing: Callable[[], bool],
        offer_with_acks: Callable[[list[Fence]], bool],
        look_again: Callable[[], None],
        answered: Callable[[list[Fence]], None],
    ) -> None:
        self._store = store
        self._acks = acks
        self._looks = looks
        self._side = side
        self._loop = loop
        self._submit = submit
        self._closing = closing
        self._offer_with_acks = offer_with_acks
        self._look_again = look_again
        self._answered = answered

    def write(self, fences: list[Fence]) -> None:
        """How a batch of acks is written: with the offer of a worker they leave idle, else
        on the runner (with the next claim if one waits); outside the loop, and closing, at
        once."""
        if not self._loop.in_loop_thread() or self._closing():
            try:
                acked = self._store().ack(fences)
            finally:
                self._answered(fences)
            refused = [f for f in fences if f.message_id not in acked]
            for fence in refused:
                report_refused_ack(self._store(), fence)
            return
        if self._offer_with_acks(fences):
            return
        self._submit(Kind.ACKS, fences=fences)

    def reject(self, fence: Fence, *, requeue: bool) -> None:
        """Celery rejected a delivery: released (``requeue``) or kept as failed
        ``rejected`` (inspectable, requeueable), never silently dropped. In the loop on the
        runner; elsewhere at once. A stale one changes nothing and is logged."""
        heartbeat().drop([fence])
        store = self._store()
        if self._loop.in_loop_thread() and not self._closing():
            op = store.release_rejected_op(fence) if requeue else store.fail_op(fence, "rejected")
            self._submit(Kind.CHANGE, op=op, fences=[fence], what="reject")
        else:
            done = store.release_rejected(fence) if requeue else store.fail(fence, "rejected")
            if not done:
                logger.warning("sqlease: stale reject ignored for %s", fence)
        if requeue:
            self._look_again()

    # ---- the answers --------------------------------------------------------------------

    def report(self, fences: list[Fence], acked: set[int]) -> None:
        """Acks the store refused are reported (off the loop: it reads their state); acks
        that went through free prefetch credit and may free a run's next message: look for
        work in the next iteration rather than at the next poll. Either way the acks are no
        longer on their way (an outage no longer waits for them)."""
        self._answered(fences)
        self.owed(acked)
        refused = [f for f in fences if f.message_id not in acked]
        if refused:
            store = self._store()

            def report() -> None:
                for fence in refused:
                    report_refused_ack(store, fence)

            self._side.run(report)
        if acked and self._loop.registered:
            self._looks.wake()
            self._loop.kick()

    def unwritten(self, fences: list[Fence]) -> None:
        """Nothing of a job that carried these acks was written: they wait for the next
        write (at close, their messages come back when their leases expire)."""
        if self._closing() or not self._loop.in_loop_thread():
            self._answered(fences)
            logger.warning(
                "sqlease: could not write %d ack(s); their messages come back when their "
                "leases expire",
                len(fences),
            )
            return
        self._acks.put_back(fences)

    def owed(self, acked: Any) -> None:
        """Runs an ack or a transition could not judge (an enqueue into them committed
        meanwhile) get their heads made ready, off the loop. One answer may serve several
        jobs: it is promoted once."""
        owed = getattr(acked, "owed_runs", ())
        if owed:
            acked.owed_runs = ()
            self.promote(list(owed))
        gates = getattr(acked, "owed_gates", ())
        if gates:
            acked.owed_gates = ()
            store = self._store()
            self._side.run(lambda: store.promote_gates(gates))

    def promote(self, runs: list[str]) -> None:
        """The runs' next messages made ready, off the loop."""
        store = self._store()
        self._side.run(lambda: store.promote_runs(runs))
