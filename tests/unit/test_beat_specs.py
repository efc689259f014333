"""The schedule logic of sqlease's beat against a fake clock: slots from Celery's own
arithmetic (intervals, crontab boundaries, DST), the catch-up policies, entry checks."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar

from sqlease.errors import InvalidSchedule
from sqlease.schedules._specs import (
    MAX_STEPS,
    entry_spec,
    from_spec,
    next_slot,
    parse_crontab,
    plan,
    to_spec,
)


def ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def at(ms_: int, tz: str = "UTC") -> datetime:
    return datetime.fromtimestamp(ms_ / 1000, tz=UTC).astimezone(ZoneInfo(tz))


def app_in(tz: str, *, enable_utc: bool = True) -> Celery:
    app = Celery("t", set_as_current=False)
    app.conf.timezone = tz
    app.conf.enable_utc = enable_utc
    return app


def test_an_interval_slot_follows_the_previous_slot_not_the_clock() -> None:
    app = app_in("UTC")
    sched = from_spec("e", to_spec("e", 30), app)
    start = ms(datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC))
    assert next_slot(sched, start, app) == start + 30_000
    assert next_slot(sched, start + 30_000, app) == start + 60_000
    assert to_spec("e", timedelta(minutes=2)) == {
        "kind": "interval",
        "seconds": 120.0,
        "relative": False,
    }


def test_crontab_boundaries_minute_hour_day_month() -> None:
    app = app_in("UTC")
    every5 = from_spec("e", to_spec("e", crontab(minute="*/5")), app)
    t = ms(datetime(2026, 1, 1, 12, 3, 17, tzinfo=UTC))
    assert at(next_slot(every5, t, app)) == datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
    on_slot = ms(datetime(2026, 1, 1, 12, 5, tzinfo=UTC))
    assert at(next_slot(every5, on_slot, app)) == datetime(2026, 1, 1, 12, 10, tzinfo=UTC)
    hourly_end = ms(datetime(2026, 1, 1, 23, 55, tzinfo=UTC))
    assert at(next_slot(every5, hourly_end, app)) == datetime(2026, 1, 2, 0, 0, tzinfo=UTC)
    monthly = from_spec("m", to_spec("m", crontab(minute=0, hour=0, day_of_month=31)), app)
    feb = ms(datetime(2026, 1, 31, 0, 0, tzinfo=UTC))
    # February has no 31st: the next slot is in March, as Celery computes it.
    assert at(next_slot(monthly, feb, app)) == datetime(2026, 3, 31, 0, 0, tzinfo=UTC)
    new_year = from_spec("y", to_spec("y", crontab(0, 0, day_of_month=1, month_of_year=1)), app)
    assert at(next_slot(new_year, feb, app)) == datetime(2027, 1, 1, tzinfo=UTC)


def test_a_daily_crontab_stays_at_local_time_across_a_dst_change() -> None:
    app = app_in("Europe/Berlin")
    nine = from_spec("d", to_spec("d", crontab(minute=0, hour=9)), app)
    berlin = ZoneInfo("Europe/Berlin")
    # Summer time starts on 2026-03-29 (02:00 -> 03:00): 9:00 local is 08:00 UTC before,
    # 07:00 UTC after.
    before = ms(datetime(2026, 3, 28, 9, 0, tzinfo=berlin))
    slot = next_slot(nine, before, app)
    assert at(slot, "Europe/Berlin").replace(tzinfo=None) == datetime(2026, 3, 29, 9, 0)
    assert slot - before == 23 * 3600 * 1000  # a 23-hour day
    autumn = ms(datetime(2026, 10, 24, 9, 0, tzinfo=berlin))
    slot = next_slot(nine, autumn, app)
    assert at(slot, "Europe/Berlin").replace(tzinfo=None) == datetime(2026, 10, 25, 9, 0)
    assert slot - autumn == 25 * 3600 * 1000


def test_a_slot_in_the_hour_that_does_not_exist_fires_once_that_day() -> None:
    app = app_in("Europe/Berlin")
    half_past_two = from_spec("n", to_spec("n", crontab(minute=30, hour=2)), app)
    berlin = ZoneInfo("Europe/Berlin")
    slot = ms(datetime(2026, 3, 28, 2, 30, tzinfo=berlin))
    slots = []
    for _ in range(3):
        slot = next_slot(half_past_two, slot, app)
        slots.append(slot)
    assert all(b > a for a, b in itertools.pairwise(slots))
    days = [at(s, "Europe/Berlin").date() for s in slots]
    assert len(set(days)) == 3  # one a day, none twice, none lost


def test_enable_utc_false_keeps_the_timezone_setting() -> None:
    app = app_in("America/New_York", enable_utc=False)
    t = ms(datetime(2026, 6, 1, 0, 0, tzinfo=UTC))
    sched = from_spec("d", to_spec("d", crontab(minute=0, hour=6)), app)
    assert at(next_slot(sched, t, app)) == datetime(2026, 6, 1, 10, 0, tzinfo=UTC)


def test_the_timezone_setting_decides_what_a_crontab_hour_means() -> None:
    t = ms(datetime(2026, 6, 1, 0, 0, tzinfo=UTC))
    utc_app, ny_app = app_in("UTC"), app_in("America/New_York")
    spec = to_spec("d", crontab(minute=0, hour=6))
    utc_slot = next_slot(from_spec("d", spec, utc_app), t, utc_app)
    ny_slot = next_slot(from_spec("d", spec, ny_app), t, ny_app)
    assert at(utc_slot) == datetime(2026, 6, 1, 6, 0, tzinfo=UTC)
    assert at(ny_slot) == datetime(2026, 6, 1, 10, 0, tzinfo=UTC)  # 06:00 EDT


def test_catch_up_policies() -> None:
    app = app_in("UTC")
    sched = from_spec("e", to_spec("e", 60), app)
    first = ms(datetime(2026, 1, 1, 12, 0, tzinfo=UTC))
    now = first + 10 * 60_000 + 5_000  # ten minutes of downtime: 11 slots came
    once = plan(sched, first, now, app, catch_up="once", limit=100, grace_ms=60_000)
    assert once.fire == [first + 600_000] and once.skipped == 10
    assert once.next_ms == first + 660_000
    skip = plan(sched, first, now, app, catch_up="skip", limit=100, grace_ms=60_000)
    assert skip.fire == [first + 600_000]  # the latest is 5 s late: on time
    skip_late = plan(sched, first, now, app, catch_up="skip", limit=100, grace_ms=1_000)
    assert skip_late.fire == [] and skip_late.skipped == 11
    every = plan(sched, first, now, app, catch_up="all", limit=100, grace_ms=0)
    assert every.fire == [first + i * 60_000 for i in range(11)] and every.skipped == 0
    capped = plan(sched, first, now, app, catch_up="all", limit=3, grace_ms=0)
    assert capped.fire == [first + i * 60_000 for i in (8, 9, 10)] and capped.skipped == 8
    on_time = plan(sched, first, first + 10, app, catch_up="skip", limit=1, grace_ms=0)
    assert on_time.fire == [] and on_time.skipped == 1  # 10 ms past a zero grace


def test_a_very_long_downtime_is_bounded() -> None:
    app = app_in("UTC")
    sched = from_spec("e", to_spec("e", 1), app)
    first = ms(datetime(2026, 1, 1, tzinfo=UTC))
    now = first + 3 * 86_400_000
    p = plan(sched, first, now, app, catch_up="once", limit=1, grace_ms=0)
    assert p.more and len(p.due) == MAX_STEPS and p.next_ms > now
    assert p.skipped == MAX_STEPS - 1


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"schedule": 10}, "task"),
        ({"task": "", "schedule": 10}, "task"),
        ({"task": "t"}, "schedule"),
        ({"task": "t", "schedule": -5}, "schedule"),
        ({"task": "t", "schedule": 0}, "schedule"),
        ({"task": "t", "schedule": "often"}, "schedule"),
        ({"task": "t", "schedule": 10, "args": "x"}, "args"),
        ({"task": "t", "schedule": 10, "kwargs": [1]}, "kwargs"),
        ({"task": "t", "schedule": 10, "catch_up": "sometimes"}, "catch_up"),
        ({"task": "t", "schedule": 10, "catch_up_limit": 0}, "catch_up_limit"),
        ({"task": "t", "schedule": 10, "catch_up_limit": 2**31}, "catch_up_limit"),
        ({"task": "t", "schedule": 10, "enabled": "yes"}, "enabled"),
        ({"task": "t", "schedule": 10, "options": {"priority": 300}}, "options.priority"),
        ({"task": "t", "schedule": 10, "options": {"queue": 5}}, "options.queue"),
        ({"task": "t", "schedule": 10, "options": {"expires": -1}}, "options.expires"),
        ({"task": "t", "schedule": 10, "args": [object()]}, "args"),
        ({"task": "t", "schedule": 10, "colour": "red"}, "colour"),
    ],
)
def test_a_bad_entry_names_its_field(entry: dict, field: str) -> None:
    with pytest.raises(InvalidSchedule) as raised:
        entry_spec("nightly", entry)
    assert raised.value.field == field
    assert "nightly" in str(raised.value) and field in str(raised.value)


@pytest.mark.parametrize(
    ("name", "problem"),
    [("é" * 501, "1002 bytes of UTF-8, over 1000"), ("night\x00ly", "a NUL character")],
)
def test_an_entry_name_the_database_cannot_store_is_refused(name: str, problem: str) -> None:
    """An entry's name is the key of its row and of its timeline: PostgreSQL's index entries
    hold at most 2704 bytes and its text no NUL (SQLite took both)."""
    with pytest.raises(InvalidSchedule) as raised:
        entry_spec(name, {"task": "t", "schedule": 10})
    assert raised.value.field == "name" and problem in str(raised.value)


@pytest.mark.parametrize(
    "text", ["61 * * * *", "* 25 * * *", "* * * *", "*/0 * * * *", "a b c d e"]
)
def test_a_bad_crontab_field_is_refused(text: str) -> None:
    with pytest.raises(InvalidSchedule) as raised:
        parse_crontab("c", text)
    assert raised.value.field == "schedule"


def test_a_crontab_round_trips_through_its_spec() -> None:
    spec = parse_crontab("c", "*/15 9-17 * * mon-fri")
    made = from_spec("c", spec)
    assert made == crontab(minute="*/15", hour="9-17", day_of_week="mon-fri")
    assert to_spec("c", made) == spec


def test_solar_slots_follow_the_sun_and_unsupported_schedules_are_refused() -> None:
    pytest.importorskip("ephem")  # the test extra installs it
    app = app_in("Europe/Berlin")
    spec = to_spec("s", solar("sunset", 48.14, 11.58))
    assert spec == {"kind": "solar", "event": "sunset", "lat": 48.14, "lon": 11.58}
    sunset = from_spec("s", spec, app)
    first = next_slot(sunset, ms(datetime(2026, 6, 1, tzinfo=UTC)), app)
    second = next_slot(sunset, first, app)
    # Munich's sunset on 1 and 2 June 2026: about 21:05 local time (19:05 UTC).
    assert abs(first - ms(datetime(2026, 6, 1, 19, 5, 36, tzinfo=UTC))) < 60_000
    assert 86_000_000 < second - first < 86_800_000

    class Custom(schedule):
        pass

    with pytest.raises(InvalidSchedule, match="not supported"):
        to_spec("x", Custom(10))


def test_slots_a_takeover_delayed_fire_under_every_policy() -> None:
    app = app_in("UTC")
    sched = from_spec("e", to_spec("e", 1), app)
    now = ms(datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC))
    first = now - 2_500  # the leader died; a standby took over 2.5 s of slots later
    for policy in ("skip", "once", "all"):
        p = plan(sched, first, now, app, catch_up=policy, limit=1, grace_ms=4_000)
        assert p.fire == [first, first + 1_000, first + 2_000], policy
        assert p.skipped == 0 and p.next_ms == first + 3_000
