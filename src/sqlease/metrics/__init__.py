"""Prometheus metrics of one sqlease database (``pip install 'sqlease[metrics]'``).

``build_registry(admin)`` gives a ``prometheus_client.CollectorRegistry`` whose collector
reads the database at each scrape, through ``sqlease.Admin`` (the dashboard mounts it at
``/metrics``); ``serve(admin, host=..., port=...)`` is the standalone exporter that
``sqlease metrics`` runs. Every name and label is in docs/reference/metrics.md.

A scrape is a few short statements: one GROUP BY over the messages table (counts per queue
and state, live leases), the declared queues, and the event totals, which fold in only the
events written since the previous scrape and keep their sums in the ``counters`` table
(``sqlease.admin._stats``), so the counters stay monotonic while the maintenance pass
prunes the events table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sqlease.admin._stats import HELD, QUEUE_STATES

if TYPE_CHECKING:
    from sqlease.admin import Admin

__all__ = ["COUNTERS", "SqleaseCollector", "build_registry", "serve"]

logger = logging.getLogger(__name__)

#: Counter name (without ``_total``) → the timeline event kind it counts, and its help.
COUNTERS = {
    "sqlease_enqueued": ("enqueued", "Tasks published (their enqueued event)."),
    "sqlease_claimed": ("claimed", "Deliveries: a message leased to a worker (claim or handoff)."),
    "sqlease_acked": ("acked", "Deliveries acknowledged (the task finished on its worker)."),
    "sqlease_released": ("released", "Deliveries given back unfinished (e.g. warm shutdown)."),
    "sqlease_exhausted": (
        "attempts_exhausted",
        "Messages that went dead with their delivery budget spent.",
    ),
    "sqlease_lease_lost": ("lease_lost", "Deliveries whose worker found its lease gone."),
    "sqlease_cancelled": ("cancelled", "Tasks cancelled (sqlease cancel, Admin.cancel, revoke)."),
}


class SqleaseCollector(Collector):
    """Reads the database at every ``collect()``. ``per_owner`` adds one series per lease
    owner (a worker process: host, pid and a random part, so a new label set at every
    worker start)."""

    def __init__(self, admin: Admin, *, per_owner: bool = False) -> None:
        self.admin = admin
        self.per_owner = per_owner

    def describe(self) -> list[Metric]:
        # Registering must not touch the database; the names come with the first scrape.
        return []

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily("sqlease_up", "1 when the scrape read the database, else 0.")
        try:
            found = list(self._read())
        except Exception:  # a database that does not answer must not break the endpoint
            logger.warning("sqlease metrics: the scrape could not read the database", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        yield from found
        up.add_metric([], 1)
        yield up
        took = GaugeMetricFamily(
            "sqlease_scrape_duration_seconds", "Time this scrape spent reading the database."
        )
        took.add_metric([], time.perf_counter() - started)
        yield took

    def _read(self) -> Iterator[Metric]:
        stats, leases = self.admin.overview()
        totals = self.admin.event_totals([kind for kind, _ in COUNTERS.values()])
        tasks = GaugeMetricFamily(
            "sqlease_tasks",
            "Tasks with a message, per queue and state (succeeded tasks have none).",
            labels=["queue", "state"],
        )
        oldest = GaugeMetricFamily(
            "sqlease_oldest_ready_age_seconds",
            "Seconds since the oldest ready task of the queue became due (0: none ready).",
            labels=["queue"],
        )
        held = GaugeMetricFamily(
            "sqlease_held_tasks",
            "Queued tasks held back, per queue and reason: run (behind their run's head), gate "
            "(at their full concurrency gate), rate (given their rate limit's turn).",
            labels=["queue", "reason"],
        )
        for queue, counts in stats.items():
            for state in QUEUE_STATES:
                tasks.add_metric([queue, state], counts[state])
            oldest.add_metric([queue], counts["oldest_ready_age_s"] or 0.0)
            for key in HELD:  # held_by_run -> run
                held.add_metric([queue, key.rsplit("_", 1)[1]], counts[key])
        yield tasks
        yield oldest
        yield held
        live = GaugeMetricFamily("sqlease_live_leases", "Messages held under a live lease.")
        live.add_metric([], sum(o["leases"] for o in leases))
        yield live
        owners = GaugeMetricFamily(
            "sqlease_lease_owners", "Lease owners (worker processes) holding a live lease."
        )
        owners.add_metric([], len(leases))
        yield owners
        if self.per_owner:
            by_owner = GaugeMetricFamily(
                "sqlease_owner_live_leases", "Live leases per owner.", labels=["owner"]
            )
            for owner in leases:
                by_owner.add_metric([owner["owner"]], owner["leases"])
            yield by_owner
        for name, (kind, text) in COUNTERS.items():
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], totals[kind])
            yield counter


def build_registry(admin: Admin, *, per_owner: bool = False) -> CollectorRegistry:
    """A registry holding only sqlease's collector for ``admin``'s database."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SqleaseCollector(admin, per_owner=per_owner))
    return registry


def serve(
    admin: Admin,
    *,
    host: str = "127.0.0.1",
    port: int = 9808,
    per_owner: bool = False,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``/metrics`` on ``host:port`` until ``stop`` is set (or the process ends)."""
    server: Any
    server, thread = start_http_server(
        port, addr=host, registry=build_registry(admin, per_owner=per_owner)
    )
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        thread.join(timeout=5)
