"""PostgreSQL: an idle worker's handoff offers (``sqlease._core.handoff``), which a publish uses
to lease a message to that worker and hand it over in its notification."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import TextClause, text

from sqlease._db.postgresql.dialect import NOW
from sqlease._db.postgresql.held import NOTIFIED, OWED
from sqlease._db.postgresql.leases import OWED_GATES, ack_ctes, ack_outside_runs_ctes
from sqlease._db.postgresql.messages import next_due_of_queues
from sqlease._db.tables import Tables, offers_sequence


def offer_writes(
    off: str,
    sequence: str,
    now: str,
    *,
    revive: Literal["refresh", "handed only"],
    params: str = "",
    only_if: str = "true",
    names: tuple[str, str] = ("rv", "o"),
) -> str:
    """Two CTEs that make ``:owner``'s offers for ``:{params}queues`` stand.

    The first updates the offers that exist. ``revive="refresh"``: a live one gets a new
    expiry, and a handed one stands again only if the worker has heard of that handoff
    (``:{params}seen``, per queue, the highest ``offer_seq`` its handoffs carried, aligned
    with the queues). ``revive="handed only"``: live offers are left alone (not even locked)
    and only heard-of handed ones stand again. The second inserts the offers that do not
    exist. Every write that makes an offer stand takes a new number from ``sequence``, so a
    handed offer's number names the one handoff that used it."""
    p = params
    if revive == "refresh":
        which = "(NOT w.handed OR w.offer_seq <= s.seen)"
    elif revive == "handed only":
        which = "w.handed AND w.offer_seq <= s.seen"
    else:
        raise ValueError(f"unknown revive mode {revive!r}")
    update, insert = names
    return (
        f"{update} AS (UPDATE {off} w SET lease_ms = :{p}lease_ms, lock_key = :{p}lock_key, "
        f"expires_at_ms = {now} + :{p}ttl_ms, handed = false, "
        f"offer_seq = nextval('{sequence}') "
        f"FROM unnest(CAST(:{p}queues AS TEXT[]), CAST(:{p}seen AS BIGINT[])) AS s(q, seen) "
        f"WHERE w.owner = :owner AND w.queue = s.q AND {which} AND {only_if}), "
        f"{insert} AS (INSERT INTO {off} "
        "(owner, queue, lease_ms, lock_key, expires_at_ms, offer_seq, handed) "
        f"SELECT :owner, q, :{p}lease_ms, :{p}lock_key, {now} + :{p}ttl_ms, "
        f"nextval('{sequence}'), false FROM unnest(CAST(:{p}queues AS TEXT[])) q "
        f"WHERE {only_if} ON CONFLICT (owner, queue) DO NOTHING)"
    )


def _gone(t: Tables) -> str:
    """CTE: ``:owner``'s live offers for queues it no longer consumes are dropped."""
    return (
        f"gone AS (DELETE FROM {t.offers.name} WHERE owner = :owner AND NOT handed "
        "AND queue <> ALL(CAST(:queues AS TEXT[]))), "
    )


def offer_ctes(t: Tables) -> str:
    """An idle worker's offer for each queue it consumes (refreshed by each idle look)."""
    return _gone(t) + offer_writes(t.offers.name, offers_sequence(t), NOW, revive="refresh")


def offer_and_next_due(t: Tables) -> TextClause:
    """The offers, with, in the same statement, when the next delayed message of those
    queues is due, and the database's time (``now_ms``): a handoff the offer brings is a lease
    the worker did not ask for itself, and its lease clock counts from that time
    (sqlease._core.lease_clock.DatabaseTime)."""
    return text(f"WITH {offer_ctes(t)} SELECT ({next_due_of_queues(t)}) AS due, {NOW} AS now_ms")


def _offer_keep(t: Tables) -> str:
    """The offers an ack that leaves a worker idle makes stand: an offer that already stands
    (the task's result wrote it) is kept, not updated: updating would lock its row just when
    the client's next publish looks for it, and the publish, which skips locked offers, would
    miss it."""
    return _gone(t) + offer_writes(t.offers.name, offers_sequence(t), NOW, revive="handed only")


def ack_offer(t: Tables) -> TextClause:
    """The ack that leaves a worker idle, with its handoff offer (and its next due time): one
    statement instead of two, so the offer stands sooner."""
    return text(
        f"WITH {ack_ctes(t)}, {_offer_keep(t)} "
        "SELECT (SELECT array_agg(id) FROM del) AS acked_ids, "
        f"({next_due_of_queues(t)}) AS due, {NOW} AS now_ms, {OWED} WHERE {NOTIFIED}"
    )


def ack_outside_runs_offer(t: Tables) -> TextClause:
    """``ack_offer`` whose acks are all of deliveries outside any run (an idle worker's plain
    tasks, handed over or claimed): the plan holds no promotion of a run
    (``leases.ack_outside_runs_ctes``)."""
    return text(
        f"WITH {ack_outside_runs_ctes(t)}, {_offer_keep(t)} "
        "SELECT (SELECT array_agg(id) FROM del) AS acked_ids, "
        f"({next_due_of_queues(t)}) AS due, {NOW} AS now_ms, {OWED_GATES}"
    )


def offer_withdraw(t: Tables) -> TextClause:
    """A handed offer stays until its worker has heard of the handoff (or closes): deleting it
    would let a refresh sent before then make a new one."""
    return text(f"DELETE FROM {t.offers.name} WHERE owner = :owner AND NOT handed")


def offer_withdraw_all(t: Tables) -> TextClause:
    return text(f"DELETE FROM {t.offers.name} WHERE owner = :owner")
