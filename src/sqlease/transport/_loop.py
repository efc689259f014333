"""The transport in the worker's event loop (Kombu's ``Hub``): the wake-up reader (LISTEN or
the SQLite watcher), the self-pipe, the tick, the safety poll and the due timer.

Kombu's redis transport keeps the same role in its ``MultiChannelPoller``. Loop thread only,
except ``wake_from_thread``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlease._core.handoff import split as split_notifications
from sqlease.store import Message

if TYPE_CHECKING:
    from sqlease.transport._channel import Channel
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)

#: SQLite: the longest an idle worker waits between looks at the file's ``data_version`` (a
#: read of a counter in shared memory, about 20 microseconds): new work starts within this.
SQLITE_IDLE_CHECK = 0.005


class EventLoop:
    """One transport's registration with an event loop."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: The hub, while registered; the thread it runs on.
        self.hub: Any = None
        self.thread = 0
        self._pipe: tuple[int, int] | None = None
        self._kicked = False
        self._reader_fd: int | None = None
        self._poll_entry: Any = None
        self._due_entry: Any = None
        self._idle_delay = 0.0
        self._last_full_poll = 0.0

    @property
    def pipe_open(self) -> bool:
        return self._pipe is not None

    @property
    def poll_timer(self) -> Any:
        """The safety poll's timer entry (a new one for each poll)."""
        return self._poll_entry

    def in_loop_thread(self) -> bool:
        return self.hub is not None and threading.get_ident() == self.thread

    def register(self, hub: Any) -> None:
        self.unregister()
        self.hub = hub
        self.thread = threading.get_ident()
        hub.on_tick.add(self.on_tick)
        self.add_reader()
        self._open_self_pipe()
        self._schedule_poll(0)

    def unregister(self) -> None:
        hub = self.hub
        if hub is None:
            return
        hub.on_tick.discard(self.on_tick)
        self.remove_reader()
        self._close_self_pipe()
        for entry in (self._poll_entry, self._due_entry):
            if entry is not None:
                entry.cancel()
        self._poll_entry = self._due_entry = None
        self.hub = None
        transport = self._transport
        transport.refill.finish()
        transport.refill.stop(loop_runner_only=True)
        transport.acks.flush(in_background=False)

    # ---- the self-pipe -----------------------------------------------------------------
    # A byte written to it makes the hub run another iteration at once. Used when acks are
    # waiting to be written and when a tick delivered tasks (the pool registers its writers
    # for new jobs at the start of an iteration, so without a wake-up a job delivered late in
    # an iteration would wait for the next timer).

    def _open_self_pipe(self) -> None:
        if self.hub is None or self._pipe is not None:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self.hub.add_reader(read_fd, self.on_self_pipe)

    def _close_self_pipe(self) -> None:
        if self._pipe is None:
            return
        read_fd, write_fd = self._pipe
        self._pipe = None
        if self.hub is not None:
            try:
                self.hub.remove_reader(read_fd)
            except Exception:
                pass
        for fd in (read_fd, write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def kick(self) -> None:
        if self._pipe is not None and not self._kicked:
            self._kicked = True
            try:
                os.write(self._pipe[1], b"k")
            except (BlockingIOError, OSError):
                pass

    def wake_from_thread(self) -> None:
        # Called on the runner's thread: always write (``_kicked`` is the loop thread's own,
        # and a wake-up lost to a race would leave the claim undelivered).
        pipe = self._pipe
        if pipe is not None:
            try:
                os.write(pipe[1], b"c")
            except OSError:
                pass

    def on_self_pipe(self) -> None:
        if self._pipe is not None:
            try:
                while os.read(self._pipe[0], 512):
                    pass
            except (BlockingIOError, OSError):
                pass
        self._kicked = False
        transport = self._transport
        if transport.refill.runner is not None:
            transport.refill.deliver()
        if transport.acks.full:
            transport.acks.flush()

    # ---- the wake-up reader ------------------------------------------------------------

    def add_reader(self) -> None:
        if self.hub is None or self._reader_fd is not None:
            return
        waker = self._transport.waker
        fd = waker.fileno()
        if fd is not None:
            self._reader_fd = fd
            self.hub.add_reader(fd, self.on_readable)
            if waker.pushes:
                self._transport.handoffs.after_listening(waker.generation)

    def remove_reader(self) -> None:
        if self.hub is not None and self._reader_fd is not None:
            try:
                self.hub.remove_reader(self._reader_fd)
            except Exception:
                pass
        self._reader_fd = None

    def on_readable(self) -> None:
        transport = self._transport
        waker = transport.waker
        payloads = waker.pending()  # None from a waker that carries no payloads
        if not waker.connected:
            # The LISTEN connection broke (server restart): re-listen on the next poll.
            self.remove_reader()
        queues: set[str] | None = None
        if payloads is not None:
            handoffs, queues = split_notifications(payloads, transport.owner)
            if handoffs:
                if queues:
                    # No-ack queues named in the same batch first: a revoke or other
                    # remote control command broadcast before a task was published must
                    # reach Celery before the task does (the payloads' order is lost).
                    # Named task queues are claimed from in the next iteration.
                    transport.notified(queues)
                    with self.errors_logged("fetching messages"):
                        transport.take_noack_first()
                    transport.drain.wake()
                with self.errors_logged("taking handed-off messages"):
                    if transport.handoffs.accept(handoffs, queues):
                        self.kick()  # let the pool pick the new job up in the next iteration
                return
            if payloads and not queues:
                return  # only handoffs to other workers: nothing to look at
        # Only the no-ack queues a notification names are looked at: a published task
        # goes straight to its claim, without a look at the remote-control queue first.
        transport.notified(queues)
        transport.drain.wake()
        self.drain()

    # ---- looking for work --------------------------------------------------------------

    def on_tick(self) -> None:
        transport = self._transport
        if transport.refill.runner is not None:
            transport.refill.deliver()
        if transport.acks.full:
            transport.acks.flush()
        if transport.drain.more:
            self.drain()

    @contextmanager
    def errors_logged(self, doing: str) -> Iterator[None]:
        """In the event loop: a connection error goes up (Celery reconnects); any other error
        is logged and the loop goes on."""
        try:
            yield
        except self._transport.connection_errors:
            raise
        except Exception:
            logger.exception("sqlease: error while %s", doing)

    def drain(self) -> None:
        """Deliver what is ready (one bounded pass); read the next due time if a claim found
        nothing."""
        transport = self._transport
        with self.errors_logged("fetching messages"):
            transport.drain.begin_pass()
            got = transport.drain_ready()
            if got:
                self.kick()  # let the pool pick the new jobs up in the next iteration
            elif transport.drain.found_nothing:  # a claim ran and found nothing due
                self.schedule_due()

    def deliver_claim(
        self, channel: Channel, claimed: list[Message], short: bool, limit: int
    ) -> None:
        """Deliver what a claim on the runner brought, as ``drain`` would have."""
        transport = self._transport
        transport.drain.begin_pass()
        if channel.after_claim(claimed, short, limit, transport._deliver):
            self.kick()  # let the pool pick the new jobs up in the next iteration
        elif transport.drain.found_nothing:
            self.schedule_due()

    # ---- timers ------------------------------------------------------------------------

    def schedule_due(self) -> None:
        if self.hub is None:
            return
        self.set_due_timer(self._transport.next_due_delay(offer=True))

    def set_due_timer(self, delay: float | None) -> None:
        if self.hub is None:
            return
        if self._due_entry is not None:
            self._due_entry.cancel()
            self._due_entry = None
        if delay is not None and delay < self._transport.polling_interval:
            self._due_entry = self.hub.call_later(delay + 0.001, self._on_due)

    def _on_due(self) -> None:
        self._due_entry = None
        transport = self._transport
        transport.look_again()
        transport.drain.wake()
        self.drain()

    def _schedule_poll(self, delay: float) -> None:
        if self.hub is not None:
            self._poll_entry = self.hub.call_later(delay, self._on_poll)

    def _on_poll(self) -> None:
        """The safety poll. PostgreSQL: every polling_interval (notifications do the rest).
        SQLite: a cheap data_version check every few milliseconds when busy, backing off to
        5 ms when idle, and a full look every polling_interval."""
        self._poll_entry = None
        next_delay = 1.0
        try:
            next_delay = self._look()
            if self._transport.drain.more:
                self.drain()
        finally:
            if self.hub is not None:
                self._schedule_poll(next_delay)

    def _look(self) -> float:
        """What the safety poll notes before it drains; the delay until the next poll."""
        transport = self._transport
        interval = transport.polling_interval
        if transport.caps.notifications:
            if self._reader_fd is None:
                self.add_reader()
            transport.drain.wake()
            transport.notified(None)
            next_delay = interval
        else:
            now = time.monotonic()
            changed = transport.waker.ready()
            if changed:
                transport.notified(None)
            if changed or now - self._last_full_poll >= interval:
                transport.drain.wake()
                self._last_full_poll = now
            if changed:
                self._idle_delay = 0.002
            else:
                self._idle_delay = min(
                    max(self._idle_delay * 2, 0.002), SQLITE_IDLE_CHECK, interval
                )
            next_delay = self._idle_delay
        return next_delay
