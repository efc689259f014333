"""Outcomes the broker itself decides reach Celery clients, and errors survive the trip."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator

import pytest
from celery import Celery
from celery._state import _task_stack
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult

import sqlease
from conftest import isolated_app
from sqlease import Admin, ContextUnavailable, LeaseLost, OutcomeUnknown, Store
from sqlease._celery.defaults import uses_sqlease
from sqlease._core.results import ResultStore
from sqlease.errors import AttemptsExhausted, SchemaVersionMismatch, WaitingForPerson
from sqlease.transport import ATTEMPT_KEY, ID_KEY, LEASE_KEY, OWNER_KEY
from sqlease.transport._completion import record_exhausted


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = isolated_app("outcomes", db_url)
    yield app
    app.close()


@pytest.mark.parametrize(
    "error",
    [
        LeaseLost(1, 2, "stalled"),
        OutcomeUnknown("t", "charge"),
        AttemptsExhausted("t", 3),
        WaitingForPerson("t", "input", "size"),
        SchemaVersionMismatch(4, 1),
    ],
)
def test_errors_survive_pickling_and_celerys_json_round_trip(error: Exception) -> None:
    again = pickle.loads(pickle.dumps(error))  # the prefork pool pickles task outcomes
    assert type(again) is type(error) and str(again) == str(error)
    assert type(error)(*error.args).args == error.args  # Celery rebuilds cls(*exc_message)


def test_exhausted_task_gets_a_failure_result(app: Celery) -> None:
    with app.connection_for_write() as conn:
        transport = conn.transport
        store = transport.store
        store.enqueue("celery", "{}", task_id="poison", max_attempts=1, now=0)
        store.claim(["celery"], "w", lease_ms=1, now=0)
        results = transport.results
        exhausted = lambda dead: record_exhausted(results, dead)  # noqa: E731 (as the fetcher)
        assert store.claim(["celery"], "w", lease_ms=1, now=10, on_exhausted=exhausted) == []
    result = AsyncResult("poison", app=app)
    assert result.state == "FAILURE"
    with pytest.raises(AttemptsExhausted, match="delivered 1 times"):
        result.get(timeout=5)


def test_requeued_message_runs_again_instead_of_completing_from_its_old_result(
    app: Celery,
) -> None:
    with app.connection_for_write() as conn:
        store: Store = conn.transport.store
    store.enqueue("celery", "{}", task_id="t")
    [first] = store.claim(["celery"], "w", lease_ms=60_000)
    ResultStore(store).put(
        "celery-task-meta-t", b"{}", state="FAILURE", task_id="t", fence=first.fence
    )
    assert store.fail(first.fence, "rejected")
    assert ResultStore(store).completed_messages([first.id]) == {first.id}
    Admin("x", store=store).requeue("t")
    assert ResultStore(store).completed_messages([first.id]) == set()


def test_a_delivery_rejected_with_requeue_runs_again_instead_of_completing(app: Celery) -> None:
    # Celery stores a hard time limit's FAILURE, then rejects with requeue when
    # acks_on_failure_or_timeout is off: the worker asked for another run.
    with app.connection_for_write() as conn:
        store: Store = conn.transport.store
    store.enqueue("celery", "{}", task_id="t")
    store.enqueue("celery", "{}", task_id="u")
    first, other = store.claim(["celery"], "w", lease_ms=60_000, limit=2)
    for message, task_id in ((first, "t"), (other, "u")):
        ResultStore(store).put(
            f"celery-task-meta-{task_id}",
            b"{}",
            state="FAILURE",
            task_id=task_id,
            fence=message.fence,
        )
    assert store.release_rejected(first.fence)
    assert ResultStore(store).completed_messages([first.id, other.id]) == {other.id}
    [again] = store.claim(["celery"], "w2", lease_ms=60_000)
    assert (again.id, again.attempt) == (first.id, 2)
    assert not store.release_rejected(first.fence)  # stale: the new holder keeps it


def _until(done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_requeued_rejected_task_runs_again_through_a_worker(app: Celery, db_url: str) -> None:
    """A task that stored its FAILURE and was then rejected without requeue (kept as failed
    ``rejected``) runs its body again once requeued: the worker's lost-ack check must not
    take the stored result for the requeued delivery's."""
    app.conf.update(
        task_acks_on_failure_or_timeout=False,  # a failed task is rejected, not acked
        result_backend_transport_options=app.conf.broker_transport_options,
    )
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "polling_interval": 0.05,
    }
    app.loader.import_task_module("celery.contrib.testing.tasks")  # celery.ping
    runs: list[int] = []

    @app.task(name="outcomes.fails_once", shared=False)
    def fails_once() -> str:
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("the first run fails")
        return "ran again"

    with app.connection_for_write() as conn:
        store: Store = conn.transport.store
    admin = Admin("x", store=store)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = fails_once.delay()
        with pytest.raises(ValueError):
            result.get(timeout=10)
        _until(lambda: admin.task(result.id).reason == "rejected", "the reject")
        message_id = admin.task(result.id).message_id
        assert message_id is not None
        # The stored FAILURE is this message's: a plain redelivery would complete from it.
        assert ResultStore(store).completed_messages([message_id]) == {message_id}
        admin.requeue(result.id)
        _until(lambda: admin.task(result.id).state == "succeeded", "the second run's ack")
    assert len(runs) == 2
    assert app.AsyncResult(result.id).get(timeout=5) == "ran again"
    kinds = [e["kind"] for e in admin.task(result.id).events]
    assert "completed_from_stored_outcome" not in kinds
    assert kinds.count("claimed") == 2


def test_purged_task_reads_as_cancelled(store: Store) -> None:
    store.enqueue("q", "{}", task_id="gone")
    store.purge("q")
    snap = Admin("x", store=store).task("gone")
    assert (snap.state, snap.reason) == ("cancelled", "purged")


def test_broker_url_from_the_environment_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "sqlease+sqlite:///x.db")
    app = Celery("env", set_as_current=False)
    assert uses_sqlease(app)
    app.finalize()
    assert app.conf.task_acks_late is True
    app.close()


def test_backend_fences_with_the_broker_transport_setting(db_url: str) -> None:
    app = Celery("setting", broker=db_url, backend=f"sqlease+{db_url}", set_as_current=False)
    app.conf.broker_transport = "sqlease.transport:Transport"
    assert app.backend._same_db_as_broker
    other = Celery(
        "other", broker=f"sqlease+{db_url}", backend=f"sqlease+{db_url}", set_as_current=False
    )
    other.conf.result_backend_transport_options = {"table_prefix": "elsewhere_"}
    assert not other.backend._same_db_as_broker  # another prefix: cannot fence
    app.close()
    other.close()


def test_context_refuses_early_acked_tasks_clearly(app: Celery) -> None:
    @app.task(name="early", acks_late=False, shared=False)
    def early() -> None:
        pass

    app.finalize()
    early.push_request(
        id="e1",
        properties={"delivery_info": {ID_KEY: 1, ATTEMPT_KEY: 1, OWNER_KEY: "w", LEASE_KEY: 1000}},
    )
    _task_stack.push(early)
    try:
        with pytest.raises(ContextUnavailable, match="acks_late"):
            sqlease.context()
    finally:
        _task_stack.pop()
        early.pop_request()


def test_context_outside_a_task_is_a_clear_error() -> None:
    with pytest.raises(ContextUnavailable, match="inside a running task"):
        sqlease.context()


def test_public_names() -> None:
    import types

    import sqlease.task_context  # importing the module must not shadow the function

    assert callable(sqlease.context) and not isinstance(sqlease.context, types.ModuleType)
    assert sqlease.__all__ == sorted(sqlease.__all__)
    assert all(hasattr(sqlease, name) for name in sqlease.__all__)
    from kombu.transport import resolve_transport

    from sqlease.transport import Transport

    assert resolve_transport("sqlease") is Transport


@pytest.mark.timeout(60)
def test_a_redelivery_whose_stored_outcome_cannot_be_read_is_claimed_again(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redelivered message is first checked for a stored final result. When that check
    fails (the database went away meanwhile), the worker must neither run the task blindly
    nor keep the message held for ever (its heartbeat would renew a lease nothing delivers):
    it lets the lease run out, and the next claim checks again."""
    from sqlalchemy.exc import OperationalError

    from sqlease.transport import _deliveries

    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "polling_interval": 0.05,
        "lease_seconds": 1.0,
    }
    runs: list[int] = []

    @app.task(name="outcomes.once", shared=False)
    def once() -> str:
        runs.append(1)
        return "ran"

    with app.connection_for_write() as conn:
        store: Store = conn.transport.store
    result = once.delay()
    # A worker took it and vanished: the next delivery is a redelivery.
    [gone] = store.claim(["celery"], "gone:1:x", lease_ms=200, limit=1)
    assert gone.task_id == result.id
    time.sleep(0.3)
    checks: list[int] = []
    real = _deliveries.settle_redelivered

    def flaky(*args: object) -> object:
        checks.append(1)
        if len(checks) == 1:
            raise OperationalError("SELECT …", {}, Exception("server closed the connection"))
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_deliveries, "settle_redelivered", flaky)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert result.get(timeout=30) == "ran"
    assert len(checks) >= 2, checks
    assert runs == [1]
