"""Green threads: Celery's gevent and eventlet pools run each task in a greenlet of the
worker's one OS thread, with ``threading`` monkey-patched to match. What runs a task there
cannot be reached as an OS thread (no signal, no asynchronous exception, no
``sys._current_frames`` entry): an exception is thrown into its greenlet from the hub, where
the task's greenlet is suspended, so it lands at the call the task waits in (``time.sleep``,
a socket read), as the pool's own time limits land."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any


@dataclass(frozen=True)
class GreenThread:
    """The greenlet a task runs in, and how to run a function in its hub soon."""

    greenlet: Any
    #: Run a function in the hub soon (from any green thread of this OS thread).
    call_soon: Callable[[Callable[[], None]], None]
    #: (In the hub.) Run a function in the hub after a delay, in seconds, without blocking:
    #: the hub cannot wait (a ``threading.Timer`` started there raises).
    call_later: Callable[[float, Callable[[], None]], None]

    def dead(self) -> bool:
        """The greenlet has ended."""
        return bool(getattr(self.greenlet, "dead", True))

    def frame(self) -> FrameType | None:
        """Where the greenlet waits (None while it runs, or once it is done)."""
        frame = getattr(self.greenlet, "gr_frame", None)
        return frame if isinstance(frame, FrameType) else None

    def throw(self, error: BaseException) -> None:
        """(In the hub.) Raise ``error`` in the greenlet, where it waits."""
        if not self.dead():
            self.greenlet.throw(error)


def green_thread_here() -> GreenThread | None:
    """The green thread this code runs in, under a gevent or eventlet monkey-patched
    ``threading`` (their pools patch it at the worker's start); None in an OS thread."""
    greenlet_module = sys.modules.get("greenlet")
    if greenlet_module is None:
        return None
    current = greenlet_module.getcurrent()
    if getattr(current, "parent", None) is None:
        return None  # a thread's own greenlet: an OS thread
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        gevent = importlib.import_module("gevent")
        loop = gevent.get_hub().loop

        def later(delay: float, fn: Callable[[], None]) -> None:
            # A greenlet started by the loop's timer (no switch now), which hands the call
            # back to the hub.
            gevent.spawn_later(delay, loop.run_callback, fn)

        # (Thread-safe: the lease watch is a greenlet too once threading is patched, but a
        # thread started before the patch would call it from another OS thread.)
        return GreenThread(current, lambda fn: loop.run_callback_threadsafe(fn), later)
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        hub = importlib.import_module("eventlet.hubs").get_hub()
        return GreenThread(
            current,
            lambda fn: hub.schedule_call_global(0, fn),
            lambda delay, fn: hub.schedule_call_global(delay, fn),
        )
    return None
