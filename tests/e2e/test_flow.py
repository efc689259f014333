"""Concurrency limits under real prefork workers: a key's tasks never run more at once than
its limit, across two workers, whether the key comes from the headers or from the task's own
options; other keys' tasks and ungated tasks run alongside."""

from __future__ import annotations

import itertools

import pytest

from sqlease import ConfigurationError

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


def _peak(rows: list[dict[str, float]]) -> int:
    points = sorted([(r["started"], 1) for r in rows] + [(r["ended"], -1) for r in rows])
    now = peak = 0
    for _, step in points:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.timeout(120)
def test_a_key_runs_at_most_its_limit_across_workers(e2e: E2E) -> None:
    e2e.start_worker(concurrency=3, E2E_PREFETCH_MULTIPLIER=1)
    e2e.start_worker(concurrency=3, E2E_PREFETCH_MULTIPLIER=1)
    app = e2e.app()
    sleep = app.tasks["e2e.sleep"]
    for _i in range(8):
        sleep.apply_async(
            (0.2,), {"label": "hot"}, headers={"concurrency_key": "hot", "concurrency_limit": 2}
        )
    for _i in range(4):
        sleep.apply_async((0.2,), {"label": "free"})
    wait_for(lambda: len(e2e.finished()) == 12, 60, "every task to finish")
    hot = e2e.finished(label="hot")
    free = e2e.finished(label="free")
    assert _peak(hot) == 2, "the key ran more (or fewer) than its limit at once"
    assert _peak(free) >= 2
    assert {r["attempt"] for r in hot + free} == {1}


@pytest.mark.timeout(120)
def test_the_tasks_own_key_serializes_each_tenant(e2e: E2E) -> None:
    e2e.start_worker(concurrency=4, E2E_PREFETCH_MULTIPLIER=1)
    app = e2e.app()
    task = app.tasks["e2e.tenant_sleep"]
    for _ in range(4):
        for tenant in ("a", "b"):
            task.delay(tenant, 0.15)
    wait_for(lambda: len(e2e.finished()) == 8, 60, "every task to finish")
    a, b = e2e.finished(label="a"), e2e.finished(label="b")
    assert _peak(a) == 1 and _peak(b) == 1
    assert _peak(a + b) == 2  # the two tenants ran side by side


def test_a_bad_key_is_refused_at_publish(e2e: E2E) -> None:
    app = e2e.app()
    with pytest.raises(ConfigurationError, match="concurrency_limit"):
        app.tasks["e2e.sleep"].apply_async(
            (0.1,), headers={"concurrency_key": "k", "concurrency_limit": 0}
        )
    with pytest.raises(ConfigurationError, match="concurrency_key"):
        app.tasks["e2e.tenant_sleep"].delay("x" * 300, 0.1)  # a key too long
    assert e2e.store.size("celery") == 0


@pytest.mark.timeout(120)
def test_a_tasks_rate_limit_holds_across_two_workers(e2e: E2E) -> None:
    """With ``cluster_rate_limits``, ``@app.task(rate_limit="5/s")`` is one limit for the
    whole cluster: two workers together start a delivery at most every 200 ms."""
    opts = '{"cluster_rate_limits": true}'
    e2e.start_worker(concurrency=2, E2E_TRANSPORT_OPTIONS=opts)
    e2e.start_worker(concurrency=2, E2E_TRANSPORT_OPTIONS=opts)
    app = e2e.app()
    # Enough of them that each worker wins some of the claims (with 8, one SQLite worker
    # once won them all on a slow machine).
    for _ in range(16):
        app.tasks["e2e.rated"].delay()
    wait_for(lambda: len(e2e.finished(name="e2e.rated")) == 16, 60, "the rated tasks")
    rows = e2e.finished(name="e2e.rated")
    claimed = sorted(
        e.at_ms for r in rows for e in e2e.store.events(task_id=r["task_id"]) if e.kind == "claimed"
    )
    assert len(claimed) == 16
    gaps = [b - a for a, b in itertools.pairwise(claimed)]
    assert min(gaps) >= 200, gaps  # by the database's clock, which the limit compares with
    assert len({r["hostname"] for r in rows}) == 2


@pytest.mark.timeout(120)
def test_a_queue_limit_from_the_transport_options_holds_across_two_workers(e2e: E2E) -> None:
    """``concurrency_limits`` and ``rate_limits`` given as transport options (mappings) are
    written by each consuming worker at start; a queue limit of 2 holds across two workers
    with three processes each."""
    opts = '{"concurrency_limits": {"queue:celery": 2}, "rate_limits": {"key:never-used": "10/s"}}'
    e2e.start_worker(concurrency=3, E2E_PREFETCH_MULTIPLIER=1, E2E_TRANSPORT_OPTIONS=opts)
    e2e.start_worker(concurrency=3, E2E_PREFETCH_MULTIPLIER=1, E2E_TRANSPORT_OPTIONS=opts)
    app = e2e.app()
    for _ in range(8):
        app.tasks["e2e.sleep"].apply_async((0.2,), {"label": "q"})
    wait_for(lambda: len(e2e.finished(label="q")) == 8, 60, "every task to finish")
    rows = e2e.finished(label="q")
    assert _peak(rows) == 2, "the queue ran more (or fewer) than its limit at once"
    admin = e2e.admin
    assert admin.limits() == {"queue:celery": 2}
    assert set(admin.rate_limits()) == {"key:never-used"}
