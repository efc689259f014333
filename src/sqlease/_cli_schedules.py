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

import argparse
import json
from collections.abc import Callable
from typing import Any

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


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser("schedules", parents=[common], help="periodic task entries")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", parents=[common], help="every entry: next and last run")
    verbs.add_parser("leader", parents=[common], help="the beat holding the leader lease")
    for verb, text in [
        ("show", "one entry and its timeline"),
        ("enable", "enable an entry"),
        ("disable", "disable an entry"),
        ("remove", "remove an entry"),
        ("run", "send an entry's task at the leader's next tick"),
    ]:
        verbs.add_parser(verb, parents=[common], help=text).add_argument("name")
    add = verbs.add_parser("add", parents=[common], help="add an entry at runtime")
    add.add_argument("name")
    add.add_argument("task")
    update = verbs.add_parser("update", parents=[common], help="change an entry")
    update.add_argument("name")
    update.add_argument("--task")
    for p in (add, update):
        p.add_argument("--every", type=float, help="an interval in seconds")
        p.add_argument("--crontab", help='five fields: "minute hour day month weekday"')
        p.add_argument("--args", help="positional arguments as a JSON list")
        p.add_argument("--kwargs", help="keyword arguments as a JSON object")
        p.add_argument("--options", help="apply_async options as a JSON object")
        p.add_argument("--queue", help="shorthand for options.queue")
        p.add_argument("--catch-up", choices=["once", "skip", "all"])
        p.add_argument("--catch-up-limit", type=int)
    add.add_argument("--disabled", action="store_true", help="add it disabled")


def _json(name: str, field: str, text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidSchedule(name, field, f"not JSON: {error}") from error


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key in ("args", "kwargs", "options"):
        value = _json(args.name, key, getattr(args, key))
        if value is not None:
            fields[key] = value
    if args.queue is not None:
        fields["options"] = dict(fields.get("options") or {}, queue=args.queue)
    if args.every is not None:
        fields["every"] = args.every
    if args.crontab is not None:
        fields["crontab"] = args.crontab
    if args.catch_up is not None:
        fields["catch_up"] = args.catch_up
    if args.catch_up_limit is not None:
        fields["catch_up_limit"] = args.catch_up_limit
    return fields


def _describe(entry: dict[str, Any]) -> str:
    lines = [
        f"{k}: {entry[k]}"
        for k in (*COLUMNS, "catch_up", "last_task_id", "args", "kwargs", "options")
        if k in entry
    ]
    if entry.get("events"):
        lines.append("events:")
        lines += [f"  {e['at']}  {e['kind']}  {json.dumps(e['data'])}" for e in entry["events"]]
    return "\n".join(lines)


def run(
    args: argparse.Namespace,
    admin: Any,
    out: Callable[..., None],
    table: Callable[[list[dict[str, Any]], list[str]], str],
) -> int:
    verb = args.verb
    if verb == "list":
        entries = admin.list_schedules()
        out(args, entries, table(entries, COLUMNS))
    elif verb == "leader":
        leader = admin.beat_leader()
        out(
            args,
            leader,
            "(no beat has led yet)"
            if leader is None
            else "\n".join(f"{k}: {v}" for k, v in leader.items() if k != "info")
            + (f"\nhost: {leader['info'].get('host')}" if leader["info"] else ""),
        )
    elif verb == "show":
        entry = admin.get_schedule(args.name)
        out(args, entry, _describe(entry))
    elif verb == "add":
        entry = admin.add_schedule(args.name, args.task, enabled=not args.disabled, **_fields(args))
        out(args, entry, f"added {args.name}: {entry['schedule']}")
    elif verb == "update":
        fields = _fields(args)
        if args.task is not None:
            fields["task"] = args.task
        entry = admin.update_schedule(args.name, **fields)
        out(args, entry, f"updated {args.name}: {entry['schedule']}")
    elif verb == "remove":
        admin.remove_schedule(args.name)
        out(args, {"removed": args.name}, f"removed {args.name}")
    elif verb == "run":
        admin.run_schedule(args.name)
        out(args, {"requested": args.name}, f"{args.name} runs at the leader's next tick")
    else:  # enable, disable
        entry = getattr(admin, f"{verb}_schedule")(args.name)
        out(args, entry, f"{verb}d {args.name}")
    return 0
