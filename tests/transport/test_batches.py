"""Batches through Celery and Kombu (no worker: the messages are read in the database):
``sqlease.batch()``, and groups, chord headers and chunks of sqlease apps published as one
batch, all or nothing; apps on other brokers untouched."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chord, group, signals
from sqlalchemy import create_engine, text

import sqlease
from conftest import unique_prefix
from sqlease import ConfigurationError, Store
from sqlease.batches import open_batch


@pytest.fixture
def setup(db_url: str) -> Iterator[tuple[Celery, Store]]:
    prefix = unique_prefix()
    app = Celery("batch_tests", broker=f"sqlease+{db_url}", set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}

    @app.task(name="b.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="b.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    @app.task(name="b.report", shared=False, unique_key="report:{user}")
    def report(user: str) -> str:
        return user

    app.finalize()
    store = Store(db_url, table_prefix=prefix)
    yield app, store
    app.close()


def rows(store: Store, where: str = "1 = 1") -> list[dict[str, Any]]:
    """The messages in the database, in enqueue order."""
    m = store.tables.messages.name
    with store.driver.reading() as conn:
        found = conn.execute(
            text(f"SELECT id, task_id, task_name, state, run_id FROM {m} WHERE {where} ORDER BY id")
        )
        return [dict(r._mapping) for r in found]


class SeenWhilePublishing:
    """Counts the messages in the database after each task publish (Celery's signal)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.counts: list[int] = []
        self.batched: list[bool] = []

    def __call__(self, sender: Any = None, **kwargs: Any) -> None:
        self.counts.append(len(rows(self.store)))
        self.batched.append(open_batch() is not None)

    def __enter__(self) -> SeenWhilePublishing:
        signals.after_task_publish.connect(self, weak=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        signals.after_task_publish.disconnect(self)


def test_a_group_of_1000_is_published_in_one_transaction(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    with SeenWhilePublishing(store) as seen:
        result = group(add.s(i, i) for i in range(1000)).apply_async()
    assert len(seen.counts) == 1000 and set(seen.counts) == {0} and all(seen.batched)
    found = rows(store)
    assert [r["task_id"] for r in found] == [r.id for r in result.results]
    assert {r["task_name"] for r in found} == {"b.add"}
    assert open_batch() is None


def test_a_chord_header_is_one_batch_and_the_body_waits(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    app.conf.result_backend = f"sqlease+{store.engine.url.render_as_string(False)}"
    add, tsum = app.tasks["b.add"], app.tasks["b.tsum"]
    with SeenWhilePublishing(store) as seen:
        chord((add.s(i, 1) for i in range(20)), tsum.s())()
    assert seen.counts == [0] * 20 and all(seen.batched)
    assert [r["task_name"] for r in rows(store)] == ["b.add"] * 20


def test_chunks_and_starmap(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    with SeenWhilePublishing(store) as seen:
        add.chunks(zip(range(100), range(100), strict=True), 10).apply_async()
    assert seen.counts == [0] * 10 and all(seen.batched)
    assert [r["task_name"] for r in rows(store)] == ["celery.starmap"] * 10
    add.starmap([(1, 2), (3, 4)]).apply_async()
    assert len(rows(store)) == 11


def test_an_explicit_batch_returns_results_and_publishes_at_its_end(
    setup: tuple[Celery, Store],
) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    with sqlease.batch():
        results = [add.delay(i, i) for i in range(30)]
        results.append(add.apply_async((1, 1), countdown=60, priority=3))
        results.append(app.send_task("b.add", (2, 2)))
        assert all(r.id for r in results)
        assert rows(store) == []
    assert [r["task_id"] for r in rows(store)] == [r.id for r in results]


def test_an_exception_in_the_block_publishes_nothing(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    with pytest.raises(RuntimeError), sqlease.batch():
        for i in range(10):
            add.delay(i, i)
        group(add.s(i, i) for i in range(10)).apply_async()  # a nested batch joins
        raise RuntimeError("the caller failed half way")
    assert rows(store) == []
    add.delay(1, 1)  # the next publish is not held
    assert len(rows(store)) == 1


def test_a_refused_member_refuses_the_batch_even_when_caught(
    setup: tuple[Celery, Store],
) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    bad = {"concurrency_key": "api", "concurrency_limit": "many"}
    with pytest.raises(ConfigurationError) as refused, sqlease.batch():
        add.delay(1, 1)
        try:
            add.apply_async((2, 2), headers=bad)
        except ConfigurationError as exc:
            assert "message 2 in the batch" in str(exc) and "b.add" in str(exc)
        add.delay(3, 3)
    assert "concurrency_limit" in str(refused.value)
    assert rows(store) == []


def test_a_failing_group_member_publishes_none_of_the_group(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    members = [add.s(i, i) for i in range(10)]
    members[7] = add.s(7, 7).set(headers={"concurrency_key": "k", "concurrency_limit": 0})
    with pytest.raises(ConfigurationError, match="message 8 in the batch"):
        group(members).apply_async()
    assert rows(store) == []


def test_a_batch_inside_a_transaction_commits_and_rolls_back_with_it(
    setup: tuple[Celery, Store], db_url: str
) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with pytest.raises(RuntimeError), engine.begin() as conn, sqlease.transaction(conn):
            with sqlease.batch():
                group(add.s(i, i) for i in range(10)).apply_async()
            raise RuntimeError("the caller's transaction rolls back")
        assert rows(store) == []
        with engine.begin() as conn, sqlease.transaction(conn):
            group(add.s(i, i) for i in range(10)).apply_async()
        assert len(rows(store)) == 10
        # A transaction opened inside the batch would be escaped: refused.
        with (
            pytest.raises(ConfigurationError, match=r"inside sqlease\.batch"),
            sqlease.batch(),
            engine.begin() as conn,
            sqlease.transaction(conn),
        ):
            add.delay(1, 1)
        assert len(rows(store)) == 10
    finally:
        engine.dispose()


def test_run_members_keep_their_order_and_parking(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    add = app.tasks["b.add"]
    members = []
    for i in range(5):
        members.append(add.s(i, 0))
        members.append(add.s(i, 1).set(headers={"run_id": "run-1"}))
    result = group(members).apply_async()
    found = rows(store)
    assert [r["task_id"] for r in found] == [r.id for r in result.results]
    in_run = [r["state"] for r in found if r["run_id"] == "run-1"]
    assert in_run == ["ready", "parked", "parked", "parked", "parked"]


def test_unique_duplicates_inside_a_group(setup: tuple[Celery, Store]) -> None:
    app, store = setup
    report, add = app.tasks["b.report"], app.tasks["b.add"]
    group([report.s("ann"), add.s(1, 1), report.s("ann"), report.s("bob")]).apply_async()
    assert [r["task_name"] for r in rows(store)] == ["b.report", "b.add", "b.report"]


def test_apps_on_other_brokers_are_untouched() -> None:
    app = Celery("other", broker="memory://", set_as_current=False)

    @app.task(name="o.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    batched: list[bool] = []

    def seen(sender: Any = None, **kwargs: Any) -> None:
        batched.append(open_batch() is not None)

    signals.before_task_publish.connect(seen, weak=False)
    try:
        group(add.s(i, i) for i in range(5)).apply_async()
    finally:
        signals.before_task_publish.disconnect(seen)
        app.close()
    assert batched == [False] * 5
