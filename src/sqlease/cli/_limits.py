"""``sqlease limits …``: flow control on the command line.

sqlease limits show                        every gate: running, limit, waiting; every rate
sqlease limits set NAME N                  a concurrency limit (task:<name> or queue:<name>)
sqlease limits rate NAME RATE              a rate limit ("100/m"; task:, queue: or key:)
sqlease limits remove NAME                 drop both limits of NAME
sqlease limits unique KEY                  a unique task's key: its holder, duplicates
"""

from __future__ import annotations

from typing import Any

import click

from sqlease.cli import _render as r
from sqlease.cli._base import VerbGroup, admin_of, common, out


def _show_text(gates: list[dict[str, Any]], rates: dict[str, dict[str, Any]], now: int) -> str:
    if not gates and not rates:
        return "no concurrency or rate limits, and no task waits for one"
    parts = []
    if gates:
        rows = [
            [g["gate"], g["running"], g["limit"], g["waiting"], "full" if g["full"] else ""]
            for g in gates
        ]
        parts.append(r.table(rows, ["gate", "running", "limit", "waiting", ""]))
    if rates:
        rows = [
            [name, v["rate"], r.duration(v["interval_ms"]), r.when(v["next_at_ms"], now)]
            for name, v in rates.items()
        ]
        parts.append(r.table(rows, ["rate limit", "rate", "interval", "next delivery"]))
    return "\n\n".join(parts)


@click.group(cls=VerbGroup, help="concurrency and rate limits")
@common
def limits() -> None:
    pass


@limits.command("show", help="every gate (running, limit, waiting) and every rate limit")
@common
@click.pass_context
def show(ctx: click.Context) -> None:
    admin = admin_of(ctx)
    gates = [g.to_dict() for g in admin.gates()]
    rates = admin.rate_limits()
    now = admin.store.now_ms()
    out(ctx, {"gates": gates, "rates": rates}, lambda: _show_text(gates, rates, now))


@limits.command("set", help="a concurrency limit: NAME is task:<task name> or queue:<queue>")
@click.argument("name")
@click.argument("limit", type=int)
@common
@click.pass_context
def set_limit(ctx: click.Context, name: str, limit: int) -> None:
    admin_of(ctx).set_limits({name: limit})
    out(ctx, {"name": name, "concurrency": limit}, f"{name}: at most {limit} at once")


@limits.command("rate", help="a rate limit such as 100/m: NAME is task:, queue: or key:")
@click.argument("name")
@click.argument("rate")
@common
@click.pass_context
def set_rate(ctx: click.Context, name: str, rate: str) -> None:
    admin_of(ctx).set_rate_limits({name: rate})
    out(ctx, {"name": name, "rate": rate}, f"{name}: at most {rate}")


@limits.command("remove", help="drop the concurrency and the rate limit of NAME")
@click.argument("name")
@common
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    removed = admin_of(ctx).remove_limit(name)
    out(
        ctx,
        {"removed": removed, "name": name},
        f"removed {name}" if removed else f"no limit {name}",
    )


@limits.command("unique", help="a unique task's key: the task holding it and its duplicates")
@click.argument("key")
@common
@click.pass_context
def unique(ctx: click.Context, key: str) -> None:
    admin = admin_of(ctx)
    state = admin.unique(key)
    if state is None:
        out(ctx, {"key": key, "taken": False}, f"no task has taken the unique key {key!r}")
        return
    now = admin.store.now_ms()
    held = "holds" if state.holding else "no longer holds"
    lines = [
        f"{key}: {held} (scope {state.scope})",
        f"task: {state.task_id}, taken {r.when(state.created_at_ms, now)}",
        f"duplicates turned away: {state.duplicates}",
    ]
    if state.until_ms is not None:
        lines.insert(2, f"until: {r.when(state.until_ms, now)}")
    out(ctx, {"taken": True, **state.to_dict()}, "\n".join(lines))


COMMANDS = [limits]
