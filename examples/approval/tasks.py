"""The Celery app of the approval example: refunds that wait for a person's decision.

Start a worker for it with ``celery -A tasks worker`` from this folder. The database lives in
``$SQLEASE_EXAMPLE_DIR`` (``run.py`` sets it), or in this folder.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

from celery import Celery

import sqlease

DATA_DIR = Path(os.environ.get("SQLEASE_EXAMPLE_DIR") or Path(__file__).parent).resolve()
URL = f"sqlease+sqlite:///{DATA_DIR / 'approval.db'}"  # broker and results: one SQLite file
PROVIDER = DATA_DIR / "payments.db"  # the fake payment provider's own records

app = Celery("approval", broker=URL, backend=URL)
app.conf.broker_transport_options = {"lease_seconds": 2.0, "polling_interval": 0.2}
app.conf.worker_prefetch_multiplier = 1


# ---- a fake payment provider: every call is a real refund ---------------------------------


def _provider() -> sqlite3.Connection:
    conn = sqlite3.connect(PROVIDER, timeout=30)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS refunds (refund_id TEXT PRIMARY KEY, order_id INTEGER, "
        "amount INTEGER)"
    )
    return conn


def issue_refund(order_id: int, amount: int) -> dict[str, Any]:
    refund = {"refund_id": f"re_{uuid.uuid4().hex[:12]}", "amount": amount}
    with closing(_provider()) as conn, conn:
        conn.execute(
            "INSERT INTO refunds (refund_id, order_id, amount) VALUES (?, ?, ?)",
            (refund["refund_id"], order_id, amount),
        )
    return refund


def refunds() -> list[tuple[int, int]]:
    """Every refund the provider made: ``(order_id, amount)``."""
    with closing(_provider()) as conn:
        return list(conn.execute("SELECT order_id, amount FROM refunds ORDER BY rowid"))


# ---- the task ------------------------------------------------------------------------------


@app.task(bind=True)
def refund_order(self: Any, order_id: int, amount: int) -> dict[str, Any]:
    ctx = sqlease.context()
    # First delivery: parks the task (no lease, no worker slot held) and stops here with
    # WaitingForPerson, a Celery Ignore. Once someone answers, the task runs again from the top
    # (attempt + 1) and this call returns the decision.
    decision = ctx.wait_for_approval(f"Refund order {order_id} for ${amount}?", amount=amount)
    if not decision["approved"]:
        return {"order_id": order_id, "refunded": False, "reason": decision["reason"]}
    refund = ctx.step("refund", issue_refund, order_id, amount)
    return {
        "order_id": order_id,
        "refunded": True,
        "refund": refund,
        "note": decision["note"],
        "attempt": ctx.attempt,
    }
