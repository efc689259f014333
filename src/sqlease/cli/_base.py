"""What every ``sqlease`` verb shares: the common options (before or after the verb), the
database they name, errors as exit statuses, and output for people or for scripts."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from sqlease.errors import SqleaseError

_META = "sqlease.options"


@dataclass
class Options:
    """The common options of one invocation, wherever on the line they were given."""

    url: str | None = None
    table_prefix: str | None = None
    json: bool = False
    #: The Celery app's broker URL and table prefix (``celery -A app sqlease …``).
    app_url: str | None = None
    app_table_prefix: str | None = None


def options(ctx: click.Context) -> Options:
    found = ctx.meta.get(_META)
    if found is None:
        found = ctx.meta[_META] = Options()
    return found


class Failure(click.ClickException):
    """A refused operation (status 1) or a usage error found by a verb (status 2), shown as
    ``sqlease VERB: message`` on stderr."""

    def __init__(
        self, message: str, *, code: int = 1, verb: str | None = None, bare: bool = False
    ) -> None:
        super().__init__(message)
        self.exit_code = code  # type: ignore[misc]  # click reads it per instance
        self.verb = verb
        #: the message names the command itself: no ``sqlease VERB:`` before it
        self.bare = bare

    def show(self, file: Any = None) -> None:
        if self.bare:
            click.echo(self.message, err=True)
        else:
            click.echo(f"sqlease {self.verb or ''}: {self.message}".replace(" :", ":"), err=True)


def _verb(ctx: click.Context) -> str:
    parts = ctx.command_path.split()
    # after the program: ``sqlease`` itself, or ``celery … sqlease`` (sqlease.cli._celery)
    start = parts.index("sqlease") + 1 if "sqlease" in parts else 1
    return " ".join(parts[start:]) or parts[0]


class Verb(click.Command):
    """A leaf command: the errors sqlease raises become ``Failure`` naming the verb."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Failure as failure:
            failure.verb = failure.verb or _verb(ctx)
            raise
        except (SqleaseError, ValueError, LookupError) as exc:
            raise Failure(str(exc), verb=_verb(ctx)) from exc


def verb(name: str | None = None, **attrs: Any) -> Callable[[Callable[..., Any]], Verb]:
    """``click.command`` making a ``Verb``."""
    return click.command(name, cls=Verb, **attrs)


class VerbGroup(click.Group):
    command_class = Verb

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group_class = VerbGroup


def _set(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None and value is not False:
            setattr(options(ctx), name, value)

    return store


def common(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--url``, ``--table-prefix`` and ``--json``, accepted before or after the verb: a
    value given after it wins; one not given leaves the earlier one alone."""
    for decorator in reversed(
        [
            click.option(
                "--url",
                expose_value=False,
                callback=_set("url"),
                help="database or broker URL (default: $SQLEASE_URL)",
            ),
            click.option(
                "--table-prefix",
                expose_value=False,
                callback=_set("table_prefix"),
                help="the app's table_prefix (default: $SQLEASE_TABLE_PREFIX, else sqlease_)",
            ),
            click.option(
                "--json",
                is_flag=True,
                default=False,
                expose_value=False,
                callback=_set("json"),
                help="machine-readable output",
            ),
        ]
    ):
        command = decorator(command)
    return command


def url_of(ctx: click.Context) -> str:
    given = options(ctx)
    url = given.url or os.environ.get("SQLEASE_URL") or given.app_url
    if not url:
        raise Failure("give the database with --url or SQLEASE_URL", code=2, verb=_verb(ctx))
    return str(url)


def prefix_of(ctx: click.Context) -> str:
    given = options(ctx)
    return (
        given.table_prefix
        or os.environ.get("SQLEASE_TABLE_PREFIX")
        or given.app_table_prefix
        or "sqlease_"
    )


def admin_of(ctx: click.Context) -> Any:
    from sqlease.admin import Admin

    return Admin(url_of(ctx), table_prefix=prefix_of(ctx))


def out(ctx: click.Context, data: Any, human: Callable[[], str] | str) -> None:
    """``data`` as JSON with ``--json``, else the text for people."""
    if options(ctx).json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(human() if callable(human) else human)
