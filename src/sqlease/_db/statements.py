"""What a Store runs outside its driver's operations: the statements both dialects have, for
one table prefix, and what a database can do.

``Statements`` is built once per Store (each dialect package's ``statements``) and never
changed. It holds only the statements the lease core and the facades run themselves (task
state, the timeline, topology, sizes); the hot operations (publish, claim, ack, renew,
transitions, result writes, offers) are the driver's, each written by its dialect with the
statements only that dialect has (``PgStatements``, ``SqliteStatements``, subclasses of this
one). No field is ever None: what one dialect does without is not a field here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sqlalchemy import TextClause

from sqlease._db.leaders import LeaderStatements
from sqlease._db.unique_sql import UniqueStatements


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one database, as reached through its URL, can do: features a caller may use or
    not, never which way to run an operation (the driver decides that)."""

    #: idle workers' standing offers, handed messages in publish notifications (PostgreSQL
    #: with a LISTEN connection: not behind a transaction pooler without ``listen_url``)
    offers: bool
    #: a commit's notification reaches idle clients at once (LISTEN/NOTIFY); otherwise they
    #: look when their waker says the database changed, or at their safety poll
    notifications: bool
    #: one writer at a time holds the whole database (SQLite's file lock): a second
    #: connection that writes waits for the first one's transaction to end
    single_writer: bool


@dataclass(frozen=True)
class Statements:
    """The statements both dialects have, for one table prefix.

    Not slotted, so that ``vars()`` lists them (the SQL snapshot test renders them so)."""

    # ---- messages ----
    size: TextClause
    purge: TextClause
    requeue: TextClause
    #: Milliseconds until the next delayed message of ``:queues`` is due.
    next_due: TextClause
    message_get: TextClause
    #: A message of a task id and payload published lately (a retried publish's check).
    published_since: TextClause
    #: The fences of every message an owner holds (expired leases included).
    leased_to_owner: TextClause
    now: TextClause
    # ---- leases (the compare-and-set's lease check, and run locks) ----
    #: The lease check of a fenced write (a compare-and-set, a step, a result): locks and
    #: renews the message row while ``(id, owner, attempt)`` holds a live lease.
    lease_check: TextClause
    #: Renew a run's lock with its message's lease.
    run_lease: TextClause
    release_run: TextClause
    #: The fencing predicate every fenced write matches, with the fence's id and attempt.
    held_predicate: str
    # ---- tasks ----
    task_ensure: TextClause
    task_cas: TextClause
    task_get: TextClause
    # ---- events ----
    event_insert: TextClause
    events_for_task: TextClause
    events_for_message: TextClause
    #: The deliveries and their ends (claimed, acked, purged) of the tasks ``:task_ids``:
    #: task_id, attempt, kind, id.
    deliveries_of_tasks: TextClause
    # ---- topology: bindings and queues ----
    bind: TextClause
    unbind: TextClause
    bindings_for: TextClause
    declare_exchange: TextClause
    exchange_type: TextClause
    delete_exchange: TextClause
    delete_exchange_bindings: TextClause
    declare_queue: TextClause
    has_queue: TextClause
    delete_queue: TextClause
    delete_queue_bindings: TextClause
    delete_queue_messages: TextClause
    # ---- held work ----
    #: The runs whose head waits parked behind its run (the maintenance pass's repair).
    stuck_runs: TextClause
    #: The gates that have messages parked at them (the maintenance pass's repair).
    parked_gates: TextClause
    #: The gates whose places the messages ``:ids`` (a JSON array) were claimed under: a
    #: message found exhausted at its claim frees its gate's place for the parked ones.
    gates_of: TextClause
    # ---- unique tasks' publish (sqlease._core.uniques) ----
    unique: UniqueStatements
    # ---- leader leases (the beat's, sqlease._core.leaders) ----
    leaders: LeaderStatements


def compile_all(statements: Statements) -> list[TextClause]:
    """Every statement object of ``statements`` (to check that each one compiles)."""
    found = (getattr(statements, f.name) for f in fields(statements))
    out: list[TextClause] = []
    for value in found:
        if isinstance(value, TextClause):
            out.append(value)
        elif isinstance(value, UniqueStatements | LeaderStatements):
            out.extend(getattr(value, f.name) for f in fields(value))
    return out
