"""The statements of a leader lease (the beat's): taken, renewed, held and given up, each on
the database's clock, each fenced by ``(owner, term)`` as a task's writes are by
``(id, owner, attempt)``."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause, text

from sqlease._db.tables import Tables


@dataclass(frozen=True)
class LeaderStatements:
    #: A first leader: the row is created with term 1 (nothing if it exists).
    create: TextClause
    #: A takeover of an expired lease: a new owner and the next term.
    take: TextClause
    #: Renew the lease held by ``(owner, term)``, expired or not, as long as no takeover has
    #: happened (the term is the fence: a takeover bumps it, and only a takeover lets another
    #: beat write); no row when it has. Inside a transaction it also locks the row, so no
    #: takeover can commit before that transaction does: every write a leader makes starts
    #: with it.
    renew: TextClause
    #: Give a live lease up at once (a clean shutdown), so that a standby need not wait.
    release: TextClause
    #: The leader's published info, fenced.
    publish_info: TextClause


def leader_statements(tables: Tables, now: str, greatest: str) -> LeaderStatements:
    """On the dialect's clock ``now`` (epoch milliseconds unless ``:now`` is bound), with its
    name for GREATEST."""
    name = tables.leaders.name
    held = "name = :name AND owner = :owner AND term = :term"
    fenced = f"{held} AND expires_at_ms > {now}"
    return LeaderStatements(
        create=text(
            f"INSERT INTO {name} (name, owner, term, expires_at_ms, acquired_at_ms) "
            f"VALUES (:name, :owner, 1, {now} + :lease_ms, {now}) "
            "ON CONFLICT (name) DO NOTHING RETURNING term"
        ),
        take=text(
            f"UPDATE {name} SET owner = :owner, term = term + 1, "
            f"expires_at_ms = {now} + :lease_ms, acquired_at_ms = {now} "
            f"WHERE name = :name AND expires_at_ms <= {now} RETURNING term"
        ),
        renew=text(
            f"UPDATE {name} SET expires_at_ms = {greatest}(expires_at_ms, {now} + :lease_ms) "
            f"WHERE {held} RETURNING expires_at_ms"
        ),
        release=text(f"UPDATE {name} SET expires_at_ms = {now} WHERE {fenced}"),
        publish_info=text(f"UPDATE {name} SET info = :info WHERE {fenced}"),
    )
