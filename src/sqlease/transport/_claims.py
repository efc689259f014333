"""Claims and takes: how the fetcher (sqlease.transport._fetcher) asks for messages, and what
it does with what they bring.

A channel's look is one delete-on-fetch batch of its no-ack queues (remote control, events)
and one claim batch of the rest, sized by its prefetch credit, with the acks waiting; about
once a second a claiming worker also sweeps the messages at a full gate off its queues' front.
What a claim brings is delivered through sqlease.transport._deliveries (the dead ones get
their FAILURE result, their runs' next messages made ready); a claim that found nothing leads
to the idle look (sqlease.transport._idle).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlease._core.lease_clock import DatabaseTime
from sqlease._core.leases import delivery_order, runs_left, split_exhausted
from sqlease._core.results import ResultStore
from sqlease.store import Message, Store
from sqlease.transport._acks import AckWriter
from sqlease.transport._completion import SideCalls, record_exhausted
from sqlease.transport._deliveries import Deliveries
from sqlease.transport._handoff import Handoffs
from sqlease.transport._looks import Consumer, LookState
from sqlease.transport._loop import EventLoop
from sqlease.transport._runners import Kind, Terms

logger = logging.getLogger(__name__)

#: Most messages one claim statement takes (the prefetch credit usually bounds it first).
CLAIM_BATCH = 128
#: Most messages one delete-on-fetch statement takes for consumers that never ack.
TAKE_BATCH = 64
#: Seconds between a worker's sweeps of its queues for messages at a full gate.
SWEEP_INTERVAL = 1.0


class Claims:
    """A transport's claims, takes and sweeps, sent and answered.

    ``store()`` / ``results()``: the transport's stores; ``terms``: the lease its claims ask
    for; ``channels()``: its channels; ``consumed_queues()``: the queues consumed with acks;
    ``looks`` / ``acks``: the drain state and the acks waiting; ``db_time``: the database's
    clock as this worker knows it; ``submit(kind, **context)``: a job for the fetcher's
    runner; ``closing()``: whether the connection is closing; ``promote(runs)``: the runs'
    next messages made ready; ``look_ahead()``: the idle look; ``offer_while_room()``: the
    offer of a worker with room after a claim that emptied its queues; ``notifications``:
    publishes name their queues to idle clients."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        results: Callable[[], ResultStore],
        terms: Terms,
        channels: Callable[[], Sequence[Consumer]],
        consumed_queues: Callable[[], list[str]],
        looks: LookState,
        acks: AckWriter,
        handoffs: Handoffs,
        deliveries: Deliveries,
        db_time: DatabaseTime,
        side: SideCalls,
        loop: EventLoop,
        submit: Callable[..., int],
        closing: Callable[[], bool],
        promote: Callable[[list[str]], None],
        look_ahead: Callable[[], None],
        offer_while_room: Callable[[], None],
        notifications: bool,
    ) -> None:
        self._store = store
        self._results = results
        self._terms = terms
        self._channels = channels
        self._consumed_queues = consumed_queues
        self._looks = looks
        self._acks = acks
        self._handoffs = handoffs
        self._deliveries = deliveries
        self._db_time = db_time
        self._side = side
        self._loop = loop
        self._submit = submit
        self._closing = closing
        self._promote = promote
        self._look_ahead = look_ahead
        self._offer_while_room = offer_while_room
        self._notifications = notifications
        self._swept_at = 0.0

    # ---- asking -------------------------------------------------------------------------

    def fetch(self, channel: Consumer) -> int:
        """A channel's look for messages: one delete-on-fetch batch of its no-ack queues and
        one claim batch, sized by its free prefetch credit, if it is time for them. How many
        were delivered now (in the event loop they come when the runner has them)."""
        delivered = self.take_noack(channel)
        queues = channel.acked_queues()
        if queues and self._looks.should_claim(
            channel.look, channel.qos, notifications=self._notifications
        ):
            credit = channel.qos.credit()  # at least 1: should_claim asked can_consume
            limit = CLAIM_BATCH if credit is None else min(credit, CLAIM_BATCH)
            delivered += self.claim(channel, queues, limit)
        return delivered

    def claim(self, channel: Consumer, queues: list[str], limit: int) -> int:
        """A claim for the channel: the acks waiting go with it (those of the tasks whose
        completion freed the credit), in one statement."""
        channel.look.claim_started()
        self._sweep(queues)
        fences = self._acks.take()
        # The lease clock of what it brings counts from here (no later than it is sent).
        sent_at = time.monotonic()
        return self._submit(
            Kind.CLAIM, channel=channel, queues=queues, limit=limit, fences=fences, sent_at=sent_at
        )

    def _sweep(self, queues: list[str]) -> None:
        """About once a second while it claims, a worker parks the messages at the front of
        its queues whose gate is full (``Store.park_held``): otherwise every claim steps
        over each of them. Best effort, off the loop: a sweep that meets a lock gives up,
        and the next one parks what it left."""
        at = time.monotonic()
        if at - self._swept_at < SWEEP_INTERVAL:
            return
        self._swept_at = at
        store = self._store()

        def sweep() -> None:
            try:
                store.park_held(queues)
            except Exception as exc:  # a lock timeout, a lost connection: try next time
                logger.debug("sqlease: a sweep of held messages gave up: %s", exc)

        self._side.run(sweep)

    def take_noack(self, channel: Consumer) -> int:
        """One delete-on-fetch batch of the channel's no-ack queues (remote control, events)
        if it is time to look at them."""
        part = channel.look
        if not part.noack_queues or not part.may_take():  # (on every fetch: the cheap test)
            return 0
        noack = [q for q in channel.active_queues() if q in part.noack_queues]
        if not noack:
            return 0
        notices = part.take_started()
        op = self._store().take_op(noack, limit=TAKE_BATCH)
        return self._submit(Kind.TAKE, op=op, channel=channel, notices=notices)

    def take_noack_first(self) -> int:
        """Remote control before tasks: every channel's no-ack queues (pidbox, events) are
        looked at (when their throttle allows) before any channel claims, so a revoke (by id
        or by stamped headers) broadcast before a task was published reaches Celery before
        that task, whichever channel the fair cycle would come to first."""
        return sum(self.take_noack(c) for c in self._channels() if c.consuming)

    def get(self, channel: Consumer, queue: str, *, no_ack: bool) -> dict[str, Any] | None:
        """One message of ``queue`` now, blocking (Kombu's ``basic_get``): deleted on fetch
        with ``no_ack``, else leased; None if none is ready. Rows that are not readable
        messages are refused and skipped."""
        store, terms, results = self._store(), self._terms, self._results()
        while True:
            if no_ack:
                taken = store.take([queue], limit=1)
                if not taken:
                    return None
                payload = self._deliveries.decode(channel, taken[0], leased=False)
            else:
                sent_at = time.monotonic()
                claimed = store.claim(
                    [queue],
                    terms.owner,
                    lease_ms=terms.lease_ms,
                    limit=1,
                    on_exhausted=lambda dead: record_exhausted(results, dead),
                )
                if not claimed:
                    return None
                payload = self._deliveries.got(channel, claimed[0], sent_at)
            if payload is not None:
                return payload

    # ---- the answers --------------------------------------------------------------------

    def took(self, channel: Consumer, taken: list[Message], notices: int) -> int:
        """A take's answer (loop thread): its messages delivered."""
        part = channel.look
        if taken:
            part.took_some()
        else:
            part.took_none(notified=self._notifications, notices=notices)
        if len(taken) == TAKE_BATCH:
            self._looks.wake()
        return self._deliveries.deliver_taken(channel, taken)

    def claimed(
        self,
        channel: Consumer,
        found: list[Message],
        short: bool,
        limit: int,
        sent_at: float,
        *,
        held_ahead: bool = False,
    ) -> int:
        """A claim's answer (loop thread): the dead get their FAILURE result, the rest are
        delivered (given back if the channel no longer takes them). ``held_ahead``: it
        stopped in front of a message the next claim judges, which goes out at once."""
        self._looks.begin_pass()
        self._note_db_time(found, sent_at)
        if self._closing() or not channel.accepts_deliveries():
            live, _ = split_exhausted(found)
            self._deliveries.give_back(live)
            return 0
        self._looks.claimed(channel.look, len(found), limit, short=short, again=held_ahead)
        live, exhausted = split_exhausted(found)
        live = self._within_credit(channel, delivery_order(live))
        if exhausted:
            results = self._results()
            self._side.run(lambda: record_exhausted(results, exhausted))
            runs = runs_left(exhausted)
            if runs:  # their runs' next messages go on
                self._promote(runs)
            # And the messages parked at their gates: a dead message holds no place.
            store, dead = self._store(), [m.id for m in exhausted]
            self._side.run(lambda: store.promote_gates_of(dead))
        queues = self._consumed_queues() if len(live) == 1 else []
        offer = self._handoffs.offer_with_result(live, queues)
        delivered = self._deliveries.hold_and_deliver(channel, live, offer, sent_at)
        if delivered:
            self._loop.kick()  # let the pool pick the new jobs up in the next iteration
            if len(found) < limit and not held_ahead:
                self._offer_while_room()  # drained: an offer lets no publish pass a waiting one
        elif self._looks.found_nothing and self._loop.registered:
            self._look_ahead()
        return delivered

    def _within_credit(self, channel: Consumer, live: list[Message]) -> list[Message]:
        """What fits the channel's credit now; the rest is given back (ready for any worker,
        attempt refunded). A handoff can arrive while a claim sized by the credit is under
        way: giving back what the claim brought beyond it (rarely anything) rather than
        the handoff keeps an idle worker's handoffs, and never costs one an attempt."""
        credit = channel.qos.credit()
        if credit is None or len(live) <= credit:
            return live
        logger.info(
            "sqlease: %d claimed message(s) beyond the consumer's credit (a handoff came "
            "meanwhile); given back",
            len(live) - credit,
        )
        self._deliveries.give_back(live[credit:])
        return live[:credit]

    def _note_db_time(self, found: list[Message], sent_at: float) -> None:
        """A claim tells the database's time: its leases end ``lease_ms`` after it."""
        for message in found:
            if message.lease_expires_at_ms is not None:
                self._db_time.note(sent_at, message.lease_expires_at_ms - self._terms.lease_ms)
                return
