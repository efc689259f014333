"""SQLite's fragments of SQL text and what it can do in one statement."""

from __future__ import annotations

from sqlease._db.statements import Capabilities

#: No offers (no LISTEN/NOTIFY to hand a message over); one writer holds the whole file.
CAPABILITIES = Capabilities(offers=False, notifications=False, single_writer=True)

#: The statement's clock in epoch milliseconds, unless ``:now`` is bound.
NOW = "COALESCE(:now, CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER))"
GREATEST = "max"
#: The fences as rows ``(id, attempt)``, from one JSON array of pairs.
FENCES = (
    "SELECT CAST(json_extract(value, '$[0]') AS INTEGER) AS id, "
    "CAST(json_extract(value, '$[1]') AS INTEGER) AS attempt FROM json_each(:fences)"
)
#: SQLite's RETURNING takes bare column names.
ROW_PREFIX = ""


def in_json(col: str, name: str) -> str:
    """``col`` is one of the strings of the JSON array ``:{name}``."""
    return f"{col} IN (SELECT value FROM json_each(:{name}))"


QUEUES_IN = in_json("m.queue", "queues")
