"""Held work's lost wake-up (docs/explanation/held-work.md), with real processes racing on
PostgreSQL: publishers keep adding messages to a few hot runs while followers claim and ack
their heads, so that the enqueue into a run and the ack of its head meet thousands of times.
Nothing may stay parked with its run empty ahead of it, with no maintenance pass to repair
it; every message runs once, a run's messages one at a time and in each publisher's order."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

import pytest
from sqlalchemy import func, select

from sqlease import Store

from .test_store_processes import Children, children, fresh_store  # noqa: F401
from .workers import messages_left

pytestmark = [pytest.mark.pg, pytest.mark.concurrency]

RUNS = 6
PER_PUBLISHER = 1_500
PUBLISHERS = 2
FOLLOWERS = 3


def stuck_runs(store: Store) -> list[str]:
    with store.driver.reading() as conn:
        return [r.run_id for r in conn.execute(store.sql.stuck_runs)]


@pytest.mark.timeout(180)
def test_enqueues_and_acks_racing_on_run_heads_lose_no_promotion(
    pg_database_url: str,
    children: Children,  # noqa: F811
) -> None:
    store = fresh_store(pg_database_url)
    common = {"url": pg_database_url, "prefix": store.tables.prefix, "queue": "hot"}
    published = children.event()
    followers = children.start_many(
        FOLLOWERS,
        "run_follower",
        limit=8,
        lease_ms=60_000,
        published=published,
        quiet_s=1.0,
        **common,
    )
    publishers = children.start_many(
        PUBLISHERS, "run_publisher", runs=RUNS, count=PER_PUBLISHER, **common
    )
    children.release(followers)
    children.release(publishers)
    sent = [children.expect(p, "result", 120) for p in publishers.members]
    published.set()
    done = [children.expect(f, "result", 120) for f in followers.members]
    for child in (*publishers.members, *followers.members):
        children.finish(child)

    # Nothing waits: no run's head is parked, nothing is left (no maintenance pass ran).
    assert stuck_runs(store) == []
    assert messages_left(store) == 0

    executions = sorted((tuple(x) for r in done for x in r), key=lambda x: x[2])
    ids = [mid for batch in sent for _, mid in batch]
    assert len(ids) == PUBLISHERS * PER_PUBLISHER
    assert Counter(x[1] for x in executions) == Counter(ids), "a task ran twice or never"
    assert all(x[4] for x in executions), "an ack was refused"
    position = {x[1]: n for n, x in enumerate(executions)}
    per_run: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for x in executions:
        per_run[x[0]].append(x)
    for run_id, runs in per_run.items():
        for before, after in itertools.pairwise(runs):
            assert before[3] < after[2], f"{run_id}: {after[1]} started before {before[1]} ended"
    for batch in sent:  # each publisher's messages of a run run in its publish order
        by_run: dict[str, list[int]] = defaultdict(list)
        for run_id, mid in batch:
            by_run[run_id].append(mid)
        for run_id, mids in by_run.items():
            order = [position[m] for m in mids]
            assert order == sorted(order), f"{run_id} ran out of publish order"


KEYS = 4
KEY_LIMIT = 2


def parked_at_gates(store: Store) -> int:
    m = store.tables.messages
    with store.driver.reading() as conn:
        return int(
            conn.execute(
                select(func.count()).where(m.c.state == "parked", m.c.reason == "gate")
            ).scalar_one()
        )


@pytest.mark.timeout(180)
def test_sweeps_and_acks_racing_on_a_gate_s_last_place_lose_no_promotion(
    pg_database_url: str,
    children: Children,  # noqa: F811
) -> None:
    """Followers claim, sweep and ack at once while publishers keep adding messages under a
    few keys of limit 2: a sweep that parks a key's messages and the ack that frees its last
    place meet thousands of times. Nothing may stay parked (no maintenance pass runs), no
    key may ever run more than its limit at once, and every message runs once."""
    store = fresh_store(pg_database_url)
    common = {"url": pg_database_url, "prefix": store.tables.prefix, "queue": "gated"}
    published = children.event()
    followers = children.start_many(
        FOLLOWERS,
        "run_gate_follower",
        limit=8,
        lease_ms=60_000,
        published=published,
        quiet_s=1.5,
        **common,
    )
    publishers = children.start_many(
        PUBLISHERS,
        "run_gate_publisher",
        keys=KEYS,
        limit=KEY_LIMIT,
        count=PER_PUBLISHER // 2,
        **common,
    )
    children.release(followers)
    children.release(publishers)
    sent = [children.expect(p, "result", 120) for p in publishers.members]
    published.set()
    done = [children.expect(f, "result", 120) for f in followers.members]
    for child in (*publishers.members, *followers.members):
        children.finish(child)

    assert parked_at_gates(store) == 0, "a message stayed parked at a gate with room"
    assert messages_left(store) == 0
    executions = [tuple(x) for r in done for x in r]
    ids = [mid for batch in sent for _, mid in batch]
    assert Counter(x[1] for x in executions) == Counter(ids), "a task ran twice or never"
    assert all(x[4] for x in executions), "an ack was refused"
    # Never more than the limit at once per key, judged from the recorded intervals.
    per_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, _mid, start, end, _ok in executions:
        per_key[str(key)].append((int(start), int(end)))
    for key, spans in per_key.items():
        edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
        running = peak = 0
        for _, step in edges:
            running += step
            peak = max(peak, running)
        assert peak <= KEY_LIMIT, f"{key} ran {peak} at once"
