"""The ``sqlease`` command line (click, as Celery's own): the verbs of ``sqlease.Admin``, plus
``migrate``, ``maintain``, ``grant``, ``demo``, ``ui`` and ``metrics``.

``sqlease --url sqlease+postgresql://… status`` (or set ``SQLEASE_URL``). Tables for people
by default, ``--json`` for scripts. The common options may come before or after the verb.
Errors name what was wrong and exit with status 2 (usage) or 1 (the operation was refused).
The verbs live in ``sqlease._cli_tasks`` (tasks and queues), ``sqlease._cli_ops`` (schema,
maintenance, servers) and ``sqlease._cli_schedules``; ``sqlease._cli_celery`` mounts the
same verbs under ``celery -A app sqlease``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from sqlease import _cli_limits, _cli_ops, _cli_schedules, _cli_tasks
from sqlease._cli_base import VerbGroup, common


@click.group(
    cls=VerbGroup,
    name="sqlease",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@common
def cli() -> None:
    """Durable Celery on SQL: see and steer tasks, queues and schedules."""


for _module in (_cli_tasks, _cli_ops, _cli_schedules, _cli_limits):
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
