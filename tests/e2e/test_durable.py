"""Durable by default: an app that only changed its broker URL to sqlease (no ``acks_late``,
no ``import sqlease``) loses nothing when its worker is SIGKILLed mid-task. The task comes back
when the dead worker's lease expires, not before, and completes on another worker as delivery 2.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow

LEASE = 2.0


@pytest.mark.timeout(120)
def test_sigkilled_worker_task_redelivered_after_lease_expiry(e2e: E2E) -> None:
    first = e2e.start_worker(app="durable_app", E2E_LEASE_SECONDS=LEASE)
    # The survivor is up (and polling) before the kill, so only the lease holds it back.
    second = e2e.start_worker(app="durable_app", E2E_LEASE_SECONDS=LEASE)
    sender = e2e.app(lease_seconds=LEASE)
    result = sender.send_task("durable.slow", args=(2.0,))

    started = wait_for(lambda: e2e.executions(task_id=result.id), 30, "the task to start")
    assert len(started) == 1 and started[0]["attempt"] == 1
    victim = first if started[0]["hostname"] == first.nodename else second
    survivor = second if victim is first else first
    message_id = started[0]["message_id"]
    assert message_id == e2e.message_id(result.id)

    os.killpg(victim.pid, signal.SIGKILL)
    killed_at = time.time()
    victim.proc.wait(10)
    # Nobody renews the lease any more: its expiry is final. Read it straight away.
    row = e2e.store.get_message(message_id)
    assert row is not None and row.lease_owner is not None and row.attempt == 1
    assert row.lease_expires_at_ms is not None
    expires_at = row.lease_expires_at_ms / 1000.0
    # It was renewed at most one heartbeat (lease/3) before the kill.
    assert expires_at >= killed_at + LEASE / 3 * 2 - 0.5

    rows = wait_for(
        lambda: (r := e2e.finished(task_id=result.id)) and r,
        LEASE + 30,
        "the task to complete on the surviving worker",
    )
    executions = e2e.executions(task_id=result.id)
    assert len(executions) == 2, executions
    retry = executions[1]
    assert rows == [retry]
    assert retry["attempt"] == 2
    assert retry["message_id"] == message_id
    assert retry["hostname"] == survivor.nodename
    # Not before the lease expired (both clocks are this machine's; 50 ms of slack for the
    # database's millisecond rounding) and promptly after it.
    assert retry["started"] >= expires_at - 0.05, (retry["started"], expires_at)
    assert retry["started"] - killed_at >= LEASE / 3 * 2 - 0.5
    assert retry["started"] - expires_at < 5.0

    e2e.wait_acked(result.id)
    kinds = [(e.kind, e.attempt) for e in e2e.store.events(task_id=result.id)]
    assert ("claimed", 1) in kinds and ("claimed", 2) in kinds and ("acked", 2) in kinds, kinds
    assert survivor.alive()
    assert e2e.admin.task(result.id).state == "succeeded"
    assert "task_acks_late is False" not in survivor.log()  # the durable default applied
