"""``sqlease schedules …``: the periodic task verbs of ``sqlease.Admin`` on the command line.

sqlease schedules list
sqlease schedules show NAME
sqlease schedules add NAME TASK (--every SECONDS | --crontab "*/5 * * * *") [--args JSON]
                                [--kwargs JSON] [--options JSON] [--queue Q]
                                [--catch-up once|skip|all] [--disabled]
sqlease schedules update NAME [the same options]
sqlease schedules enable|disable|remove|run NAME
sqlease schedules leader
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from sqlease.cli import _render as r
from sqlease.cli._base import VerbGroup, admin_of, common, out
from sqlease.errors import InvalidSchedule

COLUMNS = [
    "name",
    "task",
    "schedule",
    "enabled",
    "next_run_at",
    "last_run_at",
    "last_state",
    "total_run_count",
    "source",
]


def _json(name: str, field: str, text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidSchedule(name, field, f"not JSON: {error}") from error


def _fields(name: str, given: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key in ("args", "kwargs", "options"):
        value = _json(name, key, given.get(key))
        if value is not None:
            fields[key] = value
    if given.get("queue") is not None:
        fields["options"] = dict(fields.get("options") or {}, queue=given["queue"])
    for key in ("every", "crontab", "catch_up", "catch_up_limit"):
        if given.get(key) is not None:
            fields[key] = given[key]
    return fields


def _ms(iso: Any) -> int | None:
    if not iso:
        return None
    return int(datetime.fromisoformat(str(iso)).timestamp() * 1000)


def _when(iso: Any, now: int) -> str:
    return r.when(_ms(iso), now)


def _list_text(entries: list[dict[str, Any]], now: int) -> str:
    rows = [
        [
            e["name"],
            e["task"],
            e["schedule"],
            "yes" if e["enabled"] else "no",
            _when(e.get("next_run_at"), now),
            _when(e.get("last_run_at"), now),
            e.get("last_state"),
            e.get("total_run_count"),
            e.get("source"),
        ]
        for e in entries
    ]
    headers = ["name", "task", "schedule", "enabled", "next run", "last run", "last state"]
    text = r.table(rows, [*headers, "runs", "source"])
    return text + ("" if entries else "\nno periodic task entry")


def _describe(entry: dict[str, Any], now: int) -> str:
    lines = []
    for k in (*COLUMNS, "catch_up", "last_task_id", "args", "kwargs", "options"):
        if k not in entry:
            continue
        value = entry[k]
        if k.endswith("_at"):
            value = _when(value, now)
        lines.append(f"{k}: {r.NONE if value is None else value}")
    if entry.get("events"):
        lines.append("events:")
        lines += [
            f"  {_when(e['at'], now)}  {e['kind']}  {json.dumps(e['data'])}"
            for e in entry["events"]
        ]
    return "\n".join(lines)


@click.group(cls=VerbGroup, help="periodic task entries")
@common
def schedules() -> None:
    pass


@schedules.command("list", help="every entry: next and last run")
@common
@click.pass_context
def list_entries(ctx: click.Context) -> None:
    admin = admin_of(ctx)
    entries = admin.list_schedules()
    now = admin.store.now_ms()
    out(ctx, entries, lambda: _list_text(entries, now))


@schedules.command(help="the beat holding the leader lease")
@common
@click.pass_context
def leader(ctx: click.Context) -> None:
    found = admin_of(ctx).beat_leader()
    out(
        ctx,
        found,
        "(no beat has led yet)"
        if found is None
        else "\n".join(f"{k}: {v}" for k, v in found.items() if k != "info")
        + (f"\nhost: {found['info'].get('host')}" if found["info"] else ""),
    )


@schedules.command(help="one entry and its timeline")
@click.argument("name")
@common
@click.pass_context
def show(ctx: click.Context, name: str) -> None:
    admin = admin_of(ctx)
    entry = admin.get_schedule(name)
    now = admin.store.now_ms()
    out(ctx, entry, lambda: _describe(entry, now))


def _entry_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option("--every", type=float, help="an interval in seconds"),
            click.option("--crontab", help='five fields: "minute hour day month weekday"'),
            click.option("--args", "args_json", help="positional arguments as a JSON list"),
            click.option("--kwargs", "kwargs_json", help="keyword arguments as a JSON object"),
            click.option("--options", "options_json", help="apply_async options as JSON"),
            click.option("--queue", help="shorthand for options.queue"),
            click.option("--catch-up", type=click.Choice(["once", "skip", "all"])),
            click.option("--catch-up-limit", type=int),
        ]
    ):
        command = decorator(command)
    return command


def _given(kw: dict[str, Any]) -> dict[str, Any]:
    return {
        "args": kw.get("args_json"),
        "kwargs": kw.get("kwargs_json"),
        "options": kw.get("options_json"),
        "queue": kw.get("queue"),
        "every": kw.get("every"),
        "crontab": kw.get("crontab"),
        "catch_up": kw.get("catch_up"),
        "catch_up_limit": kw.get("catch_up_limit"),
    }


@schedules.command(help="add an entry at runtime")
@click.argument("name")
@click.argument("task")
@_entry_options
@click.option("--disabled", is_flag=True, help="add it disabled")
@common
@click.pass_context
def add(ctx: click.Context, /, name: str, task: str, disabled: bool, **kw: Any) -> None:
    entry = admin_of(ctx).add_schedule(
        name, task, enabled=not disabled, **_fields(name, _given(kw))
    )
    out(ctx, entry, f"added {name}: {entry['schedule']}")


@schedules.command(help="change an entry")
@click.argument("name")
@click.option("--task", help="another task")
@_entry_options
@common
@click.pass_context
def update(ctx: click.Context, /, name: str, task: str | None, **kw: Any) -> None:
    fields = _fields(name, _given(kw))
    if task is not None:
        fields["task"] = task
    entry = admin_of(ctx).update_schedule(name, **fields)
    out(ctx, entry, f"updated {name}: {entry['schedule']}")


@schedules.command(help="remove an entry")
@click.argument("name")
@common
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    admin_of(ctx).remove_schedule(name)
    out(ctx, {"removed": name}, f"removed {name}")


@schedules.command(help="send an entry's task at the leader's next tick")
@click.argument("name")
@common
@click.pass_context
def run(ctx: click.Context, name: str) -> None:
    admin_of(ctx).run_schedule(name)
    out(ctx, {"requested": name}, f"{name} runs at the leader's next tick")


def _toggle(verb: str, text: str) -> None:
    @schedules.command(verb, help=text)
    @click.argument("name")
    @common
    @click.pass_context
    def toggle(ctx: click.Context, name: str) -> None:
        entry = getattr(admin_of(ctx), f"{verb}_schedule")(name)
        out(ctx, entry, f"{verb}d {name}")


_toggle("enable", "enable an entry")
_toggle("disable", "disable an entry")

COMMANDS = [schedules]
