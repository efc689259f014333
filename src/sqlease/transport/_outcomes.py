"""The runner's outcomes, handled on the loop thread (sqlease.transport._fetcher): each goes
to the part that made its job.

A claim's and a take's messages are delivered (sqlease.transport._claims), an offer's and a
due-time read's answer sets the due timer (sqlease.transport._idle), handoffs waiting for a
take are accepted (sqlease.transport._handed), and the acks that went with any job are
reported or, not written, put back (sqlease.transport._acking).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlease._core.lease_clock import DatabaseTime
from sqlease.transport._acking import Acking
from sqlease.transport._claims import Claims
from sqlease.transport._completion import SideCalls
from sqlease.transport._handed import Handed
from sqlease.transport._idle import IdleLook
from sqlease.transport._looks import Consumer
from sqlease.transport._outage import Outage
from sqlease.transport._runners import Done, Kind, Runner

logger = logging.getLogger(__name__)


class Outcomes:
    """What the runner finished, handled.

    ``runner()``: the fetcher's runner, if it made one; ``side``: the database work off the
    loop (its answers are handled first); ``db_time``: the database's clock as this worker
    knows it; ``connection_errors``: what makes Celery reconnect, unless ``outage`` holds it
    back (sqlease.transport._outage); the rest: the parts the
    outcomes go to."""

    def __init__(
        self,
        *,
        runner: Callable[[], Runner | None],
        side: SideCalls,
        db_time: DatabaseTime,
        connection_errors: tuple[type[BaseException], ...],
        outage: Outage,
        claims: Claims,
        idle: IdleLook,
        handed: Handed,
        acking: Acking,
    ) -> None:
        self._runner = runner
        self._side = side
        self._db_time = db_time
        self._connection_errors = connection_errors
        self._outage = outage
        self._claims = claims
        self._idle = idle
        self._handed = handed
        self._acking = acking
        self._delivering = False
        self._again = False

    def deliver(self, *, raising: bool = False) -> int:
        """Handle what the runner finished (loop thread): report acks, deliver claims and
        takes, note offers and due times. How many messages were delivered. The first error
        is raised once all are handled if ``raising`` (the caller made the job and waits for
        it) or if it is a connection error that the outage does not hold back (Celery
        reconnects), and logged otherwise."""
        self._side.collect()
        if self._runner() is None:
            return 0
        if self._delivering:  # a consumer's callback acked or fetched meanwhile: the outer
            self._again = True  # loop takes what that brought
            return 0
        self._delivering = True
        delivered, error = 0, None
        try:
            while True:
                self._again = False
                runner = self._runner()  # the fetcher's, read on each pass as it stands
                for done in runner.collect():  # type: ignore[union-attr]
                    try:
                        delivered += self._outcome(done)
                    except Exception as exc:  # the consumer's or ours: the others go on
                        error = error or exc
                if not self._again:
                    break
        finally:
            self._delivering = False
        if error is not None:
            if raising:
                raise error
            if isinstance(error, self._connection_errors):
                if self._outage.holds_back(error):
                    return delivered
                raise error
            logger.error("sqlease: error while fetching messages", exc_info=error)
        return delivered

    def _outcome(self, done: Done) -> int:
        context = done.context
        acking = self._acking
        if done.acked is not None and context.get("fences"):
            acking.report(context["fences"], done.acked)
        elif done.error is not None and context.get("fences") and done.key is not Kind.CHANGE:
            # Nothing of it was written: its acks wait for the next write, as before (at
            # close, their messages come back when their leases expire).
            acking.unwritten(context["fences"])
        kind = done.key
        channel: Consumer = context.get("channel")  # type: ignore[assignment]
        if kind is Kind.CLAIM:
            channel.look.claim_finished()
            if done.error is not None:
                raise done.error
            return self._claims.claimed(
                channel,
                done.value,
                context["short"],
                context["limit"],
                context["sent_at"],
                held_ahead=context.get("held_ahead", False),
            )
        if kind is Kind.TAKE:
            channel.look.take_finished()
            if done.error is not None:
                raise done.error
            return self._claims.took(channel, done.value, context["notices"])
        if done.error is not None:
            raise done.error
        if kind is Kind.OFFER:
            acked, due_ms, db_now_ms = done.value
            if db_now_ms is not None:
                self._db_time.note(context["sent_at"], db_now_ms)
            acking.report(context["fences"], acked)
            self._idle.offered(context, due_ms)
        elif kind is Kind.DUE:
            self._idle.set_due(done.value)
        elif kind is Kind.HANDED:
            self._handed.accept_now(done.value, context["notified"])
        elif kind is Kind.CHANGE:
            acking.owed(done.value)
            if not done.value:
                logger.warning(
                    "sqlease: stale %s ignored for %s", context["what"], context["fences"]
                )
        return 0
