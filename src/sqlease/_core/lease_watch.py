"""Telling a running task, as soon as it is known, that its lease is lost.

A task that waits on something else (an HTTP call, a model's stream, a subprocess) learns of a
lost lease only when it next asks. One thread per process watches the lease clocks of the
deliveries whose tasks asked to be told (``TaskContext.on_lease_lost``, the
``interrupt_on_lease_lost`` option): it sleeps until the earliest deadline, or a fraction of
a lease to notice a loss the worker's heartbeat published (a refused renewal), and calls each
callback once, from its own thread, when that delivery's clock reads lost.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable

from sqlease._core.lease_clock import DeliveryClock

logger = logging.getLogger(__name__)

#: How often, at most and at least, a watched clock is read besides at its deadline (a tenth
#: of its lease, within these bounds).
MIN_POLL_S = 0.02
MAX_POLL_S = 1.0


class LeaseWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[DeliveryClock, Callable[[], None]]] = {}
        self._ids = itertools.count(1)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, clock: DeliveryClock, callback: Callable[[], None]) -> int:
        """Call ``callback()`` once, from the watch's thread, when ``clock`` reads lost (at
        once if it does already); a handle for ``unwatch``."""
        with self._lock:
            handle = next(self._ids)
            self._watched[handle] = (clock, callback)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="sqlease-lease-watch", daemon=True
                )
                self._thread.start()
        self._wake.set()
        return handle

    def unwatch(self, handle: int) -> None:
        """No call for ``handle`` from now on (a callback already under way finishes)."""
        with self._lock:
            self._watched.pop(handle, None)

    def watching(self) -> int:
        with self._lock:
            return len(self._watched)

    def check(self) -> float:
        """Call the callbacks of the clocks that read lost; how long to sleep until the next
        look (the thread's one pass, callable directly in tests)."""
        with self._lock:
            items = list(self._watched.items())
        sleep = MAX_POLL_S
        fired: list[Callable[[], None]] = []
        for handle, (clock, callback) in items:
            if clock.lost():
                with self._lock:
                    if self._watched.pop(handle, None) is None:
                        continue  # unwatched meanwhile
                fired.append(callback)
                continue
            poll = min(MAX_POLL_S, max(MIN_POLL_S, clock.lease_s / 10.0))
            remaining = clock.remaining()
            sleep = min(sleep, poll if remaining is None else min(poll, remaining))
        for callback in fired:
            try:
                callback()
            except Exception:
                logger.exception("sqlease: a lease-lost callback failed")
        return max(0.001, sleep)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
            self._wake.wait(self.check())
            self._wake.clear()


_watch = LeaseWatch()


def lease_watch() -> LeaseWatch:
    """The process's watch."""
    return _watch


def _reset_after_fork() -> None:
    # A forked child watches nothing of its parent's, and has no thread.
    global _watch
    _watch = LeaseWatch()


os.register_at_fork(after_in_child=_reset_after_fork)
