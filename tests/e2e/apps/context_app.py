"""The app of the task-context end-to-end tests: checkpoints, steps, results under leases.

Broker and result backend are the same sqlease database (so results are fenced). Side effects
("pages imported", "cards charged") are recorded in the executions file through
``records.effect``-style rows, which the tests count."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from typing import Any

from celery import Celery, signals

import sqlease

EFFECTS = """
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL, kind TEXT NOT NULL, value TEXT, attempt INTEGER, pid INTEGER
)
"""


def effect(task_id: str, kind: str, value: Any, attempt: int) -> None:
    conn = sqlite3.connect(os.environ["E2E_RECORDS"], timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(EFFECTS)
        conn.execute(
            "INSERT INTO effects (task_id, kind, value, attempt, pid) VALUES (?, ?, ?, ?, ?)",
            (task_id, kind, str(value), attempt, os.getpid()),
        )
    finally:
        conn.close()


def kill_my_worker() -> None:
    """SIGKILL the whole worker (main process and pool children): a crash with no cleanup."""
    os.killpg(os.getpgid(0), signal.SIGKILL)


def make_app(broker: str, *, prefix: str, lease_seconds: float = 2.0) -> Celery:
    app = Celery("ctx", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "lease_seconds": lease_seconds,
            "polling_interval": 0.2,
            "table_prefix": prefix,
        },
        worker_prefetch_multiplier=1,
        result_extended=True,
    )

    @app.task(name="ctx.pages", bind=True, shared=False)
    def pages(self: Any, total: int, seconds: float, kill_after: int = 0) -> dict[str, int]:
        ctx = sqlease.context()
        page = int(ctx.state.get("page", 0))
        resumed_from = page
        while page < total:
            time.sleep(seconds)
            page += 1
            ctx.checkpoint({"page": page}, progress=(page, total))
            effect(ctx.task_id, "page", page, ctx.attempt)
            if kill_after and page == kill_after and ctx.attempt == 1:
                kill_my_worker()
        return {"pages": page, "resumed_from": resumed_from, "attempt": ctx.attempt}

    @app.task(name="ctx.charge", bind=True, shared=False)
    def charge(self: Any, order: str, crash: str = "", idempotent: bool = False) -> str:
        ctx = sqlease.context()

        def charge_card() -> str:
            effect(ctx.task_id, "charge", order, ctx.attempt)
            if crash == "inside" and ctx.attempt == 1:
                kill_my_worker()
            return f"charged {order}"

        receipt: str = ctx.step("charge", charge_card, idempotent=idempotent)
        if crash == "after" and ctx.attempt == 1:
            kill_my_worker()
        return receipt

    @app.task(name="ctx.once", bind=True, shared=False)
    def once(self: Any, value: int) -> int:
        effect(self.request.id, "body", value, 0)
        return value * 2

    @app.task(name="ctx.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="ctx.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    return app


@signals.task_postrun.connect
def _lose_the_ack(
    sender: Any = None, task_id: str | None = None, kwargs: Any = None, **rest: Any
) -> None:
    # The result is stored by now; dying here loses the ack (guarantees.md, invariant 9).
    if sender is not None and sender.name == "ctx.once" and os.environ.get("E2E_LOSE_ACK"):
        marker = os.path.join(os.path.dirname(os.environ["E2E_RECORDS"]), "ack-lost")
        if not os.path.exists(marker):
            open(marker, "w").close()
            kill_my_worker()


if os.environ.get("E2E_DIE_BEFORE_COUNT"):
    # Die in the moment between a chord part's stored result and its count (Celery stores
    # the result first): the part's redelivery finds the result stored but not counted.
    from sqlease.backend import SqleaseBackend

    _count = SqleaseBackend.on_chord_part_return

    def _die_before_the_first_count(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        marker = os.path.join(os.path.dirname(os.environ["E2E_RECORDS"]), "count-lost")
        if not os.path.exists(marker):
            effect(request.id, "died_before_count", 0, 0)
            open(marker, "w").close()
            kill_my_worker()
        return _count(self, request, *args, **kwargs)

    SqleaseBackend.on_chord_part_return = _die_before_the_first_count  # type: ignore[method-assign]


if os.environ.get("E2E_DIE_AFTER_LAST_COUNT"):
    # Die in the moment after a chord's last part was counted and before Celery sends the
    # chord's callback: the part's redelivery finds its result stored and its count made.
    from sqlease.backend import SqleaseBackend
    from sqlease.backend._fencing import counting_part

    _incr = SqleaseBackend.incr

    def _die_after_the_last_count(self: Any, key: Any) -> int:
        value: int = _incr(self, key)
        marker = os.path.join(os.path.dirname(os.environ["E2E_RECORDS"]), "callback-lost")
        if value == int(os.environ["E2E_DIE_AFTER_LAST_COUNT"]) and not os.path.exists(marker):
            effect(str(counting_part.get()), "died_after_last_count", value, 0)
            open(marker, "w").close()
            kill_my_worker()
        return value

    SqleaseBackend.incr = _die_after_the_last_count  # type: ignore[method-assign]


def _from_env() -> Celery:
    env = os.environ
    if "E2E_BROKER" not in env:
        return Celery("ctx", set_as_current=False)
    return make_app(
        env["E2E_BROKER"],
        prefix=env["E2E_PREFIX"],
        lease_seconds=float(env.get("E2E_LEASE_SECONDS", "2")),
    )


app = _from_env()
