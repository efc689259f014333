"""The Celery app of the outbox example: orders and their shipping tasks in one database.

The ``orders`` and ``shipments`` tables live in the same SQLite file as sqlease's tables, so
an order and the task that ships it can be written in one transaction.

Start a worker for it with ``celery -A tasks worker`` from this folder. The database lives in
``$SQLEASE_EXAMPLE_DIR`` (``run.py`` sets it), or in this folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import (
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    select,
)

import sqlease  # noqa: F401  (registers the sqlease+ broker and backend)

DATA_DIR = Path(os.environ.get("SQLEASE_EXAMPLE_DIR") or Path(__file__).parent).resolve()
DB = DATA_DIR / "outbox.db"
URL = f"sqlease+sqlite:///{DB}"  # broker and results

app = Celery("outbox", broker=URL, backend=URL)
app.conf.broker_transport_options = {"lease_seconds": 2.0, "polling_interval": 0.2}
app.conf.worker_prefetch_multiplier = 1

# The application's own tables and engine: the SAME file as the broker (sqlease.transaction()
# refuses a connection to another database). A 30 s busy timeout, like sqlease's: on SQLite
# one writer at a time, and workers write too.
engine = create_engine(f"sqlite:///{DB}", connect_args={"timeout": 30})
metadata = MetaData()
orders = Table(
    "orders",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("item", String(100), nullable=False),
)
shipments = Table(
    "shipments",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("order_id", Integer, nullable=False),
    Column("item", String(100), nullable=False),
    Column("shipped_at", Float, nullable=False),
)


@app.task
def ship_order(order_id: int) -> dict[str, Any]:
    # The task was committed with its order, so the order is always there to read.
    with engine.connect() as conn:
        item = conn.execute(select(orders.c.item).where(orders.c.id == order_id)).scalar_one()
    with engine.begin() as conn:
        conn.execute(insert(shipments).values(order_id=order_id, item=item, shipped_at=time.time()))
    return {"order_id": order_id, "item": item, "shipped": True}


def shipped() -> list[tuple[int, str]]:
    """Every shipment so far: ``(order_id, item)``."""
    with engine.connect() as conn:
        rows = conn.execute(select(shipments.c.order_id, shipments.c.item).order_by("id"))
        return [(order_id, item) for order_id, item in rows]


def saved_orders() -> list[tuple[int, str]]:
    with engine.connect() as conn:
        rows = conn.execute(select(orders.c.id, orders.c.item).order_by(orders.c.id))
        return [(order_id, item) for order_id, item in rows]
