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
    """What a dialect can do, and does in one statement where the other needs several."""

    #: Idle workers' handoff offers: ``offer_and_next_due``, ``ack_offer``,
    #: ``offer_withdraw(_all)``, ``leased_to_owner``, ``result_put_offer``, and ``enqueue``
    #: hands a message to an offer.
    offers: bool
    #: ``ack_claim(_single)``: a worker's acks and its refill claim in one statement.
    ack_claim_in_one_statement: bool
    #: ``result_put``: the lease check, the upsert and the waiters' notification in one
    #: statement (otherwise a transaction runs the check and then the upsert).
    result_put_in_one_statement: bool
    #: ``enqueue``, ``claim``, ``renew``, ``ack`` and ``transition`` write the run locks and
    #: events themselves; otherwise the caller writes them in the same transaction
    #: (``claim_runs``, ``renew_runs``, ``release_run``, ``event_insert``).
    bookkeeping_in_statement: bool


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
