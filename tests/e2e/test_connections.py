"""The connection budget (docs/howto/operations.md, "Connections"): three real
``celery worker -P prefork -c 4`` processes with the result backend on the same URL stay
within the documented count of PostgreSQL connections, idle and busy, by default and with
``shared_pool=true``. Connections are counted in pg_stat_activity by the test's own
``application_name`` and attributed to the worker's main process or its pool children by
their sockets."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from sqlease import Store

from .apps.conn_app import make_app
from .pg_clients import children, owners

pytestmark = pytest.mark.pg

APPS = Path(__file__).parent / "apps"
CONCURRENCY = 4
WORKERS = 3
#: The documented budget per worker process: (main process, listener, each pool child).
BUDGET = {"default": (6, 1, 2), "shared_pool": (4, 1, 1)}


def per_worker(mode: str, concurrency: int = CONCURRENCY) -> int:
    main, listener, child = BUDGET[mode]
    return main + listener + child * concurrency


@pytest.fixture
def workers(pg_database_url: str, tmp_path: Path) -> Iterator[dict[str, object]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(url: str, prefix: str, name: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "conn_app",
                    "worker",
                    "-P",
                    "prefork",
                    "-c",
                    str(CONCURRENCY),
                    "-l",
                    "info",
                    "-n",
                    f"{name}@conn",
                    "--without-mingle",
                    "--without-gossip",
                ],
                env=dict(
                    os.environ,
                    CONN_URL=url,
                    CONN_PREFIX=prefix,
                    PYTHONPATH=os.pathsep.join([str(APPS), os.environ.get("PYTHONPATH", "")]),
                ),
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.append(proc)
        return proc

    def wait_ready(name: str, proc: subprocess.Popen[bytes]) -> None:
        log = tmp_path / f"{name}.log"
        deadline = time.monotonic() + 60
        while f"{name}@conn ready." not in log.read_text(errors="ignore"):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "worker not ready"
            time.sleep(0.1)

    yield {"start": start, "wait_ready": wait_ready}
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def count(admin: object, tag: str, mains: list[int]) -> dict[str, int]:
    """The test's connections, by holder: each worker's main process, its pool children,
    its listener; anything else (the test's own producer and result reader)."""
    with admin.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            text(
                "SELECT application_name, client_port FROM pg_stat_activity "
                "WHERE application_name LIKE :tag"
            ),
            {"tag": f"{tag}%"},
        ).fetchall()
    kids = {main: children(main) for main in mains}
    pids = [*mains, *(k for ks in kids.values() for k in ks)]
    found = owners([row.client_port for row in rows], pids)
    by: collections.Counter[str] = collections.Counter()
    for row in rows:
        pid = found[row.client_port]
        main = next((m for m in mains if pid == m or pid in kids[m]), None)
        if main is None:
            by["other"] += 1
            continue
        role = (
            "listener"
            if row.application_name.endswith("-listen")
            else ("main" if pid == main else "child")
        )
        by[f"{main}:{role}"] += 1
        by["workers"] += 1
    return dict(by)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["default", "shared_pool"])
def test_three_prefork_workers_stay_within_the_documented_count(
    pg_database_url: str, workers: dict, mode: str
) -> None:
    tag = f"conn{uuid.uuid4().hex[:8]}"
    url = f"{pg_database_url}?application_name={tag}"
    if mode == "shared_pool":
        url += "&shared_pool=true"
    prefix = f"{tag}_"
    Store(url, table_prefix=prefix)  # the tables, before the workers start
    names = [f"w{i}-{tag}" for i in range(WORKERS)]
    procs = [workers["start"](url, prefix, name) for name in names]
    for name, proc in zip(names, procs, strict=True):
        workers["wait_ready"](name, proc)
    mains = [proc.pid for proc in procs]
    admin = create_engine(pg_database_url.replace("postgresql://", "postgresql+psycopg://"))
    main_budget, listener_budget, child_budget = BUDGET[mode]

    def check(seen: dict[str, int]) -> None:
        assert seen.get("workers", 0) <= WORKERS * per_worker(mode), seen
        for main in mains:
            assert seen.get(f"{main}:main", 0) <= main_budget, seen
            assert seen.get(f"{main}:listener", 0) <= listener_budget, seen
            # every child together: at most child_budget each
            assert seen.get(f"{main}:child", 0) <= child_budget * CONCURRENCY, seen

    time.sleep(2.0)
    idle = count(admin, tag, mains)
    check(idle)
    app = make_app(url, prefix)
    results = [app.tasks["conn.work"].delay(0.2) for _ in range(WORKERS * CONCURRENCY * 8)]
    peak: dict[str, int] = {}
    deadline = time.monotonic() + 90
    while not all(r.ready() for r in results):
        assert time.monotonic() < deadline, "the tasks did not finish"
        seen = count(admin, tag, mains)
        check(seen)
        if seen.get("workers", 0) > peak.get("workers", 0):
            peak = seen
        time.sleep(0.2)
    pids = {r.get(timeout=10) for r in results}
    assert len(pids) > WORKERS  # the children of several workers ran tasks
    after = count(admin, tag, mains)
    check(after)
    print(
        f"{mode}: idle {idle.get('workers')} busy peak {peak.get('workers')} "
        f"after {after.get('workers')} (budget {WORKERS * per_worker(mode)}): {peak}"
    )
    admin.dispose()
