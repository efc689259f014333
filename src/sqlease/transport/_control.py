"""Remote control across processes: a revoke broadcast is also written to the database, and a
task delivered again learns of a revoke that reached the worker that held it before."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from sqlease import revokes

if TYPE_CHECKING:
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)


def durable_revoke(transport: Transport, message: dict[str, Any]) -> None:
    """A pidbox broadcast being published: if it is a revoke (by ids or by stamped
    headers), also write it to the database (``sqlease.revokes``), so it survives worker
    restarts and reaches tasks no worker has received yet."""
    revoke = revokes.parse(message)
    if revoke is not None:
        revokes.apply(transport.store, revoke)


def forward_revoke(transport: Transport, task_id: str) -> None:
    """A task delivered again (its earlier worker died or gave it back): if a revoke
    reached it while that worker held it, put it in this worker's revoked list, so Celery
    discards it (REVOKED result, ack, ``task-revoked`` event) instead of running it."""
    worker_state = sys.modules.get("celery.worker.state")
    if worker_state is None:
        return  # not a Celery worker: no revoked list to tell
    if revokes.requested(transport.store, task_id):
        logger.info("sqlease: task %s was revoked while another worker held it", task_id)
        worker_state.revoked.add(task_id)
