"""Priorities, queues and routing, and purging, through real workers."""

from __future__ import annotations

import itertools
import re

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_backlog_runs_highest_priority_first(e2e: E2E) -> None:
    app = e2e.app()
    add = app.tasks["e2e.add"]
    priorities = [3, 0, 9, 5, 0, 7, 1, 9, 2, 5, 6, 0]
    for index, priority in enumerate(priorities):  # the backlog, before any worker runs
        add.apply_async((index, 0), {"label": str(index)}, priority=priority)

    e2e.start_worker(concurrency=1, E2E_PREFETCH_MULTIPLIER=1)
    rows = wait_for(
        lambda: (r := e2e.finished()) and len(r) == len(priorities) and r,
        30,
        "the backlog to run",
    )
    order = [int(r["label"]) for r in rows]
    expected = sorted(range(len(priorities)), key=lambda i: (-priorities[i], i))
    assert order == expected, [priorities[i] for i in order]
    # one at a time: each started after the previous one ended
    assert all(b["started"] >= a["ended"] for a, b in itertools.pairwise(rows))


@pytest.mark.timeout(120)
def test_queues_and_task_routes(e2e: E2E) -> None:
    worker = e2e.start_worker(concurrency=2, queues="a,b")
    app = e2e.app()
    sent = {
        "route_a": [app.tasks["e2e.route_a"].delay() for _ in range(3)],
        "route_b": [app.tasks["e2e.route_b"].delay() for _ in range(3)],
        "add_to_b": [app.tasks["e2e.add"].apply_async((1, 1), queue="b")],
        "add_to_c": [app.tasks["e2e.add"].apply_async((1, 2), queue="c")],  # nobody consumes c
        "default": [app.tasks["e2e.add"].delay(1, 3)],  # the 'celery' queue: not consumed
    }
    wait_for(lambda: len(e2e.finished()) >= 7, 30, "the tasks of queues a and b")

    def routing_keys(name: str) -> list[str]:
        return [
            row["routing_key"] for result in sent[name] for row in e2e.finished(task_id=result.id)
        ]

    assert routing_keys("route_a") == ["a"] * 3
    assert routing_keys("route_b") == ["b"] * 3
    assert routing_keys("add_to_b") == ["b"]
    assert {r["hostname"] for r in e2e.finished()} == {worker.nodename}
    # the other queues keep their tasks, ready for a worker that consumes them
    assert e2e.store.size("c") == 1
    assert e2e.store.size("celery") == 1
    assert routing_keys("add_to_c") == [] and routing_keys("default") == []

    other = e2e.start_worker(queues="c")
    wait_for(lambda: routing_keys("add_to_c") == ["c"], 30, "queue c to be served")
    assert e2e.finished(task_id=sent["add_to_c"][0].id)[0]["hostname"] == other.nodename
    assert e2e.store.size("celery") == 1


@pytest.mark.timeout(120)
def test_purge_removes_ready_tasks_only_and_counts_them(e2e: E2E) -> None:
    e2e.start_worker(concurrency=1, E2E_PREFETCH_MULTIPLIER=1)
    app = e2e.app()
    release = e2e.tmp / "release"
    running = app.tasks["e2e.block"].delay(str(release))
    wait_for(lambda: e2e.executions(task_id=running.id), 30, "the blocking task to start")
    add = app.tasks["e2e.add"]

    # The worker holds the running task's lease and has no credit for more: the rest wait.
    queued = [add.delay(i, i) for i in range(3)]
    assert app.control.purge() == 3
    queued += [add.delay(i, i) for i in range(5)]
    output = e2e.celery("purge", "-f")
    assert re.search(r"Purged 5 messages from \d+ known task queues?\.", output), output
    assert app.control.purge() == 0

    # the leased (running) task was left to its worker, which finishes and acks it
    assert not e2e.finished(task_id=running.id)
    release.touch()
    wait_for(lambda: e2e.finished(task_id=running.id), 30, "the blocking task to finish")
    e2e.wait_acked(running.id)
    sentinel = add.delay(0, 0)
    wait_for(lambda: e2e.finished(task_id=sentinel.id), 30, "a task sent after the purge")
    assert [r["task_id"] for r in e2e.executions()] == [running.id, sentinel.id]
    assert all("purged" in [e.kind for e in e2e.store.events(task_id=r.id)] for r in queued)
