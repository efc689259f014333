"""The ``sqlease`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _url(args: argparse.Namespace) -> str:
    url = args.url or os.environ.get("SQLEASE_URL")
    if not url:
        raise SystemExit("sqlease: give the database with --url or SQLEASE_URL")
    return str(url)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sqlease", description="Durable Celery on SQL.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="kill a worker mid-task on SQLite and watch the task "
                                       "resume on another")
    demo.add_argument("--dir", help="folder for the demo database (default: a temp folder)")
    migrate = sub.add_parser("migrate", help="create or upgrade sqlease's tables")
    migrate.add_argument("--url", help="database URL (default: $SQLEASE_URL)")
    migrate.add_argument("--table-prefix", default="sqlease_")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args.dir)
    if args.command == "migrate":
        from .engine import get_engine
        from .schema import build_tables
        from .schema import migrate as do_migrate

        version = do_migrate(get_engine(_url(args)), build_tables(args.table_prefix))
        print(f"schema at version {version}")
        return 0
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
