"""``sqlease.beat:Scheduler``: Celery beat on a fenced leader lease, entries in SQL.

Every beat process (``celery beat -S sqlease.beat:Scheduler``, or ``celery worker -B``) ticks;
the one holding the leader lease fires, the others are standbys that try to take the lease
over a few times per lease. The leader syncs ``beat_schedule`` into the entries when it takes
the lease, so the config of the leader that started last wins, and reads the entries from SQL
at every tick, so an edit made through Admin or the CLI counts at the next one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import beat
from celery.schedules import crontab
from sqlalchemy.engine import URL

from sqlease._celery.defaults import broker_urls
from sqlease._celery.registry import store_for
from sqlease._core.leaders import Term
from sqlease._core.schedules import EntryRow, ScheduleStore, sync_config
from sqlease.beat._firing import BUILD_SHARE, Firing
from sqlease.beat._options import BeatOptions, beat_options
from sqlease.beat._prebuild import Prebuilder
from sqlease.errors import ConfigurationError, DatabaseUnavailable, LeadershipLost
from sqlease.options import TransportOptions
from sqlease.schedules._specs import EntrySpec, entry_spec
from sqlease.urls import to_sqlalchemy_url

logger = logging.getLogger("sqlease.beat")

#: Unplanned entries read per tick; a full batch makes the tick return 0 (tick again at once).
BATCH = 200
#: Due entries read per tick (as BATCH).
DUE_BATCH = 2000
#: The longest a sync's planning keeps its first pass's time (a wave of BATCH passes takes
#: seconds; entries left unplanned longer, backed off say, are planned from now).
PLANNING_WAVE_MS = 60_000
#: A tick builds fires ahead (sqlease.beat._prebuild) for at most this long, and only while
#: the next slot is further away than that plus PREBUILD_MARGIN_S.
PREBUILD_S = 0.5
PREBUILD_MARGIN_S = 1.0
#: After a failed send, the entry is left alone this long by this process (its slot stays
#: due in SQL: nothing is lost, and a fixed entry fires at the next tick after that).
RETRY_FAILED_S = 30.0


def _beat_url(app: Any) -> URL:
    url = app.conf.get("sqlease_beat_url")
    if url is None:
        urls = [u for u in broker_urls(app) if u.startswith("sqlease")]
        if not urls:
            raise ConfigurationError(
                "sqlease.beat:Scheduler sends through a sqlease broker: set broker_url to "
                "'sqlease+postgresql://…' or 'sqlease+sqlite:///…' (or sqlease_beat_url)"
            )
        url = urls[0]
    return to_sqlalchemy_url(str(url))


class Scheduler(beat.Scheduler):  # type: ignore[misc]
    """Celery's scheduler interface over sqlease's entries and leader lease."""

    #: The database's clock unless a test gives one (epoch milliseconds).
    clock: Callable[[], int] | None = None

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.clock = kwargs.pop("clock", None)
        self._owner = kwargs.pop("owner", None) or (
            f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        )
        self.term: Term | None = None
        self._renewed_ms = 0
        self._backoff: dict[str, float] = {}
        self._entries: ScheduleStore | None = None
        self._prebuilder: Prebuilder | None = None
        # While a sync's entries are planned over several passes (BATCH each), the time of
        # its first pass: they are all planned from it (see _pass).
        self._planning_from: int | None = None
        super().__init__(app, *args, **kwargs)

    # ---- set-up ------------------------------------------------------------------------

    def setup_schedule(self) -> None:
        self.options: BeatOptions = beat_options(self.app)
        transport = TransportOptions.parse(self.app.conf.get("broker_transport_options") or {})
        store = store_for(_beat_url(self.app), transport)
        self._entries = ScheduleStore(store, clock=self.clock)
        # Checked now: a bad entry stops beat at start, naming it, before anything is synced.
        self._config = self._config_specs()

    def _config_specs(self) -> dict[str, EntrySpec]:
        defaults: dict[str, Any] = {}
        conf = self.app.conf
        # As Celery's install_default_entries: results that do not expire by themselves.
        cleanup = conf.result_expires and not self.app.backend.supports_autoexpire
        if cleanup and "celery.backend_cleanup" not in (conf.beat_schedule or {}):
            defaults["celery.backend_cleanup"] = {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            }
        merged = dict(defaults, **(conf.beat_schedule or {}))
        specs = {}
        for name, entry in merged.items():
            entry = dict(entry)
            entry.setdefault("catch_up", self.options.catch_up)
            entry.setdefault("catch_up_limit", self.options.catch_up_limit)
            specs[name] = entry_spec(name, entry)
        return specs

    @property
    def entries(self) -> ScheduleStore:
        if self._entries is None:
            self.setup_schedule()
        assert self._entries is not None
        return self._entries

    # ---- time and leadership -----------------------------------------------------------

    def _now(self) -> int:
        return self.entries._now(None)

    def _lead(self, now: int) -> Term | None:
        """Renew the lease (every third of it, by the store's clock) or try to take it; the
        term held, if any."""
        if self.term is not None:
            if now - self._renewed_ms < self.options.renew_every * 1000:
                return self.term
            if self.entries.renew(self.term, self.options.lease_ms):
                self._renewed_ms = now
                return self.term
            logger.warning(
                "sqlease beat: %s lost the leader lease (term %d); standing by",
                self._owner,
                self.term.term,
            )
            self.term = None
        term = self.entries.acquire(self._owner, self.options.lease_ms)
        if term is not None:
            self._renewed_ms = now
            self.term = term
            logger.info("sqlease beat: %s leads (term %d)", self._owner, term.term)
            self._on_elected(term)
        return self.term

    def _on_elected(self, term: Term) -> None:
        now = self._now()
        config = {name: (spec.columns(), spec.digest()) for name, spec in self._config.items()}
        with self.entries.firing(term, self.options.lease_ms) as conn:
            done = sync_config(self.entries, conn, config, now)
        if any(done.values()):
            logger.info(
                "sqlease beat: beat_schedule synced: %s",
                ", ".join(f"{len(v)} {k}" for k, v in done.items()),
            )
        info = {
            "owner": self._owner,
            "host": socket.gethostname(),
            "tasks": sorted(self.app.tasks.keys()),
            "timezone": str(self.app.timezone),
        }
        self.entries.publish_info(term, info)

    # ---- Celery's interface --------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: lead or stand by, then (leading) plan, fire what is due. The seconds to
        sleep before the next pass."""
        try:
            now = self._now()
            term = self._lead(now)
            if term is None:
                self._planning_from = None
                return self.options.standby_poll
            return self._pass(term, now)
        except LeadershipLost as lost:
            logger.warning("sqlease beat: %s", lost)
            self.term = self._planning_from = None
            return self.options.standby_poll
        except DatabaseUnavailable as error:
            logger.warning("sqlease beat: the database is unavailable (%s); retrying", error)
            self._planning_from = None
            return min(self.options.standby_poll * 10, 5.0)

    @property
    def prebuilder(self) -> Prebuilder:
        """The leader's fires built ahead of their slots."""
        if self._prebuilder is None:
            firing = Firing(self.app, self.entries, self.options, self.producer)
            self._prebuilder = Prebuilder(
                self.app, self.entries, lambda: self.producer, firing.next_after, firing.policy
            )
        return self._prebuilder

    def _pass(self, term: Term, now: int) -> float:
        firing = Firing(self.app, self.entries, self.options, self.producer, self.prebuilder)
        # A boundary's prebuilt fires first, without reading their entries; then what is due
        # besides (entries changed since their fire was built, fires that cannot be).
        firing.fire_prebuilt(term, now, self._ready_name)
        unplanned = self.entries.unplanned(BATCH)
        asked = [e for e in unplanned if e.run_requested_at_ms is not None]
        for entry in asked:
            self._guarded(entry, self._unplanned, firing, term, entry, now)
        fresh = [e for e in unplanned if e.run_requested_at_ms is None and self._ready(e)]
        # Entries synced together are planned from one time, as Celery's scheduler gives them
        # one start: interval entries made at once keep one phase, however many passes
        # planning them takes.
        since = self._planning_from
        if since is None or now - since > PLANNING_WAVE_MS:
            since = now
        self._planning_from = since if len(unplanned) == BATCH else None
        try:
            firing.plan_together(term, fresh, now, since=since)
        except (LeadershipLost, DatabaseUnavailable):
            raise
        except Exception:  # one entry's schedule cannot be computed: plan them one by one
            for entry in fresh:
                self._guarded(entry, firing.plan_next, term, entry, now, since)
        due = self.entries.due(now, DUE_BATCH)
        for entry in firing.fire_together(term, [e for e in due if self._ready(e)], now):
            self._guarded(entry, firing.fire_due, term, entry, now)
        if len(due) == DUE_BATCH or len(unplanned) == BATCH:
            return 0.0  # more to do now: a minute boundary of many entries, or a big sync
        next_due = self.entries.next_due_ms()
        wait = ahead = self.options.renew_every
        if next_due is not None:
            ahead = max(0.0, (next_due - self._now()) / 1000.0)
            wait = min(wait, ahead)
        # Time to spare before the next slot: build the next slots' fires, a slice at a time
        # (a boundary is never kept waiting by more than one slice).
        spare = ahead > PREBUILD_S + PREBUILD_MARGIN_S
        # A slice well within the lease: the lease is renewed between slices (_lead).
        piece = min(PREBUILD_S, self.options.lease_seconds * BUILD_SHARE)
        if spare and self.prebuilder.fill(self._now(), piece):
            return 0.0
        return float(min(wait, self.max_interval))

    def _unplanned(self, firing: Firing, term: Term, entry: EntryRow, now: int) -> None:
        if entry.run_requested_at_ms is not None:
            firing.run_now(term, entry)
            entry = self.entries.require(entry.name)
        if entry.enabled and entry.next_run_at_ms is None:
            firing.plan_next(term, entry, now)

    def _ready(self, entry: EntryRow) -> bool:
        """Not waiting out a failed send (see _guarded)."""
        return self._ready_name(entry.name)

    def _ready_name(self, name: str) -> bool:
        return self._backoff.get(name, 0.0) <= time.monotonic()

    def _guarded(self, entry: EntryRow, work: Callable[..., Any], *args: Any) -> None:
        """Run one entry's work; a failure (a bad option, an unknown serializer) is logged
        and recorded on its timeline, and the entry waits RETRY_FAILED_S in this process."""
        if not self._ready(entry):
            return
        try:
            work(*args)
        except (LeadershipLost, DatabaseUnavailable):
            raise
        except Exception as error:
            logger.exception("sqlease beat: could not send %s (%s)", entry.name, entry.task)
            self._backoff[entry.name] = time.monotonic() + RETRY_FAILED_S
            if self.term is not None:
                with self.entries.firing(self.term, self.options.lease_ms) as conn:
                    data = {"error": f"{type(error).__name__}: {error}"}
                    self.entries.event(conn, entry.name, "fire_failed", data)
        else:
            self._backoff.pop(entry.name, None)

    def sync(self) -> None:
        pass  # every fire is written when it happens

    def close(self) -> None:
        """Give the lease up, so that a standby takes over at once."""
        term, self.term = self.term, None
        if term is not None and self._entries is not None:
            try:
                self._entries.release(term)
                logger.info("sqlease beat: %s gave up the leader lease", self._owner)
            except Exception:
                logger.warning("sqlease beat: could not release the leader lease", exc_info=True)
        super().close()

    @property
    def schedule(self) -> dict[str, beat.ScheduleEntry]:
        """The entries as Celery's ScheduleEntry objects (for introspection)."""
        from sqlease.schedules._specs import from_spec, loads

        found = {}
        for row in self.entries.all():
            found[row.name] = beat.ScheduleEntry(
                name=row.name,
                task=row.task,
                schedule=from_spec(row.name, row.schedule, self.app),
                args=tuple(loads(row.args)),
                kwargs=loads(row.kwargs),
                options=loads(row.options),
                total_run_count=row.total_run_count,
                app=self.app,
            )
        return found

    @schedule.setter
    def schedule(self, value: Any) -> None:
        pass  # Celery's __init__ sets self.data; the entries live in SQL

    @property
    def info(self) -> str:
        # Celery prints it from a lazy scheduler: no connection is made for it.
        url = _beat_url(self.app).render_as_string(hide_password=True)
        lease = beat_options(self.app).lease_seconds
        return f"    . sqlease -> {url} (leader lease {lease:g}s, owner {self._owner})"
