"""How many more tasks the Celery worker in this process can start now: its pool's processes
(threads, greenlets) less the tasks it has received and not finished. A worker with a free
pool process may be handed a task by a publish (the transport's handoff offers), as an idle
one is: it starts the task at once.

The worker is remembered at ``worker_init`` and forgotten at ``worker_shutdown``
(sqlease._celery.defaults); its pool is known while it runs. Elsewhere (a client, a plain
Kombu consumer, a pool's child process) nothing is known and the answer is None.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_worker: weakref.ReferenceType[Any] | None = None
_pid = 0


def remember(worker: Any) -> None:
    """``worker``: Celery's WorkController of this process."""
    global _worker, _pid
    try:
        _worker = weakref.ref(worker)
    except TypeError:  # not weak-referenceable: a stand-in, not a worker
        _worker = None
        return
    _pid = os.getpid()


def forget(worker: Any) -> None:
    """``worker`` stopped (``worker_shutdown``): nothing is known any more."""
    global _worker
    if _worker is not None and _worker() is worker:
        _worker = None


def load() -> tuple[int, int] | None:
    """The worker's pool size and its tasks received and not finished (more than the size
    when prefetched ones wait); None when unknown."""
    worker = None if _worker is None or os.getpid() != _pid else _worker()
    pool = getattr(worker, "pool", None)
    if pool is None or not getattr(pool, "active", True):  # not started, or stopped
        return None
    try:
        size = int(pool.num_processes)
    except Exception:  # a pool not started yet (or stopped): its size is not known
        return None
    if size < 1:
        return None
    from celery.worker import state

    return size, len(state.reserved_requests)
