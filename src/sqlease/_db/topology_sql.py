"""The statements of the Kombu topology, the same on every dialect: bindings (exchange, queue,
routing key or pattern), declared exchanges' types and declared queues, with a queue's
deletion (its bindings, and its ready messages nobody holds)."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db.sql_common import unleased
from sqlease._db.tables import Tables


def bind(t: Tables) -> TextClause:
    return text(
        f"INSERT INTO {t.bindings.name} (exchange, queue, routing_key, pattern) "
        "VALUES (:exchange, :queue, :routing_key, :pattern) ON CONFLICT DO NOTHING"
    )


def unbind(t: Tables) -> TextClause:
    return text(
        f"DELETE FROM {t.bindings.name} WHERE exchange = :exchange AND queue = :queue "
        "AND routing_key = :routing_key AND pattern = :pattern"
    )


def bindings_for(t: Tables) -> TextClause:
    return text(
        f"SELECT routing_key, pattern, queue FROM {t.bindings.name} "
        "WHERE exchange = :exchange ORDER BY queue, routing_key"
    )


def declare_exchange(t: Tables) -> TextClause:
    # The latest declaration's type stands (a broker would refuse a different one; Kombu's
    # in-process check does that for the declaring process). The same type again writes
    # nothing: every new connection declares its exchanges.
    e = t.exchanges.name
    return text(
        f"INSERT INTO {e} (name, type) VALUES (:exchange, :type) "
        f"ON CONFLICT (name) DO UPDATE SET type = excluded.type WHERE {e}.type <> excluded.type"
    )


def exchange_type(t: Tables) -> TextClause:
    return text(f"SELECT type FROM {t.exchanges.name} WHERE name = :exchange")


def delete_exchange(t: Tables) -> TextClause:
    return text(f"DELETE FROM {t.exchanges.name} WHERE name = :exchange")


def delete_exchange_bindings(t: Tables) -> TextClause:
    return text(f"DELETE FROM {t.bindings.name} WHERE exchange = :exchange")


def declare_queue(t: Tables, now: str) -> TextClause:
    return text(
        f"INSERT INTO {t.queues.name} (name, created_at_ms) VALUES (:queue, {now}) "
        "ON CONFLICT DO NOTHING"
    )


def has_queue(t: Tables) -> TextClause:
    return text(f"SELECT 1 FROM {t.queues.name} WHERE name = :queue")


def delete_queue(t: Tables) -> TextClause:
    return text(f"DELETE FROM {t.queues.name} WHERE name = :queue")


def delete_queue_bindings(t: Tables) -> TextClause:
    return text(f"DELETE FROM {t.bindings.name} WHERE queue = :queue")


def delete_queue_messages(t: Tables, now: str) -> TextClause:
    return text(
        f"DELETE FROM {t.messages.name} WHERE queue = :queue AND state = 'ready' "
        f"AND {unleased(now)} RETURNING run_id"
    )
