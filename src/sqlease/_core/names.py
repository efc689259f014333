"""The checks of the names and numbers a caller gives, which the database stores as keys and
columns: a clear error that names the field, on both databases, rather than the database's own
(PostgreSQL's index entries hold at most 2704 bytes, its text no NUL character, its integers
32 bits; SQLite takes all of them), and nothing stored."""

from __future__ import annotations

import uuid

from sqlease.errors import ConfigurationError

#: Longest queue name, exchange name and routing key, in bytes of UTF-8: AMQP's (they are
#: short strings there), so a name that works with RabbitMQ works here. A binding's row holds
#: three of them in one index entry, and a publish's wake-up carries its queue's name in a
#: NOTIFY (fewer than 8000 bytes).
MAX_NAME_BYTES = 255
#: Longest task id, run id, group id and task name, in bytes of UTF-8: each is an index key,
#: a result's key the task id and more.
MAX_ID_BYTES = 1000
#: Largest count (attempts, limits): PostgreSQL's ``integer``.
MAX_INT = 2**31 - 1


def is_count(value: object, most: int = MAX_INT) -> bool:
    """Is ``value`` an integer (not a bool) from 1 to ``most`` (a count PostgreSQL's
    ``integer`` holds)?"""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def utf8_size(what: str, value: str) -> int:
    """``value``'s length in bytes of UTF-8, after refusing what no database here stores: a
    NUL character (PostgreSQL's text cannot hold one) or a lone surrogate (not UTF-8: a
    file name decoded with ``surrogateescape``)."""
    if "\x00" in value:
        raise ConfigurationError(
            f"{what} {value[:40]!r} contains a NUL character, which PostgreSQL cannot store"
        )
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ConfigurationError(
            f"{what} {value[:40]!r} is not valid Unicode text: a lone surrogate "
            f"{value[exc.start]!r} at {exc.start}"
        ) from None


def check_name(what: str, name: str) -> None:
    """A clear error for a ``what`` (``"queue name"``...) that cannot be stored."""
    size = utf8_size(what, name)
    if size > MAX_NAME_BYTES:
        raise ConfigurationError(
            f"{what} {name[:40]!r}... is {size} bytes of UTF-8, over {MAX_NAME_BYTES} "
            "(AMQP's limit)"
        )


def check_id(what: str, value: str | None) -> None:
    """A clear error for an identifier (``"task id"``...) that cannot be stored."""
    if value is None:
        return
    size = utf8_size(what, value)
    if size > MAX_ID_BYTES:
        raise ConfigurationError(
            f"{what} {value[:40]!r}... is {size} bytes of UTF-8, over {MAX_ID_BYTES}"
        )


def as_id(what: str, value: object, error: type[Exception] = TypeError) -> str:
    """An identifier (task id, run id...) as the text it is stored as: a string as it is, a
    UUID or an integer as its string (as a publish stores them, so a lookup by the same value
    finds it). Anything else raises ``error`` naming ``what``: bytes would be stored as their
    repr, and a number compared with a text column is PostgreSQL's own error where SQLite
    matches nothing."""
    if isinstance(value, str):
        return value
    if isinstance(value, uuid.UUID) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    raise error(
        f"{what} must be a string, a uuid.UUID or an integer, not {type(value).__name__} "
        f"{value!r:.60}"
    )


def require_text(what: str, value: object) -> str:
    """``value`` if it is a string (a key looked up by, which a publish took as a string
    only), else a ``TypeError`` naming ``what``."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__} {value!r:.60}")
    return value
