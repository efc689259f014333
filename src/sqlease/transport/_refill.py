"""Refill claims while busy (PostgreSQL): while a channel holds deliveries, its claim goes to
the runner with the acks waiting to be written, so the event loop keeps feeding the pool during
the claim's round trip and commit; the outcome is delivered on the loop's thread."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from sqlease._core.heartbeat import heartbeat
from sqlease.store import Message
from sqlease.transport._loop_calls import LoopCalls
from sqlease.transport._runners import ACKS, Runner

if TYPE_CHECKING:
    from sqlease.transport._channel import Channel
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)


class Refill:
    """A transport's claims: in the loop, or on its runner (made on first use)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: The runner of the busy worker's calls, once one was needed.
        self.runner: Runner | None = None

    def possible(self) -> bool:
        """Calls can go to the runner: PostgreSQL, in the event loop's thread."""
        transport = self._transport
        loop = transport.loop
        in_loop = loop.pipe_open and threading.get_ident() == loop.thread
        return transport.store.driver.remote and in_loop

    def in_background(self, channel: Channel) -> bool:
        """While the channel holds deliveries (tasks running or buffered), its refill claim
        runs on the runner, so the loop keeps feeding the pool during the claim's round trip
        and commit. An idle worker claims in the loop: nothing else is waiting for it, and
        the hop to the runner would only delay the new task's start. (SQLite's claims have no
        network round trip and commit without an fsync: in the loop.)"""
        return self.possible() and channel.qos.unacked_count() > 0

    def runner_for_loop(self) -> Runner:
        if self.runner is None:
            loop = self._transport.loop
            self.runner = self._transport.leases.runner(loop.hub, loop.wake_from_thread)
        return self.runner

    def claim_in_loop(
        self, channel: Channel, queues: list[str], limit: int
    ) -> tuple[list[Message], bool]:
        """The channel's claim, in the loop. SQLite: the acks waiting to be written go with it,
        in one transaction (one write lock, one commit instead of two; the claim sees them
        free a run's next message). PostgreSQL claims here only when idle, with no acks
        waiting: as they are."""
        transport = self._transport
        acks = transport.acks
        if transport.store.driver.remote or not acks.pending:
            return transport.leases.claim(queues, limit)
        pending = acks.take()
        try:
            acked, claimed, short = transport.leases.claim_with_acks(queues, limit, pending)
        except BaseException:
            # Nothing of it was written: the acks wait for the next write, as before.
            acks.put_back(pending)
            raise
        acks.report(pending, acked)
        return claimed, short

    def claim_in_background(self, channel: Channel, queues: list[str], limit: int) -> None:
        """Submit the channel's refill claim, with the acks waiting to be written: the acks of
        the tasks whose completion freed the credit go with it, in one statement."""
        transport = self._transport
        pending = transport.acks.take()
        channel.drain.claim_started()
        leases = transport.leases
        self.runner_for_loop().submit(
            channel,
            lambda: leases.claim(queues, limit),
            limit=limit,
            queues=queues,
            pending=pending,
        )

    def deliver(self) -> None:
        """In the loop: report the runner's acks and deliver its claims (or give them back if
        their channel is closing); raise the first error as the call in the loop would have
        (a connection error makes Celery reconnect)."""
        runner = self.runner
        if runner is None:
            return
        transport = self._transport
        error: BaseException | None = None
        for outcome in runner.collect():
            if outcome.acked is not None:
                transport.acks.report(outcome.context["pending"], outcome.acked)
            if outcome.key is not ACKS:
                channel: Channel = outcome.key
                channel.drain.claim_finished()
            if outcome.error is not None:
                error = error or outcome.error
            if outcome.key is ACKS or outcome.error is not None:
                continue
            claimed, short = outcome.value
            if error is not None or not channel.accepts_deliveries() or transport.loop.hub is None:
                self.give_back(claimed)
                continue
            transport.loop.deliver_claim(channel, claimed, short, outcome.context["limit"])
        if error is not None:
            if isinstance(error, transport.connection_errors):
                raise error
            logger.error("sqlease: error while fetching messages", exc_info=error)

    def finish(self, timeout: float = 30.0) -> None:
        """Wait for the runner's calls; report their acks and give back what their claims
        leased (channels are closing: nothing more is delivered). Leases it could not give
        back expire."""
        runner = self.runner
        if runner is None:
            return
        if not runner.wait_idle(timeout):
            logger.warning(
                "sqlease: a background claim did not finish within %.0f s; its messages come "
                "back when their leases expire",
                timeout,
            )
        for outcome in runner.collect():
            if outcome.acked is not None:
                self._transport.acks.report(outcome.context["pending"], outcome.acked)
            elif outcome.context.get("pending"):
                logger.warning(
                    "sqlease: could not write %d ack(s); their messages come back when "
                    "their leases expire",
                    len(outcome.context["pending"]),
                    exc_info=outcome.error,
                )
            if outcome.key is not ACKS:
                outcome.key.drain.claim_finished()
                if outcome.error is None:
                    self.give_back(outcome.value[0])

    def stop(self, *, loop_runner_only: bool = False) -> None:
        """Stop the runner. ``loop_runner_only``: only a runner that watches the loop's hub (a
        loop registered later gets one of its own; a thread can serve it)."""
        runner = self.runner
        if runner is None or (loop_runner_only and not isinstance(runner, LoopCalls)):
            return
        runner.stop()
        self.runner = None

    def give_back(self, claimed: list[Message]) -> None:
        """Release what was claimed and will not be delivered, attempt refunded."""
        fences = [m.fence for m in claimed]
        if not fences:
            return
        heartbeat().drop(fences)
        try:
            self._transport.store.release(fences, refund=True)
        except Exception:
            logger.exception("sqlease: could not release %d undelivered message(s)", len(fences))
