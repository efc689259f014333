"""Remote control across processes: a revoke broadcast is also written to the database (a
task delivered again learns of one that reached the worker that held it before: see
sqlease.transport._completion), and a worker that starts listening for commands starts with
none of those sent before (``drop_stale_commands``)."""

from __future__ import annotations

import logging
from typing import Any

from sqlease import revokes
from sqlease.store import Store

logger = logging.getLogger(__name__)


def durable_revoke(store: Store, message: dict[str, Any]) -> None:
    """A pidbox broadcast being published: if it is a revoke (by ids or by stamped
    headers), also write it to the database (``sqlease.revokes``), so it survives worker
    restarts and reaches tasks no worker has received yet."""
    revoke = revokes.parse(message)
    if revoke is not None:
        revokes.apply(store, revoke)


def drop_stale_commands(channel: Any, queue: str, no_ack: bool) -> None:
    """A consumer starting on a worker's remote-control queue (Kombu's mailbox: an
    auto-delete queue bound to a fanout exchange ``*.pidbox``) drops the commands already
    in it. They were sent to an earlier worker of that name which stopped or died: RabbitMQ
    deletes such a queue with its consumer, and Redis broadcasts only to listening workers,
    so neither delivers them to the next worker. Kept, a ``shutdown`` or ``cancel_consumer``
    sent while the worker was down would stop the restarted one. (Revokes are not lost: they
    are in the database, see ``durable_revoke``.)"""
    if not no_ack or not channel.connection.expires_when_idle(queue):
        return
    bound = {exchange for exchange, _, _ in channel.state.queue_bindings(queue)}
    if not any(e.endswith(".pidbox") and channel.typeof(e).type == "fanout" for e in bound):
        return
    dropped = channel.store.purge(queue)
    if dropped:
        logger.warning(
            "sqlease: %d remote-control command(s) sent to %r before this worker listened "
            "were dropped, as RabbitMQ and Redis drop them",
            dropped,
            queue,
        )
