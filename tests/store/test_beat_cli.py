"""``sqlease schedules …`` on both databases: add, list, show, update, enable, disable, run,
remove, and bad input named by field."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from sqlease.cli import main
from sqlease.store import Store


@pytest.fixture
def cli(make_store: Callable[..., Store], db_url: str, capsys: pytest.CaptureFixture[str]):
    store = make_store()  # creates the tables

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--url", db_url, "--table-prefix", store.tables.prefix, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_the_schedules_verbs(cli) -> None:
    code, out, _ = cli(
        "schedules",
        "add",
        "nightly",
        "app.report",
        "--crontab",
        "0 3 * * *",
        "--args",
        "[1, 2]",
        "--queue",
        "reports",
    )
    assert code == 0 and "crontab 0 3 * * *" in out
    code, out, _ = cli("--json", "schedules", "list")
    (entry,) = json.loads(out)
    assert entry["name"] == "nightly" and entry["args"] == [1, 2]
    assert entry["options"] == {"queue": "reports"} and entry["source"] == "runtime"
    assert entry["next_run_at"] is None  # the leader plans it in its app's timezone
    assert cli("schedules", "update", "nightly", "--every", "60")[0] == 0
    assert cli("schedules", "disable", "nightly")[0] == 0
    code, out, _ = cli("--json", "schedules", "show", "nightly")
    shown = json.loads(out)
    assert shown["enabled"] is False and shown["schedule"] == "every 60s"
    assert [e["kind"] for e in shown["events"]] == [
        "schedule_added",
        "schedule_changed",
        "disabled",
    ]
    assert cli("schedules", "enable", "nightly")[0] == 0
    assert cli("schedules", "run", "nightly")[0] == 0
    assert json.loads(cli("--json", "schedules", "show", "nightly")[1])["run_requested"]
    assert cli("schedules", "leader")[1].strip() == "(no beat has led yet)"
    assert cli("schedules", "remove", "nightly")[0] == 0
    assert cli("schedules", "list")[1].strip().endswith("no periodic task entry")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["add", "x", "t", "--crontab", "61 * * * *"], "schedule"),
        (["add", "x", "t", "--every", "-5"], "schedule"),
        (["add", "x", "t"], "schedule"),
        (["add", "x", "t", "--every", "5", "--args", "{not json"], "args"),
        (["add", "x", "t", "--every", "5", "--options", '{"priority": 999}'], "options.priority"),
        (["show", "missing"], "no periodic task entry named 'missing'"),
    ],
)
def test_bad_input_is_named(cli, argv: list[str], named: str) -> None:
    code, _, err = cli("schedules", *argv)
    assert code == 1 and named in err


def test_a_duplicate_name_is_refused(cli) -> None:
    assert cli("schedules", "add", "x", "t", "--every", "5")[0] == 0
    code, _, err = cli("schedules", "add", "x", "t", "--every", "9")
    assert code == 1 and "exists already" in err
