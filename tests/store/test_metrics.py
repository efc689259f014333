"""``sqlease.metrics`` on both databases: every gauge and counter after real operations through
Store and Admin, counters that survive the retention's deletes, and a scrape of a database
that does not answer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import generate_latest

from sqlease._core.maintenance import run_pass
from sqlease._db.postgresql.dialect import EVENT_SETTLE_MS
from sqlease.admin import Admin
from sqlease.metrics import COUNTERS, build_registry
from sqlease.store import Store
from sqlease.testing import FakeClock

DAY = 86_400_000


def scrape(admin: Admin, *, per_owner: bool = False) -> dict[tuple[str, tuple], float]:
    """Every sample of one scrape, by (name, sorted labels)."""
    registry = build_registry(admin, per_owner=per_owner)
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def tasks(found: dict, queue: str, state: str) -> float:
    return found[("sqlease_tasks", (("queue", queue), ("state", state)))]


@pytest.fixture
def admin(make_store: Callable[..., Store]) -> Admin:
    store = make_store()
    return Admin(store.engine.url, store=store)


def test_the_gauges(admin: Admin, clock: FakeClock) -> None:
    store = admin.store
    store.declare_queue("empty")
    store.enqueue("q", "{}", task_id="queued")
    clock.advance(4000)
    store.enqueue("q", "{}", task_id="later", delay_ms=60_000)
    store.enqueue("q", "{}", task_id="held")
    store.enqueue("q", "{}", task_id="paused")
    store.enqueue("q", "{}", task_id="cancelled")
    store.enqueue("other", "{}", task_id="elsewhere")
    admin.pause("paused")
    admin.cancel("cancelled")
    # the oldest ready message is leased below, so the next one sets the age
    [held] = store.claim(["q"], "w1:1:a", lease_ms=30_000)
    assert held.task_id == "queued"
    [other] = store.claim(["other"], "w2:2:b", lease_ms=30_000)
    clock.advance(1500)
    found = scrape(admin, per_owner=True)
    assert tasks(found, "q", "queued") == 1  # "held" (claimed "queued" is running)
    assert tasks(found, "q", "scheduled") == 1
    assert tasks(found, "q", "running") == 1
    assert tasks(found, "q", "paused") == 1
    assert tasks(found, "q", "cancelled") == 1
    assert tasks(found, "q", "failed") == 0
    assert tasks(found, "other", "running") == 1
    assert all(tasks(found, "empty", s) == 0 for s in ("queued", "running", "failed"))
    assert found[("sqlease_oldest_ready_age_seconds", (("queue", "q"),))] == 1.5
    assert found[("sqlease_oldest_ready_age_seconds", (("queue", "empty"),))] == 0
    assert found[("sqlease_live_leases", ())] == 2
    held_q = {
        r: found[("sqlease_held_tasks", (("queue", "q"), ("reason", r)))]
        for r in ("run", "gate", "rate")
    }
    assert held_q == {"run": 0, "gate": 0, "rate": 0}
    assert found[("sqlease_lease_owners", ())] == 2
    assert found[("sqlease_owner_live_leases", (("owner", "w1:1:a"),))] == 1
    assert found[("sqlease_up", ())] == 1
    assert found[("sqlease_scrape_duration_seconds", ())] > 0
    store.ack([held.fence, other.fence])
    after = scrape(admin)
    assert after[("sqlease_live_leases", ())] == 0
    assert not any(name == "sqlease_owner_live_leases" for name, _ in after)  # opt-in


def test_waiting_and_failed_tasks(admin: Admin, clock: FakeClock) -> None:
    store = admin.store
    store.enqueue("q", "{}", task_id="asks", max_attempts=5)
    store.enqueue("q", "{}", task_id="dies", max_attempts=1)
    for _ in range(2):
        [m] = store.claim(["q"], "w", lease_ms=1000)
        if m.task_id == "asks":
            store.park(m.fence, "waiting_approval")
    clock.advance(2000)  # the lease of "dies" runs out with its budget spent
    assert store.claim(["q"], "w", lease_ms=1000) == []
    found = scrape(admin)
    assert tasks(found, "q", "waiting_approval") == 1
    assert tasks(found, "q", "waiting_input") == 0
    assert tasks(found, "q", "failed") == 1


def counter(found: dict, name: str) -> float:
    return found[(f"{name}_total", ())]


def test_the_counters_after_real_operations(admin: Admin, clock: FakeClock) -> None:
    store = admin.store
    for i in range(4):
        store.enqueue("q", "{}", task_id=f"t{i}", max_attempts=1 if i == 3 else 3)
    store.enqueue("q", "{}", task_id="c")
    admin.cancel("c")
    a, b, c, d = store.claim(["q"], "w", lease_ms=1000, limit=4)
    store.ack([a.fence, b.fence])
    store.release([c.fence])  # back to ready, claimable again
    store.record_event("lease_lost", {"owner": "w"}, task_id=d.task_id, attempt=1)
    clock.advance(2000)  # d's lease runs out, its budget spent: exhausted at the next claim
    [again] = store.claim(["q"], "w", lease_ms=1000, limit=4)
    assert again.task_id == c.task_id
    clock.advance(EVENT_SETTLE_MS)
    found = scrape(admin)
    assert counter(found, "sqlease_enqueued") == 5
    assert counter(found, "sqlease_claimed") == 5  # four, then c again
    assert counter(found, "sqlease_acked") == 2
    assert counter(found, "sqlease_released") == 1
    assert counter(found, "sqlease_exhausted") == 1
    assert counter(found, "sqlease_lease_lost") == 1
    assert counter(found, "sqlease_cancelled") == 1
    again_found = scrape(admin)  # a scrape with nothing new adds nothing
    assert all(counter(again_found, n) == counter(found, n) for n in COUNTERS)


def test_counters_survive_the_retention(admin: Admin, clock: FakeClock) -> None:
    store = admin.store
    store.enqueue("q", "{}", task_id="t")
    [m] = store.claim(["q"], "w", lease_ms=1000)
    store.ack([m.fence])
    clock.advance(EVENT_SETTLE_MS)
    assert counter(scrape(admin), "sqlease_acked") == 1
    clock.advance(2 * DAY)
    assert run_pass(store, event_retention_ms=DAY)["events_expired"] >= 1
    assert store.events(task_id="t") == []
    store.enqueue("q", "{}", task_id="u")
    clock.advance(EVENT_SETTLE_MS)
    found = scrape(admin)
    assert counter(found, "sqlease_acked") == 1  # not back to 0
    assert counter(found, "sqlease_enqueued") == 2


def test_recent_events_wait_to_settle_on_postgresql(admin: Admin, clock: FakeClock) -> None:
    store = admin.store
    store.enqueue("q", "{}", task_id="t")
    now = counter(scrape(admin), "sqlease_enqueued")
    # SQLite's single writer makes ids visible in order: counted at once. PostgreSQL waits
    # EVENT_SETTLE_MS, in case an older id's transaction has yet to commit.
    assert now == (1 if store.driver.caps.single_writer else 0)
    clock.advance(EVENT_SETTLE_MS)
    assert counter(scrape(admin), "sqlease_enqueued") == 1


def test_an_unreachable_database_scrapes_as_down(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'gone.db'}")
    admin = Admin(store.engine.url, store=store)
    (tmp_path / "gone.db").unlink()
    store.engine.dispose()
    text = generate_latest(build_registry(admin)).decode()
    assert "sqlease_up 0.0" in text and "sqlease_tasks" not in text


def test_every_counter_is_documented() -> None:
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs/reference/metrics.md").read_text()
    names = [f"{n}_total" for n in COUNTERS] + [
        "sqlease_tasks",
        "sqlease_oldest_ready_age_seconds",
        "sqlease_held_tasks",
        "sqlease_live_leases",
        "sqlease_lease_owners",
        "sqlease_owner_live_leases",
        "sqlease_up",
        "sqlease_scrape_duration_seconds",
    ]
    assert [n for n in names if f"`{n}`" not in page] == []


def test_held_tasks_per_reason(admin: Admin) -> None:
    from sqlease import NewMessage

    store = admin.store
    store.enqueue_many(
        [NewMessage("q", "{}", concurrency_key="k", concurrency_limit=1) for _ in range(3)]
        + [NewMessage("q", "{}", run_id="r") for _ in range(2)]
    )
    store.claim(["q"], "w1:1:a", lease_ms=30_000, limit=10)
    store.park_held(["q"])
    found = scrape(admin)
    held = {
        r: found[("sqlease_held_tasks", (("queue", "q"), ("reason", r)))]
        for r in ("run", "gate", "rate")
    }
    assert held == {"run": 1, "gate": 2, "rate": 0}
    assert tasks(found, "q", "queued") == 3
