"""Worker bodies for ``test_flow_processes``: each claims under concurrency limits and writes
when it starts and ends each delivery, by the database's clock, into a log table."""

from __future__ import annotations

import os
import random
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

from sqlalchemy import text

from sqlease import NewMessage, Store

from .workers import WAIT_S, _check_deadline, _ready_then_go, messages_left

#: Microseconds since the epoch by the database's clock at the moment it runs (not the
#: statement's start: a lock wait inside the statement counts).
DB_NOW_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"


def log_table(prefix: str) -> str:
    return f"{prefix}flowlog"


def gate_executor(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    limit: int,
    lease_ms: int,
    max_sleep_s: float,
    go: Event,
) -> None:
    """Claim batches; right after a claim returns, log each delivery's start; run each (a
    short random sleep); log its end, then ack it. A logged interval lies inside its lease."""
    store = Store(url, table_prefix=prefix)
    owner = f"gate-{os.getpid()}"
    rng = random.Random(os.getpid())
    log = log_table(prefix)
    _ready_then_go(out, go)
    deadline = time.monotonic() + WAIT_S
    done = 0
    while True:
        _check_deadline(deadline)
        batch = store.claim([queue], owner, lease_ms=lease_ms, limit=limit)
        if not batch:
            if messages_left(store) == 0:
                break
            time.sleep(0.002)
            continue
        with store.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO {log} (message_id, attempt, owner, started_us) "
                    f"VALUES (:id, :attempt, :owner, {DB_NOW_US})"
                ),
                [{"id": m.id, "attempt": m.attempt, "owner": owner} for m in batch],
            )
        for m in batch:
            time.sleep(rng.uniform(0.0, max_sleep_s))
            with store.engine.begin() as conn:
                conn.execute(
                    text(
                        f"UPDATE {log} SET ended_us = {DB_NOW_US} "
                        "WHERE message_id = :id AND attempt = :attempt"
                    ),
                    {"id": m.id, "attempt": m.attempt},
                )
            assert store.ack([m.fence]) == {m.id}, "a lease expired mid-test"
            done += 1
    out.send(("result", done))


def gate_holder(out: Connection, *, url: str, prefix: str, queue: str, lease_ms: int) -> None:
    """Claim one gated message, report it, then sleep until SIGKILLed."""
    store = Store(url, table_prefix=prefix)
    [msg] = store.claim([queue], f"doomed-{os.getpid()}", lease_ms=lease_ms)
    out.send(
        ("holding", {"id": msg.id, "attempt": msg.attempt, "expires": msg.lease_expires_at_ms})
    )
    time.sleep(WAIT_S)
    raise TimeoutError("the holder was never killed")


def unique_publisher(
    out: Connection, *, url: str, prefix: str, queue: str, keys: list[str], go: Event
) -> None:
    """Publish one task of each unique key, all racing the other publishers of the same
    keys (scope ``active``, nobody consumes): each key must end with exactly one message."""
    store = Store(url, table_prefix=prefix)
    pid = os.getpid()
    _ready_then_go(out, go)
    for key in keys:
        store.enqueue_many(
            [NewMessage(queue, f"{pid}:{key}", task_id=f"{pid}-{key}", unique_key=key)]
        )
    out.send(("result", len(keys)))
