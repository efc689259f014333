"""What a Store runs: the statements of one dialect and table prefix, and that dialect's
capabilities.

``Statements`` is built once per Store (``Dialect.statements`` in ``sqlease._db.dialects``)
and never changed; a hot call reads one attribute. A statement one dialect does without is
None there; callers ask ``Capabilities`` instead of testing for None or for the dialect.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sqlalchemy import TextClause


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a dialect can do; the core asks these instead of the dialect's name."""

    #: hot operations run as one autocommit statement each (claim with its run locks and
    #: events, ack, ack + claim, publish with its handoff): PostgreSQL's data-modifying CTEs
    one_statement: bool
    #: idle workers' standing offers and handoffs in publish notifications (LISTEN/NOTIFY)
    offers: bool
    #: ``pg_notify`` wake-ups for waiting clients and idle workers
    notifications: bool
    #: one timeline row lists every delivery of a statement (``task_ids`` and friends)
    batch_events: bool
    #: one writer at a time holds the whole database (SQLite's file lock): a second
    #: connection that writes waits for the first one's transaction to end
    single_writer: bool


@dataclass(frozen=True)
class Statements:
    """The statements for one dialect and table prefix.

    Not slotted, so that ``vars()`` lists them (the SQL snapshot test renders them so)."""

    # ---- messages ----
    #: Publish one message; on PostgreSQL it may be handed to an idle worker's offer.
    enqueue: TextClause
    #: Publish inside a caller's transaction: never handed over (the offer's row would stay
    #: locked until that transaction ends). SQLite: ``enqueue``.
    enqueue_plain: TextClause
    #: Delete and return ready messages (consumers that never ack).
    take: TextClause
    size: TextClause
    purge: TextClause
    requeue: TextClause
    #: Milliseconds until the next delayed message of ``:queues`` is due.
    next_due: TextClause
    message_get: TextClause
    now: TextClause
    # ---- leases ----
    claim: TextClause
    claim_single: TextClause
    #: SQLite: the run locks of a claim, written by the caller.
    claim_runs: TextClause | None
    #: SQLite: the rate limits a claim let deliveries through, advanced by the caller.
    rate_take: TextClause | None
    #: PostgreSQL: the acks and the refill claim in one statement.
    ack_claim: TextClause | None
    ack_claim_single: TextClause | None
    renew: TextClause
    #: SQLite: a renewed lease's run lock, written by the caller.
    renew_runs: TextClause | None
    ack: TextClause
    release_run: TextClause
    #: Release, park or fail fenced deliveries.
    transition: TextClause
    #: The compare-and-set's lease check: locks and renews the message row.
    hold: TextClause
    hold_run: TextClause
    #: The fencing predicate every fenced write matches, with the fence's id and attempt.
    held_predicate: str
    # ---- offers (PostgreSQL) ----
    offer_and_next_due: TextClause | None
    ack_offer: TextClause | None
    offer_withdraw: TextClause | None
    offer_withdraw_all: TextClause | None
    leased_to_owner: TextClause | None
    # ---- tasks ----
    task_ensure: TextClause
    task_cas: TextClause
    task_get: TextClause
    #: SQLite: a published task's row and a claim's attempts, written by the caller
    #: (PostgreSQL: CTEs of the publish and claim statements; sqlease._db.task_rows).
    task_publish: TextClause | None
    task_attempts: TextClause | None
    # ---- events ----
    event_insert: TextClause
    events_for_task: TextClause
    events_for_message: TextClause
    # ---- results (PostgreSQL) ----
    result_put: TextClause | None
    result_put_offer: TextClause | None
    # ---- topology: bindings and queues ----
    bind: TextClause
    unbind: TextClause
    bindings_for: TextClause
    declare_queue: TextClause
    has_queue: TextClause
    delete_queue: TextClause
    delete_queue_bindings: TextClause
    delete_queue_messages: TextClause


def compile_all(statements: Statements) -> list[TextClause]:
    """Every statement object of ``statements`` (to check that each one compiles)."""
    found = (getattr(statements, f.name) for f in fields(statements))
    return [v for v in found if isinstance(v, TextClause)]
