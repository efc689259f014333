"""Celery's revoke under real workers, both databases (``sqlease.revokes``): a running task
revoked without ``terminate`` finishes and keeps its result, as Celery documents; a prefetched
one is discarded by its worker; and a revoke that reached a task while its worker held it is
not lost when that worker is SIGKILLed before acting: the next worker discards the task.
(Queued tasks revoked with no worker online: tests/e2e/test_context.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from .conftest import E2E, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def leased(e2e: E2E, task_id: str) -> bool:
    return e2e.admin.task(task_id).state == "running"


def running_and_prefetched(e2e: E2E, app: Any) -> tuple[Path, Any, Any]:
    """A blocking task running on the (one-process) worker, and a second task its worker
    holds prefetched behind it; the blocking one ends when the returned file exists."""
    flag = e2e.tmp / "go"
    running = app.tasks["e2e.block"].delay(str(flag))
    wait_for(lambda: e2e.executions(task_id=running.id), 30, "the blocking task to start")
    prefetched = app.tasks["e2e.add"].delay(1, 2)
    wait_for(lambda: leased(e2e, prefetched.id), 30, "the worker to prefetch the second task")
    return flag, running, prefetched


def test_a_running_task_revoked_without_terminate_finishes_and_a_prefetched_one_is_discarded(
    e2e: E2E,
) -> None:
    app = e2e.app(backend=e2e.broker)
    e2e.start_worker(concurrency=1, E2E_BACKEND=e2e.broker)
    flag, running, prefetched = running_and_prefetched(e2e, app)

    running.revoke()
    prefetched.revoke()
    assert "revoke_requested" in e2e.kinds(running.id)
    assert leased(e2e, running.id)  # not taken from its worker
    flag.touch()

    assert running.get(timeout=30) is None and running.state == "SUCCESS"
    assert len(e2e.finished(task_id=running.id)) == 1
    e2e.wait_acked(prefetched.id)
    assert prefetched.state == "REVOKED"
    assert e2e.executions(task_id=prefetched.id) == []
    e2e.workers[0].wait_log(f"Discarding revoked task: e2e.add[{prefetched.id}]", 10)


def test_a_revoke_outlives_the_worker_that_held_the_task(e2e: E2E) -> None:
    app = e2e.app(backend=e2e.broker, lease_seconds=2)
    first = e2e.start_worker(concurrency=1, E2E_BACKEND=e2e.broker, E2E_LEASE_SECONDS=2)
    flag, occupant, revoked = running_and_prefetched(e2e, app)
    revoked.revoke()
    os.killpg(first.pid, signal.SIGKILL)  # before it could act on the revoke
    first.proc.wait(10)
    flag.touch()

    second = e2e.start_worker(concurrency=1, E2E_BACKEND=e2e.broker, E2E_LEASE_SECONDS=2)
    assert occupant.get(timeout=60) is None  # delivered again and run: it was not revoked
    e2e.wait_acked(revoked.id, timeout=30)
    assert revoked.state == "REVOKED"
    assert e2e.executions(task_id=revoked.id) == []
    second.wait_log(f"Discarding revoked task: e2e.add[{revoked.id}]", 10)
    second.wait_log(f"task {revoked.id} was revoked while another worker held it", 10)
