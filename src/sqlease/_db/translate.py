"""Driver errors become the errors the rest of sqlease handles, here and nowhere else.

Two kinds come out: a refusal that no retry can fix (a read-only database, a missing
privilege) becomes its sqlease error, with the driver's error attached as ``__cause__``;
anything else becomes SQLAlchemy's ``DBAPIError`` for it, exactly as SQLAlchemy's own
``Connection`` would have raised it, so that ``sqlease._db.retry`` recognises a transient
error (a disconnect, a serialization failure, a busy file) whichever path ran the statement:
SQLAlchemy's engine (through ``install``), or the direct lanes that talk to psycopg and
sqlite3 directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect, Engine

from sqlease.errors import DatabaseReadOnly, PermissionDenied

#: SQLSTATE 42501 (PostgreSQL's insufficient_privilege; psycopg's errors carry ``sqlstate``).
INSUFFICIENT_PRIVILEGE = "42501"


def refusal(original: BaseException, where: str) -> BaseException | None:
    """The sqlease error for a driver error no retry can fix, or None."""
    text = str(original)
    if "readonly database" in text or "read-only transaction" in text:
        error: BaseException = DatabaseReadOnly(
            f"the database {where} refuses writes ({text.strip()}); sqlease needs write "
            "access to enqueue, claim and ack"
        )
    elif getattr(original, "sqlstate", None) == INSUFFICIENT_PRIVILEGE:
        error = PermissionDenied(
            f"the database role lacks a privilege sqlease needs: {text.strip()} (see "
            "docs/explanation/reliability.md for the grants a worker role needs)"
        )
    else:
        return None
    error.__cause__ = original
    return error


def translate(
    error: BaseException,
    *,
    where: str,
    dialect: Dialect,
    dbapi_base: type[BaseException],
    sql: str | None = None,
    params: Mapping[str, Any] | Sequence[Any] | None = None,
    disconnected: bool = False,
) -> BaseException:
    """The error to raise for ``error``, which a direct lane's driver call raised: its refusal,
    or SQLAlchemy's DBAPIError (``disconnected``: the connection was invalidated)."""
    refused = refusal(error, where)
    if refused is not None:
        return refused
    if isinstance(params, Mapping):
        params = dict(params)
    return sa_exc.DBAPIError.instance(
        sql,
        params if isinstance(params, dict | list | tuple) else None,
        error,  # type: ignore[arg-type]
        dbapi_base,  # type: ignore[arg-type]
        connection_invalidated=disconnected,
        dialect=dialect,
    )


def install(engine: Engine) -> None:
    """Refusals on the statements SQLAlchemy's engine runs become sqlease errors too
    (SQLAlchemy wraps everything else itself)."""
    event.listen(engine, "handle_error", _on_engine_error)


def _on_engine_error(context: Any) -> BaseException | None:
    where = context.engine.url.render_as_string(hide_password=True) if context.engine else ""
    return refusal(context.original_exception, where)
