"""Remote control across processes: a revoke broadcast is also written to the database (a
task delivered again learns of one that reached the worker that held it before: see
sqlease.transport._completion)."""

from __future__ import annotations

from typing import Any

from sqlease import revokes
from sqlease.store import Store


def durable_revoke(store: Store, message: dict[str, Any]) -> None:
    """A pidbox broadcast being published: if it is a revoke (by ids or by stamped
    headers), also write it to the database (``sqlease.revokes``), so it survives worker
    restarts and reaches tasks no worker has received yet."""
    revoke = revokes.parse(message)
    if revoke is not None:
        revokes.apply(store, revoke)
