"""What the event loop's events mean for a transport: a notification, the hub's tick, a kick
of the self-pipe, the safety poll and the due timer (sqlease.transport._loop calls these).

A notification names a queue (look at it now), or hands a message over (deliver it); the
safety poll looks everywhere (PostgreSQL: every ``polling_interval``; SQLite: a cheap check
of the file's ``data_version`` every few milliseconds, backing off while idle, and a full look
every ``polling_interval``); the due timer fires when the next delayed message is due.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from sqlease._core.handoff import split as split_notifications
from sqlease._db.wakeup import Waker
from sqlease.transport._fetcher import Fetcher
from sqlease.transport._handoff import Handoffs
from sqlease.transport._loop import EventLoop, LoopCallbacks
from sqlease.transport._outage import Outage

logger = logging.getLogger(__name__)

#: SQLite: the longest an idle worker waits between looks at the file's ``data_version`` (a
#: read of a counter in shared memory, about 20 microseconds): new work starts within this.
SQLITE_IDLE_CHECK = 0.005


class _ErrorsLogged:
    """``Wakeups.errors_logged``'s context (a class, not a generator: the loop enters one
    several times per task)."""

    __slots__ = ("_doing", "_outage", "_passed")

    def __init__(self, doing: str, passed: tuple[type[BaseException], ...], outage: Outage) -> None:
        self._doing = doing
        self._passed = passed
        self._outage = outage

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if error is None or not isinstance(error, Exception):
            return False
        if isinstance(error, self._passed):
            return self._outage.holds_back(error)
        logger.error("sqlease: error while %s", self._doing, exc_info=error)
        return True


class Wakeups:
    """One transport's answers to its event loop's events.

    ``waker()``: the transport's waker (made on first use); ``keep_alive()``: touch the
    auto-delete queues consumed (their idle expiry)."""

    def __init__(
        self,
        *,
        fetcher: Fetcher,
        handoffs: Handoffs,
        loop: EventLoop,
        waker: Callable[[], Waker],
        owner: str,
        polling_interval: float,
        keep_alive: Callable[[], None],
        connection_errors: tuple[type[BaseException], ...],
    ) -> None:
        self._fetcher = fetcher
        self._handoffs = handoffs
        self._loop = loop
        self._waker = waker
        self._owner = owner
        self._interval = polling_interval
        self._keep_alive = keep_alive
        self._connection_errors = connection_errors
        self._idle_delay = 0.0
        self._last_full_poll = 0.0

    def register(self, hub: Any) -> None:
        """Join the event loop ``hub`` (leaving a loop joined before)."""
        self._fetcher.attach()
        self._loop.register(
            hub,
            LoopCallbacks(
                on_readable=self.on_readable,
                on_tick=self.on_tick,
                on_kick=self.on_kick,
                on_poll=self.on_poll,
                on_due=self.on_due,
            ),
        )
        self.listen()

    def listen(self) -> None:
        """Watch the waker's socket, if it has one (again after it broke)."""
        if not self._loop.registered or self._loop.reading:
            return
        waker = self._waker()
        fd = waker.fileno()
        if fd is None:
            return
        self._loop.add_reader(fd)
        if waker.pushes and self._handoffs.listening_again(waker.generation):
            fetcher = self._fetcher
            store = fetcher._store()
            owner = self._owner
            fetcher.side.run(lambda: store.withdraw_offers(owner, handed_too=True))

    def errors_logged(self, doing: str) -> _ErrorsLogged:
        """In the event loop: a connection error goes up (Celery reconnects) unless the outage
        holds it back; any other error is logged and the loop goes on."""
        return _ErrorsLogged(doing, self._connection_errors, self._fetcher.outage)

    # ---- the events ---------------------------------------------------------------------

    def on_readable(self) -> None:
        fetcher = self._fetcher
        waker = self._waker()
        payloads = waker.pending()  # None from a waker that carries no payloads
        if not waker.connected:
            # The LISTEN connection broke (server restart): re-listen on the next poll.
            self._loop.remove_reader()
        queues: set[str] | None = None
        if payloads is not None:
            handoffs, queues = split_notifications(payloads, self._owner)
            if handoffs:
                if queues:
                    # No-ack queues named in the same batch first: a revoke or other remote
                    # control command broadcast before a task was published must reach
                    # Celery before the task does (the payloads' order is lost). Named task
                    # queues are claimed from in the next iteration.
                    fetcher.notified(queues)
                    with self.errors_logged("fetching messages"):
                        fetcher.take_noack_first()
                    fetcher.looks.wake()
                with self.errors_logged("taking handed-off messages"):
                    fetcher.accept(handoffs, queues)
                return
            if payloads and not queues:
                return  # only handoffs to other workers: nothing to look at
        # Only the no-ack queues a notification names are looked at: a published task
        # goes straight to its claim, without a look at the remote-control queue first.
        fetcher.notified(queues)
        fetcher.looks.wake()
        self.drain()

    def on_kick(self) -> None:
        fetcher = self._fetcher
        with self.errors_logged("fetching messages"):
            fetcher.deliver_outcomes()
        if fetcher.acks.full:
            fetcher.acks.flush()

    def on_tick(self) -> None:
        # (Outcomes need no look here: the loop's runner hands them over as they come, a
        # thread's wake the self-pipe.)
        fetcher = self._fetcher
        if fetcher.acks.full:
            fetcher.acks.flush()
        if fetcher.looks.more:
            self.drain()

    def drain(self) -> None:
        """Deliver what is ready (one bounded pass)."""
        fetcher = self._fetcher
        with self.errors_logged("fetching messages"):
            self._keep_alive()
            fetcher.looks.begin_pass()
            if fetcher.drain_ready():
                self._loop.kick()  # let the pool pick the new jobs up in the next iteration
            elif fetcher.looks.found_nothing:  # a claim ran at once and found nothing due
                fetcher.look_ahead()

    def on_due(self) -> None:
        fetcher = self._fetcher
        fetcher.look_again()
        fetcher.looks.wake()
        self.drain()

    def on_poll(self) -> float:
        """The safety poll; the delay until the next one."""
        next_delay = self._look()
        if self._fetcher.looks.more:
            self.drain()
        return next_delay

    def _look(self) -> float:
        fetcher = self._fetcher
        waker = self._waker()
        if not waker.watches:  # notifications (or nothing) tell it: a look every interval
            self.listen()
            fetcher.looks.wake()
            fetcher.notified(None)
            return self._interval
        now = time.monotonic()
        changed = waker.ready()
        if changed:
            fetcher.notified(None)
        if changed or now - self._last_full_poll >= self._interval:
            fetcher.looks.wake()
            self._last_full_poll = now
        if changed:
            self._idle_delay = 0.002
        else:
            self._idle_delay = min(
                max(self._idle_delay * 2, 0.002), SQLITE_IDLE_CHECK, self._interval
            )
        return self._idle_delay
