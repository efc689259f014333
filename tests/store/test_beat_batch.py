"""sqlease's beat firing a boundary's entries in batches of prebuilt messages, against a fake
clock, on SQLite and PostgreSQL: each slot once, the message apply_async would have sent,
the same events as a one-by-one fire, and the fires that go one by one instead."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, signals
from sqlalchemy import select

from conftest import unique_prefix
from sqlease._core.schedule_fires import BatchFire, ScheduleFiring
from sqlease.beat import Scheduler, _firing, slot_task_id
from sqlease.beat._firing import Firing
from sqlease.beat._prebuild import Prebuilder
from sqlease.testing import FakeClock

START = 1_767_268_800_000  # 2026-01-01 12:00:00 UTC
EVERY_MINUTE = {"task": "beat_batch_test.tick", "schedule": 60.0}


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
        app.task(name="beat_batch_test.tick")(_tick)
        return app

    return build


@pytest.fixture
def schedulers() -> Iterator[list[Scheduler]]:
    made: list[Scheduler] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch of fires written (a spy on the batch write)."""
    sizes: list[int] = []
    fire = ScheduleFiring.fire

    def spy(self: ScheduleFiring, conn: Any, fires: Any, now_ms: int) -> set[str]:
        sizes.append(len(fires))
        return fire(self, conn, fires, now_ms)

    monkeypatch.setattr(ScheduleFiring, "fire", spy)
    return sizes


def scheduler(app: Celery, clock: FakeClock, made: list[Scheduler], owner: str = "b1") -> Scheduler:
    s = Scheduler(app, clock=clock, owner=owner)
    made.append(s)
    return s


def messages(s: Scheduler) -> list[dict[str, Any]]:
    m = s.entries.store.tables.messages
    with s.entries.store.driver.reading() as conn:
        rows = conn.execute(select(m).order_by(m.c.id)).mappings().all()
    return [dict(r) for r in rows]


def decoded(payload: str) -> dict[str, Any]:
    """A stored Kombu message with its body decoded and its per-publish tag dropped."""
    message = json.loads(payload)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    message["properties"].pop("delivery_tag")
    return message


def test_a_boundary_fires_in_batches_each_slot_once_with_the_events_of_one_by_one(
    make_app: Callable[..., Celery],
    beat_clock: FakeClock,
    schedulers: list[Scheduler],
    batches: list[int],
) -> None:
    names = [f"e{i:02d}" for i in range(30)]
    a = scheduler(make_app(dict.fromkeys(names, EVERY_MINUTE)), beat_clock, schedulers, "a")
    b = scheduler(make_app(dict.fromkeys(names, EVERY_MINUTE)), beat_clock, schedulers, "b")
    a.tick()  # leads, plans, and builds the first slots' fires ahead
    b.tick()
    assert set(a.prebuilder.built) == set(names)
    for minute in range(1, 4):
        beat_clock.set(START + minute * 60_000 + 250)
        a.tick()
        b.tick()
        a.tick()
    assert batches and sum(batches) == 90
    prefix = a.entries.store.tables.prefix
    sent = [m["task_id"] for m in messages(a)]
    expected = {slot_task_id(prefix, n, START + i * 60_000) for n in names for i in (1, 2, 3)}
    assert len(sent) == 90 and set(sent) == expected
    store = a.entries.store
    for name in names:
        entry = a.entries.require(name)
        assert entry.total_run_count == 3 and entry.next_run_at_ms == START + 4 * 60_000
        fired = [e for e in store.events(task_id=f"schedule:{name}") if e.kind == "fired"]
        assert [e.data for e in fired] == [
            {
                "slot": f"2026-01-01T12:0{i}:00.000+00:00",
                "task_id": slot_task_id(prefix, name, START + i * 60_000),
                "late_ms": 250,
                "next_run_at": f"2026-01-01T12:0{i + 1}:00.000+00:00",
            }
            for i in (1, 2, 3)
        ]
        task_id = slot_task_id(prefix, name, START + 60_000)
        own = [(e.kind, e.data, e.message_id is not None) for e in store.events(task_id=task_id)]
        assert own == [
            ("enqueued", None, True),
            ("sent_by_schedule", {"schedule": name, "slot_ms": START + 60_000}, False),
        ]
    k = store.tables.tasks
    with store.driver.reading() as conn:
        rows = conn.execute(select(k.c.task_id, k.c.task_name, k.c.queue)).all()
    want = {(t, "beat_batch_test.tick", "celery") for t in expected}
    assert {(r[0], r[1], r[2]) for r in rows} == want


def test_a_prebuilt_message_is_the_one_apply_async_sends(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    entries = {
        "routed": dict(
            EVERY_MINUTE,
            args=[1, "two"],
            kwargs={"k": [3]},
            options={"priority": 7, "headers": {"x-mine": "y"}, "shadow": "shown"},
        ),
        "queued": dict(EVERY_MINUTE, options={"queue": "nightly", "routing_key": "nightly"}),
        "by_name": dict(EVERY_MINUTE, task="elsewhere.task", args=["x"]),
    }
    app = make_app(entries, task_routes={"beat_batch_test.tick": {"queue": "routed_q"}})
    s = scheduler(app, beat_clock, schedulers)
    s.tick()
    firing = Firing(app, s.entries, s.options, s.producer, s.prebuilder)
    slot = START + 60_000
    for name in entries:
        entry = s.entries.require(name)
        built = s.prebuilder.build(entry, slot, slot)
        assert built is not None, name
        task_id = slot_task_id(s.entries.store.tables.prefix, name, slot)
        with s.entries.store.driver.writing() as conn:
            firing._send(conn, entry, task_id, slot)
        (row,) = [m for m in messages(s) if m["task_id"] == task_id]
        assert built.row["queue"] == row["queue"]
        assert built.row["priority"] == row["priority"]
        assert decoded(built.row["payload"]) == decoded(row["payload"]), name
    by_queue = {m["task_id"]: m["queue"] for m in messages(s)}
    prefix = s.entries.store.tables.prefix
    assert by_queue[slot_task_id(prefix, "routed", slot)] == "routed_q"
    assert by_queue[slot_task_id(prefix, "queued", slot)] == "nightly"
    routed = decoded(s.prebuilder.build(s.entries.require("routed"), slot, slot).row["payload"])
    assert routed["body"][:2] == [[1, "two"], {"k": [3]}]
    assert routed["headers"]["x-mine"] == "y" and routed["headers"]["shadow"] == "shown"
    assert routed["headers"]["sqlease_slot"] == "2026-01-01T12:01:00.000+00:00"


def test_expires_in_seconds_counts_from_the_slot_and_a_late_fire_from_then(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    s = scheduler(
        make_app({"m": dict(EVERY_MINUTE, options={"expires": 30})}), beat_clock, schedulers
    )
    s.tick()
    entry = s.entries.require("m")
    slot = START + 60_000
    built = s.prebuilder.built["m"]
    assert decoded(built.row["payload"])["headers"]["expires"] == "2026-01-01T12:01:30+00:00"
    assert s.prebuilder.take(entry, slot, slot + 500) is built  # on time: as built
    s.prebuilder.built["m"] = built
    late = s.prebuilder.take(entry, slot, slot + 5_000)  # late: built again from then
    assert late is not None and late is not built
    assert decoded(late.row["payload"])["headers"]["expires"] == "2026-01-01T12:01:35+00:00"


def test_an_entry_changed_after_its_fire_was_built_fires_its_new_definition(
    make_app: Callable[..., Celery],
    beat_clock: FakeClock,
    schedulers: list[Scheduler],
    batches: list[int],
) -> None:
    from sqlease.admin import Admin

    s = scheduler(make_app({"m": dict(EVERY_MINUTE, args=["old"])}), beat_clock, schedulers)
    s.tick()
    assert "m" in s.prebuilder.built
    Admin(s.entries.store.engine.url, store=s.entries.store).update_schedule("m", args=["new"])
    beat_clock.set(START + 60_000)
    s.tick()
    (message,) = messages(s)
    assert decoded(message["payload"])["body"][0] == ["new"]
    # the prebuilt fire lost its compare-and-set (it wrote nothing); the entry, read again,
    # was built and fired anew
    assert batches == [1, 1]


def test_a_fire_that_lost_its_compare_and_set_writes_nothing(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    """Two leaders' batches for one slot (a stale leader's lease check aside): the second
    finds every entry moved on and writes nothing, and a batch with one stale entry writes
    the others."""
    s = scheduler(make_app(dict.fromkeys(["a", "b", "c"], EVERY_MINUTE)), beat_clock, schedulers)
    s.tick()
    assert s.term is not None
    slot = START + 60_000
    read = {name: s.entries.require(name) for name in "abc"}
    batch = s.prebuilder.batch

    def fires(names: str) -> list[BatchFire]:
        out = []
        for name in names:
            built = s.prebuilder.built[name]
            fired = {"slot": "x", "task_id": built.task_id, "next_run_at": "y"}
            out.append(
                batch.prepare(
                    name,
                    read[name].revision,
                    slot,
                    built.next_ms,
                    built.task_id,
                    built.row,
                    fired,
                )
            )
        return out

    from sqlease.admin import Admin

    Admin(s.entries.store.engine.url, store=s.entries.store).update_schedule("b", args=[1])
    with s.entries.firing(s.term, 30_000) as conn:
        assert batch.fire(conn, fires("abc"), slot) == {"a", "c"}
    with s.entries.firing(s.term, 30_000) as conn:
        assert batch.fire(conn, fires("ac"), slot) == set()
    assert sorted(m["task_id"] for m in messages(s)) == sorted(
        slot_task_id(s.entries.store.tables.prefix, n, slot) for n in "ac"
    )
    kinds = [e.kind for e in s.entries.store.events(task_id="schedule:b")]
    assert "fired" not in kinds


def test_the_publish_signals_of_a_batch(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    before: list[str] = []
    after: list[tuple[str, str]] = []

    def on_before(sender: str, headers: dict[str, Any], **kw: Any) -> None:
        headers["stamped"] = "at build"
        before.append(headers["id"])

    def on_after(sender: str, headers: dict[str, Any], routing_key: str, **kw: Any) -> None:
        after.append((headers["id"], routing_key))

    signals.before_task_publish.connect(on_before)
    signals.after_task_publish.connect(on_after)
    try:
        s = scheduler(make_app({"m": EVERY_MINUTE}), beat_clock, schedulers)
        s.tick()  # built ahead: before_task_publish now
        task_id = slot_task_id(s.entries.store.tables.prefix, "m", START + 60_000)
        assert before == [task_id] and after == []
        beat_clock.set(START + 60_000)
        s.tick()
        assert before[0] == task_id and after[0] == (task_id, "celery")
        (message,) = messages(s)
        assert decoded(message["payload"])["headers"]["stamped"] == "at build"
    finally:
        signals.before_task_publish.disconnect(on_before)
        signals.after_task_publish.disconnect(on_after)


def test_a_takeover_catching_up_every_slot_fires_them_in_waves_of_batches(
    make_app: Callable[..., Celery],
    beat_clock: FakeClock,
    schedulers: list[Scheduler],
    batches: list[int],
) -> None:
    """Catch-up "all": a standby that takes over three slots late fires each entry's three
    slots in three batches (every entry's first, then second, then third), in order, each
    once, with the events of one-by-one fires; an entry whose slots were skipped by the
    catch-up limit goes one by one."""
    names = [f"e{i:02d}" for i in range(20)]
    schedule = {n: dict(EVERY_MINUTE, catch_up="all") for n in names}
    schedule["limited"] = dict(EVERY_MINUTE, catch_up="all", catch_up_limit=1)
    conf = {"sqlease_beat_lease_seconds": 10}
    a = scheduler(make_app(schedule, **conf), beat_clock, schedulers, "a")
    b = scheduler(make_app(schedule, **conf), beat_clock, schedulers, "b")
    a.tick()  # leads and plans every first slot at START + 60 s
    b.tick()
    a.close = lambda: None  # type: ignore[method-assign]  # dies: never gives its lease up
    beat_clock.set(START + 3 * 60_000 + 30_000)  # three slots came; a's lease long expired
    b.tick()
    assert b.term is not None
    assert batches == [20, 20, 20]
    prefix = b.entries.store.tables.prefix
    slots = [START + i * 60_000 for i in (1, 2, 3)]
    sent = [m["task_id"] for m in messages(b)]
    assert len(sent) == len(set(sent))
    assert set(sent) == {slot_task_id(prefix, n, s) for n in names for s in slots} | {
        slot_task_id(prefix, "limited", slots[-1])
    }
    store = b.entries.store
    for name in names:
        entry = b.entries.require(name)
        assert entry.total_run_count == 3 and entry.next_run_at_ms == START + 4 * 60_000
        fired = [e.data for e in store.events(task_id=f"schedule:{name}") if e.kind == "fired"]
        assert fired == [
            {
                "slot": f"2026-01-01T12:0{i}:00.000+00:00",
                "task_id": slot_task_id(prefix, name, slots[i - 1]),
                "late_ms": 3 * 60_000 + 30_000 - i * 60_000,
                "next_run_at": f"2026-01-01T12:0{i + 1}:00.000+00:00",
            }
            for i in (1, 2, 3)
        ]
    limited = [e.data for e in store.events(task_id="schedule:limited") if e.kind == "fired"]
    assert [d["slot"] for d in limited] == ["2026-01-01T12:03:00.000+00:00"]
    assert limited[0]["skipped"] == 2


def test_a_new_leader_writes_what_it_builds_within_a_quarter_of_its_lease(
    make_app: Callable[..., Celery],
    beat_clock: FakeClock,
    schedulers: list[Scheduler],
    batches: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leader that took over has nothing built ahead: it builds the due fires as it fires
    them, and writes (renewing its lease) at least every quarter of the lease. Building
    thousands before writing any let the lease lapse on a loaded machine; the standby took
    over and built them all again, and no slot fired."""
    names = [f"e{i:02d}" for i in range(10)]
    conf = {"sqlease_beat_lease_seconds": 1}
    a = scheduler(make_app(dict.fromkeys(names, EVERY_MINUTE), **conf), beat_clock, schedulers)
    a.tick()
    a.prebuilder.built.clear()  # as a new leader's: nothing built ahead
    ticks = iter(range(10_000))
    # Building one fire "takes" 0.1 s of the 0.25 s between writes.
    monkeypatch.setattr(_firing, "monotonic", lambda: next(ticks) * 0.1)
    beat_clock.set(START + 60_000)
    a.tick()
    assert batches == [3, 3, 3, 1]
    prefix = a.entries.store.tables.prefix
    assert {m["task_id"] for m in messages(a)} == {
        slot_task_id(prefix, n, START + 60_000) for n in names
    }


def test_fires_that_cannot_be_prebuilt_go_one_by_one(
    make_app: Callable[..., Celery],
    beat_clock: FakeClock,
    schedulers: list[Scheduler],
    batches: list[int],
) -> None:
    entries = {
        "plain": EVERY_MINUTE,
        "in_a_run": dict(EVERY_MINUTE, options={"headers": {"run_id": "tenant-1"}}),
        "delayed": dict(EVERY_MINUTE, options={"countdown": 5}),
        "unique": dict(EVERY_MINUTE, options={"headers": {"unique_key": "k"}}),
        "bad": dict(EVERY_MINUTE, options={"serializer": "nope"}),
    }
    s = scheduler(make_app(entries), beat_clock, schedulers)
    s.tick()
    assert set(s.prebuilder.built) == {"plain"}
    assert set(s.prebuilder.refused) == {"in_a_run", "delayed", "unique", "bad"}
    beat_clock.set(START + 60_000)
    s.tick()
    assert batches == [1]
    prefix = s.entries.store.tables.prefix
    by_task = {m["task_id"]: m for m in messages(s)}
    slot = START + 60_000
    assert set(by_task) == {slot_task_id(prefix, n, slot) for n in entries if n != "bad"}
    assert by_task[slot_task_id(prefix, "in_a_run", slot)]["run_id"] == "tenant-1"
    assert by_task[slot_task_id(prefix, "delayed", slot)]["available_at_ms"] > slot
    kinds = [e.kind for e in s.entries.store.events(task_id="schedule:bad")]
    assert "fire_failed" in kinds
    assert s.entries.require("bad").next_run_at_ms == slot  # its slot is not lost


def test_a_beat_whose_broker_is_not_its_database_sends_one_by_one(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    from kombu import Connection

    s = scheduler(make_app({"m": EVERY_MINUTE}), beat_clock, schedulers)
    s.tick()
    memory = Connection("memory://")
    producer = s.app.amqp.Producer(memory.channel(), auto_declare=False)
    other = Prebuilder(
        s.app, s.entries, lambda: producer, lambda e, slot: slot + 60_000, lambda e: ("once", 60)
    )
    assert not other.usable()
    assert not other.fill(beat_clock(), 1.0) and other.built == {}
    memory.release()


def test_a_batch_wakes_each_queue_once_at_its_commit(
    make_app: Callable[..., Celery], beat_clock: FakeClock, schedulers: list[Scheduler]
) -> None:
    """PostgreSQL: one notification per queue per batch, delivered at the commit (SQLite's
    workers see the file change)."""
    entries = {f"e{i}": EVERY_MINUTE for i in range(5)}
    entries.update({f"n{i}": dict(EVERY_MINUTE, options={"queue": "nightly"}) for i in range(3)})
    s = scheduler(make_app(entries), beat_clock, schedulers)
    if not s.entries.store.is_postgresql:
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    import psycopg

    s.tick()
    # The fires are built ahead in slices of half a second (on a loaded machine the first
    # tick may build only some of them; the boundary then fires the rest in a second batch).
    while s.prebuilder.fill(START, 5.0):
        pass
    url = s.entries.store.engine.url.set(drivername="postgresql")
    channel = s.entries.store.notify_channel
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as listen:
        listen.execute(f'LISTEN "{channel}"')
        beat_clock.set(START + 60_000)
        s.tick()
        assert len(messages(s)) == 8
        heard = sorted(n.payload for n in listen.notifies(timeout=2.0, stop_after=3))
    assert heard == ["celery", "nightly"]
