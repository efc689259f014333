"""The transport in the worker's event loop (Kombu's ``Hub``): the mechanics only.

A wake-up reader (the waker's socket), a self-pipe that makes the hub run another iteration
at once (``kick``; ``wake_from_thread`` from another thread), the hub's tick, and two timers
(the safety poll and the next due time). What each of them means is the caller's: every one
is a callback given at ``register``. Kombu's redis transport keeps the same role in its
``MultiChannelPoller``. Loop thread only, except ``wake_from_thread``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


#: The threads running a worker's event loop that a sqlease transport is registered with (a
#: worker's other connections, such as the one its events are published on, are not
#: registered themselves but publish from that thread).
_LOOP_THREADS: set[int] = set()


def on_a_loop_thread() -> bool:
    """Is the calling thread running a worker's event loop (any transport's)?"""
    return threading.get_ident() in _LOOP_THREADS


@dataclass(frozen=True, slots=True)
class LoopCallbacks:
    """What the hub's events do (sqlease.transport._wakeups)."""

    #: the wake-up socket is readable
    on_readable: Callable[[], None]
    #: every iteration of the hub
    on_tick: Callable[[], None]
    #: the self-pipe was written (a kick, or a runner's outcome)
    on_kick: Callable[[], None]
    #: the safety poll; returns the delay until the next one
    on_poll: Callable[[], float]
    #: the due timer fired
    on_due: Callable[[], None]


class EventLoop:
    """One transport's registration with an event loop."""

    def __init__(self) -> None:
        #: The hub, while registered; the thread it runs on.
        self.hub: Any = None
        self.thread = 0
        self._callbacks: LoopCallbacks | None = None
        self._pipe: tuple[int, int] | None = None
        self._kicked = False
        self._reader_fd: int | None = None
        self._poll_entry: Any = None
        self._due_entry: Any = None

    @property
    def registered(self) -> bool:
        return self.hub is not None

    @property
    def pipe_open(self) -> bool:
        return self._pipe is not None

    @property
    def poll_timer(self) -> Any:
        """The safety poll's timer entry (a new one for each poll)."""
        return self._poll_entry

    def in_loop_thread(self) -> bool:
        return self.hub is not None and threading.get_ident() == self.thread

    def register(self, hub: Any, callbacks: LoopCallbacks) -> None:
        self.unregister()
        self.hub = hub
        self.thread = threading.get_ident()
        _LOOP_THREADS.add(self.thread)
        self._callbacks = callbacks
        hub.on_tick.add(callbacks.on_tick)
        self._open_self_pipe()
        self._schedule_poll(0)

    def unregister(self) -> None:
        """Leave the hub: readers, the self-pipe and the timers go (nothing is written)."""
        hub = self.hub
        if hub is None:
            return
        if self._callbacks is not None:
            hub.on_tick.discard(self._callbacks.on_tick)
        self.remove_reader()
        self._close_self_pipe()
        for entry in (self._poll_entry, self._due_entry):
            if entry is not None:
                entry.cancel()
        self._poll_entry = self._due_entry = None
        self.hub = None
        self._callbacks = None
        _LOOP_THREADS.discard(self.thread)

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
        self.hub.add_reader(read_fd, self._on_self_pipe)

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
        # Called on a runner's thread: always write (``_kicked`` is the loop thread's own,
        # and a wake-up lost to a race would leave the claim undelivered).
        pipe = self._pipe
        if pipe is not None:
            try:
                os.write(pipe[1], b"c")
            except OSError:
                pass

    def _on_self_pipe(self) -> None:
        if self._pipe is not None:
            try:
                while os.read(self._pipe[0], 512):
                    pass
            except (BlockingIOError, OSError):
                pass
        self._kicked = False
        if self._callbacks is not None:
            self._callbacks.on_kick()

    # ---- the wake-up reader ------------------------------------------------------------

    @property
    def reading(self) -> bool:
        return self._reader_fd is not None

    def add_reader(self, fd: int) -> None:
        if self.hub is None or self._reader_fd is not None or self._callbacks is None:
            return
        self._reader_fd = fd
        self.hub.add_reader(fd, self._callbacks.on_readable)

    def remove_reader(self) -> None:
        if self.hub is not None and self._reader_fd is not None:
            try:
                self.hub.remove_reader(self._reader_fd)
            except Exception:
                pass
        self._reader_fd = None

    # ---- timers ------------------------------------------------------------------------

    def set_due_timer(self, delay: float | None) -> None:
        """The due timer fires after ``delay`` seconds (None: it is cancelled)."""
        if self.hub is None:
            return
        if self._due_entry is not None:
            self._due_entry.cancel()
            self._due_entry = None
        if delay is not None:
            self._due_entry = self.hub.call_later(delay + 0.001, self._on_due)

    def _on_due(self) -> None:
        self._due_entry = None
        if self._callbacks is not None:
            self._callbacks.on_due()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        return self.hub.call_later(delay, callback)

    def _schedule_poll(self, delay: float) -> None:
        if self.hub is not None:
            self._poll_entry = self.hub.call_later(delay, self._on_poll)

    def _on_poll(self) -> None:
        self._poll_entry = None
        next_delay = 1.0
        try:
            if self._callbacks is not None:
                next_delay = self._callbacks.on_poll()
        finally:
            if self.hub is not None:
                self._schedule_poll(next_delay)
