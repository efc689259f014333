"""``Admin``'s numbers: counts per queue and state, live leases, and event totals.

``stats()`` and ``leases()`` read the messages table in one scan (a GROUP BY); every
declared queue is listed, even an empty one. ``event_totals()`` gives monotonic totals of
timeline events by kind (what the Prometheus counters of ``sqlease.metrics`` report): the
events table is pruned by the maintenance pass's retention, so counting its rows would go
backwards. Instead each call counts only the events written since the last call (an id range
scan of the primary key) and adds them to totals kept in the ``counters`` table, in one
short transaction; nothing is added on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, case, func, or_, select, update

if TYPE_CHECKING:
    from sqlease._db.tables import Tables
    from sqlease.store import Store

#: The per-queue counts ``stats()`` gives, by task state (``sqlease.Admin``'s names).
QUEUE_STATES = (
    "queued",
    "scheduled",
    "running",
    "waiting_input",
    "waiting_approval",
    "paused",
    "failed",
    "cancelled",
)
#: Queued tasks parked behind an unfinished earlier task of their run (counted in ``queued``
#: too).
HELD_BY_RUN = "held_by_run"
#: Queued tasks parked at a full concurrency gate (their key's, task's or queue's limit),
#: counted in ``queued`` too.
HELD_BY_GATE = "held_by_gate"
#: Queued tasks a rate limit holds until their turn (counted in ``queued`` too).
HELD_BY_RATE = "held_by_rate"
HELD = (HELD_BY_RUN, HELD_BY_GATE, HELD_BY_RATE)
#: The timeline event kinds ``event_totals()`` counts by default.
COUNTED_EVENTS = (
    "enqueued",
    "claimed",
    "acked",
    "released",
    "attempts_exhausted",
    "lease_lost",
    "cancelled",
)
#: Keys of the totals in the counters table.
MARK_KEY = "sqlease:events:counted_to_id"
TOTAL_KEY = "sqlease:events:total:"


def _internal(queue: str) -> bool:
    """Kombu's own queues (Celery's remote control and event queues), which Celery declares
    per worker and per client: listed only while they hold messages."""
    return queue.endswith(".pidbox") or queue.startswith("celeryev.")


def _empty() -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(QUEUE_STATES, 0)
    row.update(ready=0, leased=0, waiting=0, dead=0, oldest_ready_age_s=None)
    row.update(dict.fromkeys(HELD, 0))
    return row


class StatsAdmin:
    """Counts per queue and state, the live leases per owner, and the event totals
    (``Admin.stats``, ``Admin.leases``, ``Admin.event_totals``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.t: Tables = store.tables

    def _scan(self, now: int) -> list[Any]:
        """Rows (queue, state, owner, count, oldest due, first and last lease expiry) from
        one pass over the messages table, grouped by queue and lease owner. (Grouping by a
        CASE that names each row's state instead made PostgreSQL misjudge the number of
        groups and sort 1,000,000 rows through temporary files rather than hash a few dozen
        groups: slower, benchmarks/metrics_scrape.py.)"""
        m = self.t.messages
        live = and_(m.c.state == "ready", m.c.lease_expires_at_ms > now)
        unleased = and_(
            m.c.state == "ready",
            or_(m.c.lease_expires_at_ms.is_(None), m.c.lease_expires_at_ms <= now),
        )
        # A message a rate limit holds, given its turn as its due time (reason "rate"), is
        # queued, not scheduled.
        timed = m.c.reason == "rate"
        ready = and_(unleased, or_(m.c.available_at_ms <= now, timed))
        parked = m.c.state == "parked"
        asking = m.c.reason.in_(("waiting_input", "waiting_approval"))
        owner = case((live, m.c.lease_owner), else_=None).label("owner")
        query = select(
            m.c.queue,
            owner,
            func.count().filter(ready),
            func.count().filter(
                and_(unleased, m.c.available_at_ms > now, or_(m.c.reason.is_(None), ~timed))
            ),
            func.count().filter(live),
            func.count().filter(and_(parked, m.c.reason == "waiting_input")),
            func.count().filter(and_(parked, m.c.reason == "waiting_approval")),
            func.count().filter(
                and_(
                    parked,
                    or_(m.c.reason.is_(None), and_(~asking, m.c.reason.not_in(("run", "gate")))),
                )
            ),
            func.count().filter(
                and_(m.c.state == "dead", or_(m.c.reason.is_(None), m.c.reason != "cancelled"))
            ),
            func.count().filter(and_(m.c.state == "dead", m.c.reason == "cancelled")),
            func.count().filter(and_(parked, m.c.reason == "run")),
            func.count().filter(and_(parked, m.c.reason == "gate")),
            func.count().filter(and_(unleased, timed)),
            func.min(m.c.available_at_ms).filter(ready),
            func.min(m.c.lease_expires_at_ms).filter(live),
            func.max(m.c.lease_expires_at_ms).filter(live),
        ).group_by(m.c.queue, owner)
        q = self.t.queues
        with self.store.driver.reading() as conn:
            found = list(conn.execute(query))
            declared = [r[0] for r in conn.execute(select(q.c.name)) if not _internal(r[0])]
        rows: list[Any] = [(name, None, None, 0, None, None, None) for name in declared]
        for queue, holder, *counts, oldest, low, high in found:
            for state, count in zip((*QUEUE_STATES, *HELD), counts, strict=True):
                if count:
                    running = state == "running"
                    rows.append(
                        (
                            queue,
                            state,
                            holder if running else None,
                            int(count),
                            oldest if state == "queued" else None,
                            low if running else None,
                            high if running else None,
                        )
                    )
        return rows

    def overview(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """``stats()`` and ``leases()`` from one pass over the messages table."""
        now = self.store.now_ms()
        rows = self._scan(now)
        return _stats(rows, now), _leases(rows)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per queue, every declared queue included: the number of tasks in each state of
        ``QUEUE_STATES``, ``held_by_run`` (of the queued, those parked behind an unfinished
        earlier task of their run), ``held_by_gate`` (of the queued, those parked at a full
        concurrency gate), ``held_by_rate`` (of the queued, those a rate limit holds until
        their turn), and ``ready`` (= queued), ``leased`` (= running), ``waiting``
        (input + approval), ``dead`` (failed + cancelled), and ``oldest_ready_age_s``, the
        seconds since the oldest ready message became due (None when none is ready)."""
        return self.overview()[0]

    def leases(self) -> list[dict[str, Any]]:
        """The owners holding live leases (one per worker process): how many messages each
        holds, per queue, and the earliest and latest expiry among them."""
        return self.overview()[1]

    def event_totals(self, kinds: Iterable[str] = COUNTED_EVENTS) -> dict[str, int]:
        """How many events of each kind were ever written (one per message: a PostgreSQL
        batch row counts each message it lists), monotonic across the retention's deletes.
        Each call folds in the events written since the previous one (on PostgreSQL, those at
        least the driver's ``event_settle_ms`` old), so the totals move at most as fast as they are
        read."""
        kinds = tuple(kinds)
        c, ev = self.t.counters, self.t.events
        per_row = self.store.driver.events_per_row()
        settle = self.store.driver.event_settle_ms
        with self.store.driver.writing() as conn:
            self._lock_mark(conn)
            have = {
                str(k): int(v)
                for k, v in conn.execute(
                    select(c.c.key, c.c.value).where(
                        or_(c.c.key == MARK_KEY, c.c.key.like(TOTAL_KEY + "%"))
                    )
                ).all()
            }
            mark = have.get(MARK_KEY, 0)
            # Up to the first event not yet settled, so none is ever passed over.
            unsettled = conn.execute(
                select(func.min(ev.c.id)).where(
                    ev.c.id > mark, ev.c.at_ms > self.store.now_ms() - settle
                )
            ).scalar()
            window = (
                ev.c.id > mark if unsettled is None else and_(ev.c.id > mark, ev.c.id < unsettled)
            )
            new_rows = conn.execute(
                select(ev.c.kind, func.sum(per_row), func.max(ev.c.id))
                .where(window)
                .group_by(ev.c.kind)
            ).all()
            # Every kind is folded in, whichever were asked for: the mark moves for all.
            values = {
                TOTAL_KEY + str(r[0]): have.get(TOTAL_KEY + str(r[0]), 0) + int(r[1])
                for r in new_rows
            }
            top = max((int(r[2]) for r in new_rows), default=mark)
            if top > mark:
                self._write(conn, {MARK_KEY: top, **values}, have)
            have.update(values)
        return {k: have.get(TOTAL_KEY + k, 0) for k in kinds}

    def _lock_mark(self, conn: Any) -> None:
        """Serialise concurrent callers on the mark's row (on SQLite the write transaction
        already holds the database)."""
        c = self.t.counters
        insert = self.store.driver.insert(c).values(key=MARK_KEY, value=0)
        conn.execute(insert.on_conflict_do_nothing(index_elements=[c.c.key]))
        conn.execute(update(c).where(c.c.key == MARK_KEY).values(value=c.c.value))

    def _write(self, conn: Any, values: dict[str, int], have: dict[str, Any]) -> None:
        c = self.t.counters
        for key, value in values.items():
            if key in have or key == MARK_KEY:
                conn.execute(update(c).where(c.c.key == key).values(value=value))
            else:
                conn.execute(c.insert().values(key=key, value=value))


def _stats(rows: list[Any], now: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for queue, state, _, count, oldest, _, _ in rows:
        entry = out.setdefault(queue, _empty())
        if state is None:
            continue  # a declared queue
        entry[state] += int(count)
        if state in (HELD_BY_RUN, HELD_BY_GATE):  # queued: parked behind its run, at its gate
            entry["queued"] += int(count)
        if state == "queued" and oldest is not None:
            age = round(max(0, now - int(oldest)) / 1000, 3)
            entry["oldest_ready_age_s"] = max(age, entry["oldest_ready_age_s"] or 0.0)
    for entry in out.values():
        entry["ready"], entry["leased"] = entry["queued"], entry["running"]
        entry["waiting"] = entry["waiting_input"] + entry["waiting_approval"]
        entry["dead"] = entry["failed"] + entry["cancelled"]
    return dict(sorted(out.items()))


def _leases(rows: list[Any]) -> list[dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for queue, _, owner, count, _, low, high in rows:
        if owner is None:
            continue
        entry = found.setdefault(
            owner, {"owner": owner, "leases": 0, "queues": {}, "next": None, "last": None}
        )
        entry["leases"] += int(count)
        entry["queues"][queue] = entry["queues"].get(queue, 0) + int(count)
        entry["next"] = int(low) if entry["next"] is None else min(entry["next"], int(low))
        entry["last"] = int(high) if entry["last"] is None else max(entry["last"], int(high))
    return [
        {
            "owner": e["owner"],
            "leases": e["leases"],
            "queues": e["queues"],
            "next_expiry_at_ms": e["next"],
            "last_expiry_at_ms": e["last"],
        }
        for e in sorted(found.values(), key=lambda e: e["owner"])
    ]
