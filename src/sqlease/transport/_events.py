"""Celery's events published off the worker's event loop: a worker's heartbeat every 2 s and,
with ``-E``, task events are best-effort fanout. Published from the loop, each would wait on
the database with the loop (for as long as a partition lasts); one thread per process
publishes them, in order, and the loop goes on. A closing channel waits for the ones it left
there, which would otherwise be published after the close and lost (a warm shutdown's last
``task-succeeded`` events and its ``worker-offline``, which monitors such as Flower wait for).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

logger = logging.getLogger(__name__)

#: Celery's events exchange (its ``event_exchange`` setting's default).
EVENT_EXCHANGE = "celeryev"

#: How long a closing channel waits for the events it left to the events thread.
FLUSH_SECONDS = 5.0

_thread: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _later(publish: Callable[[], Any]) -> Future[Any]:
    """Run ``publish`` on the events thread (calls in order); a failure is logged in one line
    (an event is best-effort)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = ThreadPoolExecutor(1, thread_name_prefix="sqlease-events")
        future = _thread.submit(publish)

    def failed(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            logger.warning("sqlease: an event was not published: %s", str(error).splitlines()[0])

    future.add_done_callback(failed)
    return future


class LaterEvents:
    """One channel's events left to the events thread."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: Future[Any] | None = None

    def publish(self, publish: Callable[[], Any]) -> None:
        self._last = _later(publish)

    def flush(self) -> None:
        """Wait (up to ``FLUSH_SECONDS``) until this channel's events are published: the
        thread runs them in order, so its last one is enough to wait for."""
        last, self._last = self._last, None
        if last is None:
            return
        try:
            last.result(timeout=FLUSH_SECONDS)
        except FutureTimeout:
            logger.warning(
                "sqlease: events of a closing channel not published within %.0f s; dropped",
                FLUSH_SECONDS,
            )
        except Exception:
            pass  # logged by _later
