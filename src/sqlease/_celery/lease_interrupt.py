"""Interrupting a task whose lease is lost: the ``interrupt_on_lease_lost`` opt-in (transport
option, or the task's own ``@app.task(interrupt_on_lease_lost=True)``).

A task that never checkpoints never asks whether it still holds its lease. With the opt-in,
the task's delivery is watched from the moment Celery starts it (``task_prerun``) until its
body returns (its final result is being written, sqlease.backend) or Celery is done with it
(``task_postrun``), and once its lease is known lost (its clock ran out, or the worker's
renewal was refused) a ``LeaseLost`` is raised in the task's thread, as Celery's soft time
limit raises ``SoftTimeLimitExceeded``:

- in the main thread (prefork pool processes, the solo pool) by a signal (``SIGUSR2``), whose
  handler raises it: a blocking system call (``time.sleep``, a socket read) is cut short. The
  handler is installed only where the process has none for that signal;
- in any other thread (the threads pool), or where the signal is taken, with
  ``PyThreadState_SetAsyncExc``: raised at the thread's next Python instruction, so a call
  blocked in C code finishes first;
- in a green thread (the gevent and eventlet pools), thrown into the task's greenlet from the
  hub (sqlease._celery.green_threads): a green blocking call (``time.sleep``, a socket read) is
  cut short. ``threading.get_ident`` names the greenlet there, so each task has its own entry.

It lands in the task's body: one that arrives while Celery's own code runs (the lease was already
lost when the task started, or the body has just returned) is held back and sent again a few
milliseconds later, until the body raised it or the task is done (``disarm``); Celery would
otherwise log it as a failing ``task_prerun`` receiver and run the body all the same. Within
the body it lands wherever the task happens to be, like any asynchronous exception: inside a
library's code, a ``finally`` block, a lock's acquisition. What that costs is the task's to
judge (see docs/howto/checkpoints-and-steps.md, "Stopping a task whose lease is lost").
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from celery import signals

from sqlease._celery.green_threads import GreenThread, green_thread_here
from sqlease._core.delivery_lease import DeliveryLease
from sqlease.delivery import CLOCK_KEY, LEASE_KEY, fence_of
from sqlease.errors import ConfigurationError, LeaseLost
from sqlease.options import parse_boolean
from sqlease.types import Fence

logger = logging.getLogger(__name__)

OPTION = "interrupt_on_lease_lost"
SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
DETAIL = "interrupted: the lease is lost (interrupt_on_lease_lost)"
#: Seconds after which an interruption that arrived outside the task's body is sent again.
RESEND_S = 0.01


@dataclass
class _Armed:
    fence: Fence
    lease: DeliveryLease
    #: The interruption was sent (a signal, or an exception pending in the thread).
    sent: bool = False
    #: Sent as a pending asynchronous exception (cleared if the task returns first).
    pending_async: bool = False
    #: The code of the task's body (its ``run``): the interruption is raised only while it
    #: runs (None: wherever the thread is).
    body: CodeType | None = None
    #: The green thread the task runs in (gevent's and eventlet's pools), None in an OS one.
    green: GreenThread | None = None


#: By thread ident: the delivery whose task that thread runs, while it may be interrupted.
_armed: dict[int, _Armed] = {}
_lock = threading.Lock()
_handler_installed = False


class LeaseInterrupted(LeaseLost):
    """The ``LeaseLost`` raised into a task by ``interrupt_on_lease_lost``. Made without
    arguments when raised as an asynchronous exception: it names the delivery the raising
    thread runs."""

    def __init__(
        self, message_id: int | None = None, attempt: int | None = None, detail: str = DETAIL
    ) -> None:
        if message_id is None or attempt is None:
            armed = _armed.get(threading.get_ident())
            message_id = armed.fence.message_id if armed is not None else 0
            attempt = armed.fence.attempt if armed is not None else 0
        super().__init__(message_id, attempt, detail)


def _wanted(task: Any) -> bool:
    own = getattr(task, OPTION, None)
    if own is not None:
        return bool(own)
    raw = (task.app.conf.get("broker_transport_options") or {}).get(OPTION)
    if raw is None:
        return False
    try:
        return parse_boolean(OPTION, raw)
    except ConfigurationError:
        return False  # the transport refuses it at connect, naming it


def _install_handler() -> bool:
    """Our signal handler, in the main thread, unless the process has one of its own."""
    global _handler_installed
    if _handler_installed:
        return True
    if SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
        return False
    signal.signal(SIGNAL, _on_signal)
    _handler_installed = True
    return True


def _body_of(task: Any) -> CodeType | None:
    """The code of ``task``'s body (its ``run``, unwrapped), or None if it has none."""
    run = getattr(task, "run", None)
    function: Any = getattr(run, "__func__", run)
    try:
        function = inspect.unwrap(function)
    except ValueError:  # a cycle of __wrapped__: the outermost is what runs first anyway
        pass
    code = getattr(function, "__code__", None)
    return code if isinstance(code, CodeType) else None


def _in_body(frame: FrameType | None, body: CodeType | None) -> bool:
    """Whether ``frame`` is the task's body or called from it."""
    if body is None:
        return True
    while frame is not None:
        if frame.f_code is body:
            return True
        frame = frame.f_back
    return False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    ident = threading.get_ident()
    armed = _armed.get(ident)
    if armed is None or not armed.sent:
        return  # not ours (the task returned meanwhile): nothing to raise
    if not _in_body(frame, armed.body):
        _send_later(ident)  # Celery's code around the body: sent again once the body runs
        return
    armed.sent = False
    raise LeaseInterrupted(armed.fence.message_id, armed.fence.attempt)


def _set_async(ident: int, error: type[BaseException] | None) -> None:
    exc = ctypes.py_object(error) if error is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc)


def _interrupt(ident: int) -> None:
    """(The watch's thread.) The lease of the task in thread ``ident`` is lost."""
    with _lock:
        armed = _armed.get(ident)
        if armed is None or armed.sent:
            return
        armed.sent = True
    logger.warning(
        "sqlease: interrupting the task of message %s attempt %s: its lease is lost",
        armed.fence.message_id,
        armed.fence.attempt,
    )
    _send(ident)


def _send(ident: int) -> None:
    """The interruption of the task in thread ``ident``, sent (again): a signal to the main
    thread, whose handler raises it if the body runs; in another thread, the exception set
    pending if the body runs, else sent again later."""
    with _lock:
        armed = _armed.get(ident)
        if armed is None or not armed.sent:
            return  # raised meanwhile, or the task is done
        if armed.green is not None:
            armed.green.call_soon(lambda: _throw_green(ident))
            return
        by_signal = (
            _handler_installed and SIGNAL is not None and ident == threading.main_thread().ident
        )
        if not by_signal:
            if not _in_body(sys._current_frames().get(ident), armed.body):
                _send_later(ident)
                return
            armed.pending_async = True
            _set_async(ident, LeaseInterrupted)
            return
    assert SIGNAL is not None
    signal.pthread_kill(ident, SIGNAL)


def _throw_green(ident: int) -> None:
    """(The hub of the task's green thread, where the task waits.) Raise the interruption in
    the task's greenlet if it waits in the body, else try again a little later. No lock:
    nothing else runs in this OS thread meanwhile."""
    armed = _armed.get(ident)
    if armed is None or not armed.sent or armed.green is None:
        return
    if armed.green.dead():  # ended without Celery's postrun: nothing to raise, ever
        if _armed.pop(ident, None) is armed:
            armed.lease.close()
        return
    if not _in_body(armed.green.frame(), armed.body):
        # Sent again from the hub's own timer: the hub cannot start a thread.
        armed.green.call_later(RESEND_S, lambda: _throw_green(ident))
        return
    armed.sent = False
    armed.green.throw(LeaseInterrupted(armed.fence.message_id, armed.fence.attempt))


def _send_later(ident: int) -> None:
    later = threading.Timer(RESEND_S, _send, args=(ident,))
    later.daemon = True
    later.start()


def arm(task: Any) -> None:
    """Celery starts ``task`` in this thread: watch its lease, if it opted in."""
    request = getattr(task, "request", None)
    properties = getattr(request, "properties", None) or {}
    info = properties.get("delivery_info") if isinstance(properties, dict) else None
    fence = fence_of(info)
    if fence is None or info is None or not _wanted(task):
        return
    lease = DeliveryLease.of(fence, int(info.get(LEASE_KEY) or 60_000), info.get(CLOCK_KEY))
    ident = threading.get_ident()
    green = green_thread_here()
    if green is None:
        _install_handler()
    with _lock:
        _armed[ident] = _Armed(fence, lease, body=_body_of(task), green=green)
    lease.watch(lambda: _interrupt(ident))


def disarm() -> None:
    """The task of this thread returned (or its final result is being written): no
    interruption from now on; one pending is withdrawn."""
    ident = threading.get_ident()
    with _lock:
        armed = _armed.pop(ident, None)
        if armed is not None and armed.pending_async:
            _set_async(ident, None)
    if armed is not None:
        armed.lease.close()


def _prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    try:
        arm(task if task is not None else sender)
    except Exception:  # never fail a task over its watch
        logger.exception("sqlease: could not watch the task's lease")


def _postrun(sender: Any = None, task: Any = None, **_: Any) -> None:
    disarm()
    request = getattr(task if task is not None else sender, "request", None)
    context = getattr(request, "_sqlease_context", None)
    close = getattr(context, "close", None)
    if callable(close):
        close()


def _after_fork_in_child() -> None:
    # A forked pool process runs none of its parent's tasks, and a parent's thread may have
    # held the lock at fork time.
    global _lock
    _lock = threading.Lock()
    _armed.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
signals.task_prerun.connect(_prerun, weak=False)
signals.task_postrun.connect(_postrun, weak=False)
