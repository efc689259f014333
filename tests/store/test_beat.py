"""sqlease's beat against a fake clock, on SQLite and PostgreSQL: the leader lease, config
sync, firing each slot once, runtime edits, a stale leader refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from sqlalchemy import select

from conftest import unique_prefix
from sqlease.beat import Scheduler, slot_task_id
from sqlease.errors import InvalidSchedule, LeadershipLost
from sqlease.testing import FakeClock

START = 1_767_268_800_000  # 2026-01-01 12:00:00 UTC


def _tick(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def beat_clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
def make_app(db_url: str) -> Callable[..., Celery]:
    prefix = unique_prefix()

    def build(schedule: dict[str, Any] | None = None, **conf: Any) -> Celery:
        app = Celery("beat_test", set_as_current=False)
        app.conf.broker_url = f"sqlease+{db_url}"
        app.conf.broker_transport_options = {"table_prefix": prefix}
        app.conf.result_backend = None
        app.conf.beat_schedule = schedule or {}
        app.conf.timezone = "UTC"
        app.conf.update(conf)

        app.task(name="beat_test.tick")(_tick)
        return app

    return build


@pytest.fixture
def schedulers() -> Iterator[list[Scheduler]]:
    made: list[Scheduler] = []
    yield made
    for s in made:
        s.close()


def scheduler(app: Celery, clock: FakeClock, made: list[Scheduler], owner: str = "b1") -> Scheduler:
    s = Scheduler(app, clock=clock, owner=owner)
    made.append(s)
    return s


def sent(s: Scheduler) -> list[tuple[str, str]]:
    """(task_id, queue) of every message the beat enqueued, in order."""
    m = s.entries.store.tables.messages
    with s.entries.store.driver.reading() as conn:
        rows = conn.execute(select(m.c.task_id, m.c.queue).order_by(m.c.id)).all()
    return [(r[0], r[1]) for r in rows]


def payload_of(s: Scheduler, task_id: str) -> dict[str, Any]:
    import json

    m = s.entries.store.tables.messages
    with s.entries.store.driver.reading() as conn:
        text = conn.execute(select(m.c.payload).where(m.c.task_id == task_id)).scalar_one()
    return json.loads(text)


EVERY_MINUTE = {"task": "beat_test.tick", "schedule": 60.0}


def test_one_leader_fires_each_slot_once(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    app = make_app({"m": EVERY_MINUTE})
    a = scheduler(app, beat_clock, schedulers, "a")
    b = scheduler(make_app({"m": EVERY_MINUTE}), beat_clock, schedulers, "b")
    b.entries  # noqa: B018 - same database, other app object
    a.tick()  # a leads, syncs, plans the first slot at START + 60 s
    b.tick()  # b stands by
    assert a.term is not None and b.term is None
    assert sent(a) == []
    for minute in range(1, 6):
        beat_clock.set(START + minute * 60_000)
        a.tick()
        b.tick()
        a.tick()
    prefix = a.entries.store.tables.prefix
    expected = [slot_task_id(prefix, "m", START + i * 60_000) for i in range(1, 6)]
    assert [t for t, _ in sent(a)] == expected
    entry = a.entries.require("m")
    assert entry.total_run_count == 5 and entry.last_task_id == expected[-1]
    # linked both ways: the entry's timeline names the task, the task's names the entry
    fired = [e for e in a.entries.store.events(task_id="schedule:m") if e.kind == "fired"]
    assert [e.data["task_id"] for e in fired] == expected
    own = a.entries.store.events(task_id=expected[0])
    assert {"kind": "sent_by_schedule", "data": {"schedule": "m", "slot_ms": START + 60_000}} in [
        {"kind": e.kind, "data": e.data} for e in own
    ]
    assert entry.next_run_at_ms == START + 6 * 60_000


def test_a_standby_takes_over_when_the_lease_expires_and_the_stale_leader_is_refused(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    conf = {"sqlease_beat_lease_seconds": 10}
    a = scheduler(make_app({"m": EVERY_MINUTE}, **conf), beat_clock, schedulers, "a")
    b = scheduler(make_app({"m": EVERY_MINUTE}, **conf), beat_clock, schedulers, "b")
    a.tick()
    stale = a.term
    assert stale is not None
    beat_clock.advance(9_000)
    b.tick()
    assert b.term is None  # the lease still holds
    beat_clock.advance(2_000)  # a stalled past its lease
    b.tick()
    assert b.term is not None and b.term.term == stale.term + 1
    with pytest.raises(LeadershipLost), a.entries.firing(stale, 10_000):
        pass
    assert not a.entries.renew(stale, 10_000)
    while beat_clock() < START + 60_000:
        beat_clock.advance(3_000)
        b.tick()
    a.tick()  # a wakes up: its renewal is refused, it stands by
    assert a.term is None
    assert len(sent(b)) == 1


def test_a_leader_past_its_lease_with_no_takeover_renews_it_and_keeps_its_term(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    """A leader whose transaction waited on a lock, or ran past its lease, would otherwise
    give the lease up to nobody and take it again under a new term."""
    conf = {"sqlease_beat_lease_seconds": 10}
    a = scheduler(make_app({"m": EVERY_MINUTE}, **conf), beat_clock, schedulers, "a")
    b = scheduler(make_app({"m": EVERY_MINUTE}, **conf), beat_clock, schedulers, "b")
    a.tick()
    held = a.term
    assert held is not None
    beat_clock.advance(25_000)  # past the lease; no standby has tried yet
    with a.entries.firing(held, 10_000):
        pass  # renewed, with the same term
    b.tick()
    assert b.term is None  # the renewal counts: no takeover
    beat_clock.set(START + 60_000)
    a.tick()
    assert a.term == held
    assert len(sent(a)) == 1
    beat_clock.advance(11_000)
    b.tick()  # now it has expired and a standby takes it: the old term is refused
    assert b.term is not None and b.term.term == held.term + 1
    assert not a.entries.renew(held, 10_000)


def test_missed_slots_follow_the_entry_policy(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    entries = {
        "once": dict(EVERY_MINUTE),
        "skip": dict(EVERY_MINUTE, catch_up="skip"),
        "all": dict(EVERY_MINUTE, catch_up="all", catch_up_limit=3),
    }
    s = scheduler(make_app(entries, sqlease_beat_grace_seconds=30), beat_clock, schedulers)
    s.tick()
    beat_clock.set(START + 10 * 60_000 + 45_000)  # ten slots came; the last is 45 s late
    s.tick()
    prefix = s.entries.store.tables.prefix
    ids = {t for t, _ in sent(s)}
    assert ids == {slot_task_id(prefix, "once", START + 600_000)} | {
        slot_task_id(prefix, "all", START + i * 60_000) for i in (8, 9, 10)
    }
    for name in entries:
        assert s.entries.require(name).next_run_at_ms == START + 660_000
    kinds = [e.kind for e in s.entries.store.events(task_id="schedule:skip")]
    assert "slots_skipped" in kinds


def test_config_sync_adds_changes_removes_and_keeps_runtime_entries(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    from sqlease.admin import Admin

    first = scheduler(make_app({"a": EVERY_MINUTE, "b": EVERY_MINUTE}), beat_clock, schedulers)
    first.tick()
    admin = Admin(first.entries.store.engine.url, store=first.entries.store)
    admin.add_schedule("runtime", "beat_test.tick", every=300)
    first.close()
    second = scheduler(
        make_app({"a": dict(EVERY_MINUTE, schedule=crontab(minute="*/5")), "c": EVERY_MINUTE}),
        beat_clock,
        schedulers,
        "second",
    )
    second.tick()
    names = {e.name for e in second.entries.all()}
    assert names == {"a", "c", "runtime", "celery.backend_cleanup"}  # as Celery installs it
    assert second.entries.require("a").schedule["kind"] == "crontab"
    assert second.entries.require("a").next_run_at_ms == START + 5 * 60_000


def test_runtime_edits_count_at_the_next_tick(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    from sqlease.admin import Admin

    s = scheduler(make_app({"m": EVERY_MINUTE}), beat_clock, schedulers)
    s.tick()
    admin = Admin(s.entries.store.engine.url, store=s.entries.store)
    admin.disable_schedule("m")
    beat_clock.set(START + 120_000)
    s.tick()
    assert sent(s) == []
    admin.enable_schedule("m")
    s.tick()  # planned again from now: the disabled time is not caught up
    assert s.entries.require("m").next_run_at_ms == START + 180_000
    admin.update_schedule("m", options={"queue": "reports", "priority": 3})
    admin.run_schedule("m")
    s.tick()
    ((task_id, queue),) = sent(s)
    assert queue == "reports"
    assert payload_of(s, task_id)["headers"]["sqlease_schedule"] == "m"
    listed = {e["name"]: e for e in admin.list_schedules()}
    assert listed["m"]["last_task_id"] == task_id and listed["m"]["total_run_count"] == 1
    admin.remove_schedule("m")
    beat_clock.set(START + 600_000)
    s.tick()
    assert len(sent(s)) == 1


def test_entry_options_reach_the_message(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    entry = dict(
        EVERY_MINUTE,
        args=[1, "two"],
        kwargs={"k": 3},
        options={
            "queue": "nightly",
            "priority": 7,
            "expires": 30,
            "headers": {"run_id": "tenant-1", "x-mine": "y"},
        },
    )
    s = scheduler(make_app({"m": entry}), beat_clock, schedulers)
    s.tick()
    beat_clock.set(START + 60_000)
    s.tick()
    ((task_id, queue),) = sent(s)
    assert queue == "nightly"
    message = payload_of(s, task_id)
    headers = message["headers"]
    assert headers["task"] == "beat_test.tick" and headers["id"] == task_id
    assert headers["run_id"] == "tenant-1" and headers["x-mine"] == "y"
    assert headers["expires"] is not None and headers["celery_beat_task"] is True
    assert message["properties"]["priority"] == 7
    m = s.entries.store.tables.messages
    with s.entries.store.driver.reading() as conn:
        run_id = conn.execute(select(m.c.run_id).where(m.c.task_id == task_id)).scalar_one()
    assert run_id == "tenant-1"


def test_a_bad_config_entry_stops_beat_at_start(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    app = make_app({"bad": {"task": "beat_test.tick", "schedule": -1}})
    with pytest.raises(InvalidSchedule, match=r"'bad'.*schedule"):
        scheduler(app, beat_clock, schedulers)


def test_a_send_that_fails_loses_no_slot(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    from sqlease.admin import Admin

    s = scheduler(
        make_app({"m": dict(EVERY_MINUTE, options={"serializer": "nope"})}), beat_clock, schedulers
    )
    s.tick()
    beat_clock.set(START + 60_000)
    s.tick()
    assert sent(s) == []
    assert s.entries.require("m").next_run_at_ms == START + 60_000  # still due
    kinds = [e.kind for e in s.entries.store.events(task_id="schedule:m")]
    assert "fire_failed" in kinds
    Admin(s.entries.store.engine.url, store=s.entries.store).update_schedule("m", options={})
    s._backoff.clear()
    s.tick()
    assert [t for t, _ in sent(s)] == [
        slot_task_id(s.entries.store.tables.prefix, "m", START + 60_000)
    ]


def test_the_tick_reads_only_due_entries(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    many = {f"e{i}": dict(EVERY_MINUTE, schedule=3600.0) for i in range(50)}
    many["soon"] = EVERY_MINUTE
    s = scheduler(make_app(many), beat_clock, schedulers)
    s.tick()
    beat_clock.set(START + 60_000)
    assert [e.name for e in s.entries.due(beat_clock(), 200)] == ["soon"]
    wait = s.tick()
    assert 0 < wait <= 10.0
    assert len(sent(s)) == 1


def test_admin_refuses_a_task_the_beat_app_does_not_know(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    from sqlease.admin import Admin

    s = scheduler(make_app({}), beat_clock, schedulers)
    s.tick()  # the leader publishes its app's task names
    admin = Admin(s.entries.store.engine.url, store=s.entries.store)
    with pytest.raises(InvalidSchedule, match=r"did you mean beat_test\.tick") as raised:
        admin.add_schedule("x", "beat_test.tik", every=10)
    assert raised.value.field == "task"
    admin.add_schedule("x", "beat_test.tik", every=10, check_task=False)  # on purpose
    assert admin.beat_leader()["owner"] == "b1"


def test_a_bad_entry_in_a_batch_holds_back_only_itself(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    entries = {f"good{i}": EVERY_MINUTE for i in range(5)}
    entries["bad"] = dict(EVERY_MINUTE, options={"serializer": "nope"})
    s = scheduler(make_app(entries), beat_clock, schedulers)
    s.tick()
    beat_clock.set(START + 60_000)
    s.tick()
    prefix = s.entries.store.tables.prefix
    assert {t for t, _ in sent(s)} == {
        slot_task_id(prefix, f"good{i}", START + 60_000) for i in range(5)
    }
    assert s.entries.require("bad").next_run_at_ms == START + 60_000


def test_a_full_batch_of_new_entries_ticks_again_at_once(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    from sqlease.beat._scheduler import BATCH

    many = {f"e{i:04d}": EVERY_MINUTE for i in range(BATCH + 10)}
    s = scheduler(make_app(many), beat_clock, schedulers)
    assert s.tick() == 0.0  # a full batch planned: more are waiting
    s.tick()
    assert all(e.next_run_at_ms is not None for e in s.entries.all())


def test_interval_entries_synced_together_keep_one_phase_across_passes(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    """As Celery's scheduler starts every entry at once: entries made by one sync are
    planned from its first pass, however many passes (BATCH each) planning them takes. A
    short interval whose slot from then has already come is planned from now instead."""
    from sqlease.beat._scheduler import BATCH

    many = {f"e{i:04d}": EVERY_MINUTE for i in range(2 * BATCH + 10)}
    many["short"] = {"task": "beat_test.tick", "schedule": 0.5}
    s = scheduler(make_app(many), beat_clock, schedulers)
    start = beat_clock()
    assert s.tick() == 0.0
    beat_clock.advance(700)  # a slow pass: the short entry's slot from the start came
    assert s.tick() == 0.0
    beat_clock.advance(700)
    s.tick()
    entries = {e.name: e for e in s.entries.all()}
    phases = {e.next_run_at_ms for n, e in entries.items() if n.startswith("e")}
    assert phases == {start + 60_000} and len(entries) == 2 * BATCH + 12  # (and cleanup)
    assert entries["short"].next_run_at_ms == beat_clock() + 500  # (planned in the third)
    # Entries added by a later sync are planned from that sync's pass.
    beat_clock.advance(5_000)
    later = scheduler(make_app({**many, "late": EVERY_MINUTE}), beat_clock, schedulers, "b2")
    s.close()
    beat_clock.advance(61_000)  # (b1's leadership ran out)
    later.tick()
    assert later.entries.require("late").next_run_at_ms == beat_clock() + 60_000


def test_a_planning_left_unfinished_for_over_a_minute_plans_the_rest_from_now(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    """The first pass's time holds for one sync's planning only (seconds): entries planned
    a minute or more later (a stalled beat, a lost and regained leadership) are planned from
    then, never from a time long gone (an hourly entry would fire early)."""
    from sqlease.beat._scheduler import BATCH

    hourly = {"task": "beat_test.tick", "schedule": 3600.0}
    s = scheduler(
        make_app({f"h{i:04d}": hourly for i in range(BATCH + 10)}), beat_clock, schedulers
    )
    start = beat_clock()
    assert s.tick() == 0.0
    beat_clock.advance(61_000)
    s.tick()
    firsts = sorted({e.next_run_at_ms for e in s.entries.all() if e.name.startswith("h")})
    assert firsts == [start + 3_600_000, beat_clock() + 3_600_000]
