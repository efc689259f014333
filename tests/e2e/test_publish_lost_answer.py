"""A Celery publish whose commit reached PostgreSQL but whose answer was lost on the way
back (the connection dropped at that moment) is stored once: the store retries on a new
connection, finds the message its first try committed, and stores nothing more.

The publisher reaches the database through a TCP proxy that lets the publish statement (or a
batch's COMMIT) through, drops the server's answer and closes the connection at both ends.
Both tests fail without the retry's check: the task, or the whole group, is stored twice."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from celery import Celery, group

from sqlease import Store

from .tcp_proxy import StallingProxy

pytestmark = [pytest.mark.timeout(60)]


@dataclass
class Publisher:
    """A Celery app that publishes through the proxy, and a store on the same tables that
    reads them directly."""

    app: Celery
    store: Store
    proxy: StallingProxy
    prefix: str

    def lose_next_insert_answer(self, *, at_commit: bool = False) -> None:
        self.proxy.lose_answer(f"INSERT INTO {self.prefix}messages".encode(), at_commit=at_commit)


@pytest.fixture
def publisher(pg_database_url: str) -> Iterator[Publisher]:
    proxy = StallingProxy.to(pg_database_url)
    prefix = f"lost{uuid.uuid4().hex[:8]}_"
    through = proxy.through(pg_database_url)
    app = Celery("lost_answer", broker="sqlease+" + through, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}
    store = Store(pg_database_url, table_prefix=prefix)
    try:
        app.send_task("lost.warm_up", task_id="warm-up")  # tables made, connection pooled
        yield Publisher(app, store, proxy, prefix)
    finally:
        app.close()
        store.engine.dispose()
        proxy.close()


def test_a_celery_publish_whose_answer_was_lost_is_stored_once(publisher: Publisher) -> None:
    task_id = str(uuid.uuid4())
    publisher.lose_next_insert_answer()
    publisher.app.send_task("lost.work", args=(1,), task_id=task_id)
    assert publisher.proxy.answers_lost == 1  # the statement's answer really was dropped
    claimed = publisher.store.claim(["celery"], "w", lease_ms=5_000, limit=10)
    assert sorted(m.task_id or "" for m in claimed) == sorted(["warm-up", task_id])
    kinds = [e.kind for e in publisher.store.events(task_id=task_id)]
    assert kinds.count("enqueued") == 1


def test_a_group_whose_answer_was_lost_is_stored_once(publisher: Publisher) -> None:
    # A group is one batch, one transaction (its statements, then COMMIT): the answer to its
    # COMMIT is lost; the retry finds the batch whole and stores nothing more.
    @publisher.app.task(name="lost.part", shared=False)
    def part(i: int) -> int:
        return i

    publisher.lose_next_insert_answer(at_commit=True)
    sent = group(part.s(i) for i in range(20)).apply_async()
    assert publisher.proxy.answers_lost == 1
    ids = sorted(r.id for r in sent.results)
    claimed = publisher.store.claim(["celery"], "w", lease_ms=5_000, limit=50)
    assert sorted(m.task_id or "" for m in claimed if m.task_id != "warm-up") == ids
