"""The fetcher: the one thing a channel calls for messages, and the one place acks leave.

It owns the drain state (when to look, whether a look is worth a claim), the runner that
does the database jobs (claims with the acks waiting, takes, offers, due-time reads, releases),
and builds the parts that make and answer those jobs, each given what it needs: claims, takes
and sweeps (sqlease.transport._claims); the delivery of what they bring
(sqlease.transport._deliveries, then sqlease.transport._completion); the acks and rejects
written (sqlease.transport._acking); the idle look, offers and due times
(sqlease.transport._idle); the handoffs accepted (sqlease.transport._handed); and the runner's
outcomes, each to the part that made its job (sqlease.transport._outcomes). In the worker's
event loop every job goes to the runner and its outcome is handled when it comes back, on the
loop thread: the loop never waits on the database (SQLite's jobs, local transactions of tens
of microseconds, run at once). Outside a loop (a client that drains by itself, ``basic_get``)
the same jobs run inline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from queue import Empty
from typing import Any

from sqlease._core.handoff import Handoff
from sqlease._core.heartbeat import heartbeat
from sqlease._core.lease_clock import DatabaseTime
from sqlease._core.results import ResultStore
from sqlease.options import TransportOptions
from sqlease.store import Fence, Store
from sqlease.transport._acking import Acking
from sqlease.transport._acks import AckWriter, stop_renewing
from sqlease.transport._claims import Claims
from sqlease.transport._completion import SideCalls
from sqlease.transport._deliveries import Deliveries
from sqlease.transport._handed import Handed
from sqlease.transport._handoff import Handoffs
from sqlease.transport._idle import IdleLook
from sqlease.transport._looks import Consumer, LookState
from sqlease.transport._loop import EventLoop
from sqlease.transport._outage import Outage
from sqlease.transport._outcomes import Outcomes
from sqlease.transport._runners import Batcher, Kind, Runner, Terms, make_runner

logger = logging.getLogger(__name__)


class Fetcher:
    """One transport's fetching, acking and giving back.

    ``store()`` / ``results()``: the transport's stores (made on first use); ``channels()``:
    its channels; ``deliver(payload, queue)``: Kombu's delivery to the consumer; ``loop``:
    the event-loop glue; ``handoffs``: the offers' state; ``notifications``: publishes name
    their queues to idle clients (a drained queue waits for one instead of a claim);
    ``cycle()``: Kombu's fair cycle over the channels; ``connection_errors``: what makes
    Celery reconnect, unless ``self.outage`` holds it back (sqlease.transport._outage);
    ``queue_ttl(queue)``: a queue's
    ``x-message-ttl`` (ms) as declared here."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        results: Callable[[], ResultStore],
        options: TransportOptions,
        owner: str,
        channels: Callable[[], Sequence[Consumer]],
        deliver: Callable[[Any, str], None],
        loop: EventLoop,
        handoffs: Handoffs,
        notifications: bool,
        cycle: Callable[[], Any],
        connection_errors: tuple[type[BaseException], ...],
        queue_ttl: Callable[[str], int | None] = lambda queue: None,
    ) -> None:
        self._store = store
        self._options = options
        self._terms = Terms(owner, options.lease_ms)
        #: Whether a connection error goes to Celery now (sqlease.transport._outage).
        self.outage = Outage(lambda: heartbeat().alive_count())
        self._channels = channels
        self._deliver = deliver
        self._loop = loop
        self._cycle = cycle
        self.looks = LookState()
        self.acks = AckWriter(
            write=self.write_acks,
            leaving=lambda fences: stop_renewing(fences, self.outage.leaving),
            in_loop=loop.in_loop_thread,
            held=self._held,
            timer=loop.call_later,
            wake=loop.kick,
        )
        self.side = SideCalls(in_loop=loop.in_loop_thread, wake=loop.wake_from_thread)
        self.runner: Runner | None = None
        self._batcher: Batcher | None = None
        self._closing = False
        # The database's clock as this worker knows it, for the leases handoffs bring.
        db_time = DatabaseTime()
        self._deliveries = Deliveries(
            store=store,
            results=results,
            options=options,
            deliver=deliver,
            side=self.side,
            loop=loop,
            submit=self._submit,
            closing=self._is_closing,
            queue_ttl=queue_ttl,
        )
        self._idle = IdleLook(
            store=store,
            owner=owner,
            polling_interval=options.polling_interval,
            channels=channels,
            consumed_queues=self.consumed_queues,
            acks_pending=lambda: bool(self.acks.pending),
            handoffs=handoffs,
            loop=loop,
            submit=self._submit,
            notifications=notifications,
        )
        self._acking = Acking(
            store=store,
            acks=self.acks,
            looks=self.looks,
            side=self.side,
            loop=loop,
            submit=self._submit,
            closing=self._is_closing,
            offer_with_acks=self._idle.offer_with_acks,
            look_again=self.look_again,
            answered=self.outage.answered,
        )
        self._handed = Handed(
            store=store,
            owner=owner,
            lease_ms=options.lease_ms,
            channels=channels,
            consumed_queues=self.consumed_queues,
            handoffs=handoffs,
            deliveries=self._deliveries,
            db_time=db_time,
            side=self.side,
            loop=loop,
            submit=self._submit,
        )
        self._claims = Claims(
            store=store,
            results=results,
            terms=self._terms,
            channels=channels,
            consumed_queues=self.consumed_queues,
            looks=self.looks,
            acks=self.acks,
            handoffs=handoffs,
            deliveries=self._deliveries,
            db_time=db_time,
            side=self.side,
            loop=loop,
            submit=self._submit,
            closing=self._is_closing,
            promote=self._acking.promote,
            look_ahead=self._idle.look_ahead,
            offer_while_room=self._idle.offer_while_room,
            notifications=notifications,
        )
        self._outcomes = Outcomes(
            runner=lambda: self.runner,
            side=self.side,
            db_time=db_time,
            connection_errors=connection_errors,
            outage=self.outage,
            claims=self._claims,
            idle=self._idle,
            handed=self._handed,
            acking=self._acking,
        )

    def _is_closing(self) -> bool:
        return self._closing

    # ---- the runner ---------------------------------------------------------------------

    def _runner(self) -> Runner:
        if self.runner is None:
            store = self._store()
            self._batcher = Batcher(store, self._terms)
            self.runner = make_runner(
                store,
                self._batcher,
                hub=self._loop.hub,
                notify=self._outcomes_ready,
                wake_from_thread=self._loop.wake_from_thread,
                loop_statements=self._options.loop_statements,
                # A claim answered later than a lease is worth nothing (its leases' clocks
                # ran out), and an ack no more: given up, sent again on a new connection.
                give_up_after=self._options.lease_seconds,
            )
        return self.runner

    def _outcomes_ready(self) -> None:
        """The loop's runner has outcomes (on the loop thread): handled now."""
        self.deliver_outcomes()

    def _submit(self, kind: Kind, **context: Any) -> int:
        """Hand a job to the runner; what was delivered at once (a synchronous runner)."""
        runner = self._runner()
        runner.submit(kind, **context)
        return self.deliver_outcomes(raising=True) if runner.synchronous else 0

    def attach(self) -> None:
        """The transport was (re)registered with an event loop: a runner of an earlier loop
        finishes its jobs and goes (the next job makes one for this loop)."""
        self.settle()
        if self.runner is not None:
            self.runner.stop()
            self.runner = None

    def deliver_outcomes(self, *, raising: bool = False) -> int:
        """Handle what the runner finished (loop thread); how many messages were delivered
        (sqlease.transport._outcomes)."""
        return self._outcomes.deliver(raising=raising)

    # ---- what the channels ask ----------------------------------------------------------

    def consumed_queues(self, *, with_credit: bool = False) -> list[str]:
        """The queues consumed with acks on any channel (``with_credit``: only on channels
        not closing and with prefetch credit)."""
        queues: set[str] = set()
        for channel in self._channels():
            if channel.consuming:
                if with_credit and (channel.look.closing or not channel.qos.can_consume()):
                    continue
                queues.update(channel.acked_queues())
        return sorted(queues)

    def _held(self) -> int:
        """Deliveries not yet acked on the transport's channels."""
        return sum(c.qos.unacked_count() for c in self._channels())

    def fetch(self, channel: Consumer) -> int:
        """A channel's look for messages (sqlease.transport._claims): how many were delivered
        now (in the event loop they come when the runner has them)."""
        return self._claims.fetch(channel)

    def claim(self, channel: Consumer, queues: list[str], limit: int) -> int:
        """A claim for the channel, with the acks waiting."""
        return self._claims.claim(channel, queues, limit)

    def take_noack_first(self) -> int:
        """Remote control before tasks: every channel's no-ack queues looked at first."""
        return self._claims.take_noack_first()

    def get(self, channel: Consumer, queue: str, *, no_ack: bool) -> dict[str, Any] | None:
        """One message of ``queue`` now, blocking (Kombu's ``basic_get``); None if none is
        ready."""
        return self._claims.get(channel, queue, no_ack=no_ack)

    def drain_ready(self) -> bool:
        """One pass: deliver until nothing more is ready or credit runs out (bounded, so the
        event loop stays responsive); True if anything came."""
        looks = self.looks
        got = self.take_noack_first() > 0
        cycle = self._cycle()
        for _ in range(50):
            looks.begin_round()
            try:
                cycle.get(self._deliver)
            except Empty:
                looks.round_found_nothing()
                break
            got = True
            if not looks.more:
                break
        return got

    def notified(self, queues: set[str] | None) -> None:
        """Something was published to ``queues`` (None: to any of them): no-ack queues are
        looked at now, not after their quiet-interval throttle, and queues known empty
        claimed from again."""
        for channel in self._channels():
            channel.look.notified(queues, channel.active_queues())

    def look_again(self) -> None:
        """Messages may have become ready (released, or the next of a run after an ack)."""
        for channel in self._channels():
            channel.look.look_again()

    def look_ahead(self) -> None:
        """A claim found nothing: the idle look (sqlease.transport._idle)."""
        self._idle.look_ahead()

    def accept(self, handoffs: list[Handoff], notified: set[str] | None = None) -> None:
        """Deliver messages a publish leased to this worker (sqlease.transport._handed)."""
        self._handed.accept(handoffs, notified)

    # ---- acks and rejects ---------------------------------------------------------------

    def write_acks(self, fences: list[Fence]) -> None:
        """How a batch of acks is written (sqlease.transport._acking)."""
        self._acking.write(fences)

    def reject(self, fence: Fence, *, requeue: bool) -> None:
        """Celery rejected a delivery: released (``requeue``) or kept as failed."""
        self._acking.reject(fence, requeue=requeue)

    # ---- settling and closing -----------------------------------------------------------

    def settle(self, timeout: float = 30.0) -> None:
        """Finish the runner's jobs and handle their outcomes (what a closing channel's claim
        brought is given back). Leases it could not give back expire."""
        runner = self.runner
        if runner is None:
            return
        if not runner.wait_idle(timeout):
            logger.warning(
                "sqlease: a background claim did not finish within %.0f s; its messages come "
                "back when their leases expire",
                timeout,
            )
        try:
            self.deliver_outcomes()
        except Exception:
            logger.warning("sqlease: a database job failed while settling", exc_info=True)

    def close(self) -> None:
        """The connection is closing: nothing more is delivered; what claims brought is given
        back, the acks waiting are written, the runner and the side thread stop."""
        self._closing = True
        self.settle()
        pending = self.acks.take()
        if pending:
            try:
                self.write_acks(pending)
            except Exception:
                logger.warning("sqlease: could not write deferred acks at close", exc_info=True)
        if self.runner is not None:
            self.runner.stop()
            self.runner = None
        self.side.close()

    def reopen(self) -> None:
        """The connection is being established (again)."""
        self._closing = False
