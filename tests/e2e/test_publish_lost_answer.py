"""A Celery publish whose commit reached PostgreSQL but whose answer was lost on the way
back (the connection dropped at that moment) is stored once: the store retries on a new
connection, finds the message its first try committed, and stores nothing more.

The publisher reaches the database through a TCP proxy that lets the publish statement (or a
batch's COMMIT) through, drops the server's answer and closes the connection at both ends.
Both tests fail without the retry's check: the task, or the whole group, is stored twice."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from sqlease import Store

from .tcp_proxy import StallingProxy

pytestmark = [pytest.mark.timeout(60)]


def test_a_celery_publish_whose_answer_was_lost_is_stored_once(pg_database_url: str) -> None:
    url = make_url(pg_database_url)
    proxy = StallingProxy((url.host or "127.0.0.1", url.port or 5432))
    prefix = f"lost{uuid.uuid4().hex[:8]}_"
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    app = Celery("lost_answer", broker="sqlease+" + through, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}
    store = Store(pg_database_url, table_prefix=prefix)
    try:
        app.send_task("lost.warm_up", task_id="warm-up")  # tables made, connection pooled
        task_id = str(uuid.uuid4())
        proxy.lose_answer(f"INSERT INTO {prefix}messages".encode())
        app.send_task("lost.work", args=(1,), task_id=task_id)
        assert proxy.answers_lost == 1  # the statement's answer really was dropped
        rows = [m for m in store.claim(["celery"], "w", lease_ms=5_000, limit=10)]
        assert sorted(m.task_id or "" for m in rows) == sorted(["warm-up", task_id])
        kinds = [e.kind for e in store.events(task_id=task_id)]
        assert kinds.count("enqueued") == 1
    finally:
        app.close()
        store.engine.dispose()
        proxy.close()


def test_a_group_whose_answer_was_lost_is_stored_once(pg_database_url: str) -> None:
    # A group is one batch, one transaction (its statements, then COMMIT): the answer to its
    # COMMIT is lost; the retry finds the batch whole and stores nothing more.
    from celery import group

    url = make_url(pg_database_url)
    proxy = StallingProxy((url.host or "127.0.0.1", url.port or 5432))
    prefix = f"lostg{uuid.uuid4().hex[:8]}_"
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    app = Celery("lost_answer", broker="sqlease+" + through, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}

    @app.task(name="lost.part", shared=False)
    def part(i: int) -> int:
        return i

    store = Store(pg_database_url, table_prefix=prefix)
    try:
        app.send_task("lost.warm_up", task_id="warm-up")
        proxy.lose_answer(f"INSERT INTO {prefix}messages".encode(), at_commit=True)
        sent = group(part.s(i) for i in range(20)).apply_async()
        assert proxy.answers_lost == 1
        ids = sorted(r.id for r in sent.results)
        claimed = store.claim(["celery"], "w", lease_ms=5_000, limit=50)
        assert sorted(m.task_id or "" for m in claimed if m.task_id != "warm-up") == ids
    finally:
        app.close()
        store.engine.dispose()
        proxy.close()
