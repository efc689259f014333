"""A publish whose commit went through but whose answer was lost (the server restarted, or
the connection dropped, at the commit) is retried by the store; the retry first looks for the
try before's message, so the message is stored once and its task runs once. A try that
failed before its commit is stored by the retry, once."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from sqlease import Admin, Store
from sqlease.testing import FakeClock
from sqlease.types import NewMessage


def _lost(statement: str = "COMMIT") -> OperationalError:
    return OperationalError(statement, {}, Exception("server closed the connection unexpectedly"))


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sqlease._db.retry.time.sleep", lambda _s: None)


@pytest.fixture
def fail_first(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``fail_first(committed=..., between=...)``: the next op the driver executes fails as
    a lost connection, after running (its commit's answer lost) or before; ``between`` runs
    after the committed op, before the error (a worker that took the message meanwhile)."""
    real = store.driver.execute
    pending: list[tuple[bool, Callable[[], None] | None]] = []

    def execute(op: Any) -> Any:
        if not pending:
            return real(op)
        committed, between = pending.pop()
        if committed:
            real(op)
            if between is not None:
                between()
        raise _lost()

    monkeypatch.setattr(store.driver, "execute", execute)

    def arm(*, committed: bool, between: Callable[[], None] | None = None) -> None:
        pending.append((committed, between))

    yield arm


def _kombu_payload(tag: str) -> str:
    # The delivery tag is what makes two publishes of one task id differ.
    return json.dumps({"body": "e30=", "properties": {"delivery_tag": tag}})


def _enqueued(store: Store, task_id: str) -> list[dict[str, Any]]:
    return [e for e in Admin("x", store=store).task(task_id).events if e["kind"] == "enqueued"]


def test_a_commit_whose_answer_was_lost_is_stored_once(store: Store, fail_first) -> None:
    fail_first(committed=True)
    message_id = store.enqueue("q", _kombu_payload("a"), task_id="t")
    assert store.size("q") == 1
    assert [e["message_id"] for e in _enqueued(store, "t")] == [message_id]
    [claimed] = store.claim(["q"], "w", lease_ms=1_000)
    assert claimed.id == message_id
    assert store.claim(["q"], "w", lease_ms=1_000) == []


def test_one_delivered_and_acked_before_the_retry_is_not_stored_again(
    store: Store, fail_first
) -> None:
    def a_worker_runs_it() -> None:
        [m] = store.claim(["q"], "w", lease_ms=1_000)
        assert store.ack([m.fence]) == {m.id}

    fail_first(committed=True, between=a_worker_runs_it)
    message_id = store.enqueue("q", _kombu_payload("a"), task_id="t")
    assert store.size("q") == 0
    assert store.claim(["q"], "w2", lease_ms=1_000) == []
    assert [e["message_id"] for e in _enqueued(store, "t")] == [message_id]


def test_a_try_that_failed_before_its_commit_is_stored_by_the_retry(
    store: Store, fail_first
) -> None:
    fail_first(committed=False)
    message_id = store.enqueue("q", _kombu_payload("a"), task_id="t")
    assert store.size("q") == 1
    assert [e["message_id"] for e in _enqueued(store, "t")] == [message_id]


def test_another_publish_of_the_task_id_is_not_taken_for_the_first_try(
    store: Store, fail_first
) -> None:
    # Celery's retry publishes the task id again (a new delivery tag): that message is not
    # this publish's first try, which failed before its commit.
    earlier = store.enqueue("q", _kombu_payload("first"), task_id="t")
    fail_first(committed=False)
    again = store.enqueue("q", _kombu_payload("retry"), task_id="t")
    assert again != earlier
    assert store.size("q") == 2
    # Nor is the same payload sent to another queue (a fanout publishes one message to each).
    fail_first(committed=False)
    store.enqueue("other", _kombu_payload("retry"), task_id="t")
    assert store.size("other") == 1


def test_a_batch_whose_answer_was_lost_is_stored_once(store: Store, fail_first) -> None:
    batch = [NewMessage("q", _kombu_payload(f"b{i}"), task_id=f"t{i}") for i in range(3)]
    fail_first(committed=True)
    ids = store.enqueue_many(batch)
    assert store.size("q") == 3
    claimed = store.claim(["q"], "w", lease_ms=1_000, limit=10)
    assert sorted(m.id for m in claimed) == sorted(ids) and len(set(ids)) == 3


def test_a_batch_that_failed_before_its_commit_is_stored_by_the_retry(
    store: Store, fail_first
) -> None:
    batch = [NewMessage("q", _kombu_payload(f"b{i}"), task_id=f"t{i}") for i in range(3)]
    fail_first(committed=False)
    ids = store.enqueue_many(batch)
    assert store.size("q") == 3 and len(set(ids)) == 3


def test_an_old_message_of_the_task_id_with_the_same_payload_is_not_this_publish(
    store: Store, clock: FakeClock, fail_first
) -> None:
    # Only what was published since the first try began can be its commit.
    store.enqueue("q", "same", task_id="t")
    clock.advance(60_000)
    fail_first(committed=False)
    store.enqueue("q", "same", task_id="t")
    assert store.size("q") == 2
