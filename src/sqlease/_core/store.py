"""The lease store put together: one driver, the aggregates built on it, one public API.

Each aggregate (``sqlease._core``: messages, leases, transitions, offers, tasks, timeline,
topology, flow limits, uniques) is an object given the store's parts; ``Store`` composes them
and delegates each public method to the aggregate that implements it (``delegate``: the same
signature and docs). Code that needs an aggregate's internals takes the aggregate
(``store.timeline``, ``store.leases``), and a transaction from the driver
(``store.driver.reading()`` / ``writing()``), never a private method of the store.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy.engine import URL, Engine

from sqlease._core.base import Clock, StoreParts, delegate
from sqlease._core.flow import FlowLimits
from sqlease._core.leases import Leases
from sqlease._core.messages import Messages
from sqlease._core.names import MAX_INT
from sqlease._core.offers import Offers
from sqlease._core.tasks import Tasks
from sqlease._core.timeline import Timeline
from sqlease._core.topology import Topology
from sqlease._core.transitions import Transitions
from sqlease._core.uniques import Uniques
from sqlease._db.connect import driver_for
from sqlease._db.engine import get_engine
from sqlease._db.migrations import ensure_schema
from sqlease._db.retry import RETRY_SECONDS, retry_transient
from sqlease._db.tables import build_tables
from sqlease.errors import ConfigurationError


class Store:
    """Lease operations on one database (SQLite file or PostgreSQL) and table prefix.

    ``lease_ms``: how long the leases its users hold last; the TCP keepalives of its
    PostgreSQL connections follow it (a dead network is noticed within about a lease)."""

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
        lease_ms: int = 60_000,
    ) -> None:
        if not isinstance(max_attempts, int) or not 1 <= max_attempts <= MAX_INT:
            raise ConfigurationError(
                f"max_attempts must be an integer from 1 to {MAX_INT}, not {max_attempts!r}"
            )
        if not isinstance(max_payload_bytes, int) or max_payload_bytes < 1:
            raise ConfigurationError(
                f"max_payload_bytes must be a positive integer, not {max_payload_bytes!r}"
            )
        self.engine = (
            url
            if isinstance(url, Engine)
            else get_engine(url, sqlite_synchronous=sqlite_synchronous, lease_ms=lease_ms)
        )
        self.tables = build_tables(table_prefix)
        #: The database's driver: its operations, its transactions, what it can do.
        self.driver = driver_for(
            url,
            self.engine,
            self.tables,
            lease_sync_commit=lease_sync_commit,
            publish_sync_commit=publish_sync_commit,
            lease_ms=lease_ms,
        )
        self.sql = self.driver.sql
        self.publish_sync_commit = publish_sync_commit
        self.max_attempts = max_attempts
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.notify_channel = self.driver.wakeup_channel
        parts = StoreParts(
            self.driver, clock=clock, max_attempts=max_attempts, max_payload_bytes=max_payload_bytes
        )
        self.parts = parts
        self.timeline = Timeline(parts)
        self.leases = Leases(parts)
        self.transitions = Transitions(parts)
        self.uniques = Uniques(parts, self.timeline)
        self.messages = Messages(parts, self.uniques, self.timeline)
        self.offers = Offers(parts, self.leases)
        self.tasks = Tasks(parts, self.leases, self.timeline)
        self.topology = Topology(parts)
        self.flow = FlowLimits(parts)
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

    def fork_section(self) -> AbstractContextManager[None]:
        """On SQLite, a block a fork waits for (sqlease._db.sqlite.fork_guard); else nothing."""
        return self.driver.fork_section()

    now_ms = delegate("parts", StoreParts.now_ms)

    # ---- messages ----
    enqueue = delegate("messages", Messages.enqueue)
    enqueue_many = delegate("messages", Messages.enqueue_many)
    check_member = delegate("messages", Messages.check_member)
    take = delegate("messages", Messages.take)
    take_op = delegate("messages", Messages.take_op)
    next_due_op = delegate("messages", Messages.next_due_op)
    next_due_in_ms = delegate("messages", Messages.next_due_in_ms)
    requeue = delegate("messages", Messages.requeue)
    get_message = delegate("messages", Messages.get_message)
    size = delegate("messages", Messages.size)
    purge = delegate("messages", Messages.purge)
    # ---- leases ----
    claim = delegate("leases", Leases.claim)
    claim_op = delegate("leases", Leases.claim_op)
    ack_and_claim = delegate("leases", Leases.ack_and_claim)
    ack_and_claim_op = delegate("leases", Leases.ack_and_claim_op)
    renew = delegate("leases", Leases.renew)
    ack = delegate("leases", Leases.ack)
    ack_op = delegate("leases", Leases.ack_op)
    promote_runs = delegate("leases", Leases.promote_runs)
    promote_gates = delegate("leases", Leases.promote_gates)
    promote_gates_of = delegate("leases", Leases.promote_gates_of)
    park_held = delegate("leases", Leases.park_held)
    holds_on = delegate("leases", Leases.holds_on)
    is_held = delegate("leases", Leases.is_held)
    # ---- transitions ----
    release = delegate("transitions", Transitions.release)
    release_op = delegate("transitions", Transitions.release_op)
    release_rejected = delegate("transitions", Transitions.release_rejected)
    release_rejected_op = delegate("transitions", Transitions.release_rejected_op)
    fail_op = delegate("transitions", Transitions.fail_op)
    park = delegate("transitions", Transitions.park)
    fail = delegate("transitions", Transitions.fail)
    # ---- offers (the handoff) ----
    offer = delegate("offers", Offers.offer)
    ack_and_offer = delegate("offers", Offers.ack_and_offer)
    offer_op = delegate("offers", Offers.offer_op)
    withdraw_offers = delegate("offers", Offers.withdraw_offers)
    leased_to = delegate("offers", Offers.leased_to)
    # ---- tasks and the timeline ----
    compare_and_set = delegate("tasks", Tasks.compare_and_set)
    append_event = delegate("tasks", Tasks.append_event)
    get_task = delegate("tasks", Tasks.get_task)
    record_event = delegate("timeline", Timeline.record_event)
    events = delegate("timeline", Timeline.events)
    # ---- topology ----
    declare_queue = delegate("topology", Topology.declare_queue)
    touch_queues = delegate("topology", Topology.touch_queues)
    has_queue = delegate("topology", Topology.has_queue)
    delete_queue = delegate("topology", Topology.delete_queue)
    bind = delegate("topology", Topology.bind)
    unbind = delegate("topology", Topology.unbind)
    unbind_key = delegate("topology", Topology.unbind_key)
    bindings = delegate("topology", Topology.bindings)
    declare_exchange = delegate("topology", Topology.declare_exchange)
    exchange_type = delegate("topology", Topology.exchange_type)
    delete_exchange = delegate("topology", Topology.delete_exchange)
    # ---- flow control and unique tasks ----
    set_limits = delegate("flow", FlowLimits.set_limits)
    set_rate_limits = delegate("flow", FlowLimits.set_rate_limits)
    remove_limit = delegate("flow", FlowLimits.remove_limit)
    limits = delegate("flow", FlowLimits.limits)
    rate_limits = delegate("flow", FlowLimits.rate_limits)
    unique = delegate("uniques", Uniques.unique)
    originals_of = delegate("uniques", Uniques.originals_of)
