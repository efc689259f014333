"""The broker topology's tables: exchange-to-queue bindings, the declared queues, with the
idle expiry of the queues that Celery's clients leave behind (migration 7), and the declared
exchanges' types (migration 15)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, MetaData, PrimaryKeyConstraint, Table, Text


def topology_tables(md: MetaData, p: str) -> tuple[Table, Table, Table]:
    """``bindings``, ``queues`` and ``exchanges`` for the prefix ``p``."""
    bindings = Table(
        f"{p}bindings",
        md,
        Column("exchange", Text, nullable=False),
        Column("queue", Text, nullable=False),
        Column("routing_key", Text, nullable=False, server_default=""),
        Column("pattern", Text, nullable=False, server_default=""),
        PrimaryKeyConstraint("exchange", "queue", "routing_key", "pattern"),
    )
    # Migration 7: a queue's bindings go with it (an idle queue's expiry, queue_delete).
    Index(f"{p}bindings_queue_ix", bindings.c.queue)
    queues = Table(
        f"{p}queues",
        md,
        Column("name", Text, primary_key=True),
        Column("created_at_ms", BigInteger, nullable=False),
        # Migration 7. A queue declared auto_delete, exclusive or with x-expires (Celery's
        # reply queues ``*.reply.celery.pidbox``, event receivers' ``celeryev.*``, workers'
        # ``*.celery.pidbox``) is deleted, with its bindings and messages, once nobody has
        # declared or consumed it for ``expires_ms``; its consumers push ``expires_at_ms``
        # forward while they live. NULL: a queue that stays until deleted.
        Column("expires_ms", BigInteger),
        Column("expires_at_ms", BigInteger),
    )
    Index(
        f"{p}queues_expires_ix",
        queues.c.expires_at_ms,
        postgresql_where=queues.c.expires_at_ms.isnot(None),
        sqlite_where=queues.c.expires_at_ms.isnot(None),
    )
    # Migration 15: each declared exchange's type, as a broker keeps it, so that a process
    # that publishes to an exchange by name without declaring it routes by that type (a
    # topic's patterns, a fanout's every queue) rather than Kombu's default, direct.
    exchanges = Table(
        f"{p}exchanges",
        md,
        Column("name", Text, primary_key=True),
        Column("type", Text, nullable=False),
    )
    return bindings, queues, exchanges
