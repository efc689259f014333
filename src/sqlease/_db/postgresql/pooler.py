"""Connection poolers in front of PostgreSQL (PgBouncer, RDS Proxy, Supavisor): what a URL
says about them, and what sqlease changes for them.

A pooler in *transaction* mode hands each transaction (each autocommit statement) to whichever
server connection is free, so nothing may rely on a session: no startup ``options`` (they
would be refused, or dropped), no prepared statements (another client's statement of the same
name may answer), no LISTEN and no session advisory locks (they stay behind on a server
connection that other clients then use). The URL says so with ``pooler=transaction``
(``pgbouncer=true`` is the same); ``listen_host`` / ``listen_port`` name a direct connection
to PostgreSQL, past the pooler, for the wake-ups (LISTEN) and the handoff lock, which then
work as without a pooler. Without them, wake-ups fall back to polling.

These query parameters are sqlease's and are removed before psycopg sees the URL; a
``prepare_threshold`` in the URL (a psycopg connection argument, not a libpq one) is passed
as the number (or None) that psycopg expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import URL

from sqlease.errors import ConfigurationError

logger = logging.getLogger("sqlease")

MODES = ("none", "session", "transaction")
#: Query parameters sqlease reads (and removes) from a PostgreSQL URL.
OURS = (
    "pooler",
    "pgbouncer",
    "listen_host",
    "listen_port",
    "prepare_threshold",
    "pool_size",
    "max_overflow",
    "shared_pool",
)
#: Connections each of sqlease's engines keeps open per process, and how many more it may
#: open for a burst (closed again when returned), unless the URL says.
POOL_SIZE = 5
MAX_OVERFLOW = 10
#: The least pool_size + max_overflow accepted: a worker's main process uses up to three
#: connections of one engine at once (measured), and the pool keeps one spare beside them.
MIN_CONNECTIONS = 4
#: Session settings sqlease sets at connect without a pooler, and checks behind one.
WANTED = {"idle_in_transaction_session_timeout": "60000", "jit": "off"}
#: The servers warned about (once per process each).
_warned: set[str] = set()


@dataclass(frozen=True)
class Pooling:
    """What sqlease does about a pooler, from the URL."""

    mode: str
    #: A direct connection to PostgreSQL for LISTEN and the handoff lock, or None.
    listen_url: URL | None
    #: psycopg's prepare_threshold: None never prepares; "default" leaves psycopg's own.
    prepare_threshold: int | str | None
    #: ``shared_pool=true``: every lane of a process on the one engine of the URL (fewer
    #: connections; no generic plans, and claims and acks wait for the WAL flush).
    shared: bool = False

    @property
    def transaction(self) -> bool:
        """Nothing may keep session state on a pooled connection."""
        return self.mode == "transaction"


def _one(url: URL, name: str) -> str | None:
    value = url.query.get(name)
    if isinstance(value, tuple):
        value = value[-1]
    return value


def _flag(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"URL parameter {name}={text!r}: expected true or false")


def _threshold(text: str | None, mode: str) -> int | str | None:
    if text is None:
        return None if mode == "transaction" else "default"
    if text.strip().lower() in ("none", "null", ""):
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(
            f"URL parameter prepare_threshold={text!r}: expected a whole number >= 0 or "
            "'none' (never prepare)"
        ) from None
    if value < 0:
        raise ConfigurationError(f"URL parameter prepare_threshold={text!r}: must be >= 0")
    if mode == "transaction" and value is not None:
        raise ConfigurationError(
            f"URL parameter prepare_threshold={text!r} with pooler=transaction: a pooler in "
            "transaction mode cannot keep prepared statements; leave it out"
        )
    return value


def split(url: URL) -> tuple[URL, Pooling]:
    """The URL psycopg gets (sqlease's parameters removed) and the pooling it describes."""
    mode = _one(url, "pooler")
    bouncer = _one(url, "pgbouncer")
    if bouncer is not None and _flag("pgbouncer", bouncer):
        if mode not in (None, "transaction"):
            raise ConfigurationError(
                f"URL parameters pgbouncer=true and pooler={mode!r} disagree; give one"
            )
        mode = "transaction"
    mode = mode or "none"
    if mode not in MODES:
        raise ConfigurationError(
            f"URL parameter pooler={mode!r}: expected one of {', '.join(MODES)}"
        )
    threshold = _threshold(_one(url, "prepare_threshold"), mode)
    host, port = _one(url, "listen_host"), _one(url, "listen_port")
    clean = url.difference_update_query(OURS)
    listen = None
    if host is not None or port is not None:
        try:
            listen = clean.set(host=host or clean.host, port=int(port) if port else clean.port)
        except ValueError:
            raise ConfigurationError(
                f"URL parameter listen_port={port!r}: expected a port number"
            ) from None
    shared = _one(url, "shared_pool")
    return clean, Pooling(
        mode, listen, threshold, shared is not None and _flag("shared_pool", shared)
    )


def _count(url: URL, name: str, default: int, minimum: int) -> int:
    text = _one(url, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(
            f"URL parameter {name}={text!r}: expected a whole number >= {minimum}"
        ) from None
    if value < minimum:
        raise ConfigurationError(f"URL parameter {name}={text!r}: must be >= {minimum}")
    return value


def pool_limits(url: URL) -> tuple[int, int]:
    """``(pool_size, max_overflow)`` of each of sqlease's engines for this URL: the
    connections kept open per engine and process, and the extra ones a burst may open."""
    size = _count(url, "pool_size", POOL_SIZE, 1)
    overflow = _count(url, "max_overflow", MAX_OVERFLOW, 0)
    if size + overflow < MIN_CONNECTIONS:
        raise ConfigurationError(
            f"URL parameters pool_size={size} and max_overflow={overflow} allow "
            f"{size + overflow} connections per engine: a worker's main process uses up to "
            f"{MIN_CONNECTIONS - 1} of an engine at once (its event loop's, the heartbeat's, "
            f"the maintenance pass's), so give pool_size + max_overflow >= {MIN_CONNECTIONS}"
        )
    return size, overflow


def connect_args(pooling: Pooling, session_options: str | None) -> dict[str, Any]:
    """psycopg's connection arguments for the pooling: the startup options without a
    pooler in transaction mode, none behind one; prepare_threshold when it is not psycopg's
    default."""
    args: dict[str, Any] = {}
    if session_options and not pooling.transaction:
        args["options"] = session_options
    if pooling.prepare_threshold != "default":
        args["prepare_threshold"] = pooling.prepare_threshold
    return args


def check_settings(dbapi_connection: Any, where: str) -> list[str]:
    """Behind a pooler in transaction mode the session settings cannot be sent: say which of
    them the server does not have already (set them on the role or database instead)."""
    missing = []
    cursor = dbapi_connection.cursor()
    try:
        for name, wanted in WANTED.items():
            cursor.execute(f"SHOW {name}")
            value = str(cursor.fetchone()[0])
            if value != wanted and not (name.endswith("timeout") and value in ("1min", "60s")):
                missing.append(name)
    finally:
        cursor.close()
        # The SHOWs began a transaction (the connection is not in autocommit yet): end it.
        # Left open, the first statement sent in autocommit on this connection fails
        # (psycopg cannot switch inside a transaction) and the pooler keeps a server
        # connection pinned to this idle client. SQLAlchemy's own rollback after its first
        # connect ran before this listener, and not at all in a forked child's new pool.
        dbapi_connection.rollback()
    if missing and where not in _warned:
        _warned.add(where)
        sets = "; ".join(f"ALTER ROLE <role> SET {n} = '{WANTED[n]}'" for n in missing)
        logger.warning(
            "sqlease behind a pooler (pooler=transaction, %s) cannot set %s per session; "
            "set them on the worker role once: %s",
            where,
            ", ".join(missing),
            sets,
        )
    return missing
