"""Worker bodies for ``test_store_processes``; each runs in its own spawned process.

Nothing here imports pytest. A worker builds its own ``Store`` (no engine is inherited), talks
to the test over a one-way ``Pipe`` (``send`` is synchronous, so a report is on its way even if
the process is stopped or killed right after), and sends ``("error", traceback)`` if it fails.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event, Semaphore
from typing import Any

from sqlalchemy import func, select

from sqlease import Message, Store
from sqlease._db.engine import dispose_all

WAIT_S = 60.0  # no worker waits longer than this for the test to tell it to go


def mono_ns() -> int:
    """CLOCK_MONOTONIC is one clock for every process on the machine (Linux)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def messages_left(store: Store) -> int:
    """Rows still in the messages table (leased or not)."""
    with store.engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(store.tables.messages)).scalar_one()
        conn.rollback()
    return int(count)


def _ready_then_go(out: Connection, go: Event, info: Any = None) -> None:
    out.send(("ready", info))
    if not go.wait(WAIT_S):
        raise TimeoutError("the test never said go")


def _check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("worker ran past its deadline")


# ---- 1. many tasks, batch claims, exactly once -------------------------------------------


def batch_drainer(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    limit: int,
    lease_ms: int,
    go: Event,
) -> None:
    """Claim in batches and ack until the table is empty. Reports every delivery
    ``(message_id, attempt, owner, pid)`` and every id that ``ack`` confirmed."""
    store = Store(url, table_prefix=prefix)
    owner = f"drainer-{os.getpid()}"
    _ready_then_go(out, go)
    deadline = time.monotonic() + WAIT_S
    deliveries: list[tuple[int, int, str, int]] = []
    acked: list[int] = []
    while True:
        _check_deadline(deadline)
        batch = store.claim([queue], owner, lease_ms=lease_ms, limit=limit)
        if not batch:
            if messages_left(store) == 0:
                break
            time.sleep(0.002)
            continue
        deliveries.extend((m.id, m.attempt, str(m.lease_owner), os.getpid()) for m in batch)
        acked.extend(store.ack([m.fence for m in batch]))
    out.send(("result", {"deliveries": deliveries, "acked": acked}))


# ---- 2. runs: serialized and in order ----------------------------------------------------


def run_executor(
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
    """Claim batches, "execute" each message (start, a short random sleep, end) and ack it
    right away. Reports ``(run_id, message_id, attempt, start_ns, end_ns, acked)`` per
    execution; the interval is inside the lease (after the claim returned, before the ack)."""
    store = Store(url, table_prefix=prefix)
    owner = f"runner-{os.getpid()}"
    rng = random.Random(os.getpid())
    _ready_then_go(out, go)
    deadline = time.monotonic() + WAIT_S
    executions: list[tuple[str, int, int, int, int, bool]] = []
    while True:
        _check_deadline(deadline)
        batch = store.claim([queue], owner, lease_ms=lease_ms, limit=limit)
        if not batch:
            if messages_left(store) == 0:
                break
            time.sleep(0.001)
            continue
        for m in batch:
            start = mono_ns()
            time.sleep(rng.uniform(0.0, max_sleep_s))
            end = mono_ns()
            done = store.ack([m.fence]) == {m.id}
            executions.append((str(m.run_id), m.id, m.attempt, start, end, done))
    out.send(("result", executions))


# ---- 3. a holder killed or stopped mid-lease -----------------------------------------------


def _claim_and_checkpoint(
    store: Store, queue: str, owner: str, lease_ms: int, task_id: str
) -> tuple[Message, dict[str, Any]]:
    [msg] = store.claim([queue], owner, lease_ms=lease_ms)
    cas = store.compare_and_set(msg.fence, task_id, 0, checkpoint={"step": 1})
    report = {
        "pid": os.getpid(),
        "message_id": msg.id,
        "owner": msg.lease_owner,
        "attempt": msg.attempt,
        "lease_expires_at_ms": msg.lease_expires_at_ms,
        "cas_outcome": str(cas.outcome),
        "revision": cas.revision,
    }
    return msg, report


def killed_holder(
    out: Connection, *, url: str, prefix: str, queue: str, lease_ms: int, task_id: str
) -> None:
    """Claim, checkpoint, report, then sleep until SIGKILLed."""
    store = Store(url, table_prefix=prefix)
    _, report = _claim_and_checkpoint(store, queue, f"doomed-{os.getpid()}", lease_ms, task_id)
    out.send(("holding", report))
    time.sleep(WAIT_S)
    raise TimeoutError("the holder was never killed")


def stopped_holder(
    out: Connection, *, url: str, prefix: str, queue: str, lease_ms: int, task_id: str
) -> None:
    """Claim, checkpoint, report, stop itself (SIGSTOP) at this exact point; once continued,
    carry on as if nothing happened: checkpoint again, ack, renew. Reports the outcomes."""
    store = Store(url, table_prefix=prefix)
    msg, report = _claim_and_checkpoint(store, queue, f"sleepy-{os.getpid()}", lease_ms, task_id)
    out.send(("holding", report))
    os.kill(os.getpid(), signal.SIGSTOP)
    # ... continued by the test, long after the lease expired.
    fence = msg.fence
    cas = store.compare_and_set(
        fence, task_id, 1, checkpoint={"step": 2}, lease_ms=lease_ms, event="stale_checkpoint"
    )
    acked = store.ack([fence])
    renewed = store.renew([fence], lease_ms=lease_ms)
    held = store.is_held(fence)
    out.send(
        (
            "result",
            {
                "cas_outcome": str(cas.outcome),
                "acked": sorted(acked),
                "renewed": renewed,
                "held": held,
            },
        )
    )


# ---- 4. racing on one hot row ---------------------------------------------------------------


def hot_racer(
    out: Connection,
    *,
    url: str,
    prefix: str,
    queue: str,
    lease_ms: int,
    abandon_every: int,
    go: Event,
    stop: Event,
    claimed: Semaphore,
) -> None:
    """Claim one message at a time in a tight loop. A first delivery of an id divisible by
    ``abandon_every`` is abandoned (never acked, so its lease must run out before anyone else
    gets it); everything else is acked after a moment's work. Each first delivery releases
    ``claimed`` once, which is what lets the test enqueue the next message. Reports every
    delivery as
    ``(message_id, attempt, owner, lease_expires_at_ms, acked)``; ``acked`` is None when the
    delivery was abandoned."""
    store = Store(url, table_prefix=prefix)
    owner = f"racer-{os.getpid()}"
    rng = random.Random(os.getpid())
    _ready_then_go(out, go)
    deadline = time.monotonic() + WAIT_S
    deliveries: list[tuple[int, int, str, int, bool | None]] = []
    claims = 0
    while not stop.is_set():
        _check_deadline(deadline)
        claims += 1
        got = store.claim([queue], owner, lease_ms=lease_ms)
        for m in got:
            assert m.lease_expires_at_ms is not None
            if m.attempt == 1:
                claimed.release()
            if m.attempt == 1 and m.id % abandon_every == 0:
                deliveries.append((m.id, m.attempt, owner, m.lease_expires_at_ms, None))
                continue
            time.sleep(rng.uniform(0.0, 0.0005))
            done = store.ack([m.fence]) == {m.id}
            deliveries.append((m.id, m.attempt, owner, m.lease_expires_at_ms, done))
    out.send(("result", {"deliveries": deliveries, "claims": claims}))


# ---- entry point ----------------------------------------------------------------------------

WORKERS: dict[str, Callable[..., None]] = {
    "batch_drainer": batch_drainer,
    "run_executor": run_executor,
    "killed_holder": killed_holder,
    "stopped_holder": stopped_holder,
    "hot_racer": hot_racer,
}


def main(out: Connection, name: str, kwargs: dict[str, Any]) -> None:
    """Process target: run worker ``name``; any failure is sent back as a traceback."""
    code = 0
    try:
        if name in WORKERS:
            WORKERS[name](out, **kwargs)
        elif name.startswith("run_"):  # held work's workers, in their own module
            from . import held_workers

            getattr(held_workers, name)(out, **kwargs)
        else:  # flow control's workers, in their own module
            from . import flow_workers

            getattr(flow_workers, name)(out, **kwargs)
    except BaseException:
        code = 1
        out.send(("error", traceback.format_exc()))
    finally:
        dispose_all(close=True)
        out.close()  # every report is written: ``send`` returns once the pipe holds it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip the interpreter's teardown: with 8 workers it only costs time
