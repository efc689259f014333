"""Celery's green pools (gevent, eventlet) run each task in a greenlet of the worker's one OS
thread. ``interrupt_on_lease_lost`` throws the ``LeaseLost`` into the task's own greenlet where
it waits, never into another task's, and not once its body has returned; and a query waits
greenly, so that the others (the heartbeat among them) run meanwhile. Each case runs in a fresh
interpreter, monkey-patched first as the pools' workers are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: The pool's monkey-patching, as its worker makes it first, and its spawn and join.
PATCH = r"""
if POOL == "gevent":
    from gevent import monkey; monkey.patch_all()
    import gevent
    spawn, joinall = gevent.spawn, lambda gs: gevent.joinall(gs, timeout=10)
else:
    import eventlet; eventlet.monkey_patch()
    spawn = eventlet.spawn
    def joinall(gs):
        for g in gs:
            g.wait()
"""

SCRIPT = (
    r"""
import sys
POOL = sys.argv[1]
"""
    + PATCH
    + r"""
import json, time
from types import SimpleNamespace
from celery import signals
from sqlease import LeaseLost
from sqlease._celery import lease_interrupt
from sqlease._core.delivery_lease import DeliveryLease
from sqlease._core.lease_clock import DeliveryClock
from sqlease.delivery import ATTEMPT_KEY, ID_KEY, LEASE_KEY, OWNER_KEY

outcome = {}
clocks = {}

LOST_AT_START = 45

def lease_of(cls, fence, lease_ms, clock_ref):
    clocks[fence.message_id] = clock = DeliveryClock(lease_ms / 1000)
    if fence.message_id == LOST_AT_START:
        clock.mark_lost()
    return DeliveryLease(fence, clock)

lease_interrupt.DeliveryLease.of = classmethod(lease_of)

def heartbeat_refused(message_id, after):  # as the worker's heartbeat publishes a refusal
    time.sleep(after)
    clocks[message_id].mark_lost()

class Task:
    def __init__(self, message_id, lease_ms, run, opted_in=True):
        info = {ID_KEY: message_id, ATTEMPT_KEY: 1, OWNER_KEY: "w", LEASE_KEY: lease_ms}
        self.app = None
        self.request = SimpleNamespace(properties={"delivery_info": info})
        self.run = run
        self.interrupt_on_lease_lost = opted_in

def celery_runs(name, task, *args):
    signals.task_prerun.send(sender=task, task_id=name, task=task, args=(), kwargs={})
    if name == "lost_at_start":  # Celery's code yields before the body (its STARTED write)
        time.sleep(0.2)
    started = time.monotonic()
    try:
        task.run(*args)
        outcome[name] = ["finished", round(time.monotonic() - started, 2)]
    except LeaseLost as exc:
        outcome[name] = [type(exc).__name__, round(time.monotonic() - started, 2), exc.message_id]
    finally:
        lease_interrupt.disarm()
        if name == "returned":  # its body returned before its lease ran out: nothing later
            time.sleep(1.0)
            outcome[name].append("still running after")

def sleeper(seconds):
    time.sleep(seconds)

def quick():
    pass

lost = Task(41, 1000, sleeper)  # its lease is lost 0.3 s after the task starts
kept = Task(42, 1000, sleeper)  # armed, and its lease holds
bystander = Task(43, 1000, sleeper, opted_in=False)  # not watched: it sleeps beside them
returned = Task(44, 1000, quick)  # lost once its body has returned
lost_at_start = Task(LOST_AT_START, 1000, sleeper)  # lost before its body starts
joinall([
    spawn(celery_runs, "lost_at_start", lost_at_start, 3.0),
    spawn(heartbeat_refused, 41, 0.3),
    spawn(heartbeat_refused, 44, 0.3),
    spawn(celery_runs, "lost", lost, 3.0),
    spawn(celery_runs, "kept", kept, 1.0),
    spawn(celery_runs, "bystander", bystander, 1.0),
    spawn(celery_runs, "returned", returned),
])
print(json.dumps(outcome))
"""
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_task_whose_lease_is_lost_is_interrupted_alone(pool: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, pool], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    kind, took, message_id = outcome["lost"]
    assert kind == "LeaseInterrupted" and message_id == 41  # cut short in its green sleep
    assert took < 2.0, outcome
    # The others slept to the end: the interruption reached only its own greenlet.
    assert outcome["kept"][0] == "finished" and outcome["kept"][1] >= 0.95, outcome
    assert outcome["bystander"][0] == "finished" and outcome["bystander"][1] >= 0.95, outcome
    assert outcome["returned"] == ["finished", 0.0, "still running after"], outcome
    # Held back while Celery's code ran (sent again from the hub's timer), raised in the body.
    kind, took, message_id = outcome["lost_at_start"]
    assert kind == "LeaseInterrupted" and message_id == 45 and took < 1.0, outcome
    assert "Traceback" not in done.stderr, done.stderr


QUERIES = (
    r"""
import sys
POOL, URL = sys.argv[1], sys.argv[2]
if POOL.endswith("-late"):  # sqlease (and psycopg) imported before the patch
    import sqlease._db.postgresql.engine
    POOL = POOL.removesuffix("-late")
"""
    + PATCH
    + r"""
import time
from sqlalchemy import text
from sqlease._db import bounds
from sqlease._db.engine import get_engine

engine = get_engine(URL)  # sqlease's PostgreSQL engine, as the worker's store makes it

def query(bound):
    # A call bounded by a lease (as a heartbeat's renewal) waits in sqlease's own loop.
    with bounds.bounded(lambda: 30.0 if bound else None), engine.connect() as conn:
        conn.execute(text("SELECT pg_sleep(0.6)"))

started = time.monotonic()
joinall([spawn(query, False) for _ in range(3)])  # each connects, then queries
first = time.monotonic() - started
started = time.monotonic()
joinall([spawn(query, True) for _ in range(3)])
print(round(max(first, time.monotonic() - started), 2))
engine.dispose()
"""
)


@pytest.mark.pg
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", ["gevent", "eventlet", "eventlet-late", "gevent-late"])
def test_queries_of_green_threads_wait_side_by_side(pool: str, pg_database_url: str) -> None:
    """Three green threads' connects and queries of 0.6 s take about 0.6 s, not 1.8 s, and so
    do three bounded by a lease: psycopg's own C wait blocked the whole process under eventlet
    (a worker hung at its first query), and under either when psycopg was imported before the
    patch; sqlease's own wait for a bounded call looked for ``select.poll``, which eventlet's
    patch removes."""
    done = subprocess.run(
        [sys.executable, "-c", QUERIES, pool, pg_database_url],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    took = float(done.stdout.strip().splitlines()[-1])
    assert took < 1.5, took
