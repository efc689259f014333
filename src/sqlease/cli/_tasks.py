"""``sqlease status | tasks | show | pause | resume | cancel | requeue | input | approve |
reject | purge``: tasks and queues, through ``sqlease.Admin``."""

from __future__ import annotations

import json
from typing import Any

import click

from sqlease.cli import _render as r
from sqlease.cli._base import Failure, admin_of, common, out
from sqlease.cli._base import verb as verb_command

# ---- status ------------------------------------------------------------------------------

_STATUS_COLUMNS = (
    ("queued", "queued"),
    ("scheduled", "scheduled"),
    ("running", "running"),
    ("waiting_input", "input"),
    ("waiting_approval", "approval"),
    ("paused", "paused"),
    ("failed", "failed"),
    ("cancelled", "cancelled"),
)


def status_data(admin: Any) -> dict[str, Any]:
    """What ``status --json`` prints (keys documented in docs/reference/cli.md)."""
    now = admin.store.now_ms()
    queues, owners = admin.overview()
    totals = {state: sum(q[state] for q in queues.values()) for state, _ in _STATUS_COLUMNS}
    return {
        "at_ms": now,
        "queues": queues,
        "totals": totals,
        "leases": {"live": sum(o["leases"] for o in owners), "owners": owners},
    }


def _status_text(data: dict[str, Any]) -> str:
    now = data["at_ms"]
    queues = data["queues"]
    rows = [
        [name, *(q[key] for key, _ in _STATUS_COLUMNS), _age(q["oldest_ready_age_s"])]
        for name, q in queues.items()
    ]
    if queues:
        rows.append(["(all)", *(data["totals"][key] for key, _ in _STATUS_COLUMNS), ""])
    lines = [f"at {r.local(now)} (the database's clock)", "", f"Queues ({len(queues)})"]
    lines.append(r.table(rows, ["queue", *(h for _, h in _STATUS_COLUMNS), "oldest ready"]))
    if not queues:
        lines.append("no queue yet: a worker declares its queues when it starts")
    leases = data["leases"]
    lines += ["", f"Live leases: {leases['live']}"]
    if leases["owners"]:
        lines.append(
            r.table(
                [
                    [
                        o["owner"],
                        o["leases"],
                        ", ".join(f"{q} ({n})" for q, n in sorted(o["queues"].items())),
                        r.when(o["next_expiry_at_ms"], now),
                    ]
                    for o in leases["owners"]
                ],
                ["owner", "leases", "queues", "next lease expiry"],
            )
        )
    else:
        lines.append("no worker holds a task now")
    return "\n".join(lines)


def _age(seconds: float | None) -> str:
    return r.NONE if seconds is None else r.duration(seconds * 1000)


@verb_command(help="per queue: tasks in each state and the oldest ready; the live leases")
@common
@click.pass_context
def status(ctx: click.Context) -> None:
    data = status_data(admin_of(ctx))
    out(ctx, data, lambda: _status_text(data))


# ---- tasks and show ------------------------------------------------------------------------


def _state(task: dict[str, Any]) -> str:
    """The state, with its reason when that says more (``failed (attempts_exhausted)``)."""
    reason = task.get("reason")
    state = str(task["state"])
    return state + (f" ({reason})" if reason and reason != state else "")


def _attempt(task: dict[str, Any]) -> str:
    if task.get("max_attempts"):
        return f"{task['attempt']}/{task['max_attempts']}"
    return str(task.get("attempt", 0))


def _took(task: dict[str, Any]) -> str:
    if task.get("finished_at_ms") is None or task.get("created_at_ms") is None:
        return r.NONE
    return r.duration(task["finished_at_ms"] - task["created_at_ms"])


def _tasks_text(found: list[dict[str, Any]], now: int) -> str:
    rows = [
        [
            t["task_id"],
            t.get("task_name"),
            _state(t),
            _attempt(t),
            t.get("queue"),
            r.when(t.get("created_at_ms"), now),
            _took(t),
            t.get("run_id"),
            r.short(t.get("last_error"), 40) if t.get("last_error") else None,
        ]
        for t in found
    ]
    headers = ["task_id", "task", "state", "attempt", "queue", "created", "took", "run", "error"]
    text = r.table(rows, headers)
    return text + ("" if found else "\nno task matches")


@verb_command(help="list tasks, newest first")
@click.option("--state", help="one of the task states (queued … cancelled)")
@click.option("--queue")
@click.option("--run", "run_id", help="the tasks of one run")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option(
    "--before", help="with no filter: the page after this cursor (the last page printed it)"
)
@common
@click.pass_context
def tasks(
    ctx: click.Context,
    state: str | None,
    queue: str | None,
    run_id: str | None,
    limit: int,
    before: str | None,
) -> None:
    admin = admin_of(ctx)
    listed = admin.tasks(state=state, queue=queue, run_id=run_id, limit=limit, before=before)
    found = [t.to_dict() for t in listed]
    now = admin.store.now_ms()
    paged = state is None and queue is None and run_id is None and len(found) == limit

    def text() -> str:
        page = _tasks_text(found, now)
        if paged:
            last = found[-1]
            page += f"\nnext page: --before {last['created_at_ms']}:{last['task_id']}"
        return page

    out(ctx, found, text)


def _show_text(snap: dict[str, Any], now: int) -> str:
    fields: list[tuple[str, Any]] = [
        ("task", snap.get("task_name")),
        ("state", _state(snap)),
        ("attempt", _attempt(snap)),
        ("queue", snap.get("queue")),
        ("run", snap.get("run_id")),
        ("created", r.when(snap.get("created_at_ms"), now)),
    ]
    if snap.get("finished_at_ms") is not None:
        fields.append(("finished", f"{r.when(snap['finished_at_ms'], now)}, took {_took(snap)}"))
    if snap.get("lease_owner"):
        fields.append(("held by", snap["lease_owner"]))
        fields.append(("lease expires", r.when(snap.get("lease_expires_at_ms"), now)))
    if snap["state"] == "scheduled":
        fields.append(("due", r.when(snap.get("available_at_ms"), now)))
    if snap.get("result_state"):
        fields.append(("result", snap["result_state"]))
    if snap.get("last_error"):
        fields.append(("last error", r.short(snap["last_error"], 200)))
    if snap.get("waiting"):
        wait = snap["waiting"]
        fields.append(("waiting for", f"{wait['kind']} since {r.when(wait['since_ms'], now)}"))
    if snap.get("progress"):
        progress = snap["progress"]
        fields.append(("progress", f"{progress.get('done')}/{progress.get('total')}"))
    if snap.get("checkpoint"):
        fields.append(("checkpoint", r.short(json.dumps(snap["checkpoint"], default=str), 200)))
    width = max(len(k) for k, _ in fields)
    lines = [snap["task_id"]] + [
        f"  {k.ljust(width)}  {r.NONE if v is None else v}" for k, v in fields
    ]
    if snap["steps"]:
        lines += ["", "steps:"]
        lines += [
            f"  {s['name']}: {s['status']} (attempt {s['attempt']})"
            + (f": {r.short(s['error'], 80)}" if s.get("error") else "")
            for s in snap["steps"]
        ]
    lines += ["", "timeline:", *r.timeline(snap["events"])]
    return "\n".join(lines)


@verb_command(help="one task with its timeline")
@click.argument("task_id")
@common
@click.pass_context
def show(ctx: click.Context, task_id: str) -> None:
    admin = admin_of(ctx)
    snap = admin.task(task_id).to_dict()
    now = admin.store.now_ms()
    out(ctx, snap, lambda: _show_text(snap, now))


# ---- steering ------------------------------------------------------------------------------


def _steer(
    ctx: click.Context, verb: str, task_id: str | None, run_id: str | None, **kw: Any
) -> None:
    if bool(task_id) == bool(run_id):
        raise Failure("give a TASK_ID or --run RUN_ID (not both)", code=2)
    count = getattr(admin_of(ctx), verb)(task_id, run_id=run_id, **kw)
    out(ctx, {verb: count}, f"{verb}: {count} task(s)")


def _steering(verb: str, text: str) -> click.Command:
    def run(ctx: click.Context, /, task_id: str | None, run_id: str | None, **kw: Any) -> None:
        _steer(ctx, verb, task_id, run_id, **kw)

    command = click.pass_context(run)
    command = common(command)
    if verb == "cancel":
        command = click.option("--reason", default="cancelled", show_default=True)(command)
    command = click.option("--run", "run_id", help="every task of a run")(command)
    command = click.argument("task_id", required=False)(command)
    return verb_command(verb, help=text)(command)


pause = _steering("pause", "hold a task or a whole run")
resume = _steering("resume", "make paused tasks claimable again")
cancel = _steering("cancel", "stop a task or a whole run for good")


@verb_command(help="make a failed/cancelled/parked task claimable again")
@click.argument("task_id")
@click.option("--max-attempts", type=int, help="deliveries allowed from now (default 3)")
@common
@click.pass_context
def requeue(ctx: click.Context, task_id: str, max_attempts: int | None) -> None:
    admin_of(ctx).requeue(task_id, max_attempts=max_attempts)
    out(ctx, {"requeued": task_id}, f"requeued {task_id}")


@verb_command("input", help="answer a task waiting for input")
@click.argument("task_id")
@click.argument("data")
@common
@click.pass_context
def give_input(ctx: click.Context, task_id: str, data: str) -> None:
    text = data
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as handle:
                text = handle.read()
        except OSError as error:
            raise Failure(f"cannot read {text[1:]}: {error.strerror}", code=2) from None
    try:
        answer = json.loads(text)
    except ValueError as exc:
        raise Failure(f"the answer is not valid JSON: {exc}", code=2) from None
    admin_of(ctx).provide_input(task_id, answer)
    out(ctx, {"answered": task_id}, f"input given to {task_id}")


@verb_command(help="approve a waiting task")
@click.argument("task_id")
@click.option("--note")
@common
@click.pass_context
def approve(ctx: click.Context, task_id: str, note: str | None) -> None:
    admin_of(ctx).approve(task_id, note)
    out(ctx, {"approved": task_id}, f"approved {task_id}")


@verb_command(help="reject a waiting task")
@click.argument("task_id")
@click.option("--reason", required=True)
@common
@click.pass_context
def reject(ctx: click.Context, task_id: str, reason: str) -> None:
    admin_of(ctx).reject(task_id, reason)
    out(ctx, {"rejected": task_id}, f"rejected {task_id}")


@verb_command(help="delete a queue's undelivered tasks")
@click.argument("queue")
@common
@click.pass_context
def purge(ctx: click.Context, queue: str) -> None:
    count = admin_of(ctx).purge(queue)
    out(ctx, {"purged": count}, f"purged {count} task(s) from {queue}")


COMMANDS = [
    status,
    tasks,
    show,
    pause,
    resume,
    cancel,
    requeue,
    give_input,
    approve,
    reject,
    purge,
]
