"""The lease store put together: every aggregate's operations on one driver."""

from __future__ import annotations

from sqlalchemy.engine import URL, Engine

from sqlease._core.base import Clock
from sqlease._core.flow import FlowLimits
from sqlease._core.leases import Leases
from sqlease._core.messages import Messages
from sqlease._core.offers import Offers
from sqlease._core.tasks import Tasks
from sqlease._core.topology import Topology
from sqlease._core.transitions import Transitions
from sqlease._db.connect import driver_for
from sqlease._db.engine import get_engine
from sqlease._db.migrations import ensure_schema
from sqlease._db.retry import RETRY_SECONDS, retry_transient
from sqlease._db.tables import build_tables
from sqlease.errors import ConfigurationError


class Store(Messages, Offers, Leases, Transitions, Tasks, Topology, FlowLimits):
    """Lease operations on one database (SQLite file or PostgreSQL) and table prefix.

    The operations live in ``sqlease._core`` by aggregate (messages, leases, transitions,
    offers, tasks, topology); this class puts them together on one driver."""

    def __init__(
        self,
        url: str | URL | Engine,
        *,
        table_prefix: str = "sqlease_",
        auto_migrate: bool = True,
        max_attempts: int = 3,
        max_payload_bytes: int = 16 * 1024 * 1024,
        sqlite_synchronous: str = "NORMAL",
        lease_sync_commit: bool = False,
        publish_sync_commit: bool = True,
        clock: Clock | None = None,
        connect_retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, not {max_attempts!r}")
        if not isinstance(max_payload_bytes, int) or max_payload_bytes < 1:
            raise ConfigurationError(
                f"max_payload_bytes must be a positive integer, not {max_payload_bytes!r}"
            )
        self.engine = (
            url
            if isinstance(url, Engine)
            else get_engine(url, sqlite_synchronous=sqlite_synchronous)
        )
        self.tables = build_tables(table_prefix)
        #: The database's driver: its operations, its transactions, what it can do.
        self.driver = driver_for(
            url,
            self.engine,
            self.tables,
            lease_sync_commit=lease_sync_commit,
            publish_sync_commit=publish_sync_commit,
        )
        self.sql = self.driver.sql
        self.publish_sync_commit = publish_sync_commit
        self.max_attempts = max_attempts
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.notify_channel = self.driver.wakeup_channel
        # A pooled connection killed by a restart fails once: ride it out here too, for up to
        # ``connect_retry_seconds`` (the transport keeps it short: Kombu retries connecting).
        retry_transient(ensure_schema, connect_retry_seconds)(
            self.engine, self.tables, auto_migrate=auto_migrate
        )

    @property
    def is_postgresql(self) -> bool:
        """Whether the database is PostgreSQL (for callers; sqlease itself calls the driver's
        operations)."""
        return self.driver.name == "postgresql"
