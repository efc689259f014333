"""sqlease behind a real PgBouncer in transaction mode (``?pooler=transaction``): no startup
options, no prepared statements, no session locks or LISTEN on pooled connections; real
workers publish, claim, ack, store results and run a chord through it, a SIGKILLed worker's
task is taken over, and a restart of PgBouncer itself is ridden out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import chord
from sqlalchemy import create_engine, text

from conftest import unique_prefix
from sqlease.errors import ConfigurationError
from sqlease.store import Store

from .conftest import Bouncer
from .pooler_app import make_app

pytestmark = [pytest.mark.pg, pytest.mark.slow]
HERE = Path(__file__).parent


def test_url_parameters_are_typed_or_refused(pg_database_url: str) -> None:
    store = Store(f"{pg_database_url}?prepare_threshold=0", table_prefix=unique_prefix())
    store.enqueue("q", "{}", task_id="t")  # psycopg got a number, not the string "0"
    assert store.size("q") == 1
    for bad, named in [
        ("prepare_threshold=often", "prepare_threshold"),
        ("prepare_threshold=-1", "prepare_threshold"),
        ("pooler=sometimes", "pooler"),
        ("pooler=transaction&listen_port=x", "listen_port"),
        ("pgbouncer=maybe", "pgbouncer"),
        ("pooler=transaction&prepare_threshold=5", "prepare_threshold"),
    ]:
        with pytest.raises(ConfigurationError, match=named):
            Store(f"{pg_database_url}?{bad}", table_prefix=unique_prefix())


def test_the_store_through_the_pooler_shares_server_connections_safely(
    bouncer: Bouncer,
) -> None:
    """Four threads of lease traffic over three server connections: with prepared statements
    or startup options, this fails (PgBouncer refuses ``options``; a statement name would
    reach another client's session)."""
    store = Store(bouncer.url(), table_prefix=unique_prefix())
    errors: list[BaseException] = []

    def traffic(n: int) -> None:
        try:
            for i in range(40):
                store.enqueue(f"q{n}", f'{{"i": {i}}}', task_id=f"{n}-{i}")
                (claimed,) = store.claim([f"q{n}"], f"owner{n}", lease_ms=5_000, limit=1)
                store.renew([claimed.fence], lease_ms=5_000)
                assert set(store.ack([claimed.fence])) == {claimed.id}
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=traffic, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert all(store.size(f"q{n}") == 0 for n in range(4))


@pytest.fixture
def workers(bouncer: Bouncer, tmp_path: Path) -> Iterator[dict[str, object]]:
    prefix = f"p{os.getpid()}_{uuid.uuid4().hex[:6]}_"
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[object] = []

    def start(url: str, name: str, **env: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed at teardown
        logs.append(log)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "pooler_app",
                "worker",
                "-l",
                "info",
                "-c",
                "2",
                "-n",
                f"{name}@pooler",
                "--without-mingle",
                "--without-gossip",
            ],
            env=dict(
                os.environ,
                POOLER_URL=url,
                POOLER_PREFIX=prefix,
                PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                **env,
            ),
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        deadline = time.monotonic() + 30
        while f"{name}@pooler ready." not in (tmp_path / f"{name}.log").read_text(errors="ignore"):
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "worker not ready"
            time.sleep(0.1)
        return proc

    Store(bouncer.url(), table_prefix=prefix)  # the tables, before the workers start
    try:
        yield {"prefix": prefix, "start": start, "logs": tmp_path}
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        for log in logs:
            log.close()  # type: ignore[attr-defined]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("listen", ["polling", "direct-listen"])
def test_tasks_results_and_a_chord_through_the_pooler(
    bouncer: Bouncer, workers: dict, listen: str
) -> None:
    query = {"listen_port": str(bouncer.direct_port)} if listen == "direct-listen" else {}
    url = bouncer.url(**query)
    workers["start"](url, "w1")
    app = make_app(url, workers["prefix"])
    results = [app.tasks["pooler.add"].delay(i, i) for i in range(200)]
    assert [r.get(timeout=120) for r in results] == [2 * i for i in range(200)]
    header = [app.tasks["pooler.add"].s(i, 1) for i in range(20)]
    assert chord(header)(app.tasks["pooler.total"].s()).get(timeout=60) == sum(range(1, 21))
    log = (workers["logs"] / "w1.log").read_text(errors="ignore")
    assert "prepared statement" not in log and "Unrecoverable" not in log, log[-3000:]


@pytest.mark.timeout(120)
def test_a_killed_workers_task_is_taken_over_through_the_pooler(
    bouncer: Bouncer, workers: dict
) -> None:
    """Two workers; the one whose task is running is SIGKILLed. Attempt 2 starts on the
    other once attempt 1's lease (2 s, renewed every 0.67 s) has run out: between 1.3 and
    2 s after the kill, never before (no double run)."""
    url = bouncer.url()
    procs = {p.pid: p for p in (workers["start"](url, "w1"), workers["start"](url, "w2"))}
    app = make_app(url, workers["prefix"])
    result = app.tasks["pooler.slow"].delay(5.0)
    store = Store(url, table_prefix=workers["prefix"])
    m = store.tables.messages
    deadline = time.monotonic() + 30
    owner = None
    while owner is None:
        assert time.monotonic() < deadline, "attempt 1 never started"
        time.sleep(0.05)
        with store.engine.connect() as conn:
            owner = conn.execute(
                m.select().with_only_columns(m.c.lease_owner).where(m.c.lease_owner.isnot(None))
            ).scalar()
    holder = int(owner.split(":")[1])  # host:pid:nonce of the worker's main process
    time.sleep(1.0)  # attempt 1 is running
    os.killpg(procs[holder].pid, signal.SIGKILL)
    killed = time.time()
    outcome = result.get(timeout=60)
    assert outcome["attempt"] == 2 and outcome["pid"] not in (holder,)
    waited = outcome["started"] - killed
    assert 1.0 < waited < 10, waited  # after the lease ran out, and soon after


@pytest.mark.timeout(180)
def test_a_restart_of_pgbouncer_is_ridden_out(bouncer: Bouncer, workers: dict) -> None:
    """PgBouncer killed and started again while tasks run: every task published before,
    during and after completes once, and the same worker process carries on."""
    url = bouncer.url()
    worker = workers["start"](url, "w1")
    app = make_app(url, workers["prefix"])
    before = [app.tasks["pooler.slow"].delay(0.2) for _ in range(10)]
    time.sleep(0.5)  # some are running, some queued
    bouncer.stop()
    time.sleep(1.0)
    bouncer.start()
    after = []
    deadline = time.monotonic() + 60
    for i in range(20):  # a publish may meet the restart's disconnect once: Celery retries
        while True:
            try:
                after.append(app.tasks["pooler.add"].delay(i, 2))
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    # Each its own run: two pool processes may read the same time.time() (a 238 ns step).
    assert len({(r.get(timeout=90)["pid"], r.get()["started"]) for r in before}) == 10
    assert [r.get(timeout=90) for r in after] == [i + 2 for i in range(20)]
    assert worker.poll() is None  # recovered, not restarted
    store = Store(url, table_prefix=workers["prefix"])
    with store.engine.connect() as conn:  # nothing left: every message was acked once
        left = conn.execute(text(f"SELECT count(*) FROM {store.tables.messages.name}")).scalar()
    assert left == 0
    log = (workers["logs"] / "w1.log").read_text(errors="ignore")
    assert "Unrecoverable" not in log, log[-3000:]


def test_no_session_lock_is_left_on_pooled_connections(bouncer: Bouncer, workers: dict) -> None:
    engine = create_engine(bouncer.direct_url.replace("postgresql://", "postgresql+psycopg://"))
    # Every advisory lock of this session's database, by session (the tests run beside this
    # one have databases of their own; this one's other listeners may hold some).
    query = text(
        "SELECT l.pid, l.classid, l.objid, l.mode, a.application_name FROM pg_locks l "
        "JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND a.datname = current_database()"
    )

    def locks() -> dict[tuple[int, int, int, str], str]:
        with engine.connect() as conn:
            return {(r[0], r[1], r[2], r[3]): r[4] for r in conn.execute(query)}

    before = locks()
    url = bouncer.url(listen_port=str(bouncer.direct_port))
    worker = workers["start"](url, "w1")
    app = make_app(url, workers["prefix"])
    assert app.tasks["pooler.add"].delay(1, 1).get(timeout=60) == 2
    new = {k: v for k, v in locks().items() if k not in before}
    # The worker's handoff lock, and the waiting client's shared ones (sqlease._core.waiters),
    # are held by direct listen connections, never a pooled one.
    assert new and set(new.values()) == {"sqlease-listen"}, new
    held = {k: v for k, v in new.items() if k[3] == "ExclusiveLock"}  # the worker's
    assert held and len({k[0] for k in new if k[3] == "ShareLock"}) == 1, new  # the client's
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    deadline = time.monotonic() + 20
    while set(held) & set(locks()):  # the server notices the closed socket soon, not at once
        assert time.monotonic() < deadline, "the killed worker's lock stayed"
        time.sleep(0.2)
    engine.dispose()


def test_an_engines_first_connection_behind_the_pooler_is_left_idle(bouncer: Bouncer) -> None:
    """The check of the server's settings on a pool's first connection ends the transaction its
    ``SHOW`` statements began: else the first statement sent in autocommit on that connection
    fails (psycopg cannot switch a connection inside a transaction), which a prefork child's
    first task met as a FAILURE (the chaos run through PgBouncer), and the pooler keeps a
    server connection pinned to the idle client meanwhile. Checked in the process that made
    the engine and in a forked child (whose pool is new: the check runs there again)."""
    from psycopg.pq import TransactionStatus

    from sqlease._db.engine import _engines

    store = Store(bouncer.url(), table_prefix=unique_prefix())
    store.enqueue("q", "{}", task_id="t")
    engines = [e for e in _engines.values() if e.url.port == bouncer.port]
    assert engines

    def first_connections_idle() -> bool:
        idle = True
        for engine in engines:
            fairy = engine.raw_connection()
            driver = fairy.driver_connection
            idle = idle and driver.info.transaction_status == TransactionStatus.IDLE
            driver.autocommit = True  # what the direct lanes do with a pooled connection
            driver.autocommit = False
            fairy.close()
        return idle

    assert first_connections_idle()
    pid = os.fork()
    if pid == 0:  # the child: a new pool per engine (sqlease._db.engine, after fork)
        try:
            os._exit(0 if first_connections_idle() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
