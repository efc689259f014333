"""Chord counters in the result store: an atomic counter per chord, each part counted once
(a marker row beside the counter), the parts a running part adds (Celery's ``add_to_chord``)
and a fresh start when a chord is applied again. A mixin of ``ResultStore``
(sqlease._core.results), whose tables and transaction helpers it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Table, delete, select

from sqlease._core.chord_sql import ChordStatements
from sqlease._core.store import Store
from sqlease._db.retry import transient
from sqlease.types import Fence


class FenceRefused(Exception):
    """Internal: a fenced write found its lease gone (nothing was written)."""


@dataclass(frozen=True)
class PartCount:
    """What ``ChordCounters.count_part`` found and did for one chord part."""

    #: What the count reached, as ``incr(part=…)`` returns it (0: nothing counted now).
    value: int
    #: Counted before, with nothing more to do (``parts_settled``): nothing was counted.
    settled: bool
    #: The chord's size as stored, with the parts added since (None: none stored).
    size: int | None
    #: Whether the chord's header is saved (when it is not, nothing was counted).
    header: bool
    #: Whether the expiries asked for were written (the count did not complete the chord).
    expired: bool


class ChordCounters:
    store: Store
    results: Table
    counters: Table
    _insert: Callable[[Table], Any]
    _sql: ChordStatements

    def _now(self) -> int:
        raise NotImplementedError

    def _held(self, conn: Any, fence: Fence, task_id: str | None) -> bool:
        raise NotImplementedError

    @transient
    def incr(
        self,
        key: str,
        *,
        fence: Fence | None = None,
        task_id: str | None = None,
        part: str | None = None,
        part_expires_ms: int | None = None,
    ) -> int:
        """Atomically add one to a counter; raises FenceRefused if the fence's lease is gone.

        ``part`` (a chord part's task id): counted once whatever happens. The first count
        leaves a marker row, holding the value the count reached, in the same transaction.
        A later one (the part ran again after its worker died) adds nothing. It returns 0,
        so it can neither count twice nor fire the chord's callback again, with one
        exception: if this part's count was the last one made and the counter is still
        there, it returns that value again. Celery deletes the counter once it has sent the
        callback, so a counter still standing at the part's own count means that the worker
        died after the count and before the callback; returning the chord's size lets the
        part's redelivery send it."""
        with self.store.driver.writing() as conn:
            if fence is not None and not self._held(conn, fence, task_id):
                raise FenceRefused(fence)
            if part is None:
                return int(
                    conn.execute(self._sql.increment, {"k": key, "expiry": None}).scalar_one()
                )
            return self._count_once(conn, key, part, part_expires_ms)[0]

    def _count_once(
        self,
        conn: Connection,
        key: str,
        part: str,
        part_expires_ms: int | None,
        expiring: tuple[int | None] | None = None,
    ) -> tuple[int, bool]:
        """``incr(part=…)`` inside the caller's transaction, and whether it added one (the
        part's marker was not there). ``expiring``: the counter's new expiry (None inside:
        never), written by the count itself."""
        marker_key = part_marker(key, part)
        expires = None if part_expires_ms is None else self._now() + part_expires_ms
        sql = self._sql
        if conn.execute(sql.marker, {"k": marker_key, "expiry": expires}).first() is None:
            counted, current = self._marker_and_counter(conn, key, part)
            return (counted if counted and counted == current else 0), False
        stmt = sql.increment if expiring is None else sql.increment_expiring
        params = {"k": key, "expiry": None if expiring is None else expiring[0]}
        value = int(conn.execute(stmt, params).scalar_one())
        conn.execute(sql.marker_value, {"k": marker_key, "reached": value})
        return value, True

    @transient
    def count_part(
        self,
        key: str,
        part: str,
        *,
        group_key: str,
        size: int | None = None,
        fence: Fence | None = None,
        task_id: str | None = None,
        part_expires_ms: int | None = None,
        expiries: Sequence[tuple[str, float | None]] = (),
    ) -> PartCount:
        """A chord part's whole count in one transaction: ``part_state``, whether the chord's
        header is still saved under ``group_key``, ``incr(part=…)`` and, when the count is not
        to complete the chord, ``expiries`` (what Celery's base expires after such a count;
        ``size``: the chord's size as the part's request gives it, else the stored one).

        Nothing is counted for a part that is settled, or whose chord's header is gone
        (Celery's base then fails the chord's body). Raises FenceRefused if the fence's
        lease is gone."""
        with self.store.driver.writing() as conn:
            if fence is not None and not self._held(conn, fence, task_id):
                raise FenceRefused(fence)
            counted, current, stored, header = self._part_rows(conn, key, part, group_key)
            if _settled(counted, current, stored):
                return PartCount(0, True, stored, header, False)
            if not header:
                return PartCount(0, False, stored, False, False)
            # The count locks the chord's one counter row until the commit, so it comes first
            # (a transaction that writes a key in both tables takes the counters row first:
            # two of them on one key cannot deadlock), and writes the counter's own expiry:
            # the fewer statements after it, the less the chord's parts wait for each other.
            # A part that another's count made the last after all has expired keys Celery's
            # base then deletes, or expires again (its own result).
            total = stored if size is None else size
            expire = bool(expiries) and total is not None and (current or 0) + 1 < total
            asked = dict(expiries)
            expiring = None
            if expire and key in asked:
                expiring = (self._expiry_of(asked[key]),)
            value, added = self._count_once(conn, key, part, part_expires_ms, expiring)
            if expire:
                self._refresh_expiries(conn, expiries, counted=key if added else None)
            return PartCount(value, False, stored, True, expire)

    def _expiry_of(self, seconds: float | None) -> int | None:
        """Celery's ``expire(key, seconds)`` as an ``expires_at_ms`` (None: never)."""
        return self._now() + int(seconds * 1000) if seconds else None

    def _refresh_expiries(
        self,
        conn: Connection,
        expiries: Sequence[tuple[str, float | None]],
        counted: str | None = None,
    ) -> None:
        """Celery's ``expire`` of each ``(key, seconds)`` in the caller's transaction, both
        tables, counters first (``counted``: a counter whose count just wrote its expiry).
        Every part of a chord sets the same keys' expiry to its own "now + seconds": a row
        whose expiry is already within a hundredth of ``seconds`` (at most a minute) below
        the new one is left as it is, so a chord's parts do not rewrite its few shared rows
        once each."""
        by_time: dict[tuple[int | None, int], list[str]] = {}
        for key, seconds in expiries:
            slack = min(int(seconds * 1000) // 100, 60_000) if seconds else 0
            by_time.setdefault((self._expiry_of(seconds), slack), []).append(key)
        for table in (self.counters, self.results):
            for (expires, slack), keys in by_time.items():
                if table is self.counters:
                    keys = [k for k in keys if k != counted]
                for at in range(0, len(keys), _KEYS_PER_STATEMENT):
                    chunk = keys[at : at + _KEYS_PER_STATEMENT]
                    if expires is None:
                        conn.execute(self._sql.keep[table.name], {"keys": chunk})
                    else:
                        terms = {"keys": chunk, "expiry": expires, "floor": expires - slack}
                        conn.execute(self._sql.expire[table.name], terms)

    def _marker_and_counter(
        self, conn: Connection, key: str, part: str
    ) -> tuple[int | None, int | None]:
        """The value ``part``'s count reached in counter ``key``, and the counter's value now
        (None for a row that is not there)."""
        marker_key = part_marker(key, part)
        found = conn.execute(self._sql.counter_rows, {"keys": [key, marker_key]}).all()
        rows = {row_key: value for row_key, value in found}
        counted, current = rows.get(marker_key), rows.get(key)
        return (
            None if counted is None else int(counted),
            None if current is None else int(current),
        )

    @transient
    def part_state(self, key: str, part: str) -> tuple[bool, int | None]:
        """For a chord part about to be counted, in one read: whether it needs nothing more
        (``parts_settled``), and the chord's size: the size stored under ``key`` with the
        parts added since (``add_part``), None if no size is stored."""
        with self.store.driver.reading() as conn:
            counted, current, size, _ = self._part_rows(conn, key, part)
        return _settled(counted, current, size), size

    def parts_settled(self, keys_and_parts: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which (counter key, part) pairs need nothing more (``_settled``). A redelivered
        part that is not settled must run again (``incr`` then lets it send the callback)."""
        with self.store.driver.reading() as conn:
            return {
                (key, part)
                for key, part in keys_and_parts
                if _settled(*self._part_rows(conn, key, part)[:3])
            }

    def _part_rows(
        self, conn: Connection, key: str, part: str, header_key: str | None = None
    ) -> tuple[int | None, int | None, int | None, bool]:
        """The value ``part``'s count reached in counter ``key``, the counter's value now, the
        chord's size (stored under ``key``, with the parts added since), in two reads; None
        for what is not there (a size that is not an integer is None too); and whether a
        live value is stored under ``header_key`` (read with the size, its value left)."""
        marker_key, added_key = part_marker(key, part), _added_key(key)
        sql = self._sql
        found = conn.execute(sql.counter_rows, {"keys": [key, marker_key, added_key]}).all()
        keys = [key] if header_key is None else [key, header_key]
        stored = dict(
            conn.execute(sql.result_rows, {"keys": keys, "now": self._now(), "sized": key}).all()
        )
        rows = {row_key: int(value) for row_key, value in found}
        value = stored.get(key)
        size = None if value is None else _int_or_none(value)
        total = None if size is None else size + rows.get(added_key, 0)
        return rows.get(marker_key), rows.get(key), total, header_key in stored

    @transient
    def reset_counter(self, key: str, parts: Iterable[str]) -> None:
        """Start counter ``key`` afresh: the counter, the value stored under its key (a
        chord's size), the record of each of ``parts`` as counted (``part_marker``) and the
        parts added to it (``add_part``) with theirs go. Exact keys only: a range of keys
        would follow the database's collation, which need not sort ``:`` bytewise."""
        with self.store.driver.writing() as conn:
            added = self._added(conn, key)
            markers = [part_marker(key, part) for part in [*parts, *added]]
            counter_keys = [key, _added_key(key), *markers]
            result_keys = [key, *(_added_key(key, n) for n in range(1, len(added) + 1))]
            for table, keys in ((self.counters, counter_keys), (self.results, result_keys)):
                for at in range(0, len(keys), _KEYS_PER_STATEMENT):
                    chunk = keys[at : at + _KEYS_PER_STATEMENT]
                    conn.execute(delete(table).where(table.c.key.in_(chunk)))

    @transient
    def add_part(self, key: str, part: str, *, expires_ms: int | None = None) -> int:
        """Record ``part`` as one more part that counter ``key`` waits for (Celery's
        ``add_to_chord``); how many have been added."""
        now = self._now()
        expires = None if expires_ms is None else now + expires_ms
        count = (
            self._insert(self.counters)
            .values(key=_added_key(key), value=1, expires_at_ms=expires)
            .on_conflict_do_update(
                index_elements=[self.counters.c.key],
                set_={"value": self.counters.c.value + 1},
            )
            .returning(self.counters.c.value)
        )
        with self.store.driver.writing() as conn:
            added = int(conn.execute(count).scalar_one())
            conn.execute(
                self._insert(self.results).values(
                    key=_added_key(key, added),
                    value=part.encode(),
                    expires_at_ms=expires,
                    updated_at_ms=now,
                )
            )
        return added

    @transient
    def added_parts(self, key: str) -> list[str]:
        """The parts ``add_part`` recorded for counter ``key``, in the order they were added."""
        with self.store.driver.reading() as conn:
            return self._added(conn, key)

    def _added(self, conn: Connection, key: str) -> list[str]:
        count = conn.execute(
            select(self.counters.c.value).where(self.counters.c.key == _added_key(key))
        ).scalar()
        keys = [_added_key(key, n) for n in range(1, int(count or 0) + 1)]
        found: dict[str, str] = {}
        for at in range(0, len(keys), _KEYS_PER_STATEMENT):
            rows = conn.execute(
                select(self.results.c.key, self.results.c.value).where(
                    self.results.c.key.in_(keys[at : at + _KEYS_PER_STATEMENT])
                )
            ).all()
            found.update((row.key, bytes(row.value).decode()) for row in rows)
        return [found[k] for k in keys if k in found]


#: Keys per ``IN`` list (SQLite allows 32,766 parameters in a statement).
_KEYS_PER_STATEMENT = 1000


def _added_key(key: str, number: int | None = None) -> str:
    """The counter of the parts added to counter ``key``, or the row naming the added part
    ``number`` (from 1)."""
    return f"{key}:added" if number is None else f"{key}:added:{number}"


def _settled(counted: int | None, current: int | None, size: int | None) -> bool:
    """Whether a chord part needs nothing more: counted, and not maybe the last count of a
    chord whose callback was never sent. That is when the counter still stands at this part's
    count (Celery deletes it once it has sent the callback) and the count reached the chord's
    ``size`` (its parts with those added), or the size is not known."""
    if counted is None:
        return False  # not counted
    return not (counted and counted == current and (size is None or counted >= size))


def part_marker(key: str, part: str) -> str:
    """The counters row that records ``part`` as counted in counter ``key``."""
    return f"{key}:counted:{part}"


def _int_or_none(value: Any) -> int | None:
    """A chord size stored by ``set_chord_size`` (the text of an integer), else None."""
    try:
        return int(bytes(value).decode() if isinstance(value, bytes | memoryview) else value)
    except (TypeError, ValueError):
        return None
