"""SQLite: the messages parked at a full gate (reason ``gate``; see
sqlease._db.postgresql.gates for why). One writer holds the whole file from a transaction's
first write, so a sweep and the statement that frees a gate's place never run at once: the
ack promotes the gates it freed in its own transaction (``promote``)."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.sqlite.dialect import GREATEST, NOW
from sqlease._db.tables import Tables


def _running(t: Tables, gate: str) -> str:
    """The live leases claimed under ``gate`` (exact: one writer at a time)."""
    return (
        f"(SELECT count(*) FROM {t.messages.name} h WHERE h.gate = {gate} "
        f"AND h.lease_expires_at_ms > {NOW})"
    )


def park_find(t: Tables) -> TextClause:
    """Of the first ``:scan`` ready messages of ``:queue``, those whose gate is full, with
    their gate (parked by ``park_set``, in the same transaction)."""
    m = t.messages.name
    first = (
        f"SELECT m.id, {c.GATE} AS gate, {c.GATE_LIMIT} AS lim FROM {m} m {c.gate_joins(t)} "
        f"WHERE m.state = 'ready' AND m.queue = :queue "
        f"AND m.priority IN {c.ready_priorities(t, ':queue')} AND m.available_at_ms <= {NOW} "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        # No gated lease live, no gate full: no scan (a worker sweeps every second).
        f"AND EXISTS (SELECT 1 FROM {m} g WHERE g.gate IS NOT NULL "
        f"AND g.lease_expires_at_ms > {NOW}) "
        f"{c.ORDER} LIMIT :scan"
    )
    return text(
        f"SELECT f.id, f.gate FROM ({first}) f "
        f"WHERE f.gate IS NOT NULL AND {_running(t, 'f.gate')} >= f.lim"
    )


def gates_of(t: Tables) -> TextClause:
    """The gates the messages ``:ids`` (a JSON array) were claimed under (a message keeps
    its gate after its lease ends)."""
    return text(
        f"SELECT DISTINCT m.gate FROM {t.messages.name} m WHERE m.gate IS NOT NULL "
        "AND m.id IN (SELECT value FROM json_each(:ids))"
    )


def park_set(t: Tables) -> TextClause:
    return text(
        f"UPDATE {t.messages.name} SET state = 'parked', reason = 'gate', gate = :gate, "
        "lease_owner = NULL, lease_expires_at_ms = NULL WHERE id = :id AND state = 'ready'"
    )


def gate_limit(t: Tables) -> TextClause:
    """The limit of the gate ``:gate`` (NULL: none, all its parked messages may go): a
    key's, from its first parked message; a task's or a queue's, configured."""
    m, fl = t.messages.name, t.flow_limits.name
    return text(
        "SELECT CASE WHEN :gate LIKE 'key:%' THEN (SELECT p.gate_limit FROM "
        f"{m} p WHERE p.state = 'parked' AND p.reason = 'gate' AND p.gate = :gate "
        "ORDER BY p.priority DESC, p.available_at_ms, p.id LIMIT 1) "
        f"ELSE (SELECT l.concurrency FROM {fl} l WHERE l.name = :gate) END AS lim, "
        f"{_running(t, ':gate')} AS running, "
        f"(SELECT count(*) FROM {m} r WHERE r.gate = :gate AND r.state = 'ready' "
        f"AND r.available_at_ms <= {NOW} "
        f"AND (r.lease_expires_at_ms IS NULL OR r.lease_expires_at_ms <= {NOW})) AS waiting"
    )


def promote(t: Tables) -> TextClause:
    """The first ``:n`` messages parked at ``:gate`` (-1: all), made ready."""
    m = t.messages.name
    return text(
        f"UPDATE {m} SET state = 'ready', reason = NULL WHERE id IN (SELECT p.id FROM {m} p "
        "WHERE p.state = 'parked' AND p.reason = 'gate' AND p.gate = :gate "
        "ORDER BY p.priority DESC, p.available_at_ms, p.id LIMIT :n) RETURNING id"
    )


def project_find(t: Tables) -> TextClause:
    """Of the first ``:scan`` ready messages of ``:queue``, those held by a rate limit whose
    turn (see sqlease._db.postgresql.gates.project_rates) is more than ``:horizon`` ms away,
    with that time and their rate (given it by ``project_set``)."""
    m = t.messages.name
    first = (
        f"SELECT m.id, m.priority, m.available_at_ms, {c.RATE} AS rate, "
        f"{c.RATE_INTERVAL} AS ivl, {c.RATE_TAU} AS tau, {c.RATE_TAT} AS tat "
        f"FROM {m} m {c.gate_joins(t)} WHERE m.state = 'ready' AND m.queue = :queue "
        f"AND m.priority IN {c.ready_priorities(t, ':queue')} AND m.available_at_ms <= {NOW} "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        # No rate limit anywhere, no scan.
        f"AND EXISTS (SELECT 1 FROM {t.flow_limits.name} r WHERE r.interval_ms IS NOT NULL) "
        f"{c.ORDER} LIMIT :scan"
    )
    last = (
        f"(SELECT max(w.available_at_ms) FROM {m} w WHERE w.state = 'ready' "
        "AND w.reason = 'rate' AND w.rate_gate = x.rate)"
    )
    turns = (
        f"SELECT f.id, f.rate, f.ivl, {GREATEST}(COALESCE(f.tat, 0), {NOW}) - f.tau + "
        "(row_number() OVER (PARTITION BY f.rate ORDER BY f.priority DESC, "
        "f.available_at_ms, f.id) - 1) * f.ivl AS turn "
        f"FROM ({first}) f WHERE f.rate IS NOT NULL"
    )
    later = (
        f"SELECT x.id, x.rate, {GREATEST}(x.turn, COALESCE({last} + row_number() OVER "
        "(PARTITION BY x.rate ORDER BY x.turn) * x.ivl, 0)) AS due "
        f"FROM ({turns}) x WHERE x.turn > {NOW} + :horizon"
    )
    return text(f"SELECT s.id, s.rate, s.due FROM ({later}) s")


def project_set(t: Tables) -> TextClause:
    return text(
        f"UPDATE {t.messages.name} SET available_at_ms = {GREATEST}(available_at_ms, :due), "
        "reason = 'rate', rate_gate = :rate WHERE id = :id AND state = 'ready'"
    )


def release_rates(t: Tables) -> TextClause:
    m = t.messages.name
    return text(
        f"UPDATE {m} SET available_at_ms = min(available_at_ms, {NOW}), reason = NULL "
        "WHERE state = 'ready' AND reason = 'rate' "
        "AND rate_gate IN (SELECT value FROM json_each(:rates)) RETURNING id"
    )
