"""The ``sqlease`` command for people, on both databases: status with every declared queue and
the live leases (also when all is empty), task listings with names, queues and attempts,
times in local ISO form and relative, the timeline, ``--json`` keys, exit statuses, the Celery
command (``celery -A app sqlease``), the metrics exporter and the ``ui`` verb without its
extra."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from sqlease.admin import Admin
from sqlease.cli import _render as render
from sqlease.cli import main
from sqlease.store import Store
from sqlease.testing import FakeClock


@pytest.fixture
def cli(
    make_store: Callable[..., Store],
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):
    store = make_store()  # creates the tables

    def bound(url: str, *, table_prefix: str) -> Admin:
        # The command's Admin on this test's store, with its fake clock, when the command
        # names this test's database: times are injected, never waited for.
        if (url, table_prefix) == (db_url, store.tables.prefix):
            return Admin(url, store=store)
        return Admin(url, table_prefix=table_prefix)

    monkeypatch.setattr("sqlease.admin.Admin", bound)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--url", db_url, "--table-prefix", store.tables.prefix, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    run.store = store  # type: ignore[attr-defined]
    return run


def test_status_when_everything_is_empty(cli) -> None:
    code, out, _ = cli("status")
    assert code == 0
    assert "Queues (0)" in out and "queued" in out and "no queue yet" in out
    assert "Live leases: 0" in out and "(none)" not in out
    code, out, _ = cli("--json", "status")
    data = json.loads(out)
    assert data["queues"] == {} and data["leases"] == {"live": 0, "owners": []}
    assert data["totals"]["queued"] == 0 and isinstance(data["at_ms"], int)


def test_status_shows_every_declared_queue_and_the_leases(cli, clock: FakeClock) -> None:
    store: Store = cli.store
    store.declare_queue("celery")
    store.declare_queue("idle")
    store.enqueue("celery", "{}", task_id="a", task_name="app.a")
    store.enqueue("celery", "{}", task_id="b", task_name="app.b")
    store.claim(["celery"], "web-1:4121:9a0c", lease_ms=60_000)
    clock.advance(3 * 60_000 + 5000)  # the lease is gone; "b" has waited 3 min 5 s
    store.claim(["celery"], "web-2:977:1b2d", lease_ms=120_000)
    code, out, _ = cli("status")
    assert code == 0
    lines = out.splitlines()
    [celery] = [line for line in lines if line.startswith("celery ")]
    [idle] = [line for line in lines if line.startswith("idle ")]
    assert celery.split()[:4] == ["celery", "1", "0", "1"]  # queued, scheduled, running
    assert celery.endswith("3 min 5 s")  # the oldest ready task's age
    assert idle.split()[1:9] == ["0"] * 8
    assert "Live leases: 1" in out
    [owner] = [line for line in lines if line.startswith("web-2:977:1b2d")]
    assert "celery (1)" in owner and "(in 2 min)" in owner
    data = json.loads(cli("--json", "status")[1])
    assert set(data["queues"]) == {"celery", "idle"}
    assert data["queues"]["celery"]["running"] == 1
    assert data["queues"]["celery"]["oldest_ready_age_s"] == 185.0
    [held] = data["leases"]["owners"]
    assert held["owner"] == "web-2:977:1b2d" and held["leases"] == 1
    assert held["queues"] == {"celery": 1}


def test_kombu_queues_and_dead_reasons(cli, clock: FakeClock) -> None:
    store: Store = cli.store
    store.declare_queue("worker1@host.celery.pidbox")  # Celery's remote control, per worker
    store.declare_queue("celeryev.4f1c")
    store.enqueue("celery", "{}", task_id="dies", task_name="app.dies", max_attempts=1)
    store.claim(["celery"], "w", lease_ms=1000)
    clock.advance(2000)
    store.claim(["celery"], "w", lease_ms=1000)  # its budget spent: dead
    data = json.loads(cli("--json", "status")[1])
    assert set(data["queues"]) == {"celery"}  # empty Kombu queues are left out
    assert data["queues"]["celery"]["failed"] == 1
    out = cli("tasks")[1]
    assert "failed (attempts_exhausted)" in out
    store.enqueue("q", "{}", task_id="asks")
    [m] = store.claim(["q"], "w", lease_ms=60_000)
    store.park(m.fence, "waiting_input")
    [line] = [x for x in cli("show", "asks")[1].splitlines() if x.split()[:1] == ["state"]]
    assert line.split() == ["state", "waiting_input"]  # the reason only when it says more


def test_finished_tasks_keep_name_queue_and_attempt(cli, clock: FakeClock) -> None:
    store: Store = cli.store
    store.enqueue("celery", "{}", task_id="done", task_name="app.report")
    [m] = store.claim(["celery"], "web-1:4121:9a0c", lease_ms=1000)
    clock.advance(2500)
    with store.engine.begin() as conn:  # the result the backend writes at success
        conn.execute(
            store.tables.results.insert().values(
                key="celery-task-meta-done",
                value=b"{}",
                state="SUCCESS",
                task_id="done",
                message_id=m.id,
                attempt=m.attempt,
                updated_at_ms=clock(),
            )
        )
    store.ack([m.fence])
    clock.advance(180_000)
    code, out, _ = cli("tasks", "--state", "succeeded")
    assert code == 0
    [line] = [x for x in out.splitlines() if x.startswith("done ")]
    cells = line.split()
    assert cells[:5] == ["done", "app.report", "succeeded", "1", "celery"]
    assert f"{render.local(clock() - 182_500)} (3 min 2 s ago)" in line
    assert "2.5 s" in line  # how long it took
    [listed] = json.loads(cli("--json", "tasks", "--state", "succeeded")[1])
    assert listed["task_name"] == "app.report" and listed["attempt"] == 1
    assert listed["queue"] == "celery"


def test_show_draws_the_timeline_with_local_times(cli, clock: FakeClock) -> None:
    store: Store = cli.store
    start = clock()
    store.enqueue("celery", "{}", task_id="t", task_name="app.import")
    store.claim(["celery"], "web-1:4121:9a0c", lease_ms=1000)
    clock.advance(1500)
    [second] = store.claim(["celery"], "web-2:977:1b2d", lease_ms=60_000)
    clock.advance(250)
    store.compare_and_set(second.fence, "t", 0, checkpoint={"page": 4})
    code, out, _ = cli("show", "t")
    assert code == 0
    assert "None" not in out
    fields = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()[1:8]}
    assert fields["task"] == "app.import" and fields["attempt"] == "2/3"
    assert fields["queue"] == "celery" and fields["state"] == "running"
    assert f"{render.local(start)} (1.8 s ago)" in out
    assert "held by        web-2:977:1b2d" in out
    # the demo's layout: "+  1.50s  attempt 2  claimed  by web-2 pid 977"
    timeline = [re.sub(r"\+\s+", "+", x) for x in out[out.index("timeline:") :].splitlines()]
    assert timeline[1] == f"  from {render.local(start)}"
    assert timeline[2].split() == ["+0.00s", "attempt", "0", "enqueued"]
    assert timeline[3].split() == [
        "+0.00s",
        "attempt",
        "1",
        "claimed",
        "by",
        "web-1",
        "pid",
        "4121",
    ]
    assert timeline[4].split() == ["+1.50s", "attempt", "2", "claimed", "by", "web-2", "pid", "977"]
    assert timeline[5].split()[:4] == ["+1.75s", "attempt", "2", "checkpoint"]
    assert '{"page": 4}' in timeline[5]
    snap = json.loads(cli("--json", "show", "t")[1])
    assert snap["task_name"] == "app.import" and snap["events"][0]["at_ms"] == start


def test_errors_and_exit_statuses(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = cli("show", "missing")
    assert code == 1 and err.strip() == "sqlease show: no task 'missing' in this database"
    code, _, err = cli("pause")
    assert code == 2 and "give a TASK_ID or --run RUN_ID" in err
    code, _, err = cli("tasks", "--state", "sleeping")
    assert code == 1 and "unknown state 'sleeping'" in err
    code, _, err = cli("tasks", "--limit", "many")
    assert code == 2 and "'many' is not a valid integer" in err
    code, _, err = cli("tasks", "--limit", "-1")
    assert code == 2 and "-1 is not in the range x>=1" in err
    code, _, err = cli("maintain", "--retention-days", "1e300")
    assert code == 2 and "must be from 0 to 36500 days, not 1e+300" in err
    code, _, err = cli("nonsense")
    assert code == 2 and "No such command 'nonsense'" in err
    code, _, err = cli("input", "t", "@/nonexistent/answer.json")
    assert code == 2 and "cannot read /nonexistent/answer.json" in err
    monkeypatch.delenv("SQLEASE_URL", raising=False)
    assert main(["status"]) == 2


def test_maintain_gives_its_lock_back_and_waits_for_a_workers_pass(cli) -> None:
    """Twice in a row, both run: the pass's lock is given up when it ends, not held for its
    five minutes. While a worker's pass holds it, the command says so and runs nothing."""
    from sqlease._core.maintenance import acquire, release

    for _ in range(2):
        code, out, err = cli("maintain")
        assert code == 0, err
        assert "steps_outcome_unknown: 0" in out
    store = cli.store  # type: ignore[attr-defined]
    assert acquire(store, "worker-1", 300_000, store.now_ms())
    code, _, err = cli("maintain")
    assert code == 1 and "a worker is running the maintenance pass now" in err
    assert release(store, "worker-1")  # the command did not take or drop the worker's lock


def test_options_after_the_verb_win(cli, db_url: str, capsys) -> None:
    store: Store = cli.store
    store.enqueue("q", "{}", task_id="t")
    code = main(
        [
            "--url",
            "sqlite:////nonexistent/x.db",
            "status",
            "--url",
            db_url,
            "--table-prefix",
            store.tables.prefix,
            "--json",
        ]
    )
    assert code == 0 and json.loads(capsys.readouterr().out)["queues"]["q"]["queued"] == 1


def test_durations() -> None:
    assert render.duration(850) == "850 ms"
    assert render.duration(4200) == "4.2 s"
    assert render.duration(184_000) == "3 min 4 s"
    assert render.duration(2 * 3_600_000 + 300_000) == "2 h 5 min"
    assert render.duration(3 * 86_400_000 + 4 * 3_600_000) == "3 d 4 h"
    assert render.duration(3_600_000) == "1 h"
    assert render.relative(1000, 1000) == "now"
    assert render.relative(0, 180_000) == "3 min ago"
    assert render.relative(5000, 0) == "in 5.0 s"


@pytest.mark.skipif(
    importlib.util.find_spec("sqlease.ui") is not None, reason="sqlease.ui is installed here"
)
def test_ui_without_its_extra(cli) -> None:
    code, _, err = cli("ui", "--port", "8123", "--read-only")
    assert code == 2
    assert err.strip() == "sqlease ui needs the ui extra: pip install 'sqlease[ui]'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_metrics_exporter(make_store: Callable[..., Store], db_url: str) -> None:
    store = make_store(clock=None)
    store.enqueue("celery", "{}", task_id="t")
    port = _free_port()
    exporter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sqlease",
            "metrics",
            "--url",
            db_url,
            "--table-prefix",
            store.tables.prefix,
            "--port",
            str(port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as got:
                    text = got.read().decode()
                break
            except OSError:
                assert exporter.poll() is None, exporter.stderr.read() if exporter.stderr else ""
                assert time.monotonic() < deadline, "the exporter did not answer"
                time.sleep(0.1)
        assert 'sqlease_tasks{queue="celery",state="queued"} 1.0' in text
        assert "sqlease_up 1.0" in text and "sqlease_enqueued_total" in text
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)
        if exporter.stderr is not None:
            exporter.stderr.close()


def test_celery_sqlease_reads_the_apps_broker_url(
    make_store: Callable[..., Store], db_url: str, tmp_path: Path
) -> None:
    store = make_store(clock=None)
    admin = Admin(store.engine.url, store=store)
    store.enqueue("celery", "{}", task_id="t1", task_name="app.charge")
    (tmp_path / "cliapp.py").write_text(
        textwrap.dedent(
            """
            import os
            from celery import Celery

            app = Celery("cliapp", broker=os.environ["APP_BROKER"])
            app.conf.broker_transport_options = {"table_prefix": os.environ["APP_PREFIX"]}
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLEASE_")}
    env.update(
        APP_BROKER=f"sqlease+{db_url}",
        APP_PREFIX=store.tables.prefix,
        PYTHONPATH=str(tmp_path),
    )

    def celery(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "cliapp", "sqlease", *argv],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    shown = celery("status")
    assert shown.returncode == 0, shown.stderr
    assert "Queues (1)" in shown.stdout and "celery" in shown.stdout
    data = json.loads(celery("--json", "tasks").stdout)
    assert [(t["task_id"], t["task_name"]) for t in data] == [("t1", "app.charge")]
    assert celery("pause", "t1").returncode == 0
    assert admin.task("t1").state == "paused"
    refused = celery("show", "missing")
    assert refused.returncode == 1
    assert refused.stderr.strip() == "sqlease show: no task 'missing' in this database"
