"""One store per database and options in a process: the transport's and backend's registry.

A worker's connections, its result backend and its task contexts share one Store (one set of
pools, one schema check) for the same URL and options.
"""

from __future__ import annotations

import threading

from sqlalchemy.engine import URL

from sqlease._db.retry import RETRY_SECONDS
from sqlease.options import TransportOptions
from sqlease.store import Store

_stores: dict[tuple[object, ...], Store] = {}
_stores_lock = threading.Lock()


#: How long the transport's connect (the schema check) retries a refused database itself. Kept
#: short: a connect is one attempt of Kombu's own retry loop (``ensure_connection``,
#: ``connect_timeout``, ``max_retries``, failover to an alternate URL), which a 20 s retry
#: inside each attempt would defeat.
CONNECT_RETRY_SECONDS = 1.0


def store_for(
    url: URL, options: TransportOptions, *, connect_retry_seconds: float = RETRY_SECONDS
) -> Store:
    """The process-wide store for a database and options (the schema is checked once)."""
    # Keyed by what the Store is built from, not by the whole options: the limits options are
    # mappings (unhashable), and two transports that differ only in them share one store (the
    # limits live in the database).
    key = (
        url.render_as_string(hide_password=False),
        options.table_prefix,
        options.auto_migrate,
        options.max_attempts,
        options.max_payload_bytes,
        options.sqlite_synchronous,
        options.lease_sync_commit,
        options.publish_sync_commit,
        options.lease_ms,
    )
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = Store(
                url,
                table_prefix=options.table_prefix,
                auto_migrate=options.auto_migrate,
                max_attempts=options.max_attempts,
                max_payload_bytes=options.max_payload_bytes,
                sqlite_synchronous=options.sqlite_synchronous,
                lease_sync_commit=options.lease_sync_commit,
                publish_sync_commit=options.publish_sync_commit,
                connect_retry_seconds=connect_retry_seconds,
                lease_ms=options.lease_ms,
            )
            _stores[key] = store
        return store
