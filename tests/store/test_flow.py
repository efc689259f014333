"""Flow control in the claim, on both databases: per-key concurrency, limits per task name and
per queue, no head-of-line blocking, expired leases freeing their slot, runs unchanged."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from sqlease import ConfigurationError, NewMessage, Store
from sqlease.testing import FakeClock

LEASE = 10_000


def _put(
    store: Store,
    n: int,
    *,
    key: str | None = None,
    limit: int | None = None,
    queue: str = "q",
    task: str | None = None,
    run_id: str | None = None,
) -> list[int]:
    return store.enqueue_many(
        [
            NewMessage(
                queue,
                f"{key}-{i}",
                task_name=task,
                run_id=run_id,
                concurrency_key=key,
                concurrency_limit=limit,
            )
            for i in range(n)
        ]
    )


def _claim(store: Store, owner: str = "w", limit: int = 50, queues: list[str] | None = None):
    return store.claim(queues or ["q"], owner, lease_ms=LEASE, limit=limit)


def test_a_key_holds_at_most_its_limit_and_an_ack_frees_a_place(store: Store) -> None:
    _put(store, 5, key="tenant-1", limit=2)
    first = _claim(store)
    assert len(first) == 2
    assert _claim(store, "other") == []  # full, for every worker
    assert store.ack([first[0].fence]) == {first[0].id}
    [third] = _claim(store, "other")
    assert third.payload == "tenant-1-2"  # oldest first


def test_a_full_key_does_not_block_the_messages_behind_it(store: Store) -> None:
    """One claim reads the first rows in delivery order, so a key below its limit may crowd
    the rest of that batch out; the next claim skips the full key and takes what lies behind
    its backlog. A worker claims again at once when a claim brought anything."""
    _put(store, 40, key="hot", limit=1)
    _put(store, 3, key="cold", limit=5)
    _put(store, 2)  # no key
    got, claims = [], 0
    while batch := _claim(store, limit=10):
        got += batch
        claims += 1
    assert Counter(m.payload.split("-")[0] for m in got) == {"hot": 1, "cold": 3, "None": 2}
    assert claims <= 2
    assert _claim(store, "other", limit=10) == []  # the hot key is still full


def test_one_claim_fills_a_key_up_to_its_free_places_only(store: Store) -> None:
    _put(store, 10, key="k", limit=3)
    got = _claim(store, limit=2)
    assert len(got) == 2
    assert len(_claim(store, "x", limit=10)) == 1
    assert _claim(store, "y", limit=10) == []


def test_an_expired_lease_frees_its_place(store: Store, clock: FakeClock) -> None:
    _put(store, 3, key="k", limit=1)
    [held] = _claim(store, "dead-worker")
    assert _claim(store, "live") == []
    clock.advance(LEASE + 1)
    [again] = _claim(store, "live")
    assert again.id == held.id and again.attempt == 2  # the crashed delivery is taken over
    assert _claim(store, "another") == []  # and it holds the key's one place again
    assert store.ack([held.fence]) == set()  # the stale worker can no longer ack


def test_a_renewed_lease_keeps_its_place(store: Store, clock: FakeClock) -> None:
    _put(store, 2, key="k", limit=1)
    [held] = _claim(store)
    for _ in range(3):
        clock.advance(LEASE - 1000)
        assert store.renew([held.fence], lease_ms=LEASE)
        assert _claim(store, "other") == []


def test_a_checkpoint_renewal_keeps_its_place(store: Store, clock: FakeClock) -> None:
    _put(store, 2, key="k", limit=1)
    [held] = _claim(store)
    clock.advance(LEASE - 1000)
    result = store.compare_and_set(held.fence, "task-1", 0, checkpoint={"n": 1}, lease_ms=LEASE)
    assert result.outcome.value == "updated"
    clock.advance(2000)  # past the claim's expiry, within the checkpoint's
    assert _claim(store, "other") == []


def test_release_and_fail_free_the_place(store: Store) -> None:
    _put(store, 3, key="k", limit=1)
    [a] = _claim(store)
    store.release([a.fence])
    [b] = _claim(store)
    assert b.id == a.id
    store.fail(b.fence, reason="boom")
    [c] = _claim(store)
    assert c.id != a.id


def test_limits_are_per_key(store: Store) -> None:
    for k in range(20):
        _put(store, 3, key=f"tenant-{k}", limit=2)
    got = _claim(store, limit=100)
    assert Counter(m.payload.rsplit("-", 1)[0] for m in got) == {
        f"tenant-{k}": 2 for k in range(20)
    }


def test_a_task_name_limit_and_a_queue_limit(store: Store) -> None:
    store.set_limits({"task:app.resize": 2, "queue:images": 3})
    _put(store, 5, task="app.resize")
    _put(store, 5, task="app.other")
    got = _claim(store, limit=20)
    names = Counter(m.payload for m in got)
    assert len(got) == 7 and sum(1 for m in got if m.payload.startswith("None")) == 7
    _put(store, 6, queue="images", task="app.thumb")
    assert len(_claim(store, queues=["images"], limit=20)) == 3
    assert _claim(store, queues=["images"], limit=20) == []
    assert names  # (kept for the failure message)


def test_a_key_is_more_specific_than_its_task_limit(store: Store) -> None:
    store.set_limits({"task:app.t": 1})
    _put(store, 3, key="k", limit=3, task="app.t")
    assert len(_claim(store, limit=10)) == 3


def test_removing_a_limit_opens_the_gate(store: Store) -> None:
    store.set_limits({"queue:q": 1})
    _put(store, 3)
    assert len(_claim(store, limit=10)) == 1
    assert store.limits() == {"queue:q": 1}
    assert store.remove_limit("queue:q")
    assert len(_claim(store, limit=10)) == 2
    store.set_limits({"task:x": 4, "queue:q": 2})
    store.set_limits({"task:x": 5}, replace=True)
    assert store.limits() == {"task:x": 5}


def test_a_run_stays_ordered_under_a_key(store: Store) -> None:
    _put(store, 3, key="k", limit=5, run_id="r1")
    [head] = _claim(store, limit=10)
    assert head.payload == "k-0"
    assert _claim(store, "other", limit=10) == []
    store.ack([head.fence])
    [nxt] = _claim(store, limit=10)
    assert nxt.payload == "k-1"


def test_pausing_a_running_task_frees_its_place(store: Store) -> None:
    from sqlease import Admin

    ids = _put(store, 2, key="k", limit=1)
    [held] = _claim(store)
    assert held.id == ids[0]
    admin = Admin("unused", store=store)
    with store.engine.begin() as conn:
        conn.execute(
            store.tables.messages.update()
            .where(store.tables.messages.c.id == held.id)
            .values(task_id="t-held")
        )
    assert admin.pause("t-held") == 1
    [other] = _claim(store, "x")
    assert other.id == ids[1]


@pytest.mark.parametrize(
    ("key", "limit", "named"),
    [
        ("k", 0, "concurrency_limit"),
        ("k", -1, "concurrency_limit"),
        ("k", "3", "concurrency_limit"),
        ("k", True, "concurrency_limit"),
        (5, 2, "concurrency_key"),
        ("", 2, "concurrency_key"),
        ("k", None, "concurrency_limit"),
        (None, 2, "concurrency_key"),
    ],
)
def test_bad_concurrency_is_refused_and_nothing_is_enqueued(
    store: Store, key: object, limit: object, named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named):
        store.enqueue_many(
            [
                NewMessage("q", "ok"),
                NewMessage(
                    "q",
                    "x",
                    concurrency_key=key,  # type: ignore[arg-type]
                    concurrency_limit=limit,
                ),
            ]  # type: ignore[arg-type]
        )
    assert store.size("q") == 0


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"images": 3}, "'images'"),
        ({"queue:": 3}, "'queue:'"),
        ({"queue:images": 0}, "queue:images"),
        ({"task:t": "2"}, "task:t"),
        ([("queue:q", 2)], "mapping"),
    ],
)
def test_bad_limits_are_refused(store: Store, limits: object, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        store.set_limits(limits)  # type: ignore[arg-type]
    assert store.limits() == {}


def test_the_flow_migration_upgrades_the_schema_before_it(
    make_store: Callable[..., Store], db_url: str
) -> None:
    from sqlalchemy import inspect, text, update

    from sqlease._db.migrations import (
        CURRENT_VERSION,
        MIGRATIONS,
        _migration_flow_control,
        read_version,
    )

    old = make_store()
    old.enqueue("q", "kept")
    m = old.tables.messages.name
    version = MIGRATIONS.index(_migration_flow_control)  # the schema before flow control
    with old.engine.begin() as conn:
        for gate_index in ("messages_gate_ix", "messages_gate_ready_ix"):  # by dialect
            conn.execute(text(f"DROP INDEX IF EXISTS {old.tables.prefix}{gate_index}"))
        conn.execute(text(f"DROP INDEX {old.tables.prefix}messages_gate_wait_ix"))  # v13
        conn.execute(text(f"DROP INDEX {old.tables.prefix}messages_rate_wait_ix"))  # v13
        for column in ("task_name", "gate_key", "gate_limit", "gate", "rate_gate"):
            conn.execute(text(f"ALTER TABLE {m} DROP COLUMN {column}"))
        conn.execute(text(f"DROP TABLE {old.tables.slots.name}"))
        conn.execute(text(f"DROP TABLE {old.tables.flow_limits.name}"))
        conn.execute(update(old.tables.schema_version).values(version=version))
    new = make_store()
    with new.driver.reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        assert inspect(conn).has_table(new.tables.slots.name)
    _put(new, 2, key="k", limit=1)
    got = new.claim(["q"], "w", lease_ms=LEASE, limit=10)
    assert sorted(x.payload for x in got) == ["k-0", "kept"]


def test_admin_shows_each_gates_running_limit_and_waiting(store: Store) -> None:
    from sqlease import Admin

    admin = Admin("unused", store=store)
    admin.set_limits({"task:app.resize": 2, "queue:images": 1})
    _put(store, 4, key="tenant-1", limit=3)
    _put(store, 3, task="app.resize")
    _put(store, 2, queue="images")
    _claim(store, limit=3)
    _claim(store, limit=3)
    _claim(store, queues=["images"])
    states = {g.gate: g.to_dict() for g in admin.gates()}
    assert states["key:tenant-1"] == {
        "gate": "key:tenant-1",
        "running": 3,
        "limit": 3,
        "waiting": 1,
        "full": True,
    }
    assert states["task:app.resize"] == {
        "gate": "task:app.resize",
        "running": 2,
        "limit": 2,
        "waiting": 1,
        "full": True,
    }
    assert states["queue:images"]["running"] == 1 and states["queue:images"]["waiting"] == 1
    assert admin.limits() == {"queue:images": 1, "task:app.resize": 2}


# ---- rate limits -----------------------------------------------------------------------------


def test_a_rate_limit_lets_one_delivery_through_per_interval(
    store: Store, clock: FakeClock
) -> None:
    store.set_rate_limits({"task:app.api": "10/s"})  # one per 100 ms
    _put(store, 5, task="app.api")
    _put(store, 2, task="app.other")
    first = _claim(store, limit=10)
    assert sorted(m.payload.split("-")[0] for m in first) == ["None"] * 3
    assert sum(1 for m in first if m.id <= 5) == 1  # one of the rated task, the others free
    assert _claim(store, limit=10) == []
    clock.advance(99)
    assert _claim(store, limit=10) == []
    clock.advance(1)
    assert len(_claim(store, limit=10)) == 1
    clock.advance(1_000)  # no burst: an idle second does not save up deliveries
    assert len(_claim(store, limit=10)) == 1
    assert store.rate_limits()["task:app.api"]["rate"] == "10/s"


def test_a_queue_rate_and_a_key_rate(store: Store, clock: FakeClock) -> None:
    store.set_rate_limits({"queue:slow": "2/m", "key:api:pay": "1/s"})
    _put(store, 3, queue="slow")
    _put(store, 3, key="api:pay", limit=10)
    assert len(_claim(store, queues=["slow"], limit=10)) == 1
    assert len(_claim(store, limit=10)) == 1
    clock.advance(1_000)
    assert len(_claim(store, limit=10)) == 1
    assert _claim(store, queues=["slow"], limit=10) == []
    clock.advance(29_000)
    assert len(_claim(store, queues=["slow"], limit=10)) == 1


def test_a_rate_and_a_concurrency_limit_together(store: Store, clock: FakeClock) -> None:
    store.set_rate_limits({"task:app.t": "1/s"})
    store.set_limits({"task:app.t": 1})
    _put(store, 3, task="app.t")
    [a] = _claim(store)
    clock.advance(1_000)
    assert _claim(store) == []  # the rate allows one, the concurrency limit does not
    store.ack([a.fence])
    assert len(_claim(store)) == 1
    assert store.limits() == {"task:app.t": 1}
    store.set_limits({}, replace=True)
    assert store.limits() == {} and "task:app.t" in store.rate_limits()


@pytest.mark.parametrize(
    ("rates", "named"),
    [
        ({"task:x": "ten/s"}, "task:x"),
        ({"task:x": "10/d"}, "task:x"),
        ({"task:x": "0/s"}, "task:x"),
        ({"task:x": "-1/m"}, "task:x"),
        ({"task:x": True}, "task:x"),
        ({"task:x": "5000/s"}, "fastest"),
        ({"worker:x": "1/s"}, "'worker:x'"),
        ("10/s", "mapping"),
    ],
)
def test_bad_rates_are_refused(store: Store, rates: object, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        store.set_rate_limits(rates)  # type: ignore[arg-type]
    assert store.rate_limits() == {}


def test_an_idle_worker_is_told_when_a_rate_limit_reopens(store: Store, clock: FakeClock) -> None:
    store.set_rate_limits({"task:app.api": "2/s"})
    _put(store, 3, task="app.api")
    assert len(_claim(store)) == 1
    assert store.next_due_in_ms(["q"]) == 500  # the next delivery's moment, not a poll
    clock.advance(200)
    assert store.next_due_in_ms(["q"]) == 300
    store.enqueue("q", "later", delay_ms=100)
    assert store.next_due_in_ms(["q"]) == 100  # the sooner of the two


def test_a_held_task_gets_an_event_naming_the_limit(store: Store, clock: FakeClock) -> None:
    from sqlease._core.maintenance import run_pass

    store.set_rate_limits({"task:app.api": "1/m"})
    store.enqueue_many(
        [
            NewMessage("q", "k1", task_id="t-k1", concurrency_key="k", concurrency_limit=1),
            NewMessage("q", "k2", task_id="t-k2", concurrency_key="k", concurrency_limit=1),
            NewMessage("q", "a1", task_id="t-a1", task_name="app.api"),
            NewMessage("q", "a2", task_id="t-a2", task_name="app.api"),
        ]
    )
    assert len(_claim(store, limit=10)) == 2
    summary = run_pass(store, event_retention_ms=0)
    assert summary["waiting_for_limit"] == 2
    [held] = [e for e in store.events(task_id="t-k2") if e.kind == "waiting_for_limit"]
    assert held.data == {"limit": "key:k", "kind": "concurrency", "running": 1, "max": 1}
    [rated] = [e for e in store.events(task_id="t-a2") if e.kind == "waiting_for_limit"]
    assert rated.data["limit"] == "task:app.api" and rated.data["kind"] == "rate"
    assert rated.data["opens_at_ms"] == clock() + 60_000
    assert run_pass(store, event_retention_ms=0)["waiting_for_limit"] == 0  # once per attempt


def test_the_limits_verbs(
    make_store: Callable[..., Store], db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from sqlease.cli import main

    store = make_store(clock=None)  # the command reads the database's clock
    base = ["--url", db_url, "--table-prefix", store.tables.prefix]
    assert main([*base, "limits", "show"]) == 0
    assert "no concurrency or rate limits" in capsys.readouterr().out
    assert main([*base, "limits", "set", "queue:q", "1"]) == 0
    assert main([*base, "limits", "rate", "task:app.t", "10/s"]) == 0
    capsys.readouterr()
    _put(store, 3)
    _claim(store)
    assert main([*base, "--json", "limits", "show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["gates"] == [
        {"gate": "queue:q", "running": 1, "limit": 1, "waiting": 2, "full": True}
    ]
    assert shown["rates"]["task:app.t"]["rate"] == "10/s"
    assert main([*base, "limits", "show"]) == 0
    text = capsys.readouterr().out
    assert "queue:q" in text and "full" in text and "task:app.t" in text and "100 ms" in text
    assert main([*base, "limits", "set", "queue:q", "0"]) == 1
    assert "queue:q" in capsys.readouterr().err
    assert main([*base, "limits", "rate", "task:x", "fast"]) == 1
    assert main([*base, "limits", "remove", "queue:q"]) == 0
    assert store.limits() == {}
