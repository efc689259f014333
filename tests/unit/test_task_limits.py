"""A task's own concurrency options become the headers of each publish."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from sqlease import ConfigurationError
from sqlease._task_limits import ERROR_HEADER, _apply_task_default, key_for
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
