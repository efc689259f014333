"""Indexes the migrations add to tables made by earlier versions: the batch-event index
(migration 11) and the retention deletes' indexes (migration 7). Both are also part of the
tables themselves (``sqlease._db.tables``), so a new database gets them at creation."""

from __future__ import annotations

from sqlalchemy import Index, Table

#: kB of the batch-event index's pending list (PostgreSQL's default is 4 MB). The statement
#: that fills the list merges it into the index: at 4 MB that took 190-210 ms of one claim,
#: at 1 MB 59-74 ms (120,000 tasks, batches of 32), for the same throughput.
BATCH_EVENTS_PENDING_LIST_KB = 1024

#: A batch event's task keys are its task ids hashed into 0..TASK_KEY_MASK (2**18 values).
#: A GIN index never deletes a key from its key tree (VACUUM empties its posting list, the
#: key stays until a REINDEX), so an index over the task ids themselves grew with every task
#: ever seen, about 66 bytes each, whatever the retention (2.3 -> 7.0 MB in 7 minutes of a
#: soak at 250 tasks/s with the live rows flat). Over the hashes it holds at most 2**18 keys;
#: a lookup rechecks the rows that share its task's hash (about live ids / 2**18 of them).
TASK_KEY_MASK = (1 << 18) - 1


def task_key(expr: str) -> str:
    """SQL for the task key of the text ``expr`` (PostgreSQL). ``hashtextextended`` is the
    hash PostgreSQL's hash partitioning stores by, so it stays the same across upgrades."""
    return f"CAST(hashtextextended({expr}, 0) & {TASK_KEY_MASK} AS INTEGER)"


def batch_events_index(events: Table) -> Index:
    """A task's batch events are found by its task key inside the row's list of keys
    (PostgreSQL GIN: entries go through its pending list, so a batch costs about one index
    insertion rather than one per message; bounded: see ``TASK_KEY_MASK``). Made once per
    table; later calls return it."""
    name = f"{events.name}_batch_key_ix"
    for index in events.indexes:
        if index.name == name:
            return index
    return Index(
        name,
        events.c.task_keys,
        postgresql_using="gin",
        postgresql_where=events.c.task_keys.isnot(None),
        postgresql_with={"gin_pending_list_limit": BATCH_EVENTS_PENDING_LIST_KB},
    ).ddl_if(dialect="postgresql")


#: The indexes migration 7 adds (the retention deletes' and the idle queues'), by table.
RETENTION_INDEXES = {
    "messages": ("messages_dead_ix", "messages_stray_ix"),
    "tasks": ("tasks_created_ix",),
    "events": ("events_at_ix",),
    "queues": ("queues_expires_ix",),
    "bindings": ("bindings_queue_ix",),
    "results": ("results_unexpiring_ix",),
    "counters": ("counters_expires_ix",),
    "steps": ("steps_started_ix", "steps_open_ix"),
    "waits": ("waits_created_ix",),
}
