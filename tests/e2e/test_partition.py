"""A worker cut off from its database stops within its lease (guarantees.md, invariant 14).

Worker A reaches PostgreSQL through a TCP proxy that stops forwarding both ways while keeping
every socket open (a partition: no reset, no error); worker B connects directly. Lease 3 s.
A runs two tasks: one checkpoints every 0.25 s, the other never does and blocks in one long
``time.sleep`` (with ``interrupt_on_lease_lost``). Then the network is cut for 8 s:

- B takes both tasks over once their leases expire, and finishes them; the results are B's;
- each of A's tasks learned that its lease was lost (``LeaseLost``: the checkpointing one from
  its checkpoint, the blocked one by interruption) from its lease clock, before B started it
  and within the lease of the cut, while A still could not reach the database;
- A's acks of them are not sent, and when the network heals, the writes the partition held
  reach the database and change nothing: no checkpoint of A's after the takeover;
- A serves again without a restart.

The figures are printed (``-s``), and the reliability page quotes them.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from .apps.partition_app import make_app
from .conftest import E2E, wait_for
from .tcp_proxy import StallingProxy

pytestmark = [pytest.mark.timeout(120)]

LEASE = 3.0
PARTITION = 8.0
#: How late, past the moment its clock says, a task may be seen acting on it (a loaded
#: machine's scheduling; the clock's own margin is counted before this).
SLACK = 0.35


def timeline(e2e: E2E, task_id: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(str(e2e.records_path), timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'timeline'").fetchone():
            return []
        rows = conn.execute("SELECT * FROM timeline WHERE task_id = ? ORDER BY id", (task_id,))
        return [dict(r) for r in rows]
    finally:
        conn.close()


def first(rows: list[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r[k] == v for k, v in where.items())), None)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_worker_cut_off_from_its_database_stops_within_its_lease(e2e: E2E, pool: str) -> None:
    """With A's tasks in prefork processes, or in green threads beside A's heartbeat."""
    url = make_url(e2e.db_url)
    proxy = StallingProxy((url.host or "127.0.0.1", url.port or 5432))
    try:
        _partition(e2e, proxy, url.set(host="127.0.0.1", port=proxy.port), pool)
    finally:
        proxy.close()


def _partition(e2e: E2E, proxy: StallingProxy, proxied: Any, pool: str) -> None:
    app = make_app(e2e.broker, prefix=e2e.prefix, lease_seconds=LEASE)
    e2e._apps.append(app)
    through = "sqlease+" + proxied.render_as_string(hide_password=False)
    a = e2e.start_worker(
        app="partition_app",
        pool=pool,
        concurrency=2,
        queues="celery,only_a",
        E2E_BROKER=through,
        E2E_HOST="A",
    )
    work = app.tasks["part.work"].delay(40, 0.25)
    block = app.tasks["part.block"].delay(6.0)
    for task in (work, block):
        wait_for(lambda t=task: first(timeline(e2e, t.id), host="A"), 30, f"{task.id} on A")
    b = e2e.start_worker(app="partition_app", concurrency=2, E2E_HOST="B")
    wait_for(lambda: first(timeline(e2e, work.id), kind="checkpoint", host="A"), 10, "a checkpoint")

    cut = time.time()
    proxy.stall()
    for task in (work, block):
        wait_for(lambda t=task: first(timeline(e2e, t.id), host="B"), 30, f"{task.id} on B")
    time.sleep(max(0.0, cut + PARTITION - time.time()))
    healed = time.time()
    proxy.resume()

    # A serves again, without a restart.
    hello = app.tasks["part.hello"].apply_async(queue="only_a")
    assert hello.get(timeout=30) == "A"
    served_again = time.time() - healed
    assert work.get(timeout=60)["host"] == "B" and block.get(timeout=60)["host"] == "B"

    figures: dict[str, float] = {}
    for name, task, learned_kind in (("work", work, "lease_lost"), ("block", block, "interrupted")):
        rows = timeline(e2e, task.id)
        learned = first(rows, host="A", kind=learned_kind)
        started_on_b = first(rows, host="B", kind="start")
        assert learned is not None, f"{name}: A never learned its lease was lost: {rows}"
        assert started_on_b is not None and started_on_b["attempt"] == 2
        # From its clock, within the lease of the cut, before the network came back.
        assert learned["at"] - cut <= LEASE + SLACK, (name, learned, cut)
        assert learned["at"] < healed
        assert "lease" in learned["detail"]
        # Never two at once: A had stopped before B started.
        assert learned["at"] < started_on_b["at"], (name, learned, started_on_b)
        claims = [e for e in e2e.store.events(task_id=task.id) if e.kind == "claimed"]
        [takeover] = [e for e in claims if e.attempt == 2]
        figures[f"{name}: takeover after the cut (s)"] = takeover.at_ms / 1000 - cut
        figures[f"{name}: LeaseLost after the cut (s)"] = learned["at"] - cut
        # The lease as last renewed before the cut: by a checkpoint (up to 0.25 s before),
        # or by the heartbeat (every third of the lease, plus the renewal's own time).
        after_cut = takeover.at_ms / 1000 - cut
        assert LEASE * 2 / 3 - 0.25 <= after_cut <= LEASE + 3.0, (name, after_cut, rows)
        # Nothing of A's after the takeover: the held writes reached the database when the
        # network healed, and were refused.
        late = [
            e
            for e in e2e.store.events(task_id=task.id)
            if e.attempt == 1 and e.at_ms > takeover.at_ms and e.kind != "lease_lost"
        ]
        assert late == [], (name, late)
    # The work task's state is B's: it resumed from A's last checkpoint and finished.
    assert e2e.admin.task(work.id).checkpoint["step"] == 40
    assert proxy.held_to_server > 0  # the partition held writes that arrived late
    log = a.log()
    assert "not sent: its lease is lost" in log, log[-4000:]  # A did not ack what it lost
    assert "Unrecoverable error" not in log and a.alive() and b.alive(), log[-4000:]
    figures["held bytes that reached the server after the heal"] = proxy.held_to_server
    figures["A served again after the heal (s)"] = served_again
    print("\npartition figures:", {k: round(v, 2) for k, v in figures.items()})


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_call_through_a_partition_ends_with_the_lease(e2e: E2E) -> None:
    """One task-side call, on its own: a checkpoint sent into a partition raises ``LeaseLost``
    when its delivery's lease clock runs out, not when the network heals; the next call past
    the clock raises at once; after the heal a new connection serves, and the held write,
    delivered late, changed nothing."""
    from sqlease import LeaseLost, Store
    from sqlease._core.lease_clock import DeliveryClock
    from sqlease.task_context import TaskContext

    url = make_url(e2e.db_url)
    proxy = StallingProxy((url.host or "127.0.0.1", url.port or 5432))
    try:
        through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        store = Store(through, table_prefix=e2e.prefix, lease_ms=3_000)
        store.enqueue("q", "{}", task_id="t-bounded")
        [message] = store.claim(["q"], "w1", lease_ms=3_000)
        ctx = TaskContext(
            store, message.fence, task_id="t-bounded", lease_ms=3_000, clock=DeliveryClock(3.0)
        )
        ctx.ensure_lease()
        ctx.checkpoint({"page": 1})
        proxy.stall()
        started = time.monotonic()
        deadline = ctx.deadline
        assert deadline is not None
        with pytest.raises(LeaseLost, match="no answer from the database within the lease"):
            ctx.checkpoint({"page": 2})
        assert time.monotonic() <= deadline + SLACK  # at its clock, not at the heal
        assert time.monotonic() - started < 3.0
        with pytest.raises(LeaseLost, match="lease clock ran out"):
            ctx.event("late")  # at once
        # Taken over meanwhile (directly, past the partition), then the network heals.
        time.sleep(max(0.0, message.lease_expires_at_ms / 1000 - time.time() + 0.2))
        [again] = e2e.store.claim(["q"], "w2", lease_ms=3_000)
        proxy.resume()
        assert again.attempt == 2
        # A new connection through the healed network serves the store.
        assert store.get_task("t-bounded") is not None
        assert proxy.held_to_server > 0  # the checkpoint's statement, held by the partition
        time.sleep(0.5)  # it reaches the server and runs there, late: fenced, it changes nothing
        assert e2e.store.get_task("t-bounded").checkpoint == {"page": 1}
    finally:
        proxy.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_connection_opened_through_a_partition_ends_at_the_bound(e2e: E2E) -> None:
    """A connection made inside a bounded call is given up when the bound passes, not at
    libpq's ``connect_timeout`` (whole seconds, at least 2): a task whose checkpoint had to
    open a new connection into a partition learned ``LeaseLost`` half a second late."""
    import psycopg

    from sqlease._db.bounds import bounded
    from sqlease._db.postgresql import bounded as pg_bounded

    proxy = StallingProxy.to(e2e.db_url)
    try:
        conninfo = make_url(proxy.through(e2e.db_url)).set(drivername="postgresql")
        proxy.stall()
        started = time.monotonic()
        with (
            bounded(lambda: started + 0.5 - time.monotonic()),
            pytest.raises(psycopg.OperationalError, match="no connection to the database within"),
        ):
            pg_bounded.connect(conninfo.render_as_string(hide_password=False))
        assert 0.5 <= time.monotonic() - started < 0.5 + SLACK
        assert proxy.opened_while_stalled == 1
        # Unbounded, it is psycopg's connect, unchanged: through the healed network it connects.
        proxy.resume()
        with pg_bounded.connect(conninfo.render_as_string(hide_password=False)) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        proxy.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_checkpoint_that_must_connect_through_a_partition_ends_with_the_lease(
    e2e: E2E,
) -> None:
    """The checkpoint finds no open connection (its pool was emptied) and the network is cut:
    ``LeaseLost`` at its lease clock, within the slack, as when a connection hangs."""
    from sqlease import LeaseLost, Store
    from sqlease._core.lease_clock import DeliveryClock
    from sqlease._db.engine import dispose_all
    from sqlease.task_context import TaskContext

    proxy = StallingProxy.to(e2e.db_url)
    try:
        store = Store(proxy.through(e2e.db_url), table_prefix=e2e.prefix, lease_ms=3_000)
        store.enqueue("q", "{}", task_id="t-connect")
        [message] = store.claim(["q"], "w1", lease_ms=3_000)
        ctx = TaskContext(
            store, message.fence, task_id="t-connect", lease_ms=3_000, clock=DeliveryClock(3.0)
        )
        ctx.checkpoint({"page": 1})
        proxy.stall()
        dispose_all(close=True)  # no connection left open: the next call must make one
        # 1.2 s left: libpq's timeout, at least 2 s, would end 0.8 s past the lease.
        deadline = ctx.deadline
        assert deadline is not None
        time.sleep(max(0.0, deadline - 1.2 - time.monotonic()))
        with pytest.raises(LeaseLost, match="no answer from the database within the lease"):
            ctx.checkpoint({"page": 2})
        assert time.monotonic() <= deadline + SLACK  # at its clock, not 2 s later
        assert proxy.opened_while_stalled >= 1
        proxy.resume()
        assert e2e.store.get_task("t-connect").checkpoint == {"page": 1}
    finally:
        proxy.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_checkpoint_waiting_for_a_free_connection_ends_with_the_lease(e2e: E2E) -> None:
    """Every connection of the engine is checked out (a green pool's many tasks, hung in a
    partition): a checkpoint waits for one no longer than its lease clock, not for the pool's
    own timeout (30 s), and raises ``LeaseLost``; outside a bounded call the pool's timeout
    is unchanged, also in a pool recreated meanwhile."""
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    from sqlease import LeaseLost, Store
    from sqlease._core.lease_clock import DeliveryClock
    from sqlease._db.bounds import bounded
    from sqlease.task_context import TaskContext

    url = make_url(e2e.db_url).update_query_dict({"pool_size": "4", "max_overflow": "0"})
    store = Store(url.render_as_string(hide_password=False), table_prefix=e2e.prefix)
    store.enqueue("q", "{}", task_id="t-pool")
    [message] = store.claim(["q"], "w1", lease_ms=3_000)
    ctx = TaskContext(
        store, message.fence, task_id="t-pool", lease_ms=3_000, clock=DeliveryClock(3.0)
    )
    ctx.checkpoint({"page": 1})
    deadline = ctx.deadline
    assert deadline is not None
    taken = [store.engine.connect() for _ in range(4)]
    try:
        with pytest.raises(LeaseLost, match="no answer from the database within the lease"):
            ctx.checkpoint({"page": 2})
        assert deadline <= time.monotonic() <= deadline + SLACK
        assert store.engine.pool._timeout == 30  # type: ignore[attr-defined]
        with bounded(lambda: 0.2), pytest.raises(PoolTimeout):
            store.engine.connect()
        store.engine.pool = store.engine.pool.recreate()
        assert store.engine.pool._timeout == 30  # type: ignore[attr-defined]
    finally:
        for conn in taken:
            conn.close()
    assert e2e.store.get_task("t-pool").checkpoint == {"page": 1}
