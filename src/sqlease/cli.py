"""The ``sqlease`` command line: the verbs of ``sqlease.Admin``, plus ``migrate`` and ``demo``
(``schedules …``: sqlease._cli_schedules).

``sqlease --url sqlease+postgresql://… status`` (or set ``SQLEASE_URL``). Human-readable
tables by default, ``--json`` for scripts. Errors name what was wrong and exit with status 2
(usage) or 1 (the operation was refused).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqlease import _cli_schedules as schedules_cli
from sqlease.errors import SqleaseError


def _url(args: argparse.Namespace) -> str:
    url = args.url or os.environ.get("SQLEASE_URL")
    if not url:
        print("sqlease: give the database with --url or SQLEASE_URL", file=sys.stderr)
        raise SystemExit(2)
    return str(url)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[("-" if row.get(c) is None else str(row.get(c))) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    def options(suppress: bool) -> argparse.ArgumentParser:
        # The same options before or after the verb; after it they must not reset what was
        # given before it, hence SUPPRESS as their default there.
        def default(value: Any) -> Any:
            return argparse.SUPPRESS if suppress else value

        common = argparse.ArgumentParser(add_help=False)
        common.add_argument(
            "--url", default=default(None), help="database or broker URL (default: $SQLEASE_URL)"
        )
        common.add_argument(
            "--table-prefix", default=default(os.environ.get("SQLEASE_TABLE_PREFIX", "sqlease_"))
        )
        common.add_argument(
            "--json", action="store_true", default=default(False), help="machine-readable output"
        )
        return common

    common = options(suppress=True)
    parser = argparse.ArgumentParser(
        prog="sqlease", description="Durable Celery on SQL.", parents=[options(suppress=False)]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="kill a worker mid-task on SQLite and watch the task resume on another"
    )
    demo.add_argument("--dir", help="folder for the demo database (default: a temp folder)")
    sub.add_parser("migrate", parents=[common], help="create or upgrade sqlease's tables")
    sub.add_parser(
        "status",
        parents=[common],
        help="per queue: ready, scheduled, leased, waiting, paused, dead, oldest age",
    )
    tasks = sub.add_parser("tasks", parents=[common], help="list tasks")
    tasks.add_argument("--state")
    tasks.add_argument("--queue")
    tasks.add_argument("--run", dest="run_id")
    tasks.add_argument("--limit", type=int, default=50)
    show = sub.add_parser("show", parents=[common], help="one task with its timeline")
    show.add_argument("task_id")
    for verb in ("pause", "resume", "cancel"):
        p = sub.add_parser(verb, parents=[common], help=f"{verb} a task or a whole run")
        p.add_argument("task_id", nargs="?")
        p.add_argument("--run", dest="run_id")
        if verb == "cancel":
            p.add_argument("--reason", default="cancelled")
    requeue = sub.add_parser(
        "requeue", parents=[common], help="make a failed/cancelled/parked task claimable again"
    )
    requeue.add_argument("task_id")
    requeue.add_argument("--max-attempts", type=int)
    give = sub.add_parser("input", parents=[common], help="answer a task waiting for input")
    give.add_argument("task_id")
    give.add_argument("data", help="the answer as JSON (or @file.json)")
    approve = sub.add_parser("approve", parents=[common], help="approve a waiting task")
    approve.add_argument("task_id")
    approve.add_argument("--note")
    reject = sub.add_parser("reject", parents=[common], help="reject a waiting task")
    reject.add_argument("task_id")
    reject.add_argument("--reason", required=True)
    maintain = sub.add_parser("maintain", parents=[common], help="run one maintenance pass now")
    maintain.add_argument(
        "--retention-days",
        type=float,
        default=30.0,
        help="keep events of finished tasks this long (0: forever)",
    )
    grant = sub.add_parser(
        "grant",
        parents=[common],
        help="print (or --apply) the grants of a least-privilege worker role",
    )
    grant.add_argument("role")
    grant.add_argument("--schema", default="public")
    grant.add_argument("--apply", action="store_true", help="run them against --url")
    purge = sub.add_parser("purge", parents=[common], help="delete a queue's undelivered tasks")
    purge.add_argument("queue")
    schedules_cli.add_parser(sub, common)
    return parser


def _admin(args: argparse.Namespace) -> Any:
    from sqlease.admin import Admin

    return Admin(_url(args), table_prefix=args.table_prefix)


def _out(args: argparse.Namespace, data: Any, human: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else human)


def _demo(args: argparse.Namespace) -> int:
    from sqlease._demo import run

    return run(args.dir)


def _migrate(args: argparse.Namespace) -> int:
    from sqlease._db.engine import get_engine
    from sqlease._db.migrations import migrate as do_migrate
    from sqlease._db.tables import build_tables
    from sqlease.urls import strip_prefix

    version = do_migrate(get_engine(strip_prefix(_url(args))), build_tables(args.table_prefix))
    _out(args, {"schema_version": version}, f"schema at version {version}")
    return 0


def _grant(args: argparse.Namespace) -> int:
    from sqlalchemy import text as sql_text

    from sqlease._db.engine import get_engine
    from sqlease._db.roles import worker_grants
    from sqlease._db.tables import build_tables
    from sqlease.urls import strip_prefix

    statements = worker_grants(build_tables(args.table_prefix), args.role, schema=args.schema)
    if args.apply:
        with get_engine(strip_prefix(_url(args))).begin() as conn:
            for statement in statements:
                conn.execute(sql_text(statement))
    _out(args, statements, ";\n".join(statements) + ";")
    return 0


_STATUS_COLUMNS = [
    "queue",
    "ready",
    "scheduled",
    "leased",
    "waiting",
    "paused",
    "dead",
    "oldest_ready_age_s",
]
_TASK_COLUMNS = ["task_id", "state", "reason", "attempt", "queue", "run_id", "last_error"]
_SHOW_FIELDS = (
    "task_id",
    "state",
    "reason",
    "attempt",
    "max_attempts",
    "queue",
    "run_id",
    "lease_owner",
    "lease_expires_at_ms",
    "last_error",
    "result_state",
    "waiting",
)


def _status(args: argparse.Namespace, admin: Any) -> int:
    stats = admin.stats()
    rows = [{"queue": q, **v} for q, v in stats.items()]
    _out(args, stats, _table(rows, _STATUS_COLUMNS))
    return 0


def _tasks(args: argparse.Namespace, admin: Any) -> int:
    found = [
        t.to_dict()
        for t in admin.tasks(
            state=args.state, queue=args.queue, run_id=args.run_id, limit=args.limit
        )
    ]
    _out(args, found, _table(found, _TASK_COLUMNS))
    return 0


def _show(args: argparse.Namespace, admin: Any) -> int:
    snap = admin.task(args.task_id).to_dict()
    lines = [f"{k}: {snap[k]}" for k in _SHOW_FIELDS]
    lines.append(f"checkpoint: {json.dumps(snap['checkpoint'])}")
    for step in snap["steps"]:
        lines.append(f"step {step['name']}: {step['status']} (attempt {step['attempt']})")
    lines.append("events:")
    lines.append(_table(snap["events"], ["id", "kind", "attempt", "at_ms", "data"]))
    _out(args, snap, "\n".join(lines))
    return 0


def _steer(args: argparse.Namespace, admin: Any) -> int:
    command = args.command  # pause, resume or cancel
    if bool(args.task_id) == bool(args.run_id):
        print(f"sqlease {command}: give a TASK_ID or --run RUN_ID (not both)", file=sys.stderr)
        raise SystemExit(2)
    kwargs: dict[str, Any] = {"run_id": args.run_id}
    if command == "cancel":
        kwargs["reason"] = args.reason
    count = getattr(admin, command)(args.task_id, **kwargs)
    _out(args, {command: count}, f"{command}: {count} task(s)")
    return 0


def _requeue(args: argparse.Namespace, admin: Any) -> int:
    admin.requeue(args.task_id, max_attempts=args.max_attempts)
    _out(args, {"requeued": args.task_id}, f"requeued {args.task_id}")
    return 0


def _input(args: argparse.Namespace, admin: Any) -> int:
    text = args.data
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as handle:
            text = handle.read()
    try:
        data = json.loads(text)
    except ValueError as exc:
        print(f"sqlease input: the answer is not valid JSON: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    admin.provide_input(args.task_id, data)
    _out(args, {"answered": args.task_id}, f"input given to {args.task_id}")
    return 0


def _approve(args: argparse.Namespace, admin: Any) -> int:
    admin.approve(args.task_id, args.note)
    _out(args, {"approved": args.task_id}, f"approved {args.task_id}")
    return 0


def _reject(args: argparse.Namespace, admin: Any) -> int:
    admin.reject(args.task_id, args.reason)
    _out(args, {"rejected": args.task_id}, f"rejected {args.task_id}")
    return 0


def _maintain(args: argparse.Namespace, admin: Any) -> int:
    from sqlease._core.maintenance import acquire, run_pass

    store = admin.store
    if not acquire(store, f"cli:{os.getpid()}", 300_000, store.now_ms()):
        print(
            "sqlease maintain: a worker is running the maintenance pass now; try later",
            file=sys.stderr,
        )
        return 1
    summary = run_pass(store, event_retention_ms=int(args.retention_days * 86_400_000))
    _out(args, summary, "\n".join(f"{k}: {v}" for k, v in sorted(summary.items())))
    return 0


def _purge(args: argparse.Namespace, admin: Any) -> int:
    count = admin.purge(args.queue)
    _out(args, {"purged": count}, f"purged {count} task(s) from {args.queue}")
    return 0


#: Verbs that need no Admin (no schema check: ``migrate`` creates it).
_PLAIN: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo,
    "migrate": _migrate,
    "grant": _grant,
}
_ADMIN: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "status": _status,
    "tasks": _tasks,
    "show": _show,
    "pause": _steer,
    "resume": _steer,
    "cancel": _steer,
    "requeue": _requeue,
    "input": _input,
    "approve": _approve,
    "reject": _reject,
    "maintain": _maintain,
    "purge": _purge,
    "schedules": lambda args, admin: schedules_cli.run(args, admin, _out, _table),
}


def _run(args: argparse.Namespace) -> int:
    plain = _PLAIN.get(args.command)
    if plain is not None:
        return plain(args)
    return _ADMIN[args.command](args, _admin(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (SqleaseError, ValueError, LookupError) as exc:
        print(f"sqlease {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
