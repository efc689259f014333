"""Celery's schedules as stored JSON, entries checked field by field, and the next slot.

The arithmetic is Celery's own (``celery.schedules``: intervals, crontabs, solar events, the
app's ``timezone`` and ``enable_utc``, DST as Celery handles it); sqlease only asks it, for a
slot, which slot comes next. A slot is epoch milliseconds. ``next_slot`` runs the schedule with
its clock set to the slot, so the answer depends on the slot alone: every beat process, and a
takeover, computes the same next slot, which a compare-and-set can then check.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule, solar
from kombu.entity import Queue
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from sqlease._core.names import MAX_INT, check_id, is_count
from sqlease.errors import ConfigurationError, InvalidSchedule

CATCH_UP = ("skip", "once", "all")
#: Keys an entry of ``beat_schedule`` (or an Admin add) may have. ``catch_up``,
#: ``catch_up_limit`` and ``enabled`` are sqlease's; the rest are Celery's.
ENTRY_KEYS = frozenset(
    {"task", "schedule", "args", "kwargs", "options", "relative", "enabled"}
    | {"catch_up", "catch_up_limit"}
)
#: A slot after which the next one is not found within this many tries is given up on.
MAX_STEPS = 10_000


def _bad(name: str, field_name: str, problem: str) -> InvalidSchedule:
    return InvalidSchedule(name, field_name, problem)


# ---- schedules <-> JSON -------------------------------------------------------------------


def to_spec(name: str, value: Any, *, relative: bool = False) -> dict[str, Any]:
    """The JSON form of an entry's ``schedule``: seconds, a timedelta or a Celery schedule."""
    if isinstance(value, bool):
        raise _bad(name, "schedule", f"expected seconds or a celery schedule, not {value!r}")
    if isinstance(value, numbers.Real | timedelta):
        value = schedule(value, relative=relative)
    if isinstance(value, crontab):
        spec: dict[str, Any] = {"kind": "crontab"}
        for key in ("minute", "hour", "day_of_week", "day_of_month", "month_of_year"):
            spec[key] = str(getattr(value, f"_orig_{key}"))
        return spec
    if isinstance(value, solar):
        return {"kind": "solar", "event": value.event, "lat": value.lat, "lon": value.lon}
    if type(value) is schedule:
        seconds = value.run_every.total_seconds()
        if seconds <= 0:
            raise _bad(name, "schedule", f"an interval must be positive, not {seconds:g} s")
        return {"kind": "interval", "seconds": seconds, "relative": bool(value.relative)}
    raise _bad(
        name,
        "schedule",
        f"{type(value).__name__} is not supported: use seconds, a timedelta, "
        "celery.schedules.schedule, crontab or solar",
    )


def from_spec(name: str, spec: Mapping[str, Any], app: Celery | None = None) -> BaseSchedule:
    """The Celery schedule a stored spec stands for (bound to ``app`` for its timezone)."""
    kind = spec.get("kind")
    try:
        if kind == "interval":
            seconds = float(spec["seconds"])
            if seconds <= 0:
                raise ValueError(f"an interval must be positive, not {seconds:g} s")
            made: BaseSchedule = schedule(
                timedelta(seconds=seconds), relative=bool(spec.get("relative")), app=app
            )
        elif kind == "crontab":
            made = crontab(
                minute=spec.get("minute", "*"),
                hour=spec.get("hour", "*"),
                day_of_week=spec.get("day_of_week", "*"),
                day_of_month=spec.get("day_of_month", "*"),
                month_of_year=spec.get("month_of_year", "*"),
                app=app,
            )
        elif kind == "solar":
            made = solar(spec["event"], float(spec["lat"]), float(spec["lon"]), app=app)
        else:
            raise ValueError(f"unknown kind {kind!r} (interval, crontab or solar)")
    except InvalidSchedule:
        raise
    except ImportError as error:  # solar needs the ephem package
        raise _bad(
            name, "schedule", f"{error} (solar schedules need: pip install ephem)"
        ) from error
    except (KeyError, TypeError, ValueError) as error:
        raise _bad(name, "schedule", str(error) or type(error).__name__) from error
    except Exception as error:  # crontab's ParseException and friends
        raise _bad(name, "schedule", f"{type(error).__name__}: {error}") from error
    return made


def describe(spec: Mapping[str, Any]) -> str:
    """A short human form: ``every 30s``, ``crontab */5 * * * *``, ``solar sunset 48.1,11.6``."""
    kind = spec.get("kind")
    if kind == "interval":
        return f"every {float(spec['seconds']):g}s"
    if kind == "crontab":
        fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        return "crontab " + " ".join(str(spec.get(f, "*")) for f in fields)
    if kind == "solar":
        return f"solar {spec['event']} {spec['lat']},{spec['lon']}"
    return str(kind)


def parse_crontab(name: str, text: str) -> dict[str, Any]:
    """``"*/5 * * * *"`` (minute hour day-of-month month day-of-week) as a spec."""
    parts = text.split()
    if len(parts) != 5:
        raise _bad(name, "schedule", f"a crontab has 5 fields, {text!r} has {len(parts)}")
    minute, hour, day_of_month, month_of_year, day_of_week = parts
    spec = {
        "kind": "crontab",
        "minute": minute,
        "hour": hour,
        "day_of_week": day_of_week,
        "day_of_month": day_of_month,
        "month_of_year": month_of_year,
    }
    from_spec(name, spec)  # checks every field
    return spec


# ---- the next slot ----------------------------------------------------------------------


def _aware(ms: int, app: Celery) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC).astimezone(app.timezone)


def next_slot(sched: BaseSchedule, after_ms: int, app: Celery) -> int:
    """The first slot of ``sched`` after ``after_ms`` (Celery's arithmetic, its clock set to
    ``after_ms`` so the answer is the same wherever and whenever it is asked)."""
    after = _aware(after_ms, app)
    saved = sched.nowfun
    sched.nowfun = lambda: after
    try:
        remaining = sched.remaining_estimate(after)
    finally:
        sched.nowfun = saved
    slot = after_ms + round(remaining.total_seconds() * 1000)
    # A schedule that answers "now" (or earlier) for its own slot would fire in a loop.
    return slot if slot > after_ms else after_ms + 1000


@dataclass(frozen=True)
class Plan:
    """What a tick does with one due entry."""

    #: Slots to fire, oldest first (each in its own transaction).
    fire: list[int]
    #: Slots that came and are not fired (the catch-up policy).
    skipped: int
    #: The entry's next slot once these are done: the first after now.
    next_ms: int
    #: More slots came than were counted (MAX_STEPS): ``skipped`` is a lower bound.
    more: bool = False
    due: list[int] = field(default_factory=list)


def plan(
    sched: BaseSchedule,
    first_ms: int,
    now_ms: int,
    app: Celery,
    *,
    catch_up: str,
    limit: int,
    grace_ms: int,
) -> Plan:
    """The slots from ``first_ms`` (due) to ``now_ms``, and which of them fire.

    A slot at most ``grace_ms`` late is on time and always fires (a takeover delays slots by
    up to a lease; it must not lose them). Older slots were missed (no beat ran), and the
    policy decides:

    - ``once`` (Celery's own behaviour): the latest missed slot, unless an on-time slot
      fires anyway;
    - ``skip``: none;
    - ``all``: every missed slot, oldest first, the latest ``limit`` of them at most.
    """
    due = [first_ms]
    slot = next_slot(sched, first_ms, app)
    more = False
    while slot <= now_ms:
        if len(due) >= MAX_STEPS:
            more = True
            slot = next_slot(sched, now_ms, app)
            break
        due.append(slot)
        slot = next_slot(sched, slot, app)
    on_time = [s for s in due if now_ms - s <= grace_ms]
    missed = due[: len(due) - len(on_time)]
    if catch_up == "all":
        fire = missed[-max(1, limit) :] + on_time
    elif catch_up == "once" and missed and not on_time:
        fire = [missed[-1]]
    else:
        fire = on_time
    return Plan(fire, len(due) - len(fire), slot, more, due)


# ---- entries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EntrySpec:
    """A checked entry, ready to store."""

    name: str
    task: str
    schedule: dict[str, Any]
    args: str
    kwargs: str
    options: str
    enabled: bool
    catch_up: str
    catch_up_limit: int

    def columns(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "schedule": self.schedule,
            "args": self.args,
            "kwargs": self.kwargs,
            "options": self.options,
            "enabled": self.enabled,
            "catch_up": self.catch_up,
            "catch_up_limit": self.catch_up_limit,
        }

    def digest(self) -> str:
        """Changes when anything the config says about the entry changes."""
        body = json.dumps(self.columns(), sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


def _json_field(name: str, field_name: str, value: Any) -> str:
    try:
        return str(kombu_dumps(value))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as error:
        raise _bad(
            name, field_name, f"cannot be stored as JSON ({error}); use plain values"
        ) from error


def _options(name: str, options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise _bad(name, "options", f"expected a dict, not {type(options).__name__}")
    out = dict(options)
    if isinstance(out.get("queue"), Queue):  # stored by name; routing finds the rest
        out["queue"] = out["queue"].name
    for key in ("queue", "routing_key", "exchange"):
        if key in out and out[key] is not None and not isinstance(out[key], str):
            raise _bad(name, f"options.{key}", f"expected a string, not {out[key]!r}")
    priority = out.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        raise _bad(name, "options.priority", f"expected an integer 0-255, not {priority!r}")
    expires = out.get("expires")
    if expires is not None and not isinstance(expires, numbers.Real | datetime):
        raise _bad(name, "options.expires", f"expected seconds or a datetime, not {expires!r}")
    if isinstance(expires, numbers.Real) and expires <= 0:
        raise _bad(name, "options.expires", f"must be positive, not {expires!r}")
    headers = out.get("headers")
    if headers is not None and not isinstance(headers, Mapping):
        raise _bad(name, "options.headers", f"expected a dict, not {type(headers).__name__}")
    return out


def entry_spec(name: Any, entry: Mapping[str, Any]) -> EntrySpec:
    """Check one entry (``beat_schedule``'s form) field by field."""
    if not isinstance(name, str) or not name.strip():
        raise _bad(str(name), "name", "expected a non-empty string")
    try:
        check_id("entry name", name)  # the entries' key, and its timeline's ("schedule:<name>")
    except ConfigurationError as error:
        raise _bad(name[:40] + "...", "name", str(error)) from None
    if not isinstance(entry, Mapping):
        raise _bad(name, "entry", f"expected a dict, not {type(entry).__name__}")
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        allowed = ", ".join(sorted(ENTRY_KEYS))
        raise _bad(name, sorted(unknown)[0], f"unknown key (allowed: {allowed})")
    task = entry.get("task")
    if not isinstance(task, str) or not task:
        raise _bad(name, "task", f"expected a task name, not {task!r}")
    if "schedule" not in entry:
        raise _bad(name, "schedule", "missing")
    spec = to_spec(name, entry["schedule"], relative=bool(entry.get("relative", False)))
    from_spec(name, spec)
    args = entry.get("args", ())
    if args is None:
        args = ()
    if not isinstance(args, list | tuple):
        raise _bad(name, "args", f"expected a list or tuple, not {type(args).__name__}")
    kwargs = entry.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise _bad(name, "kwargs", f"expected a dict, not {type(kwargs).__name__}")
    catch_up = entry.get("catch_up", "once")
    if catch_up not in CATCH_UP:
        raise _bad(name, "catch_up", f"expected one of {', '.join(CATCH_UP)}, not {catch_up!r}")
    limit = entry.get("catch_up_limit", 100)
    if not is_count(limit):
        raise _bad(
            name, "catch_up_limit", f"expected a positive integer up to {MAX_INT}, not {limit!r}"
        )
    enabled = entry.get("enabled", True)
    if not isinstance(enabled, bool):
        raise _bad(name, "enabled", f"expected True or False, not {enabled!r}")
    return EntrySpec(
        name=name,
        task=task,
        schedule=spec,
        args=_json_field(name, "args", list(args)),
        kwargs=_json_field(name, "kwargs", dict(kwargs)),
        options=_json_field(name, "options", _options(name, entry.get("options"))),
        enabled=enabled,
        catch_up=catch_up,
        catch_up_limit=limit,
    )


def loads(text: str) -> Any:
    """A stored args, kwargs or options column (kombu's JSON: datetimes and friends)."""
    return kombu_loads(text)  # type: ignore[no-untyped-call]
