"""The statements of a chord part's count (sqlease._core.chord_counters), built once per result
store with bound parameters. Built afresh for each part, their construction and cache keys
cost more than running them: a part's count on SQLite took 0.8 ms more of Python than the
statements did."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Table, bindparam, case, select, update


class ChordStatements:
    """Each takes the parameters its comment names."""

    def __init__(self, counters: Table, results: Table, insert: Callable[[Table], Any]) -> None:
        c, r = counters.c, results.c
        # keys: the counters rows to read (key, value)
        self.counter_rows = select(c.key, c.value).where(
            c.key.in_(bindparam("keys", expanding=True))
        )
        # keys, now, sized: the live results rows among ``keys``, with the value of ``sized``
        # alone (another's, such as a chord's saved header, may be large)
        self.result_rows = select(
            r.key, case((r.key == bindparam("sized"), r.value), else_=None)
        ).where(
            r.key.in_(bindparam("keys", expanding=True)),
            r.expires_at_ms.is_(None) | (r.expires_at_ms > bindparam("now")),
        )
        # k, expiry: a part's marker, unless it is there (returns its key when written)
        self.marker = (
            insert(counters)
            .values(key=bindparam("k"), value=0, expires_at_ms=bindparam("expiry"))
            .on_conflict_do_nothing(index_elements=[c.key])
            .returning(c.key)
        )
        # k, expiry: one more on counter ``k``, started at 1 (then expiring at ``expiry``)
        self.increment = (
            insert(counters)
            .values(key=bindparam("k"), value=1, expires_at_ms=bindparam("expiry"))
            .on_conflict_do_update(index_elements=[c.key], set_={"value": c.value + 1})
            .returning(c.value)
        )
        # k, expiry: the same, and the counter expires at ``expiry`` (None: never) from now
        self.increment_expiring = (
            insert(counters)
            .values(key=bindparam("k"), value=1, expires_at_ms=bindparam("expiry"))
            .on_conflict_do_update(
                index_elements=[c.key],
                set_={"value": c.value + 1, "expires_at_ms": bindparam("expiry")},
            )
            .returning(c.value)
        )
        # k, reached: the value a part's count reached, on its marker
        self.marker_value = (
            update(counters).where(c.key == bindparam("k")).values(value=bindparam("reached"))
        )
        # keys, expiry, floor: per table, expire ``keys`` at ``expiry`` unless already
        # between ``floor`` and it
        self.expire = {
            table.name: update(table)
            .where(
                table.c.key.in_(bindparam("keys", expanding=True)),
                table.c.expires_at_ms.is_(None)
                | (table.c.expires_at_ms < bindparam("floor"))
                | (table.c.expires_at_ms > bindparam("expiry")),
            )
            .values(expires_at_ms=bindparam("expiry"))
            for table in (counters, results)
        }
        # keys: per table, ``keys`` never expire
        self.keep = {
            table.name: update(table)
            .where(
                table.c.key.in_(bindparam("keys", expanding=True)),
                table.c.expires_at_ms.isnot(None),
            )
            .values(expires_at_ms=None)
            for table in (counters, results)
        }
