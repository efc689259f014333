"""A task's own concurrency options become the headers of each publish."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from celery import Celery

from sqlease import ConfigurationError
from sqlease._celery.task_limits import ERROR_HEADER, _apply_task_default, key_for
from sqlease._core.uniques import check_unique
from sqlease.transport._codec import new_message


def charge(account: str, amount: int) -> None:
    return None


def call(account: str, amount: int) -> None:
    return None


def half() -> None:
    return None


def plain() -> None:
    return None


def _app() -> Celery:
    app = Celery("limits", set_as_current=False)
    app.task(name="limits.charge", concurrency_key="acct:{account}", concurrency_limit=2)(charge)
    app.task(name="limits.call", concurrency_key=lambda *a, **k: f"c:{a[0]}", concurrency_limit=1)(
        call
    )
    app.task(name="limits.half", concurrency_key="x")(half)
    app.task(name="limits.plain")(plain)
    app.finalize()
    return app


def test_the_key_is_formatted_from_positional_and_keyword_arguments() -> None:
    app = _app()
    task = app.tasks["limits.charge"]
    assert key_for(task, (("a1",), {"amount": 3}, {})) == ("acct:a1", 2)
    assert key_for(task, ((), {"account": "a2", "amount": 3}, {})) == ("acct:a2", 2)
    assert key_for(app.tasks["limits.call"], (("z",), {}, {})) == ("c:z", 1)
    assert key_for(app.tasks["limits.plain"], ((), {}, {})) is None


def test_half_an_option_or_a_missing_argument_is_refused_at_publish() -> None:
    app = _app()
    with pytest.raises(ConfigurationError, match="give both"):
        key_for(app.tasks["limits.half"], ((), {}, {}))
    headers: dict[str, Any] = {"task": "limits.charge", "id": "t1"}
    _apply_task_default(sender="limits.charge", body=((), {"amount": 1}, {}), headers=headers)
    assert "account" in headers[ERROR_HEADER]
    with pytest.raises(ConfigurationError, match="account"):
        new_message("celery", {"headers": headers, "properties": {}, "body": ""})


def test_a_header_given_by_the_caller_wins() -> None:
    _app()
    headers: dict[str, Any] = {
        "task": "limits.charge",
        "concurrency_key": "mine",
        "concurrency_limit": 5,
    }
    _apply_task_default(sender="limits.charge", body=(("a",), {}, {}), headers=headers)
    assert (headers["concurrency_key"], headers["concurrency_limit"]) == ("mine", 5)
    message = new_message("celery", {"headers": headers, "properties": {}, "body": ""})
    assert (message.concurrency_key, message.concurrency_limit, message.task_name) == (
        "mine",
        5,
        "limits.charge",
    )


def report(user: str) -> None:
    return None


def stray() -> None:
    return None


def test_a_tasks_unique_options_become_headers_and_the_codec_reads_them() -> None:
    from sqlease._celery.task_limits import unique_for

    app = Celery("uniques", set_as_current=False)
    task = app.task(name="u.report", unique_key="report:{user}", unique_for=30)(report)
    bad = app.task(name="u.stray", unique_scope="queued")(stray)
    app.finalize()
    assert unique_for(task, (("ann",), {}, {})) == {"unique_key": "report:ann", "unique_for": 30}
    with pytest.raises(ConfigurationError, match="without a unique_key"):
        unique_for(bad, ((), {}, {}))
    found = new_message(
        "celery", {"headers": {"id": "t2", "unique_key": "k", "unique_for": 1.5}, "properties": {}}
    )
    # The codec reads the headers (unique_for in ms); the store checks them, once, and gives
    # a key with a period its scope.
    assert (found.unique_key, found.unique_scope, found.unique_for_ms) == ("k", None, 1500)
    assert check_unique(found.unique_key, found.unique_scope, found.unique_for_ms) == (
        "k",
        "period",
        1500,
    )


def test_a_chord_header_part_is_never_unique() -> None:
    """A duplicate never runs, so the chord's body would wait for it for ever."""
    found = new_message(
        "celery",
        {"headers": {"id": "t", "unique_key": "k", "chord": {"task": "body"}}, "properties": {}},
    )
    assert found.unique_key is None
    stray = new_message(
        "celery", {"headers": {"id": "t", "unique_key": "k", "unique_scope": "x"}, "properties": {}}
    )
    with pytest.raises(ConfigurationError, match="unique_scope"):
        check_unique(stray.unique_key, stray.unique_scope, stray.unique_for_ms)


def test_importing_sqlease_connects_the_publish_handler() -> None:
    # A process that only imports sqlease still sets its tasks' headers: the package imports
    # the Celery defaults, which import task_limits for its before_task_publish handler.
    code = "import sys, sqlease; assert 'sqlease._celery.task_limits' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
