"""The ``sqlease`` command line (click, as Celery's own): the verbs of ``sqlease.Admin``, plus
``migrate``, ``maintain``, ``grant``, ``demo``, ``ui`` and ``metrics``.

``sqlease --url sqlease+postgresql://… status`` (or set ``SQLEASE_URL``). Tables for people
by default, ``--json`` for scripts. The common options may come before or after the verb.
Errors name what was wrong and exit with status 2 (usage) or 1 (the operation was refused).
The verbs live in ``sqlease.cli._tasks`` (tasks and queues), ``sqlease.cli._ops`` (schema,
maintenance, servers) and ``sqlease.cli._schedules``; ``sqlease.cli._celery`` mounts the
same verbs under ``celery -A app sqlease``.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from sqlease.cli import _limits, _ops, _schedules, _tasks
from sqlease.cli._base import VerbGroup, common


@click.group(
    cls=VerbGroup,
    name="sqlease",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@common
def cli() -> None:
    """Durable Celery on SQL: see and steer tasks, queues and schedules."""


for _module in (_tasks, _ops, _schedules, _limits):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point: the exit status (0, 1 refused, 2 usage)."""
    try:
        cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="sqlease",
            standalone_mode=False,
        )
    except click.exceptions.Exit as done:
        return int(done.exit_code)
    except click.ClickException as error:
        error.show()
        return int(error.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    return 0
