"""``sqlease migrate | maintain | grant | demo | ui | metrics``: the schema, the maintenance
pass, roles, the demo, and the two servers (the web dashboard and the Prometheus exporter)."""

from __future__ import annotations

import os
from typing import Any

import click

from sqlease.cli._base import Failure, admin_of, common, out, prefix_of, url_of, verb

#: A century: longer keeps events forever in all but name (and overflows milliseconds).
MAX_RETENTION_DAYS = 36_500


@verb(help="kill a worker mid-task on SQLite and watch the task resume on another")
@click.option("--dir", "folder", help="folder for the demo database (default: a temp folder)")
@click.pass_context
def demo(ctx: click.Context, folder: str | None) -> None:
    from sqlease.cli._demo import run

    ctx.exit(run(folder))


@verb(help="create or upgrade sqlease's tables")
@common
@click.pass_context
def migrate(ctx: click.Context) -> None:
    from sqlease._db.engine import get_engine
    from sqlease._db.migrations import migrate as do_migrate
    from sqlease._db.tables import build_tables
    from sqlease.urls import strip_prefix

    version = do_migrate(get_engine(strip_prefix(url_of(ctx))), build_tables(prefix_of(ctx)))
    out(ctx, {"schema_version": version}, f"schema at version {version}")


@verb(help="print (or --apply) the grants of a least-privilege worker role")
@click.argument("role")
@click.option("--schema", default="public", show_default=True)
@click.option("--apply", "apply_them", is_flag=True, help="run them against --url")
@common
@click.pass_context
def grant(ctx: click.Context, role: str, schema: str, apply_them: bool) -> None:
    from sqlalchemy import text as sql_text

    from sqlease._db.engine import get_engine
    from sqlease._db.roles import worker_grants
    from sqlease._db.tables import build_tables
    from sqlease.urls import strip_prefix

    statements = worker_grants(build_tables(prefix_of(ctx)), role, schema=schema)
    if apply_them:
        with get_engine(strip_prefix(url_of(ctx))).begin() as conn:
            for statement in statements:
                conn.execute(sql_text(statement))
    out(ctx, statements, ";\n".join(statements) + ";")


@verb(help="run one maintenance pass now")
@click.option(
    "--retention-days",
    type=float,
    default=30.0,
    show_default=True,
    help="keep events of finished tasks this long (0: forever)",
)
@common
@click.pass_context
def maintain(ctx: click.Context, retention_days: float) -> None:
    from sqlease._core.maintenance import acquire, release, run_pass

    if not 0 <= retention_days <= MAX_RETENTION_DAYS:  # (NaN too)
        raise click.BadParameter(
            f"must be from 0 to {MAX_RETENTION_DAYS} days, not {retention_days}",
            param_hint="--retention-days",
        )
    store = admin_of(ctx).store
    owner = f"cli:{os.getpid()}"
    if not acquire(store, owner, 300_000, store.now_ms()):
        raise Failure("a worker is running the maintenance pass now; try later")
    try:
        summary = run_pass(store, event_retention_ms=int(retention_days * 86_400_000))
    finally:
        release(store, owner)  # the workers' next pass need not wait out this lock
    out(ctx, summary, "\n".join(f"{k}: {v}" for k, v in sorted(summary.items())))


@verb(help="the web dashboard (needs the ui extra: pip install 'sqlease[ui]')")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--token",
    envvar="SQLEASE_UI_TOKEN",
    help="the token actions need (default: $SQLEASE_UI_TOKEN)",
)
@click.option("--read-only", is_flag=True, help="no actions at all")
@click.option("--root-path", default="", help="the URL prefix behind a reverse proxy")
@click.option("--redact-args", is_flag=True, help="never show task arguments")
@common
@click.pass_context
def ui(
    ctx: click.Context,
    host: str,
    port: int,
    token: str | None,
    read_only: bool,
    root_path: str,
    redact_args: bool,
) -> None:
    try:
        from sqlease.ui import serve  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise Failure(
            "sqlease ui needs the ui extra: pip install 'sqlease[ui]'", code=2, bare=True
        ) from None
    serve(
        url_of(ctx),
        host=host,
        port=port,
        token=token,
        read_only=read_only,
        root_path=root_path,
        redact_args=redact_args,
    )


@verb(help="serve Prometheus metrics at http://HOST:PORT/metrics")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", type=int, default=9808, show_default=True)
@click.option("--per-owner", is_flag=True, help="one series per lease owner too")
@common
@click.pass_context
def metrics(ctx: click.Context, host: str, port: int, per_owner: bool) -> None:
    try:
        from sqlease.metrics import serve
    except ImportError as error:
        raise Failure(
            f"sqlease metrics needs the metrics extra: pip install 'sqlease[metrics]' ({error})",
            code=2,
        ) from None
    admin = admin_of(ctx)
    click.echo(f"sqlease metrics: http://{host}:{port}/metrics", err=True)
    serve(admin, host=host, port=port, per_owner=per_owner)


COMMANDS: list[Any] = [demo, migrate, grant, maintain, ui, metrics]
