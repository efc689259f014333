"""Flow control's concurrency claims, shown with real processes racing on PostgreSQL: no key,
task name or queue ever has more deliveries running than its limit, judged from start and end
times that the database's clock wrote; a SIGKILLed holder's place comes back at expiry."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy import text

from sqlease import NewMessage, Store

from .flow_workers import log_table
from .test_store_processes import Children, children, fresh_store  # noqa: F401

pytestmark = [pytest.mark.pg, pytest.mark.concurrency]

PROCESSES = 6
BATCH = 4


def _make_log(store: Store) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {log_table(store.tables.prefix)} (message_id BIGINT, "
                "attempt INT, owner TEXT, started_us BIGINT, ended_us BIGINT)"
            )
        )


def _intervals(store: Store) -> list[dict[str, Any]]:
    m = store.tables.messages.name
    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                f"SELECT l.message_id, l.started_us, l.ended_us, l.owner "
                f"FROM {log_table(store.tables.prefix)} l ORDER BY l.started_us"
            )
        ).fetchall()
        conn.execute(text(f"SELECT 1 FROM {m} LIMIT 1"))
        conn.rollback()
    return [dict(r._mapping) for r in rows]


def _peak(intervals: list[tuple[int, int]]) -> int:
    """The most intervals open at one instant (an end at t comes before a start at t)."""
    points = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1])
    )
    open_now = peak = 0
    for _, step in points:
        open_now += step
        peak = max(peak, open_now)
    return peak


@pytest.mark.timeout(180)
def test_racing_workers_never_exceed_a_key_or_a_queue_limit(
    pg_database_url: str,
    children: Children,  # noqa: F811
) -> None:
    store = fresh_store(pg_database_url)
    _make_log(store)
    store.set_limits({"task:app.limited": 3})
    keys = {f"tenant-{k}": 1 + k % 3 for k in range(8)}  # limits 1, 2 and 3
    gate_of: dict[int, str] = {}
    new: list[NewMessage] = []
    labels: list[str] = []
    for i in range(25):
        for key, limit in keys.items():
            new.append(
                NewMessage(
                    "flow", f"{key}:{i}", concurrency_key=key, concurrency_limit=limit, record=False
                )
            )
            labels.append(f"key:{key}")
        new.append(NewMessage("flow", f"limited:{i}", task_name="app.limited", record=False))
        labels.append("task:app.limited")
        new.append(NewMessage("flow", f"free:{i}", record=False))
        labels.append("free")
    ids = store.enqueue_many(new)
    gate_of = dict(zip(ids, labels, strict=True))
    limits = {f"key:{k}": v for k, v in keys.items()} | {"task:app.limited": 3}

    pack = children.start_many(
        PROCESSES,
        "gate_executor",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="flow",
        limit=BATCH,
        lease_ms=60_000,
        max_sleep_s=0.004,
    )
    children.release(pack)
    done = [children.expect(c, "result", 150) for c in pack.members]
    for c in pack.members:
        children.finish(c)
    assert sum(done) == len(ids)

    rows = _intervals(store)
    assert len(rows) == len(ids) and all(r["ended_us"] is not None for r in rows)
    per_gate: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in rows:
        per_gate[gate_of[r["message_id"]]].append((r["started_us"], r["ended_us"]))
    for gate, limit in limits.items():
        peak = _peak(per_gate[gate])
        assert peak <= limit, f"{gate} had {peak} deliveries running at once, limit {limit}"
    # Meaningful only if the workers raced: a gate reached its limit, ungated work overlapped.
    assert any(_peak(per_gate[g]) == lim for g, lim in limits.items() if lim > 1)
    assert _peak(per_gate["free"]) > 1


@pytest.mark.timeout(120)
def test_a_sigkilled_holders_place_comes_back_after_its_lease(
    pg_database_url: str,
    children: Children,  # noqa: F811
) -> None:
    store = fresh_store(pg_database_url)
    first, second = store.enqueue_many(
        [NewMessage("one", f"m{i}", concurrency_key="solo", concurrency_limit=1) for i in range(2)]
    )
    holder = children.start(
        "gate_holder", url=pg_database_url, prefix=store.tables.prefix, queue="one", lease_ms=2_000
    )
    report = children.expect(holder, "holding", 60)
    assert report["id"] == first
    os.kill(holder.pid, signal.SIGKILL)
    holder.process.join(10)
    assert store.claim(["one"], "heir", lease_ms=60_000) == []  # the place is still held
    got: list[Any] = []
    deadline = time.monotonic() + 15
    while not got and time.monotonic() < deadline:
        got = store.claim(["one"], "heir", lease_ms=60_000)
        time.sleep(0.05)
    [heir] = got
    assert (heir.id, heir.attempt) == (first, 2)  # the oldest first: the crashed delivery
    assert heir.lease_expires_at_ms - 60_000 >= report["expires"]
    assert store.claim(["one"], "other", lease_ms=60_000) == []
    assert store.ack([heir.fence]) == {first}
    [nxt] = store.claim(["one"], "other", lease_ms=60_000)
    assert nxt.id == second


@pytest.mark.timeout(180)
def test_racing_workers_never_exceed_a_rate_limit(
    pg_database_url: str,
    children: Children,  # noqa: F811
) -> None:
    """Judged from the claims' own times (the database's statement clock, which the rate
    limit compares with): deliveries of a task limited to 20/s start at least 50 ms apart."""
    from collections import Counter

    from sqlease.store import expand_event_rows

    store = fresh_store(pg_database_url)
    _make_log(store)
    store.set_rate_limits({"task:app.rated": "20/s"})
    rated = store.enqueue_many(
        [NewMessage("flow", f"rated:{i}", task_name="app.rated", record=False) for i in range(30)]
    )
    store.enqueue_many([NewMessage("flow", f"free:{i}", record=False) for i in range(60)])
    pack = children.start_many(
        PROCESSES,
        "gate_executor",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="flow",
        limit=BATCH,
        lease_ms=60_000,
        max_sleep_s=0.002,
    )
    children.release(pack)
    done = [children.expect(c, "result", 150) for c in pack.members]
    for c in pack.members:
        children.finish(c)
    assert sum(done) == 90
    ev = store.tables.events
    with store.engine.connect() as conn:
        rows = expand_event_rows(
            r._mapping for r in conn.execute(ev.select().where(ev.c.kind == "claimed"))
        )
        conn.rollback()
    at = {int(r["message_id"]): int(r["at_ms"]) for r in rows}
    times = sorted(at[i] for i in rated)
    assert len(times) == 30
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 50, f"two deliveries {min(gaps)} ms apart under a 20/s limit"
    # Meaningful only if the workers raced: rated claims came from several of them.
    owners = Counter(r["owner"] for r in _intervals(store) if r["message_id"] in set(rated))
    assert len(owners) > 1


@pytest.mark.timeout(120)
def test_racing_publishers_of_one_unique_key_enqueue_it_once(
    pg_database_url: str,
    children: Children,  # noqa: F811
) -> None:
    """Every process publishes the same 60 unique keys at once: each key gets one message,
    every other publish is a recorded duplicate of that message's task. Half the keys are
    already taken by a task that has died: there the racers must take the key over once,
    not once each."""
    store = fresh_store(pg_database_url)
    keys = [f"report:{i}" for i in range(60)]
    store.enqueue_many(
        [NewMessage("seed", f"0:{k}", task_id=f"0-{k}", unique_key=k) for k in keys[::2]]
    )
    for msg in store.claim(["seed"], "seeder", lease_ms=60_000, limit=100):
        assert store.fail(msg.fence, "seeded dead")
    pack = children.start_many(
        PROCESSES,
        "unique_publisher",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="u",
        keys=keys,
    )
    children.release(pack)
    assert [children.expect(c, "result", 90) for c in pack.members] == [len(keys)] * PROCESSES
    for c in pack.members:
        children.finish(c)
    m, d = store.tables.messages.name, store.tables.duplicates.name
    with store.engine.connect() as conn:
        per_key = conn.execute(
            text(
                f"SELECT split_part(payload, ':', 2) || ':' || split_part(payload, ':', 3), "
                f"count(*), min(task_id) FROM {m} WHERE state = 'ready' GROUP BY 1"
            )
        ).fetchall()
        duplicates = conn.execute(text(f"SELECT task_id, original_id FROM {d}")).fetchall()
    assert sorted(r[0] for r in per_key) == sorted(keys)
    assert all(r[1] == 1 for r in per_key), [r for r in per_key if r[1] != 1]
    original = {r[0]: r[2] for r in per_key}
    assert len(duplicates) == len(keys) * (PROCESSES - 1)
    for task_id, original_id in duplicates:
        assert original_id == original[task_id.split("-", 1)[1]]
