"""The Celery app the browser tests run in-process: a task that waits for a person's
approval through ``sqlease.context()``, and a quick one for the throughput chart."""

from __future__ import annotations

from typing import Any

from celery import Celery

import sqlease


def wait_then_ship(order: int) -> dict[str, Any]:
    ctx = sqlease.context()
    decision = ctx.wait_for_approval(f"Ship order {order}?", order=order, amount=120)
    ctx.checkpoint({"approved": decision["approved"]})
    return {"order": order, "shipped": decision["approved"], "attempt": ctx.attempt}


def add(x: int, y: int) -> int:
    return x + y


def make_app(url: str, prefix: str) -> Celery:
    app = Celery("ui_browser", broker="sqlease+" + url, backend="sqlease+" + url)
    app.conf.update(
        broker_transport_options={"table_prefix": prefix, "polling_interval": 0.05},
        result_backend_transport_options={"table_prefix": prefix},
        result_extended=True,
    )
    app.task(name="shop.wait_then_ship")(wait_then_ship)
    app.task(name="shop.add")(add)
    return app
