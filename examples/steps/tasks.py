"""The Celery app of the steps example: a checkout that charges a card in a durable step.

Start a worker for it with ``celery -A tasks worker`` from this folder. The database lives in
``$SQLEASE_EXAMPLE_DIR`` (``run.py`` sets it), or in this folder.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

from celery import Celery

import sqlease

DATA_DIR = Path(os.environ.get("SQLEASE_EXAMPLE_DIR") or Path(__file__).parent).resolve()
URL = f"sqlease+sqlite:///{DATA_DIR / 'steps.db'}"  # broker and results: one SQLite file
PROVIDER = DATA_DIR / "payments.db"  # the fake payment provider's own records
PACKING_SECONDS = 2.0

app = Celery("steps", broker=URL, backend=URL)
app.conf.broker_transport_options = {
    "lease_seconds": 2.0,  # short, so the takeover after a crash is quick in this example
    "polling_interval": 0.2,
}
app.conf.worker_prefetch_multiplier = 1


# ---- a fake payment provider: every call is a real charge --------------------------------


def _provider() -> sqlite3.Connection:
    conn = sqlite3.connect(PROVIDER, timeout=30)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS charges (charge_id TEXT PRIMARY KEY, order_id INTEGER, "
        "amount_cents INTEGER, pid INTEGER)"
    )
    return conn


def charge_card(order_id: int, amount_cents: int) -> dict[str, Any]:
    """Charge the customer's card and return the provider's receipt (JSON data)."""
    receipt = {"charge_id": f"ch_{uuid.uuid4().hex[:12]}", "amount_cents": amount_cents}
    with closing(_provider()) as conn, conn:
        conn.execute(
            "INSERT INTO charges (charge_id, order_id, amount_cents, pid) VALUES (?, ?, ?, ?)",
            (receipt["charge_id"], order_id, amount_cents, os.getpid()),
        )
    return receipt


def charges(order_id: int) -> list[dict[str, Any]]:
    """What the provider recorded for an order."""
    with closing(_provider()) as conn:
        rows = conn.execute(
            "SELECT charge_id, amount_cents FROM charges WHERE order_id = ? ORDER BY rowid",
            (order_id,),
        )
        return [{"charge_id": c, "amount_cents": a} for c, a in rows]


# ---- the task ------------------------------------------------------------------------------


@app.task(bind=True)
def checkout(self: Any, order_id: int, amount_cents: int) -> dict[str, Any]:
    ctx = sqlease.context()
    # Runs charge_card at most once for this task, across deliveries: a later delivery gets the
    # stored receipt back without calling the provider again.
    receipt = ctx.step("charge", charge_card, order_id, amount_cents)
    time.sleep(PACKING_SECONDS)  # pack the parcel: the run script kills the worker here
    return {"order_id": order_id, "receipt": receipt, "attempt": ctx.attempt}
