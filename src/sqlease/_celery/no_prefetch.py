"""Celery's ``worker_disable_prefetch`` (``celery worker --disable-prefetch``) on sqlease: the
worker takes a task only while it holds fewer than its pool can run (the autoscaler's most,
when it scales), so that tasks it could not start yet wait in the database, where any other
worker can take them, instead of leased to this one.

Celery applies the setting to Redis alone: its task-consumer step logs that it ignores it on
any other broker and returns. A consumer step of sqlease's, started after Celery's, limits the
task consumer's channel the same way (its claims, and the handoffs it accepts), and that
warning, which would no longer be true, is not logged.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

logger = logging.getLogger(__name__)

#: The start of the warning Celery's task-consumer step logs for a broker other than Redis.
CELERY_WARNING = "worker_disable_prefetch is only supported for Redis brokers"


class _DropCeleryWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CELERY_WARNING)


_filter = _DropCeleryWarning()


def install(app: Any) -> None:
    """At ``worker_init`` of a sqlease app: add the step if the app disables prefetch."""
    if not app.conf.get("worker_disable_prefetch"):
        return
    app.steps["consumer"].add(NoPrefetch)
    celery_logger = logging.getLogger("celery.worker.consumer.tasks")
    if _filter not in celery_logger.filters:
        celery_logger.addFilter(_filter)


def task_limit(controller: Any) -> int:
    """How many tasks the worker may hold: the autoscaler's most, or its pool's processes."""
    autoscaler = getattr(controller, "autoscaler", None)
    most = getattr(autoscaler, "max_concurrency", None) or getattr(
        controller, "max_concurrency", None
    )
    return int(most or controller.pool.num_processes)


class NoPrefetch(bootsteps.StartStopStep):  # type: ignore[misc]
    """Limits the task consumer's channel to the tasks the pool can run, at every start of the
    consumer (a reconnection makes a new channel)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        from celery.worker import state

        if not c.app.conf.get("worker_disable_prefetch"):  # (the step stays on the app)
            return
        consumer = getattr(c, "task_consumer", None)
        qos: Any = getattr(getattr(consumer, "channel", None), "qos", None)
        if not hasattr(qos, "task_room"):  # not a sqlease channel's QoS
            logger.warning(
                "sqlease: worker_disable_prefetch is ignored: the task consumer's channel is "
                "not sqlease's (%s)",
                type(qos).__name__,
            )
            return
        controller = c.controller

        def task_room() -> int:
            # A task acked late is both a delivery held and a request received; one acked
            # early only the latter: the larger count covers both. Redelivered ones being
            # settled are neither yet.
            held = max(len(state.reserved_requests), int(qos.unacked_count()))
            return task_limit(controller) - held - int(qos.settling)

        qos.task_room = task_room
        logger.info(
            "sqlease: worker_disable_prefetch: this worker holds no more tasks than its pool "
            "runs (%d); the others wait in the database for any worker",
            task_limit(controller),
        )
