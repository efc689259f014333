"""``manage.py sqlease VERB …``: the ``sqlease`` command line on the project's database.

Every verb of ``sqlease`` (status, tasks, show, pause, cancel, requeue, migrate, ui, …) with
``--url`` and ``--table-prefix`` taken from ``SQLEASE_DATABASE`` and ``SQLEASE_TABLE_PREFIX``
unless given. The arguments go to the command line untouched (its own ``--help``).
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from sqlease.contrib.django.conf import alias_url, table_prefix


def _with_defaults(argv: list[str]) -> list[str]:
    given = {arg.split("=", 1)[0] for arg in argv}
    head = []
    if "--url" not in given:
        head += ["--url", alias_url()]
    if "--table-prefix" not in given:
        head += ["--table-prefix", table_prefix()]
    return [*head, *argv]


class Command(BaseCommand):
    help = "Run an sqlease verb on SQLEASE_DATABASE (manage.py sqlease --help lists them)."

    def run_from_argv(self, argv: list[str]) -> None:
        # argv: [manage.py, "sqlease", …]; the sqlease command line parses the rest itself.
        from django.db import connections

        try:
            code = self._run(argv[2:])
        finally:
            connections.close_all()
        if code:
            raise SystemExit(code)

    def handle(self, *args: Any, **options: Any) -> None:  # call_command("sqlease", …)
        code = self._run([str(arg) for arg in args])
        if code:
            raise CommandError(f"sqlease {' '.join(map(str, args))} exited with status {code}")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("args", nargs=argparse.REMAINDER)
        return parser

    @staticmethod
    def _run(argv: list[str]) -> int:
        from sqlease.cli import main

        return main(_with_defaults(argv))
