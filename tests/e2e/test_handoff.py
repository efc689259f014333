"""Handoff with real worker processes (PostgreSQL): an idle worker is handed a published task
in the publish statement and runs it without claiming; once that worker is SIGKILLed, its offer
(still unexpired in the table) is never used, because its listening connection and the
advisory lock that made the offer live died with it: the next task goes to another worker at
once, as delivery 1."""

from __future__ import annotations

import os
import signal

import pytest
from sqlalchemy import select, text

from .conftest import E2E, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.pg,
    pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
]

LEASE = 30.0  # far longer than the test waits: a message handed to the dead worker would stall


def offer_owners(e2e: E2E) -> set[str]:
    offers = e2e.store.tables.offers
    with e2e.store.engine.connect() as conn:
        return set(conn.execute(select(offers.c.owner)).scalars())


def lock_released(e2e: E2E, owner: str) -> bool:
    """Whether the server has seen the worker's listening connection close: its advisory
    lock, which the publish checks, is free. (Between a SIGKILL and the server noticing the
    closed socket, a few milliseconds, the offer still looks live; a message handed over in
    that window waits for its lease, as any lost delivery does.)"""
    offers = e2e.store.tables.offers
    with e2e.store.engine.connect() as conn:
        keys = set(conn.execute(select(offers.c.lock_key).where(offers.c.owner == owner)).scalars())
        free = all(
            conn.execute(text("SELECT pg_try_advisory_xact_lock_shared(:k)"), {"k": k}).scalar()
            for k in keys
        )
        conn.rollback()
        return free


@pytest.mark.timeout(120)
def test_idle_worker_is_handed_the_task_and_a_killed_ones_offer_is_never_used(e2e: E2E) -> None:
    first = e2e.start_worker(app="durable_app", E2E_LEASE_SECONDS=LEASE)
    sender = e2e.app(lease_seconds=LEASE)
    [owner] = wait_for(lambda: offer_owners(e2e), 15, "the idle worker to offer")

    result = sender.send_task("durable.slow", args=(0.0,))
    wait_for(lambda: e2e.finished(task_id=result.id), 15, "the first task to finish")
    claimed = [e for e in e2e.store.events(task_id=result.id) if e.kind == "claimed"]
    assert [(e.attempt, e.data) for e in claimed] == [(1, {"owner": owner, "handoff": True})]
    # After the ack the idle worker offers again; then it is killed with its offer standing.
    wait_for(lambda: offer_owners(e2e) == {owner}, 15, "the worker to offer again")
    os.killpg(first.pid, signal.SIGKILL)
    first.proc.wait(10)
    wait_for(lambda: lock_released(e2e, owner), 5, "the server to see the worker's death")
    # Published while the dead worker's offer is the only one (unexpired; its lock is gone).
    after = sender.send_task("durable.slow", args=(0.0,))
    assert offer_owners(e2e) == {owner}
    second = e2e.start_worker(app="durable_app", E2E_LEASE_SECONDS=LEASE)
    # Not stalled behind a lease given to the dead worker (that would take LEASE seconds).
    wait_for(lambda: e2e.finished(task_id=after.id), 15, "the second task to finish")
    [execution] = e2e.executions(task_id=after.id)
    assert execution["attempt"] == 1 and execution["hostname"] == second.nodename
    owners = {(e.data or {}).get("owner") for e in e2e.store.events(task_id=after.id)}
    assert owner not in owners


def live_offers(e2e: E2E, owner: str) -> int:
    """The worker's offers a publish could use now (not handed, not expired)."""
    offers = e2e.store.tables.offers
    with e2e.store.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    f"SELECT count(*) FROM {offers.name} WHERE owner = :o AND NOT handed "
                    "AND expires_at_ms > CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 "
                    "AS BIGINT)"
                ),
                {"o": owner},
            ).scalar_one()
        )


@pytest.mark.timeout(120)
def test_a_worker_with_a_free_pool_process_is_handed_the_next_task(e2e: E2E) -> None:
    # Two pool processes, one busy with a long task: the other can start a task at once, so
    # the worker offers while the first runs, and the next publish is handed to it.
    worker = e2e.start_worker(app="durable_app", concurrency=2, E2E_LEASE_SECONDS=LEASE)
    sender = e2e.app(lease_seconds=LEASE)
    [owner] = wait_for(lambda: offer_owners(e2e), 15, "the idle worker to offer")
    long = sender.send_task("durable.slow", args=(30.0,))
    wait_for(lambda: e2e.executions(task_id=long.id), 15, "the long task to start")
    wait_for(lambda: live_offers(e2e, owner) > 0, 15, "the busy worker to offer its free process")
    short = sender.send_task("durable.slow", args=(0.0,))
    wait_for(lambda: e2e.finished(task_id=short.id), 15, "the short task to finish")
    claimed = [e for e in e2e.store.events(task_id=short.id) if e.kind == "claimed"]
    assert [(e.attempt, e.data) for e in claimed] == [(1, {"owner": owner, "handoff": True})]
    assert not e2e.finished(task_id=long.id)  # ran beside the long one, not after it
    [execution] = e2e.executions(task_id=short.id)
    assert execution["hostname"] == worker.nodename


@pytest.mark.timeout(120)
def test_a_worker_whose_pool_is_full_offers_nothing(e2e: E2E) -> None:
    # One pool process, busy: a task handed to this worker would wait for it while another
    # worker could start it now, so no offer of its stands until the task ends.
    e2e.start_worker(app="durable_app", concurrency=1, E2E_LEASE_SECONDS=LEASE)
    sender = e2e.app(lease_seconds=LEASE)
    [owner] = wait_for(lambda: offer_owners(e2e), 15, "the idle worker to offer")
    # Long enough to outlast a second worker's start on a loaded machine (3 s once did not).
    long = sender.send_task("durable.slow", args=(8.0,))
    wait_for(lambda: e2e.executions(task_id=long.id), 15, "the long task to start")
    # A task claimed rather than handed over leaves the worker's offer standing until its
    # next look withdraws it, a moment later.
    wait_for(lambda: live_offers(e2e, owner) == 0, 3, "the busy worker's offer to go")
    second = e2e.start_worker(app="durable_app", concurrency=1, E2E_LEASE_SECONDS=LEASE)
    wait_for(lambda: len(offer_owners(e2e)) == 2, 15, "the second worker to offer")
    short = sender.send_task("durable.slow", args=(0.0,))
    wait_for(lambda: e2e.finished(task_id=short.id), 15, "the short task to finish")
    [execution] = e2e.executions(task_id=short.id)
    assert execution["hostname"] == second.nodename  # not queued behind the long task
    assert not e2e.finished(task_id=long.id)
    wait_for(lambda: live_offers(e2e, owner) > 0, 15, "the first worker to offer once free")
