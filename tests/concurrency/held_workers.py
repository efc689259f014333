"""Worker bodies for ``test_held_races``: publishers into a few hot runs and executors that
claim and ack them at the same time, so that enqueues and the acks of run heads race."""

from __future__ import annotations

import os
import random
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

from sqlalchemy import select

from sqlease import NewMessage, Store

from .workers import WAIT_S, _check_deadline, _ready_then_go, mono_ns


def run_publisher(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    runs: int,
    count: int,
    go: Event,
) -> None:
    """Publish ``count`` messages into ``runs`` runs, each into a random one, as fast as it
    can. Reports ``(run_id, message_id)`` in publish order."""
    store = Store(url, table_prefix=prefix)
    rng = random.Random(os.getpid())
    _ready_then_go(out, go)
    published: list[tuple[str, int]] = []
    for n in range(count):
        run_id = f"run-{rng.randrange(runs)}"
        published.append((run_id, store.enqueue(queue, f"{os.getpid()}:{n}", run_id=run_id)))
    out.send(("result", published))


def run_follower(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    limit: int,
    lease_ms: int,
    go: Event,
    published: Event,
    quiet_s: float,
) -> None:
    """Claim and ack at once, until the publishers are done and nothing could be claimed for
    ``quiet_s`` (a message stuck parked would stay behind: the test looks). Reports
    ``(run_id, message_id, start_ns, end_ns, acked)`` per execution."""
    store = Store(url, table_prefix=prefix)
    owner = f"follower-{os.getpid()}"
    _ready_then_go(out, go)
    deadline = time.monotonic() + WAIT_S
    executions: list[tuple[str, int, int, int, bool]] = []
    idle_since: float | None = None
    while True:
        _check_deadline(deadline)
        batch = store.claim([queue], owner, lease_ms=lease_ms, limit=limit)
        if not batch:
            now = time.monotonic()
            if not published.is_set():
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since > quiet_s:
                break
            time.sleep(0.001)
            continue
        idle_since = None
        for m in batch:
            start = mono_ns()
            end = mono_ns()
            done = store.ack([m.fence]) == {m.id}
            executions.append((str(m.run_id), m.id, start, end, done))
    out.send(("result", executions))


def run_gate_publisher(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    keys: int,
    limit: int,
    count: int,
    go: Event,
) -> None:
    """Publish ``count`` messages, each under one of ``keys`` concurrency keys of limit
    ``limit``, as fast as it can. Reports ``(key, message_id)``."""
    store = Store(url, table_prefix=prefix)
    rng = random.Random(os.getpid())
    _ready_then_go(out, go)
    published: list[tuple[str, int]] = []
    for n in range(count):
        key = f"key-{rng.randrange(keys)}"
        [mid] = store.enqueue_many(
            [NewMessage(queue, f"{os.getpid()}:{n}", concurrency_key=key, concurrency_limit=limit)]
        )
        published.append((key, mid))
    out.send(("result", published))


def run_gate_follower(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    limit: int,
    lease_ms: int,
    go: Event,
    published: Event,
    quiet_s: float,
) -> None:
    """Claim, sweep (park what waits at a full gate) and ack, over and over, so that sweeps
    and the acks that free a gate's last place meet; stops once the publishers are done and
    nothing could be claimed for ``quiet_s``. Reports ``(key, message_id, start_ns, end_ns,
    acked)`` per execution."""
    store = Store(url, table_prefix=prefix)
    owner = f"gate-follower-{os.getpid()}"
    _ready_then_go(out, go)
    deadline = time.monotonic() + WAIT_S
    executions: list[tuple[str, int, int, int, bool]] = []
    idle_since: float | None = None
    gate = store.tables.messages.c.gate_key
    while True:
        _check_deadline(deadline)
        batch = store.claim([queue], owner, lease_ms=lease_ms, limit=limit)
        try:
            store.park_held([queue])
        except Exception:  # a sweep that met a lock gives up (lock_timeout): so do we
            pass
        if not batch:
            now = time.monotonic()
            if not published.is_set():
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since > quiet_s:
                break
            time.sleep(0.001)
            continue
        idle_since = None
        with store.driver.reading() as conn:
            keys = dict(
                conn.execute(
                    select(store.tables.messages.c.id, gate).where(
                        store.tables.messages.c.id.in_([m.id for m in batch])
                    )
                ).all()
            )
        for m in batch:
            start = mono_ns()
            time.sleep(0.0005)
            end = mono_ns()
            done = store.ack([m.fence]) == {m.id}
            executions.append((str(keys.get(m.id)), m.id, start, end, done))
    out.send(("result", executions))
