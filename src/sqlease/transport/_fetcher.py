"""The fetcher: the one thing a channel calls for messages, and the one place acks leave.

It owns the drain state (when to look, whether a look is worth a claim), the runner that
does the database jobs (claims with the acks waiting, takes, offers, due-time reads, releases),
and the pipeline that follows a claim (sqlease.transport._completion). In the worker's event
loop every job goes to the runner and its outcome is handled when it comes back, on the loop
thread: the loop never waits on the database (SQLite's jobs, local transactions of tens of
microseconds, run at once). Outside a loop (a client that drains by itself, ``basic_get``)
the same jobs run inline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from queue import Empty
from typing import Any

from sqlease._core.handoff import Handoff
from sqlease._core.heartbeat import heartbeat
from sqlease._core.lease_clock import DatabaseTime, deadline_after
from sqlease._core.leases import delivery_order, runs_left, split_exhausted
from sqlease._core.results import ResultStore
from sqlease._db.driver import Op
from sqlease.options import TransportOptions
from sqlease.store import Fence, Message, Store
from sqlease.transport._acks import AckWriter, report_refused_ack
from sqlease.transport._codec import decode
from sqlease.transport._completion import (
    SideCalls,
    forward_revokes,
    record_exhausted,
    record_failure,
    settle_redelivered,
    split_redelivered,
)
from sqlease.transport._handoff import Handoffs
from sqlease.transport._looks import Consumer, LookState
from sqlease.transport._loop import EventLoop
from sqlease.transport._runners import Batcher, Done, Kind, Runner, Terms, make_runner

logger = logging.getLogger(__name__)

#: Most messages one claim statement takes (the prefetch credit usually bounds it first).
CLAIM_BATCH = 128
#: Most messages one delete-on-fetch statement takes for consumers that never ack.
TAKE_BATCH = 64
#: Seconds between a worker's sweeps of its queues for messages at a full gate.
SWEEP_INTERVAL = 1.0


class Fetcher:
    """One transport's fetching, acking and giving back.

    ``store()`` / ``results()``: the transport's stores (made on first use); ``channels()``:
    its channels; ``deliver(payload, queue)``: Kombu's delivery to the consumer; ``loop``:
    the event-loop glue; ``handoffs``: the offers' state; ``notifications``: publishes name
    their queues to idle clients (a drained queue waits for one instead of a claim);
    ``cycle()``: Kombu's fair cycle over the channels; ``connection_errors``: what makes
    Celery reconnect."""

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
    ) -> None:
        self._store = store
        self._results = results
        self._options = options
        self._terms = Terms(owner, options.lease_ms)
        self._channels = channels
        self._deliver = deliver
        self._loop = loop
        self._handoffs = handoffs
        self._notifications = notifications
        self._cycle = cycle
        self._connection_errors = connection_errors
        self.looks = LookState()
        self.acks = AckWriter(
            write=self.write_acks,
            in_loop=loop.in_loop_thread,
            held=self._held,
            timer=loop.call_later,
            wake=loop.kick,
        )
        self.side = SideCalls(in_loop=loop.in_loop_thread, wake=loop.wake_from_thread)
        self.runner: Runner | None = None
        #: The database's clock as this worker knows it, for the leases handoffs bring.
        self._db_time = DatabaseTime()
        self._batcher: Batcher | None = None
        self._closing = False
        self._delivering = False
        self._again = False
        self._swept_at = 0.0

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
        """A channel's look for messages: one delete-on-fetch batch of its no-ack queues and
        one claim batch, sized by its free prefetch credit, if it is time for them. How many
        were delivered now (in the event loop they come when the runner has them)."""
        delivered = self.take_noack(channel)
        queues = channel.acked_queues()
        if queues and self.looks.should_claim(
            channel.look, channel.qos, notifications=self._notifications
        ):
            qos = channel.qos
            credit = qos.can_consume_max_estimate() if qos.prefetch_count else None
            delivered += self.claim(channel, queues, min(credit or CLAIM_BATCH, CLAIM_BATCH))
        return delivered

    def claim(self, channel: Consumer, queues: list[str], limit: int) -> int:
        """A claim for the channel: the acks waiting go with it (those of the tasks whose
        completion freed the credit), in one statement."""
        channel.look.claim_started()
        self._sweep(queues)
        fences = self.acks.take()
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

        self.side.run(sweep)

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
                payload = self._decode(channel, taken[0], leased=False)
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
                payload = self._got(channel, claimed[0], sent_at)
            if payload is not None:
                return payload

    def _got(self, channel: Consumer, message: Message, sent_at: float) -> dict[str, Any] | None:
        heartbeat().hold(
            self._store(),
            message.fence,
            lease_ms=self._options.lease_ms,
            interval=self._options.heartbeat_seconds,
            sent_at=sent_at,
            task_id=message.task_id,
        )
        if split_redelivered([message])[0]:
            try:
                done, revoked = settle_redelivered(self._store(), self._results(), [message])
            except BaseException:
                heartbeat().drop([message.fence])  # its lease runs out: claimed again later
                raise
            if done:
                heartbeat().drop([message.fence])
                return None
            forward_revokes(revoked)
        return self._decode(channel, message, leased=True)

    # ---- outcomes -----------------------------------------------------------------------

    def deliver_outcomes(self, *, raising: bool = False) -> int:
        """Handle what the runner finished (loop thread): report acks, deliver claims and
        takes, note offers and due times. How many messages were delivered. The first error
        is raised once all are handled if it is a connection error (Celery reconnects) or
        ``raising`` (the caller made the job and waits for it), and logged otherwise."""
        self.side.collect()
        if self.runner is None:
            return 0
        if self._delivering:  # a consumer's callback acked or fetched meanwhile: the outer
            self._again = True  # loop takes what that brought
            return 0
        self._delivering = True
        delivered, error = 0, None
        try:
            while True:
                self._again = False
                for done in self.runner.collect():
                    try:
                        delivered += self._outcome(done)
                    except Exception as exc:  # the consumer's or ours: the others go on
                        error = error or exc
                if not self._again:
                    break
        finally:
            self._delivering = False
        if error is not None:
            if raising or isinstance(error, self._connection_errors):
                raise error
            logger.error("sqlease: error while fetching messages", exc_info=error)
        return delivered

    def _outcome(self, done: Done) -> int:
        context = done.context
        if done.acked is not None and context.get("fences"):
            self._report(context["fences"], done.acked)
        elif done.error is not None and context.get("fences") and done.key is not Kind.CHANGE:
            # Nothing of it was written: its acks wait for the next write, as before (at
            # close, their messages come back when their leases expire).
            self._unwritten(context["fences"])
        kind = done.key
        channel: Consumer = context.get("channel")  # type: ignore[assignment]
        if kind is Kind.CLAIM:
            channel.look.claim_finished()
            if done.error is not None:
                raise done.error
            return self._claimed(
                channel, done.value, context["short"], context["limit"], context["sent_at"]
            )
        if kind is Kind.TAKE:
            channel.look.take_finished()
            if done.error is not None:
                raise done.error
            return self._took(channel, done.value, context["notices"])
        if done.error is not None:
            raise done.error
        if kind is Kind.OFFER:
            acked, due_ms, db_now_ms = done.value
            if db_now_ms is not None:
                self._db_time.note(context["sent_at"], db_now_ms)
            self._report(context["fences"], acked)
            self._offered(context, due_ms)
        elif kind is Kind.DUE:
            self.set_due(done.value)
        elif kind is Kind.HANDED:
            self._accept_now(done.value, context["notified"])
        elif kind is Kind.CHANGE:
            self._owed(done.value)
            if not done.value:
                logger.warning(
                    "sqlease: stale %s ignored for %s", context["what"], context["fences"]
                )
        return 0

    def _owed(self, acked: Any) -> None:
        """Runs an ack or a transition could not judge (an enqueue into them committed
        meanwhile) get their heads made ready, off the loop. One answer may serve several
        jobs: it is promoted once."""
        owed = getattr(acked, "owed_runs", ())
        if owed:
            acked.owed_runs = ()
            self._promote(list(owed))
        gates = getattr(acked, "owed_gates", ())
        if gates:
            acked.owed_gates = ()
            store = self._store()
            self.side.run(lambda: store.promote_gates(gates))

    def _promote(self, runs: list[str]) -> None:
        store = self._store()
        self.side.run(lambda: store.promote_runs(runs))

    def _report(self, fences: list[Fence], acked: set[int]) -> None:
        """Acks the store refused are reported (off the loop: it reads their state); acks
        that went through free prefetch credit and may free a run's next message: look for
        work in the next iteration rather than at the next poll."""
        self._owed(acked)
        refused = [f for f in fences if f.message_id not in acked]
        if refused:
            store = self._store()

            def report() -> None:
                for fence in refused:
                    report_refused_ack(store, fence)

            self.side.run(report)
        if acked and self._loop.registered:
            self.looks.wake()
            self._loop.kick()

    def _unwritten(self, fences: list[Fence]) -> None:
        if self._closing or not self._loop.in_loop_thread():
            logger.warning(
                "sqlease: could not write %d ack(s); their messages come back when their "
                "leases expire",
                len(fences),
            )
            return
        self.acks.put_back(fences)

    def _took(self, channel: Consumer, taken: list[Message], notices: int) -> int:
        part = channel.look
        if taken:
            part.took_some()
        else:
            part.took_none(notified=self._notifications, notices=notices)
        if len(taken) == TAKE_BATCH:
            self.looks.wake()
        delivered = 0
        for message in taken:
            payload = self._decode(channel, message, leased=False)
            if payload is not None:
                self._deliver(payload, message.queue)
                delivered += 1
        return delivered

    # ---- after a claim: the pipeline ----------------------------------------------------

    def _claimed(
        self, channel: Consumer, found: list[Message], short: bool, limit: int, sent_at: float
    ) -> int:
        self.looks.begin_pass()
        self._note_db_time(found, sent_at)
        if self._closing or not channel.accepts_deliveries():
            live, _ = split_exhausted(found)
            self.give_back(live)
            return 0
        self.looks.claimed(channel.look, len(found), limit, short=short)
        live, exhausted = split_exhausted(found)
        live = delivery_order(live)
        if exhausted:
            results = self._results()
            self.side.run(lambda: record_exhausted(results, exhausted))
            runs = runs_left(exhausted)
            if runs:  # their runs' next messages go on
                self._promote(runs)
            # And the messages parked at their gates: a dead message holds no place.
            store, dead = self._store(), [m.id for m in exhausted]
            self.side.run(lambda: store.promote_gates_of(dead))
        queues = self.consumed_queues() if len(live) == 1 else []
        offer = self._handoffs.offer_with_result(live, queues)
        delivered = self.hold_and_deliver(channel, live, offer, sent_at)
        if delivered:
            self._loop.kick()  # let the pool pick the new jobs up in the next iteration
            if len(found) < limit:  # drained: an offer lets no publish pass a waiting one
                self.offer_while_room()
        elif self.looks.found_nothing and self._loop.registered:
            self.look_ahead()
        return delivered

    def _note_db_time(self, found: list[Message], sent_at: float) -> None:
        """A claim tells the database's time: its leases end ``lease_ms`` after it."""
        for message in found:
            if message.lease_expires_at_ms is not None:
                self._db_time.note(sent_at, message.lease_expires_at_ms - self._options.lease_ms)
                return

    def hold_and_deliver(
        self,
        channel: Consumer,
        messages: list[Message],
        offer: dict[str, Any] | None,
        sent_at: float,
    ) -> int:
        """The heartbeat keeps their leases from now on, their lease clocks counted from
        ``sent_at`` (when the statement that leased them was sent, at the latest); those
        delivered before are settled first (their result may be stored, a revoke may wait for
        them), off the loop. Leases whose clock ran out before they arrived (the claim took
        longer than a lease: retried through an outage) are given back, never delivered."""
        beat, store, options = heartbeat(), self._store(), self._options
        if messages and deadline_after(sent_at, options.lease_seconds) <= time.monotonic():
            logger.warning(
                "sqlease: %d message(s) arrived after their lease could have ended; given back",
                len(messages),
            )
            self.give_back(messages)
            return 0
        for message in messages:
            beat.hold(
                store,
                message.fence,
                lease_ms=options.lease_ms,
                interval=options.heartbeat_seconds,
                sent_at=sent_at,
                task_id=message.task_id,
            )
        again, fresh = split_redelivered(messages)
        delivered = [self._deliver_to(channel, fresh, offer)]
        if again:
            results = self._results()

            def settle() -> tuple[set[int], set[str]] | None:
                try:
                    return settle_redelivered(store, results, again)
                except Exception as exc:  # the database went away meanwhile
                    logger.warning(
                        "sqlease: could not tell whether %d redelivered message(s) already "
                        "finished (%s); their leases are let run out and they are claimed "
                        "again",
                        len(again),
                        exc,
                    )
                    return None

            # In the loop the answer comes later (``_settled`` delivers then); elsewhere now.
            self.side.run(
                settle,
                lambda found: delivered.append(self._settled(channel, again, found, offer)),
            )
        return sum(delivered)

    def _settled(
        self,
        channel: Consumer,
        again: list[Message],
        found: tuple[set[int], set[str]] | None,
        offer: dict[str, Any] | None,
    ) -> int:
        if found is None:
            # Not known whether they finished: delivering could run a finished task again,
            # and holding them on would keep them for ever (nothing would deliver them).
            # Their leases run out instead, and the next claim settles them again.
            heartbeat().drop([m.fence for m in again])
            return 0
        done, revoked = found
        heartbeat().drop([m.fence for m in again if m.id in done])
        forward_revokes(revoked)
        rest = [m for m in again if m.id not in done]
        if not channel.accepts_deliveries():
            self.give_back(rest)
            return 0
        delivered = self._deliver_to(channel, rest, offer)
        if delivered and self._loop.registered:
            self._loop.kick()
        return delivered

    def _deliver_to(
        self, channel: Consumer, messages: list[Message], offer: dict[str, Any] | None
    ) -> int:
        delivered = 0
        for index, message in enumerate(messages):
            try:
                payload = self._decode(channel, message, leased=True, offer=offer)
                if payload is not None:
                    self._deliver(payload, message.queue)
                    delivered += 1
            except BaseException:
                # The consumer failed mid-batch: the rest never reached it (nor QoS, so no
                # close would release it). Given back now, attempt refunded.
                self.give_back(messages[index + 1 :])
                raise
        return delivered

    def _decode(
        self,
        channel: Consumer,
        message: Message,
        *,
        leased: bool,
        offer: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        store = self._store()
        return decode(
            message,
            channel.decode_body,
            lease_ms=self._options.lease_ms,
            now_ms=store.now_ms,
            leased=leased,
            refuse=lambda m, reason, error: self._refuse(m, reason, error, leased=leased),
            offer=offer,
            clock=heartbeat().clock_ref(message.fence) if leased else None,
        )

    def _refuse(self, message: Message, reason: str, error: str, *, leased: bool) -> None:
        """A fetched message that will not reach its consumer: a leased one is kept as failed
        ``reason`` (an undecodable task also gets its FAILURE result); one deleted on fetch
        leaves its payload in the timeline."""
        store, results = self._store(), self._results()

        def write() -> None:
            if not leased:
                data = {"error": error, "payload": message.payload[:1000]}
                store.record_event(reason, data, task_id=message.task_id, message_id=message.id)
                return
            store.fail(message.fence, reason, error=error)
            if reason == "undecodable" and message.task_id is not None:
                args = [f"undecodable message: {error}"]
                record_failure(
                    results, message.task_id, "ContentDisallowed", args, "kombu.exceptions"
                )

        if leased:
            heartbeat().drop([message.fence])
        self.side.run(write)

    # ---- acks and giving back -----------------------------------------------------------

    def write_acks(self, fences: list[Fence]) -> None:
        """How a batch of acks is written: with the offer of a worker they leave idle, else
        on the runner (with the next claim if one waits); outside the loop, and closing, at
        once."""
        if not self._loop.in_loop_thread() or self._closing:
            acked = self._store().ack(fences)
            refused = [f for f in fences if f.message_id not in acked]
            for fence in refused:
                report_refused_ack(self._store(), fence)
            return
        queues = self.consumed_queues()
        handoffs = self._handoffs
        if self._notifications and handoffs.acks_leave_idle(fences, queues):
            # The acks that leave the worker idle also leave its handoff offer (one
            # statement), so a publish right after the task finished is handed over too.
            store = self._store()
            op = store.offer_op(fences, queues, self._terms.owner, **handoffs.terms())
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
            return
        self._submit(Kind.ACKS, fences=fences)

    def give_back(self, messages: list[Message]) -> None:
        """Release what was claimed and will not be delivered, attempt refunded."""
        fences = [m.fence for m in messages]
        if not fences:
            return
        heartbeat().drop(fences)
        if self._closing or not self._loop.in_loop_thread():
            try:
                self._store().release(fences, refund=True)
            except Exception:
                logger.exception("sqlease: could not release %d message(s)", len(fences))
            return
        op = self._store().release_op(fences, refund=True)
        self._submit(Kind.CHANGE, op=op, fences=fences, what="release")

    def reject(self, fence: Fence, *, requeue: bool) -> None:
        """Celery rejected a delivery: released (``requeue``) or kept as failed
        ``rejected`` (inspectable, requeueable), never silently dropped. In the loop on the
        runner; elsewhere at once. A stale one changes nothing and is logged."""
        heartbeat().drop([fence])
        store = self._store()
        if self._loop.in_loop_thread() and not self._closing:
            op = store.release_op([fence]) if requeue else store.fail_op(fence, "rejected")
            self._submit(Kind.CHANGE, op=op, fences=[fence], what="reject")
        else:
            done = bool(store.release([fence])) if requeue else store.fail(fence, "rejected")
            if not done:
                logger.warning("sqlease: stale reject ignored for %s", fence)
        if requeue:
            self.look_again()

    # ---- the idle look ------------------------------------------------------------------

    def look_ahead(self) -> None:
        """A claim found nothing: when is the next delayed message due (and, idle, the
        worker's offer for its queues, with which that time comes back)."""
        queues = self.consumed_queues()
        handoffs = self._handoffs
        if self._notifications and handoffs.can_offer():
            open_queues = handoffs.idle_queues(
                acks_pending=bool(self.acks.pending),
                open_queues=lambda: self.consumed_queues(with_credit=True),
            )
            if handoffs.worth_an_offer(open_queues):
                store = self._store()
                op = store.offer_op([], open_queues, self._terms.owner, **handoffs.terms())
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
        if self.acks.pending or not handoffs.has_room():  # acks go with the next offer
            return
        queues = self.consumed_queues(with_credit=True)
        if not queues:
            return
        store = self._store()
        op = store.offer_op([], queues, self._terms.owner, keep_live=True, **handoffs.terms())
        self._submit(
            Kind.OFFER,
            op=op,
            fences=[],
            queues=queues,
            covers=set(queues) == set(self.consumed_queues()),
            heard=dict(handoffs.heard),
            sent_at=time.monotonic(),
        )

    def _offered(self, context: dict[str, Any], due_ms: int | None) -> None:
        self._handoffs.stood(context["queues"], context["heard"])
        if context["covers"]:
            self.set_due(due_ms)
        elif self.consumed_queues():
            self._submit(Kind.DUE, op=self._store().next_due_op(self.consumed_queues()))

    def set_due(self, due_ms: int | None) -> None:
        """Wake up when the next delayed message is due, if before the next safety poll."""
        delay = None if due_ms is None else due_ms / 1000.0
        if delay is not None and delay >= self._options.polling_interval:
            delay = None
        self._loop.set_due_timer(delay)

    # ---- handoffs -----------------------------------------------------------------------

    def accept(self, handoffs: list[Handoff], notified: set[str] | None = None) -> None:
        """Deliver messages a publish leased to this worker (its idle offer), as a claim's
        would be. ``notified``: queues named by plain notifications read with these handoffs
        (their messages wait for a claim). A take under way goes first (remote control
        before tasks): then they wait for it on the runner."""
        if any(c.look.taking for c in self._channels()):
            self._submit(Kind.HANDED, op=Op.answer(handoffs), notified=notified)
            return
        self._accept_now(handoffs, notified)

    def _accept_now(self, handoffs: list[Handoff], notified: set[str] | None) -> None:
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

        self.side.run(read, then)

    def _handed(self, handoff: Handoff, row: Message | None, notified: set[str] | None) -> None:
        owner = self._terms.owner
        if row is None or row.lease_owner != owner or row.attempt != handoff.attempt:
            return
        if row.state != "ready":
            return
        channel = self._handoffs.channel_for(row.queue)
        if channel is None:  # no channel consumes it any more
            self.give_back([row])
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
            row.lease_expires_at_ms, self._options.lease_ms, time.monotonic()
        )
        if sent_at is None:  # no statement told the database's time yet: not deliverable
            logger.info(
                "sqlease: message %s handed over before any statement told the database's "
                "time; given back to be claimed",
                row.id,
            )
            self.give_back([row])
            return
        offer = self._handoffs.offer_with_result([row], self.consumed_queues())
        if self.hold_and_deliver(channel, [row], offer, sent_at):
            self._loop.kick()  # let the pool pick the new job up in the next iteration

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
