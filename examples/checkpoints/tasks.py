"""The Celery app of the checkpoints example: a catalog import that checkpoints every page.

Start a worker for it with ``celery -A tasks worker`` from this folder. The database lives in
``$SQLEASE_EXAMPLE_DIR`` (``run.py`` sets it), or in this folder.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from celery import Celery

import sqlease

DATA_DIR = Path(os.environ.get("SQLEASE_EXAMPLE_DIR") or Path(__file__).parent).resolve()
URL = f"sqlease+sqlite:///{DATA_DIR / 'checkpoints.db'}"  # broker and results: one SQLite file
CATALOG = DATA_DIR / "catalog.db"  # the "application database" the import writes into
SECONDS_PER_PAGE = 0.4

app = Celery("checkpoints", broker=URL, backend=URL)
app.conf.broker_transport_options = {
    "lease_seconds": 2.0,  # short, so the takeover after a crash is quick in this example
    "polling_interval": 0.2,
}
app.conf.worker_prefetch_multiplier = 1


def _catalog() -> sqlite3.Connection:
    conn = sqlite3.connect(CATALOG, timeout=30)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS imported_pages (page INTEGER, attempt INTEGER, pid INTEGER)"
    )
    return conn


def import_page(page: int, attempt: int) -> None:
    """Fetch one page (slow) and store it in the catalog (one row per import)."""
    time.sleep(SECONDS_PER_PAGE)
    with closing(_catalog()) as conn, conn:
        conn.execute(
            "INSERT INTO imported_pages (page, attempt, pid) VALUES (?, ?, ?)",
            (page, attempt, os.getpid()),
        )


def imported_pages() -> list[tuple[int, int, int]]:
    """Every import, in order: ``(page, attempt, pid)``."""
    with closing(_catalog()) as conn:
        return list(conn.execute("SELECT page, attempt, pid FROM imported_pages ORDER BY rowid"))


@app.task(bind=True)
def import_catalog(self: Any, pages: int) -> dict[str, int]:
    ctx = sqlease.context()
    page = int(ctx.state.get("page", 0))  # 0 on the first delivery, the checkpoint after
    resumed_from = page
    while page < pages:
        page += 1
        import_page(page, ctx.attempt)
        # Saved under the lease: a delivery that lost its lease gets LeaseLost here.
        ctx.checkpoint({"page": page}, progress=(page, pages))
    return {"pages": page, "resumed_from": resumed_from, "attempt": ctx.attempt}
