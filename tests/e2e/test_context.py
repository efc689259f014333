"""The task context and the fenced result backend under real workers (both databases):
resume from a checkpoint after SIGKILL, a stalled worker refused after SIGSTOP/SIGCONT, a lost
ack completed from the stored result, an interrupted step, chords and groups of 100."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from typing import Any

import pytest
from celery import chord, group

from .apps.context_app import make_app
from .conftest import E2E, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def effects(e2e: E2E, kind: str) -> list[dict[str, Any]]:
    if not e2e.records_path.exists():
        return []
    conn = sqlite3.connect(str(e2e.records_path), timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'effects'").fetchone()
        if not exists:
            return []
        return [
            dict(r)
            for r in conn.execute("SELECT * FROM effects WHERE kind = ? ORDER BY id", (kind,))
        ]
    finally:
        conn.close()


def app_for(e2e: E2E, lease: float = 2.0) -> Any:
    app = make_app(e2e.broker, prefix=e2e.prefix, lease_seconds=lease)
    e2e._apps.append(app)
    return app


def test_checkpoint_then_sigkill_resumes_with_attempt_2(e2e: E2E) -> None:
    app = app_for(e2e)
    e2e.start_worker(app="context_app")
    result = app.tasks["ctx.pages"].delay(8, 0.1, kill_after=3)
    wait_for(lambda: not e2e.workers[0].alive(), 30, "the worker to kill itself")
    killed_at = time.monotonic()
    snap = e2e.admin.task(result.id)
    assert snap.checkpoint["page"] == 3 and snap.state == "running"  # lease not yet expired
    e2e.start_worker(app="context_app")
    outcome = result.get(timeout=60)
    assert time.monotonic() - killed_at >= 1.5  # not taken over before the lease expired
    assert outcome == {"pages": 8, "resumed_from": 3, "attempt": 2}
    pages = [(int(r["value"]), r["attempt"]) for r in effects(e2e, "page")]
    assert pages == [(1, 1), (2, 1), (3, 1)] + [(p, 2) for p in range(4, 9)]
    assert result.state == "SUCCESS"


def test_stalled_worker_gets_lease_lost_and_its_result_is_refused(e2e: E2E) -> None:
    app = app_for(e2e)
    stalled = e2e.start_worker(app="context_app")
    result = app.tasks["ctx.pages"].delay(6, 0.4)
    wait_for(lambda: len(effects(e2e, "page")) >= 1, 30, "the first page")
    e2e.stall(stalled)  # past the 2 s lease (no heartbeat)
    try:
        e2e.start_worker(app="context_app")
        outcome = result.get(timeout=60)
        assert outcome["attempt"] == 2
    finally:
        os.killpg(stalled.pid, signal.SIGCONT)
    # The stalled delivery wakes up, tries its next checkpoint, gets LeaseLost and stops:
    # nothing more is recorded under attempt 1, and the new holder's result stands.
    wait_for(lambda: "ignored" in stalled.log(), 30, "the stalled worker to notice")
    time.sleep(1.0)
    # LeaseLost stopped the task, not the worker (it must survive the prefork pool's pickling)
    assert stalled.alive() and "Unrecoverable error" not in stalled.log()
    late = [r for r in effects(e2e, "page") if r["attempt"] == 1]
    takeover_page = outcome["resumed_from"]
    assert all(int(r["value"]) <= takeover_page + 1 for r in late)
    assert app.AsyncResult(result.id).get(timeout=5) == outcome
    assert "FAILURE" not in {result.state}
    kinds = [e["kind"] for e in e2e.admin.task(result.id).events]
    assert kinds.count("claimed") == 2 and "failed" not in kinds


def test_lost_ack_completes_from_the_stored_result(e2e: E2E) -> None:
    app = app_for(e2e)
    e2e.start_worker(app="context_app", E2E_LOSE_ACK=1)
    result = app.tasks["ctx.once"].delay(21)
    wait_for(lambda: not e2e.workers[0].alive(), 30, "the worker to die after storing")
    assert result.get(timeout=10) == 42  # stored before the crash
    e2e.start_worker(app="context_app")
    wait_for(
        lambda: (
            "completed_from_stored_outcome" in [e["kind"] for e in e2e.admin.task(result.id).events]
        ),
        30,
        "the redelivery to complete from the stored result",
    )
    assert len(effects(e2e, "body")) == 1  # the body ran once
    assert e2e.store.size("celery") == 0
    assert e2e.admin.task(result.id).state == "succeeded"


def test_interrupted_step_is_outcome_unknown_not_repeated(e2e: E2E) -> None:
    app = app_for(e2e)
    e2e.start_worker(app="context_app")
    result = app.tasks["ctx.charge"].delay("order-1", crash="inside")
    wait_for(lambda: not e2e.workers[0].alive(), 30, "the worker to die inside the step")
    e2e.start_worker(app="context_app")
    with pytest.raises(Exception, match="outcome is unknown"):
        result.get(timeout=60)
    assert len(effects(e2e, "charge")) == 1
    steps = e2e.admin.task(result.id).steps
    assert steps == [{"name": "charge", "status": "outcome_unknown", "attempt": 1, "error": None}]


def test_finished_step_is_not_repeated_after_a_crash(e2e: E2E) -> None:
    app = app_for(e2e)
    e2e.start_worker(app="context_app")
    result = app.tasks["ctx.charge"].delay("order-2", crash="after")
    wait_for(lambda: not e2e.workers[0].alive(), 30, "the worker to die after the step")
    e2e.start_worker(app="context_app")
    assert result.get(timeout=60) == "charged order-2"
    assert len(effects(e2e, "charge")) == 1


def test_groups_and_chords_of_100(e2e: E2E) -> None:
    app = app_for(e2e, lease=10.0)
    e2e.start_worker(app="context_app", pool="threads", concurrency=4)
    add, tsum = app.tasks["ctx.add"], app.tasks["ctx.tsum"]
    assert group(add.s(i, i) for i in range(100))().get(timeout=120) == [2 * i for i in range(100)]
    assert chord((add.s(i, 1) for i in range(100)), tsum.s())().get(timeout=120) == sum(
        i + 1 for i in range(100)
    )


def _chord_of_three_with_a_kill(
    e2e: E2E, kind: str, **hook: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """A chord of three parts and a sum, on a worker that kills itself where ``hook`` says
    (recording ``kind``); the app, the chord's result and the record of the part that died."""
    app = app_for(e2e)
    e2e.start_worker(app="context_app", **hook)
    add, tsum = app.tasks["ctx.add"], app.tasks["ctx.tsum"]
    result = chord((add.s(i, 1) for i in range(3)), tsum.s())()
    wait_for(lambda: not e2e.workers[0].alive(), 30, f"the worker to die ({kind})")
    [died] = effects(e2e, kind)
    return app, result, died


def _completes_with_the_part_run_twice(e2e: E2E, result: Any, died: dict[str, Any]) -> None:
    e2e.start_worker(app="context_app")
    assert result.get(timeout=60) == 1 + 2 + 3
    kinds = [e["kind"] for e in e2e.admin.task(died["task_id"]).events]
    assert kinds.count("claimed") == 2 and "completed_from_stored_outcome" not in kinds


def test_a_chord_part_killed_between_its_result_and_its_count_still_completes_the_chord(
    e2e: E2E,
) -> None:
    """Celery stores a part's result, then counts it towards the chord. A worker killed in
    between leaves the result stored and the part uncounted: completing that delivery from
    the stored result (guarantees.md, invariant 9) would leave the chord waiting forever. The
    part runs again instead, and is counted once."""
    app, result, died = _chord_of_three_with_a_kill(
        e2e, "died_before_count", E2E_DIE_BEFORE_COUNT=1
    )
    assert app.AsyncResult(died["task_id"]).get(timeout=10) is not None  # stored, uncounted
    _completes_with_the_part_run_twice(e2e, result, died)


def test_a_chord_part_killed_after_the_last_count_still_sends_the_callback(e2e: E2E) -> None:
    """The last part's count reached the chord's size, and the worker died before Celery sent
    the callback. The part's redelivery runs again (its count stays one), and the callback
    is sent by it."""
    _, result, died = _chord_of_three_with_a_kill(
        e2e, "died_after_last_count", E2E_DIE_AFTER_LAST_COUNT=3
    )
    _completes_with_the_part_run_twice(e2e, result, died)
    assert len(effects(e2e, "died_after_last_count")) == 1


def test_pause_a_running_task_and_resume_it_on_another_worker(e2e: E2E) -> None:
    app = app_for(e2e)
    first = e2e.start_worker(app="context_app")
    result = app.tasks["ctx.pages"].delay(12, 0.3)
    wait_for(lambda: len(effects(e2e, "page")) >= 3, 30, "three pages")
    assert e2e.admin.pause(result.id) == 1
    # The running delivery finds out at its next checkpoint (LeaseLost: ignored, no failure).
    wait_for(lambda: "ignored" in first.log(), 30, "the paused delivery to stop")
    paused_at = e2e.admin.task(result.id).checkpoint["page"]
    assert e2e.admin.task(result.id).state == "paused"
    first.warm_shutdown()
    e2e.start_worker(app="context_app")
    assert e2e.admin.resume(result.id) == 1
    outcome = result.get(timeout=60)
    assert outcome["pages"] == 12 and outcome["attempt"] == 2
    assert outcome["resumed_from"] == paused_at
    kinds = [e["kind"] for e in e2e.admin.task(result.id).events]
    assert "paused" in kinds and "resumed" in kinds and "failed" not in kinds
    assert result.state == "SUCCESS"


def test_revoke_is_durable_across_worker_restarts(e2e: E2E) -> None:
    app = app_for(e2e)
    result = app.tasks["ctx.once"].delay(5)  # no worker is running yet
    result.revoke()
    assert e2e.admin.task(result.id).state == "cancelled"
    assert app.AsyncResult(result.id).state == "REVOKED"
    e2e.start_worker(app="context_app")  # a fresh worker never saw the broadcast
    later = app.tasks["ctx.once"].delay(6)
    assert later.get(timeout=60) == 12
    assert effects(e2e, "body") == [
        {**row, "value": "6"} for row in effects(e2e, "body")
    ]  # only the later one ran
    assert len(effects(e2e, "body")) == 1


def test_unknown_task_is_kept_as_rejected_and_the_worker_keeps_serving(e2e: E2E) -> None:
    app = app_for(e2e)
    worker = e2e.start_worker(app="context_app")
    unknown = app.send_task("nobody.knows.this", args=(1,))
    known = app.tasks["ctx.add"].delay(2, 3)
    assert known.get(timeout=60) == 5
    wait_for(
        lambda: e2e.admin.task(unknown.id).state == "failed",
        30,
        "the unknown task to be kept as failed",
    )
    snap = e2e.admin.task(unknown.id)
    assert snap.reason == "rejected" and worker.alive()
