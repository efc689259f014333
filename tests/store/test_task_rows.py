"""The task row keeps a task's name, queue and attempt at publish (migration 9), written by
the publish statements, so finished tasks show them in ``Admin`` listings; the claims leave it
alone, and a listing reads a finished task's deliveries from its events."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select, text, update

from sqlease._core.timeline import Delivered
from sqlease.admin import Admin
from sqlease.store import Store
from sqlease.testing import FakeClock
from sqlease.transport._codec import new_message


def row(store: Store, task_id: str) -> tuple[str | None, str | None, int]:
    k = store.tables.tasks
    with store.driver.reading() as conn:
        found = conn.execute(
            select(k.c.task_name, k.c.queue, k.c.attempt).where(k.c.task_id == task_id)
        ).one()
    return found.task_name, found.queue, int(found.attempt)


def test_the_claims_leave_the_task_row_as_published(store: Store, clock: FakeClock) -> None:
    store.enqueue("celery", "{}", task_id="t1", task_name="app.charge")
    assert row(store, "t1") == ("app.charge", "celery", 0)
    [first] = store.claim(["celery"], "w1", lease_ms=1000)
    clock.advance(2000)  # the lease runs out: a second delivery
    [second] = store.claim(["celery"], "w2", lease_ms=1000)
    assert first.id == second.id and second.attempt == 2
    assert store.ack([second.fence]) == {second.id}
    assert row(store, "t1") == ("app.charge", "celery", 0)
    store.enqueue("q", "{}", task_id="a", task_name="app.a")
    store.enqueue("q", "{}", task_id="b", task_name="app.b")
    [a] = store.claim(["q"], "w", lease_ms=1000)
    acked, [claimed] = store.ack_and_claim([a.fence], ["q"], "w", lease_ms=1000, limit=1)
    assert acked == {a.id} and claimed.task_id == "b"
    assert row(store, "a") == ("app.a", "q", 0) and row(store, "b") == ("app.b", "q", 0)


def test_the_timeline_tells_each_tasks_deliveries(store: Store, clock: FakeClock) -> None:
    for task_id in ("twice", "once", "purged", "never-delivered", "queued"):
        store.enqueue("q", "{}", task_id=task_id, task_name="app.t")
    [first] = store.claim(["q"], "w1", lease_ms=1000)
    assert first.task_id == "twice"
    clock.advance(2000)  # its lease runs out: delivered again, then acked
    [again] = store.claim(["q"], "w2", lease_ms=1000)
    assert again.task_id == "twice" and again.attempt == 2
    acked, [once] = store.ack_and_claim([again.fence], ["q"], "w2", lease_ms=1000, limit=1)
    assert acked == {again.id} and once.task_id == "once"
    assert store.ack([once.fence]) == {once.id}
    [held] = store.claim(["q"], "w3", lease_ms=1000)
    assert held.task_id == "purged"
    store.release([held.fence])  # back in the queue after a delivery, then purged with it
    assert store.purge("q") == 3  # purged (after a delivery), never-delivered, queued
    store.enqueue("q", "{}", task_id="queued", task_name="app.t")  # published again
    with store.driver.reading() as conn:
        found = store.timeline.delivered_on(
            conn, ["twice", "once", "purged", "never-delivered", "queued", "unknown"]
        )
        assert store.timeline.delivered_on(conn, []) == {}
    assert found == {
        "twice": Delivered(2, "acked"),
        "once": Delivered(1, "acked"),
        "purged": Delivered(1, "purged"),
        "never-delivered": Delivered(0, "purged"),
        "queued": Delivered(0, "purged"),
    }


def test_a_republished_task_keeps_its_name_and_follows_its_queue(store: Store) -> None:
    store.enqueue("q", "{}", task_id="t", task_name="app.t")
    [m] = store.claim(["q"], "w", lease_ms=1000)
    store.ack([m.fence])
    store.enqueue("retries", "{}", task_id="t")  # a retry, published without a name
    assert row(store, "t") == ("app.t", "retries", 0)


def test_finished_tasks_list_their_deliveries_and_how_they_ended(
    make_store: Callable[..., Store], clock: FakeClock
) -> None:
    store = make_store()
    admin = Admin(store.engine.url, store=store)
    store.enqueue("q", "{}", task_id="retried", task_name="app.t")
    store.enqueue("q", "{}", task_id="purged", task_name="app.t")
    store.claim(["q"], "w1", lease_ms=1000, limit=1)
    clock.advance(2000)  # a worker lost its lease: the task is delivered a second time
    [again] = store.claim(["q"], "w2", lease_ms=1000, limit=1)
    assert again.task_id == "retried" and store.ack([again.fence]) == {again.id}
    [held] = store.claim(["q"], "w3", lease_ms=1000, limit=1)
    store.release([held.fence])
    assert store.purge("q") == 1
    listed = {t.task_id: t for t in admin.tasks()}
    assert (listed["retried"].state, listed["retried"].attempt) == ("succeeded", 2)
    assert (listed["purged"].state, listed["purged"].reason) == ("cancelled", "purged")
    assert listed["purged"].attempt == 1
    shown = admin.task("retried")
    assert (shown.state, shown.attempt) == ("succeeded", 2)


def test_finished_tasks_are_listed_with_name_queue_and_attempt(
    make_store: Callable[..., Store], clock: FakeClock
) -> None:
    store = make_store()
    admin = Admin(store.engine.url, store=store)
    store.enqueue("celery", "{}", task_id="done", task_name="app.report")
    [m] = store.claim(["celery"], "w", lease_ms=1000)
    with store.engine.begin() as conn:  # the result the backend writes at success
        conn.execute(
            store.tables.results.insert().values(
                key="celery-task-meta-done",
                value=b"{}",
                state="SUCCESS",
                task_id="done",
                message_id=m.id,
                attempt=m.attempt,
                updated_at_ms=clock() + 500,
            )
        )
    store.ack([m.fence])
    [listed] = admin.tasks(state="succeeded")
    assert (listed.task_id, listed.task_name, listed.queue, listed.attempt) == (
        "done",
        "app.report",
        "celery",
        1,
    )
    assert listed.created_at_ms == clock() and listed.finished_at_ms == clock() + 500
    assert admin.tasks(state="succeeded", queue="other") == []
    shown = admin.task("done")
    assert (shown.state, shown.task_name, shown.queue, shown.attempt) == (
        "succeeded",
        "app.report",
        "celery",
        1,
    )
    store.enqueue("celery", "{}", task_id="live", task_name="app.live")
    [queued] = admin.tasks(state="queued")
    assert queued.task_name == "app.live" and queued.created_at_ms == clock()


def test_a_database_before_migration_9_gets_the_columns(
    make_store: Callable[..., Store],
) -> None:
    from sqlalchemy import inspect

    old = make_store()
    tasks = old.tables.tasks.name
    with old.engine.begin() as conn:  # as it was before
        for column in ("task_name", "queue", "attempt"):
            conn.execute(text(f"ALTER TABLE {tasks} DROP COLUMN {column}"))
        conn.execute(update(old.tables.schema_version).values(version=6))
    new = make_store()
    with new.driver.reading() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns(tasks)}
    assert {"task_name", "queue", "attempt"} <= columns
    new.enqueue("q", "{}", task_id="t", task_name="app.t")
    assert row(new, "t") == ("app.t", "q", 0)


def test_the_transport_publishes_the_task_name() -> None:
    message = {"headers": {"id": "t1", "task": "app.charge"}, "properties": {}, "body": ""}
    assert new_message("celery", message).task_name == "app.charge"
    assert new_message("celery", {"headers": {}, "properties": {}}).task_name is None
