"""Celery's revokes written to the database when the transport publishes them
(``sqlease.revokes``), on SQLite and PostgreSQL, with no worker running: a task no worker
holds is cancelled at once; a held one is left to its holder and the revoke is recorded, so
that its next delivery is discarded by Celery; stamped-header revokes match as Celery's worker
matches them. The same under real workers: tests/e2e/test_revoke.py."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from sqlease import Admin, Store
from sqlease.revokes import REQUESTED, Revoke, parse, requested, stamps_match


@pytest.fixture
def app(broker_url: str, transport_options: dict[str, Any]) -> Iterator[Celery]:
    app = Celery("revokes", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = transport_options
    yield app
    app.close()


@pytest.fixture
def admin(broker_url: str, table_prefix: str, db_store: Store) -> Admin:
    return Admin(broker_url, table_prefix=table_prefix, store=db_store)


def send(app: Celery, *args: Any, **options: Any) -> str:
    return str(app.send_task("t.work", args=args, **options).id)


def stamped(app: Celery, **stamps: Any) -> str:
    """A task published with Celery's stamped headers (as a stamping visitor leaves them)."""
    return send(app, stamped_headers=list(stamps), **stamps)


def held_by_a_consumer(connect: Callable[..., Connection]) -> tuple[Connection, Any]:
    """Fetch the next message of the ``celery`` queue without acking it: a live lease."""
    conn = connect()
    message = conn.SimpleQueue("celery", no_ack=False).get(timeout=10)
    return conn, message


def test_revoking_a_queued_task_cancels_it_with_a_revoked_result(app: Celery, admin: Admin) -> None:
    task_id = send(app, 1)
    app.control.revoke(task_id)
    snap = admin.task(task_id)
    assert (snap.state, snap.reason, snap.result_state) == ("cancelled", "cancelled", "REVOKED")
    assert snap.last_error == "revoked"


def test_revoking_a_held_task_leaves_it_to_its_worker_and_records_the_revoke(
    app: Celery, admin: Admin, db_store: Store, connect: Callable[..., Connection]
) -> None:
    task_id = send(app, 1)
    _holder, message = held_by_a_consumer(connect)
    assert message.headers["id"] == task_id
    app.control.revoke(task_id, terminate=True)

    snap = admin.task(task_id)
    assert snap.state == "running" and snap.result_state is None  # untouched: its worker decides
    events = [e for e in db_store.events(task_id=task_id) if e.kind == REQUESTED]
    assert len(events) == 1
    assert (events[0].attempt, events[0].data) == (1, {"terminate": True})
    assert requested(db_store, task_id)
    message.ack()  # the holder's ack still counts: the lease was never taken
    assert "acked" in [e.kind for e in db_store.events(task_id=task_id)]


def test_a_held_task_delivered_again_is_put_in_celerys_revoked_list(
    app: Celery, connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.worker import state as worker_state

    monkeypatch.setattr(worker_state, "revoked", set())
    revoked_id, other_id = send(app, 1), send(app, 2)
    holder = connect()
    queue = holder.SimpleQueue("celery", no_ack=False)
    first, second = queue.get(timeout=10), queue.get(timeout=10)
    assert [first.headers["id"], second.headers["id"]] == [revoked_id, other_id]
    app.control.revoke(revoked_id)
    holder.release()  # the holder goes away before acting: both are given back

    again = connect().SimpleQueue("celery", no_ack=False)
    redelivered = [again.get(timeout=10), again.get(timeout=10)]
    assert [m.delivery_info["redelivered"] for m in redelivered] == [True, True]
    assert worker_state.revoked == {revoked_id}  # Celery discards it; the other one runs


def test_a_redelivery_outside_a_celery_worker_is_delivered_as_it_is(
    app: Celery, connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "celery.worker.state", raising=False)
    task_id = send(app, 1)
    holder, _ = held_by_a_consumer(connect)
    app.control.revoke(task_id)
    holder.release()
    message = connect().SimpleQueue("celery", no_ack=False).get(timeout=10)
    assert message.headers["id"] == task_id and message.delivery_info["redelivered"]


def test_revoke_by_stamped_headers_cancels_the_matching_queued_tasks(
    app: Celery, admin: Admin
) -> None:
    plain = send(app, 0)
    a = stamped(app, batch="a")
    b = stamped(app, batch="b")
    in_list = stamped(app, batch=["x", "a"])
    other_header = stamped(app, tenant="a")
    app.control.revoke_by_stamped_headers({"batch": ["a", "z"]})
    states = {t: admin.task(t).state for t in (plain, a, b, in_list, other_header)}
    assert states == {
        plain: "queued",
        a: "cancelled",
        b: "queued",
        in_list: "cancelled",
        other_header: "queued",
    }
    app.control.revoke_by_stamped_headers(["tenant=a"])  # Celery's list form, "name=value"
    assert admin.task(other_header).state == "cancelled"


def test_revoke_by_stamped_headers_records_the_held_ones(
    app: Celery, admin: Admin, db_store: Store, connect: Callable[..., Connection]
) -> None:
    held = stamped(app, batch="a")
    _holder, message = held_by_a_consumer(connect)
    assert message.headers["id"] == held
    queued = stamped(app, batch="a")
    app.control.revoke_by_stamped_headers({"batch": "a"})
    assert admin.task(queued).state == "cancelled"
    assert admin.task(held).state == "running"
    assert requested(db_store, held) and not requested(db_store, queued)


def test_revokes_of_unknown_finished_or_cancelled_tasks_change_nothing(
    app: Celery, admin: Admin, connect: Callable[..., Connection]
) -> None:
    done = send(app, 1)
    _holder, message = held_by_a_consumer(connect)
    message.ack()
    cancelled = send(app, 2)
    admin.cancel(cancelled)
    before = {t: admin.task(t).events for t in (done, cancelled)}
    app.control.revoke(["no-such-task", done, cancelled])  # no error, nothing written
    assert {t: admin.task(t).events for t in (done, cancelled)} == before
    assert admin.task(cancelled).last_error == "cancelled"  # a revoke would say "revoked"


def test_the_revokes_celery_publishes_are_read_and_nothing_else(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlease import revokes

    seen: list[Revoke] = []
    monkeypatch.setattr(revokes, "apply", lambda store, revoke: seen.append(revoke))
    app.control.revoke("t1", terminate=True, signal="KILL")
    app.control.revoke(["t2", "t3"])
    app.control.revoke_by_stamped_headers({"batch": "a", "n": [1, 2]})
    app.control.broadcast("ping")
    assert seen == [
        Revoke(task_ids=("t1",), terminate=True),
        Revoke(task_ids=("t2", "t3")),
        Revoke(stamps={"batch": ["a"], "n": [1, 2]}),
    ]


def test_stamps_match_as_celerys_worker_does() -> None:
    def headers(**stamps: Any) -> dict[str, Any]:
        return {"stamped_headers": list(stamps), "stamps": stamps}

    assert stamps_match(headers(batch="a"), {"batch": ["a"]})
    assert stamps_match(headers(batch=["b", "a"]), {"batch": ["a"]})
    assert stamps_match(headers(batch=3), {"batch": [1, 3]})
    assert not stamps_match(headers(batch="b"), {"batch": ["a"]})
    assert not stamps_match(headers(other="a"), {"batch": ["a"]})
    assert not stamps_match({"stamps": {"batch": "a"}}, {"batch": ["a"]})  # not stamped
    assert not stamps_match({"stamped_headers": None, "stamps": None}, {"batch": ["a"]})
    assert not stamps_match(headers(batch=None), {"batch": [None]})


def test_parse_ignores_what_is_not_a_revoke() -> None:
    assert parse({"body": "not json", "content-type": "application/json"}) is None
    assert parse({}) is None
