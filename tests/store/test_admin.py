"""Admin, task states, pause/resume/cancel, waiting for a person, steps and checkpoints, on
both databases, driving deliveries through the real store (TaskContext built on a claim)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from sqlease import (
    Admin,
    ConfigurationError,
    InvalidAnswer,
    InvalidTransition,
    LeaseLost,
    OutcomeUnknown,
    Store,
    UnknownTask,
    WaitingForPerson,
)
from sqlease.task_context import TaskContext
from sqlease.testing import FakeClock

LEASE = 10_000


@pytest.fixture
def admin(store: Store) -> Admin:
    return Admin("unused", store=store)


def deliver(store: Store, owner: str = "w1", queue: str = "q") -> TaskContext:
    [message] = store.claim([queue], owner, lease_ms=LEASE)
    assert message.task_id is not None
    return TaskContext(
        store, message.fence, task_id=message.task_id, run_id=message.run_id, lease_ms=LEASE
    )


# ---- states -----------------------------------------------------------------------------------


def test_states_follow_the_message(store: Store, admin: Admin, clock: FakeClock) -> None:
    store.enqueue("q", "{}", task_id="later", delay_ms=5_000)
    store.enqueue("q", "{}", task_id="t")
    assert admin.task("t").state == "queued"
    assert admin.task("later").state == "scheduled"
    ctx = deliver(store)
    snap = admin.task("t")
    assert snap.state == "running" and snap.lease_owner == "w1" and snap.attempt == 1
    ctx.checkpoint({"page": 3}, progress=(3, 10))
    snap = admin.task("t")
    assert snap.checkpoint["page"] == 3 and snap.progress == {"done": 3, "total": 10}
    store.ack([ctx.fence])
    assert admin.task("t").state == "succeeded"
    kinds = [e["kind"] for e in admin.task("t").events]
    assert kinds == ["enqueued", "claimed", "checkpoint", "acked"]


def test_unknown_task_is_a_clear_error(admin: Admin) -> None:
    with pytest.raises(UnknownTask, match="no task 'nope'"):
        admin.task("nope")
    with pytest.raises(UnknownTask):
        admin.pause("nope")


def test_exhausted_task_is_listed_with_reason_and_requeued(
    store: Store, admin: Admin, clock: FakeClock
) -> None:
    store.enqueue("q", "{}", task_id="poison", max_attempts=2)
    for _ in range(2):
        deliver(store)
        clock.advance(LEASE)
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    [dead] = admin.tasks(state="failed")
    assert (dead.task_id, dead.reason, dead.attempt) == ("poison", "attempts_exhausted", 2)
    assert admin.stats()["q"]["dead"] == 1
    assert admin.requeue("poison")
    assert admin.task("poison").state == "queued"
    assert deliver(store).attempt == 3
    kinds = [e["kind"] for e in admin.task("poison").events]
    assert "attempts_exhausted" in kinds and "requeued" in kinds


def test_stats_per_queue(store: Store, admin: Admin, clock: FakeClock) -> None:
    store.enqueue("a", "{}", task_id="a1")
    store.enqueue("a", "{}", task_id="a2")
    store.enqueue("a", "{}", task_id="a3", delay_ms=60_000)
    store.enqueue("b", "{}", task_id="b1")
    deliver(store, queue="b")
    clock.advance(2_000)
    stats = admin.stats()
    assert stats["a"]["ready"] == 2 and stats["a"]["scheduled"] == 1
    assert stats["a"]["oldest_ready_age_s"] == 2.0
    assert stats["b"]["leased"] == 1 and stats["b"]["ready"] == 0


# ---- pause / resume / cancel ---------------------------------------------------------------


def test_pause_a_running_task_then_resume_it_elsewhere(
    store: Store, admin: Admin, clock: FakeClock
) -> None:
    store.enqueue("q", "{}", task_id="t")
    first = deliver(store, "w1")
    first.checkpoint({"page": 2})
    assert admin.pause("t") == 1
    assert admin.task("t").state == "paused"
    # The running delivery lost its lease: its next fenced write says so, nothing is written.
    with pytest.raises(LeaseLost):
        first.checkpoint({"page": 3})
    assert first.lease_lost
    assert store.ack([first.fence]) == set()
    clock.advance(10 * LEASE)
    assert store.claim(["q"], "w2", lease_ms=LEASE) == []  # held while paused
    assert admin.resume("t") == 1
    second = deliver(store, "w2")
    assert second.attempt == 2 and second.state == {"page": 2}
    events = [e["kind"] for e in admin.task("t").events]
    assert "paused" in events and "resumed" in events and "failed" not in events


def test_pause_and_cancel_a_whole_run(store: Store, admin: Admin) -> None:
    for i in range(3):
        store.enqueue("q", "{}", task_id=f"r{i}", run_id="R")
    store.enqueue("q", "{}", task_id="other")
    assert admin.pause(run_id="R") == 3
    assert [m.task_id for m in store.claim(["q"], "w", lease_ms=LEASE, limit=5)] == ["other"]
    assert admin.resume(run_id="R") == 3
    assert admin.cancel(run_id="R") == 3
    assert {t.task_id for t in admin.tasks(state="cancelled")} == {"r0", "r1", "r2"}


def test_cancel_is_final_and_sets_a_revoked_result(store: Store, admin: Admin) -> None:
    store.enqueue("q", "{}", task_id="t")
    ctx = deliver(store)
    assert admin.cancel("t", reason="not needed") == 1
    snap = admin.task("t")
    assert snap.state == "cancelled" and snap.result_state == "REVOKED"
    with pytest.raises(LeaseLost):
        ctx.event("still working")
    with pytest.raises(InvalidTransition, match="already finished or was cancelled"):
        admin.cancel("t")
    with pytest.raises(InvalidTransition, match="not paused"):
        admin.resume("t")


# ---- waiting for a person ------------------------------------------------------------------


def test_wait_for_input_parks_then_the_answer_resumes(store: Store, admin: Admin) -> None:
    store.enqueue("q", "{}", task_id="t", run_id="R")
    store.enqueue("q", "{}", task_id="after", run_id="R")
    store.enqueue("q", "{}", task_id="unrelated")
    ctx = deliver(store)
    schema = {"type": "object", "required": ["size"], "properties": {"size": {"type": "integer"}}}
    with pytest.raises(WaitingForPerson):
        ctx.wait_for_input("Which size?", schema=schema)
    snap = admin.task("t")
    assert snap.state == "waiting_input" and snap.waiting is not None
    assert snap.waiting["request"]["prompt"] == "Which size?"
    # Parked: holds no lease, its run waits behind it, other tasks are served.
    assert [m.task_id for m in store.claim(["q"], "w", lease_ms=LEASE, limit=5)] == ["unrelated"]
    with pytest.raises(InvalidAnswer, match=r"\$.size must be integer"):
        admin.provide_input("t", {"size": "big"})
    with pytest.raises(InvalidAnswer, match=r"\$.size is required"):
        admin.provide_input("t", {})
    with pytest.raises(InvalidTransition, match="waits for input, not approval"):
        admin.approve("t")
    admin.provide_input("t", {"size": 3})
    with pytest.raises(InvalidTransition, match="already answered"):
        admin.provide_input("t", {"size": 4})
    again = deliver(store)
    assert again.task_id == "t" and again.attempt == 2
    assert again.wait_for_input("Which size?", schema=schema) == {"size": 3}


def test_names_postgresql_cannot_store_are_refused_in_the_task(store: Store, admin: Admin) -> None:
    """A step name, an event kind and a wait's key (its prompt unless key= is given) are keys
    of their rows: a NUL character or more than 1000 bytes is refused by name on both
    databases, in the task, and the delivery goes on; a long prompt with a short key waits."""
    store.enqueue("q", "{}", task_id="t")
    ctx = deliver(store)
    with pytest.raises(ConfigurationError, match=r"step name 's\\x00' contains a NUL"):
        ctx.step("s\x00", lambda: 1)
    with pytest.raises(ConfigurationError, match=r"event kind .* over 1000"):
        ctx.event("k" * 1001)
    long_prompt = "Approve the refund? " * 100  # 2,000 bytes
    with pytest.raises(ConfigurationError, match=r"wait key .* over 1000 .* unless key= is given"):
        ctx.wait_for_input(long_prompt)
    assert ctx.step("s", lambda: 2) == 2
    with pytest.raises(WaitingForPerson):
        ctx.wait_for_input(long_prompt, key="refund")
    assert admin.task("t").state == "waiting_input"


def test_wait_for_approval_approve_and_reject(store: Store, admin: Admin) -> None:
    store.enqueue("q", "{}", task_id="a")
    store.enqueue("q", "{}", task_id="b")
    for task_id in ("a", "b"):
        ctx = deliver(store)
        with pytest.raises(WaitingForPerson):
            ctx.wait_for_approval(f"ship {task_id}?", amount=10)
    assert {t.task_id for t in admin.tasks(state="waiting_approval")} == {"a", "b"}
    admin.approve("a", note="fine")
    with pytest.raises(InvalidAnswer, match="needs a reason"):
        admin.reject("b", "")
    admin.reject("b", "too expensive")
    answers = {}
    for _ in range(2):
        ctx = deliver(store)
        answers[ctx.task_id] = ctx.wait_for_approval(f"ship {ctx.task_id}?", amount=10)
    assert answers == {
        "a": {"approved": True, "note": "fine"},
        "b": {"approved": False, "reason": "too expensive"},
    }


def test_answering_a_task_that_does_not_wait_is_refused(store: Store, admin: Admin) -> None:
    store.enqueue("q", "{}", task_id="t")
    with pytest.raises(InvalidTransition, match="not waiting for a person"):
        admin.provide_input("t", {})


# ---- steps and checkpoints ----------------------------------------------------------------


def test_step_runs_once_across_deliveries(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "{}", task_id="t")
    calls: list[int] = []

    def charge(amount: int) -> dict[str, Any]:
        calls.append(amount)
        return {"charged": amount}

    first = deliver(store, "w1")
    assert first.step("charge", charge, 5) == {"charged": 5}
    clock.advance(LEASE)  # the worker dies after the step, before finishing the task
    second = deliver(store, "w2")
    assert second.step("charge", charge, 5) == {"charged": 5}
    assert calls == [5]


def test_interrupted_step_is_outcome_unknown(store: Store, admin: Admin, clock: FakeClock) -> None:
    store.enqueue("q", "{}", task_id="t")
    first = deliver(store, "w1")
    first._steps.start(first.fence, "t", "charge")  # started; the worker died inside fn
    clock.advance(LEASE)
    second = deliver(store, "w2")
    ran: list[bool] = []
    with pytest.raises(OutcomeUnknown, match="'charge'"):
        second.step("charge", lambda: ran.append(True))
    assert ran == []
    assert admin.task("t").steps[0]["status"] == "outcome_unknown"
    assert second.step("charge", lambda: "again", idempotent=True) == "again"


def test_failed_step_runs_again(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "{}", task_id="t")
    first = deliver(store)

    def boom() -> None:
        raise RuntimeError("card declined")

    with pytest.raises(RuntimeError):
        first.step("charge", boom)
    assert first.step("charge", lambda: "ok") == "ok"


def test_stale_delivery_step_and_checkpoint_are_refused(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "{}", task_id="t")
    stale = deliver(store, "w1")
    clock.advance(LEASE)
    fresh = deliver(store, "w2")
    with pytest.raises(LeaseLost):
        stale.checkpoint({"x": 1})
    with pytest.raises(LeaseLost):
        stale.step("s", lambda: 1)
    with pytest.raises(LeaseLost):
        stale.ensure_lease()
    assert fresh.checkpoint({"x": 2}) == {"x": 2}


def test_checkpoint_merges_and_rejects_non_json(store: Store) -> None:
    store.enqueue("q", "{}", task_id="t")
    ctx = deliver(store)
    ctx.checkpoint({"a": 1})
    ctx.checkpoint(b=2)
    assert dict(ctx.state) == {"a": 1, "b": 2}
    with pytest.raises(TypeError, match="JSON-serializable"):
        ctx.checkpoint({"c": object()})
    with pytest.raises(TypeError):
        ctx.state["a"] = 5  # type: ignore[index]


# ---- the command line ----------------------------------------------------------------------


def run_cli(db_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sqlease", "--url", db_url, "--table-prefix", prefix, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_verbs(make_store: Callable[..., Store], db_url: str) -> None:
    store = make_store()
    prefix = store.tables.prefix
    store.enqueue("q", "{}", task_id="t1")
    store.enqueue("q", "{}", task_id="t2")
    status = run_cli(db_url, prefix, "--json", "status")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["queues"]["q"]["ready"] == 2
    assert "t1" in run_cli(db_url, prefix, "tasks").stdout
    assert run_cli(db_url, prefix, "pause", "t1").returncode == 0
    shown = json.loads(run_cli(db_url, prefix, "--json", "show", "t1").stdout)
    assert shown["state"] == "paused"
    assert run_cli(db_url, prefix, "resume", "t1").returncode == 0
    assert run_cli(db_url, prefix, "cancel", "t2", "--reason", "dup").returncode == 0
    bad = run_cli(db_url, prefix, "show", "missing")
    assert bad.returncode == 1 and "no task 'missing'" in bad.stderr
    bad_json = run_cli(db_url, prefix, "input", "t1", "{not json")
    assert bad_json.returncode != 0 and "not valid JSON" in bad_json.stderr
    assert json.loads(run_cli(db_url, prefix, "--json", "purge", "q").stdout) == {"purged": 1}
