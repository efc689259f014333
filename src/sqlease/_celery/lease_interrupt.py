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
  blocked in C code finishes first.

It lands wherever the task happens to be, like any asynchronous exception: inside a library's
code, a ``finally`` block, a lock's acquisition. What that costs is the task's to judge (see
docs/howto/checkpoints-and-steps.md, "Stopping a task whose lease is lost").
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from celery import signals

from sqlease._core.delivery_lease import DeliveryLease
from sqlease.delivery import CLOCK_KEY, LEASE_KEY, fence_of
from sqlease.errors import ConfigurationError, LeaseLost
from sqlease.options import parse_boolean
from sqlease.types import Fence

logger = logging.getLogger(__name__)

OPTION = "interrupt_on_lease_lost"
SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
DETAIL = "interrupted: the lease is lost (interrupt_on_lease_lost)"


@dataclass
class _Armed:
    fence: Fence
    lease: DeliveryLease
    #: The interruption was sent (a signal, or an exception pending in the thread).
    sent: bool = False
    #: Sent as a pending asynchronous exception (cleared if the task returns first).
    pending_async: bool = False


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


def _on_signal(signum: int, frame: Any) -> None:
    armed = _armed.get(threading.get_ident())
    if armed is None or not armed.sent:
        return  # not ours (the task returned meanwhile): nothing to raise
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
        by_signal = (
            _handler_installed and SIGNAL is not None and ident == threading.main_thread().ident
        )
        if not by_signal:
            armed.pending_async = True
            _set_async(ident, LeaseInterrupted)
    logger.warning(
        "sqlease: interrupting the task of message %s attempt %s: its lease is lost",
        armed.fence.message_id,
        armed.fence.attempt,
    )
    if by_signal:
        assert SIGNAL is not None
        signal.pthread_kill(ident, SIGNAL)


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
    _install_handler()
    with _lock:
        _armed[ident] = _Armed(fence, lease)
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
