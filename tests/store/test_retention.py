"""Bounded tables on both databases (fake clock): every kind of row leaves after its
documented lifetime (docs/explanation/table-lifetimes.md), idle auto-delete queues go with
their bindings and messages, a touched one stays, and a steady load keeps every table
bounded."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from sqlease import Store
from sqlease._core import retention
from sqlease._core.maintenance import run_pass
from sqlease._core.results import ResultStore
from sqlease._core.steps import StepStore
from sqlease.task_context import TaskContext
from sqlease.testing import FakeClock

HOUR = 3_600_000
TABLES = (
    "messages",
    "runs",
    "tasks",
    "events",
    "bindings",
    "queues",
    "results",
    "counters",
    "steps",
    "waits",
    "locks",
    "offers",
    "schedules",
    "leaders",
)


def counts(store: Store) -> dict[str, int]:
    with store.driver.reading() as conn:
        return {
            name: int(
                conn.execute(
                    select(func.count()).select_from(getattr(store.tables, name))
                ).scalar_one()
            )
            for name in TABLES
        }


def test_an_idle_auto_delete_queue_goes_with_its_bindings_and_messages(
    store: Store, clock: FakeClock
) -> None:
    reply = f"{uuid.uuid4()}.reply.celery.pidbox"
    live = "celeryev.live"
    for queue in (reply, live):
        store.declare_queue(queue, expires_ms=10_000)
        store.bind("reply.celery.pidbox" if queue == reply else "celeryev", queue, queue)
        store.enqueue(queue, "{}", record=False)
    store.declare_queue("celery")  # a plain queue: never expires
    store.enqueue("celery", "{}", task_id="t")
    clock.advance(9_000)
    assert store.touch_queues([live, "celery"]) == {live}  # "celery" has no expiry
    assert run_pass(store, event_retention_ms=0)["idle_queues_expired"] == 0
    clock.advance(1_001)  # the reply queue's consumer is gone; the live one touched at 9 s
    assert run_pass(store, event_retention_ms=0)["idle_queues_expired"] == 1
    assert not store.has_queue(reply) and store.bindings("reply.celery.pidbox") == []
    assert store.size(reply) == 0
    assert store.has_queue(live) and store.size(live) == 1
    assert store.bindings("celeryev") == [(live, "", live)]
    clock.advance(10 * HOUR)
    run_pass(store, event_retention_ms=0)
    assert store.has_queue("celery") and store.size("celery") == 1
    assert not store.has_queue(live)
    # A touch of a queue that expired says so: its consumer declares it again.
    assert store.touch_queues([live]) == set()


def test_a_plain_declaration_keeps_a_queues_expiry(store: Store, clock: FakeClock) -> None:
    store.declare_queue("x.reply.celery.pidbox", expires_ms=1_000)
    store.declare_queue("x.reply.celery.pidbox")  # a producer's, without arguments
    clock.advance(1_001)
    assert run_pass(store, event_retention_ms=0)["idle_queues_expired"] == 1


def test_every_kind_of_row_leaves_after_its_retention(store: Store, clock: FakeClock) -> None:
    results, steps = ResultStore(store), StepStore(store)
    store.enqueue("q", "{}", task_id="done")
    store.enqueue("q", "{}", task_id="failed")
    store.enqueue("q", "{}", task_id="waiting")
    claimed = {m.task_id: m for m in store.claim(["q"], "w", lease_ms=10_000, limit=10)}
    ctx = TaskContext(store, claimed["done"].fence, task_id="done", lease_ms=10_000)
    ctx.checkpoint({"n": 1})
    steps.start(ctx.fence, "done", "charge")
    steps.finish(ctx.fence, "done", "charge", result=1)
    with store.engine.begin() as conn:  # the task asks a person (its message parks)
        conn.execute(
            store.tables.waits.insert().values(
                task_id="waiting", key="k", kind="input", status="waiting", created_at_ms=clock()
            )
        )
    store.ack([claimed["done"].fence])
    store.fail(claimed["failed"].fence, "rejected")
    results.put("celery-task-meta-done", b"x", state="SUCCESS", task_id="done", expires_ms=HOUR)
    results.put("celery-task-meta-failed", b"x", state="FAILURE", task_id="failed")
    results.put("user", b"x")  # no expiry, not one sqlease writes: kept
    from sqlease.admin import Admin

    Admin(store.engine.url, store=store).cancel("waiting")
    before = counts(store)
    assert before["messages"] == 2 and before["waits"] == 1 and before["steps"] == 1
    clock.advance(2 * HOUR)
    summary = run_pass(store, event_retention_ms=HOUR, dead_retention_ms=3 * HOUR)
    assert summary["results_expired"] == 1
    assert summary["dead_messages_expired"] == 0  # its own, longer retention
    assert summary["task_records_expired"] == 1 and summary["steps_expired"] == 1
    clock.advance(2 * HOUR)
    summary = run_pass(store, event_retention_ms=HOUR, dead_retention_ms=3 * HOUR)
    assert summary["dead_messages_expired"] == 2
    assert summary["unexpiring_results_expired"] == 2  # FAILURE and the cancel's REVOKED
    run_pass(store, event_retention_ms=HOUR, dead_retention_ms=3 * HOUR)
    left = counts(store)
    assert left["messages"] == left["tasks"] == left["events"] == 0
    assert left["steps"] == left["waits"] == 0
    assert left["results"] == 1 and results.get("user") == b"x"


def test_a_big_backlog_is_pruned_in_batches(
    store: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retention, "PRUNE_BATCH", 7)
    statements: list[int] = []
    real = retention.Batches.run

    def counting(self: retention.Batches, build: object, batch: int = 7) -> int:
        done = real(self, build, 7)  # type: ignore[arg-type]
        statements.append(done)
        return done

    monkeypatch.setattr(retention.Batches, "run", counting)
    for i in range(30):
        store.enqueue("q", "{}", task_id=f"t{i}", max_attempts=1)
    for m in store.claim(["q"], "w", lease_ms=1_000, limit=30):
        store.fail(m.fence, "rejected")
    clock.advance(2 * HOUR)
    summary = run_pass(store, event_retention_ms=HOUR)
    assert summary["dead_messages_expired"] == 30
    assert counts(store)["messages"] == 0


@pytest.mark.timeout(300)
def test_a_steady_load_keeps_every_table_bounded(store: Store, clock: FakeClock) -> None:
    """Cycles of publish, claim, ack, fail, results, checkpoints, steps, a chord counter,
    inspect-like reply queues and an event receiver that go away, with a maintenance pass
    after each: past the retention, no table grows."""
    results, steps = ResultStore(store), StepStore(store)
    worker_pidbox = "w1@host.celery.pidbox"
    store.declare_queue(worker_pidbox, expires_ms=10_000)
    store.bind("celery.pidbox", worker_pidbox, "")
    history: list[dict[str, int]] = []
    for cycle in range(16):
        for i in range(12):
            store.enqueue("celery", "{}", task_id=f"c{cycle}-{i}")
        for i, m in enumerate(store.claim(["celery"], "w", lease_ms=60_000, limit=12)):
            assert m.task_id is not None
            if i % 4 == 3:
                store.fail(m.fence, "rejected")
                results.put(f"meta-{m.task_id}", b"x", state="FAILURE", task_id=m.task_id)
                continue
            ctx = TaskContext(store, m.fence, task_id=m.task_id, lease_ms=60_000)
            ctx.checkpoint({"i": i})
            steps.start(m.fence, m.task_id, "s")
            steps.finish(m.fence, m.task_id, "s", result=i)
            results.put(f"meta-{m.task_id}", b"x", state="SUCCESS", expires_ms=2 * HOUR)
            store.ack([m.fence])
        results.incr(f"chord-{cycle}")
        results.expire(f"chord-{cycle}", 2 * HOUR / 1000)
        # Two `celery inspect` calls and an event receiver that leave their queues behind.
        for n in range(2):
            reply = f"{cycle}-{n}.reply.celery.pidbox"
            store.declare_queue(reply, expires_ms=10_000)
            store.bind("reply.celery.pidbox", reply, reply)
            store.enqueue(reply, "{}", record=False)  # a reply nobody read
        store.declare_queue(f"celeryev.{cycle}", expires_ms=60_000)
        store.bind("celeryev", f"celeryev.{cycle}", "#", "#")
        store.enqueue(worker_pidbox, "{}", record=False)  # a broadcast
        clock.advance(HOUR // 2)
        store.touch_queues([worker_pidbox])  # the worker lives on
        run_pass(store, event_retention_ms=HOUR, dead_retention_ms=HOUR)
        history.append(counts(store))
    steady = {name: max(h[name] for h in history[:8]) for name in TABLES}
    for later in history[8:]:
        grown = {name: (steady[name], later[name]) for name in TABLES if later[name] > steady[name]}
        assert not grown, grown
    assert store.has_queue(worker_pidbox)
    assert history[-1]["queues"] <= 3  # celery, the worker's pidbox, at most this cycle's


def _made_on(index: Any, dialect: str) -> bool:
    only = getattr(index, "_ddl_if", None)
    return only is None or only.dialect in (None, dialect)


def test_a_version_6_database_gets_migration_7(db_url: str) -> None:
    """Migration 7 adds the queues' idle expiry, the retention indexes and (PostgreSQL) the
    hot tables' storage settings to a database made before it, queues and all."""
    from sqlalchemy import inspect, text, update

    from conftest import unique_prefix
    from sqlease._db.migrations import CURRENT_VERSION, read_version, retention_indexes
    from sqlease._db.postgresql.storage import TABLE_SETTINGS

    prefix = unique_prefix()
    old = Store(db_url, table_prefix=prefix)
    old.declare_queue("celery")
    t = old.tables
    with old.engine.begin() as conn:  # as version 6 left it
        for index in retention_indexes(t):
            conn.execute(text(f"DROP INDEX IF EXISTS {index.name}"))
        for column in ("expires_ms", "expires_at_ms"):
            conn.execute(text(f"ALTER TABLE {t.queues.name} DROP COLUMN {column}"))
        if old.is_postgresql:
            for short, settings in TABLE_SETTINGS.items():
                names = ", ".join(k for k, _ in settings if k != "fillfactor")
                if names:
                    conn.execute(text(f"ALTER TABLE {t.name(short)} RESET ({names})"))
        conn.execute(update(t.schema_version).values(version=6))
    new = Store(db_url, table_prefix=prefix)
    with new.driver.reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        columns = {c["name"] for c in inspect(conn).get_columns(t.queues.name)}
        assert {"expires_ms", "expires_at_ms"} <= columns
        present = {
            i["name"]
            for table in t.metadata.sorted_tables
            for i in inspect(conn).get_indexes(table.name)
        }
        # The leftover-lease index is SQLite's only (PostgreSQL's claims stay HOT without it).
        made = {i.name for i in retention_indexes(t) if _made_on(i, conn.dialect.name)}
        assert made <= present and f"{t.messages.name}_claim_ix" in present
        if new.is_postgresql:
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                {"name": t.messages.name},
            ).scalar()
            assert "autovacuum_vacuum_cost_delay=0" in options
            assert "autovacuum_vacuum_scale_factor=0.01" in options
    assert new.has_queue("celery")
    new.declare_queue("x.reply.celery.pidbox", expires_ms=1_000)
    assert new.touch_queues(["x.reply.celery.pidbox"]) == {"x.reply.celery.pidbox"}


@pytest.mark.pg
@pytest.mark.timeout(300)
def test_the_batch_event_index_stays_bounded_as_task_ids_come_and_go(
    pg_database_url: str,
) -> None:
    """Rounds of batch events, each with 160,000 task ids never seen before, deleted and
    vacuumed after each round: the batch-event index (over the ids' hashes) stops growing.
    A GIN index over the ids themselves, built alongside as the control, keeps every id it
    has seen and grows round after round."""
    from sqlalchemy import text

    from conftest import unique_prefix
    from sqlease._db.schema_indexes import task_key

    store = Store(pg_database_url, table_prefix=unique_prefix())
    events = store.tables.events.name
    ours, control = f"{events}_batch_key_ix", f"{events}_control_ix"
    with store.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text(f"CREATE INDEX {control} ON {events} USING gin (task_ids)"))
        sizes: list[tuple[int, int]] = []
        for r in range(4):
            conn.execute(
                text(
                    f"INSERT INTO {events} (kind, at_ms, task_ids, message_ids, attempts, "
                    f"task_keys) SELECT 'acked', 0, ids, NULL, NULL, (SELECT array_agg("
                    f"DISTINCT {task_key('x')}) FROM unnest(ids) x) FROM (SELECT "
                    "ARRAY(SELECT 'r' || :r || '-' || b || '-' || i FROM generate_series(1, 32) "
                    "i) AS ids FROM generate_series(1, 5000) b) s"
                ),
                {"r": r},
            )
            conn.execute(text(f"DELETE FROM {events}"))
            conn.execute(text(f"VACUUM {events}"))
            sizes.append(
                tuple(  # type: ignore[arg-type]
                    conn.execute(
                        text("SELECT pg_relation_size(:a), pg_relation_size(:b)"),
                        {"a": ours, "b": control},
                    ).one()
                )
            )
    (ours_2, control_2), (ours_4, control_4) = sizes[1], sizes[3]
    assert control_4 > 1.5 * control_2, sizes  # the control grows: the test can see growth
    assert ours_4 <= 1.1 * ours_2, sizes
