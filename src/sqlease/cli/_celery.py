"""``celery -A app sqlease VERB``: the ``sqlease`` verbs as a Celery command (the
``celery.commands`` entry point). Without ``--url`` or ``SQLEASE_URL`` they use the app's
broker URL (``conf.broker_url``) and the ``table_prefix`` of its transport options."""

from __future__ import annotations

from typing import Any

import click

from sqlease import cli as sqlease_cli
from sqlease.cli._base import VerbGroup, common, options


def _app_of(ctx: click.Context) -> Any:
    # Celery's own CLI puts its CLIContext (with the -A app) in ctx.obj.
    holder = ctx.find_object(object) if ctx.obj is None else ctx.obj
    return getattr(holder, "app", None)


@click.group(cls=VerbGroup, name="sqlease", help="sqlease's verbs for this app's broker")
@common
@click.pass_context
def sqlease(ctx: click.Context) -> None:
    app = _app_of(ctx)
    if app is None:
        return
    given = options(ctx)
    url = app.conf.broker_url
    given.app_url = None if url is None else str(url)
    transport_options = app.conf.broker_transport_options or {}
    prefix = transport_options.get("table_prefix")
    given.app_table_prefix = None if prefix is None else str(prefix)


for _name, _command in sqlease_cli.cli.commands.items():
    sqlease.add_command(_command, _name)
