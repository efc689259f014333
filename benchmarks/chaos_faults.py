"""The faults of benchmarks/chaos.py, and what they are made on: real ``celery worker``
processes, a throwaway PostgreSQL server of the run's own (never the machine's shared one: the
run restarts it and terminates its connections), an optional PgBouncer in transaction mode in
front of it, and one TCP proxy per worker between it and the database, which can cut that one
worker off (a partition: no reset, no error, every socket stays open).

Every fault is logged with its wall-clock times (``faults``): the checks compare them with what
the tasks recorded and with the database's timeline."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The throwaway server and the partitioning proxy are the end-to-end tests' own (standard
# library only), shared rather than copied.
sys.path.insert(0, str(HERE.parent / "tests" / "e2e"))

from pg_clusters import Server, free_port  # noqa: E402
from tcp_proxy import StallingProxy  # noqa: E402

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class Bouncer:
    """A PgBouncer in transaction mode on a port of its own, in front of ``upstream_port``
    (run as ``postgres`` when we are root: PgBouncer refuses to run as root)."""

    def __init__(self, upstream_port: int) -> None:
        if not os.path.exists(PGBOUNCER):
            raise RuntimeError("pgbouncer is not installed (apt-get install pgbouncer)")
        self.folder = Path(tempfile.mkdtemp(prefix="sqlease-chaos-pgbouncer-"))
        self.port = free_port()
        (self.folder / "users.txt").write_text('"postgres" ""\n')
        (self.folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={upstream_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {self.folder / 'users.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 20\nmax_client_conn = 1000\n"
            "server_reset_query =\n"
            f"logfile = {self.folder / 'pgbouncer.log'}\npidfile = {self.folder / 'pid'}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [PGBOUNCER, str(self.folder / "pgbouncer.ini")]
        if os.geteuid() == 0:
            import pwd

            uid = pwd.getpwnam("postgres").pw_uid
            for path in [self.folder, *self.folder.iterdir()]:
                os.chown(path, uid, -1)
            command[1:1] = ["-u", "postgres"]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            time.sleep(0.05)
        raise RuntimeError("pgbouncer did not listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)


class Busy:
    """Which workers are executing a task now, from the records' tails (read as they grow): a
    stall or a partition picks one of those, so that it cuts off work in flight."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}
        self._open: dict[tuple[str, int], str] = {}

    def workers(self) -> set[str]:
        for path in self.folder.glob("*.jsonl"):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                r = json.loads(line)
                key = (r["task"], r["attempt"])
                if r["kind"] == "begin":
                    self._open[key] = r["worker"]
                elif r["kind"] in ("end", "lease_lost"):
                    self._open.pop(key, None)
        return set(self._open.values())


@dataclass
class Worker:
    label: str
    proc: subprocess.Popen[bytes]
    proxy: StallingProxy | None
    busy: bool = False  # stopped or cut off: no other fault picks it meanwhile


@dataclass
class Chaos:
    db: str  # pg, pgbouncer or sqlite
    lease: float
    prefix: str
    tmp: Path
    sqlite_url: str = ""
    server: Server | None = None
    bouncer: Bouncer | None = None
    workers: list[Worker] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    pending: list[tuple[float, Callable[[], None]]] = field(default_factory=list)
    terminated: int = 0
    _busy: Busy | None = None

    @property
    def records(self) -> Path:
        return self.tmp / "records"

    def setup(self) -> str:
        """Start what the workers run on; the URL the checks read the database with."""
        self.records.mkdir(exist_ok=True)
        self._busy = Busy(self.records)
        if self.db == "sqlite":
            return self.sqlite_url
        self.server = Server(max_connections=300)
        self.server.start()
        if self.db == "pgbouncer":
            self.bouncer = Bouncer(self.server.port)
            self.bouncer.start()
        return self.server.url()

    def worker_url(self, proxy: StallingProxy | None) -> str:
        if proxy is None:
            return f"sqlease+{self.sqlite_url}"
        query = "?pooler=transaction" if self.bouncer is not None else ""
        return f"sqlease+postgresql://postgres@127.0.0.1:{proxy.port}/postgres{query}"

    def start_worker(self) -> Worker:
        proxy = None
        if self.server is not None:
            upstream = self.bouncer.port if self.bouncer is not None else self.server.port
            proxy = StallingProxy(("127.0.0.1", upstream))
        label = f"w{len(self.workers)}-{uuid.uuid4().hex[:4]}"
        env = dict(
            os.environ,
            CHAOS_URL=self.worker_url(proxy),
            CHAOS_PREFIX=self.prefix,
            CHAOS_LEASE=str(self.lease),
            CHAOS_WORKER=label,
            CHAOS_RECORDS=str(self.records),
            PYTHONPATH=str(HERE),
        )
        log = (self.tmp / "workers.log").open("ab")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "chaos_app",
                "worker",
                "--pool",
                "prefork",
                "-c",
                "2",
                "-l",
                "warning",
                "-n",
                f"chaos-{label}@%h",
                "--without-mingle",
                "--without-gossip",
            ],
            env=env,
            cwd=HERE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        worker = Worker(label, proc, proxy)
        self.workers.append(worker)
        return worker

    def _victim(self, *, proxied: bool = False, working: bool = False) -> Worker | None:
        alive = [
            w
            for w in self.workers
            if w.proc.poll() is None and not w.busy and (w.proxy is not None or not proxied)
        ]
        if working:  # one with a task in flight, if any (a killed one's never end: skip them)
            executing = self._busy.workers() if self._busy is not None else set()
            alive = [w for w in alive if w.label in executing] or alive
        return random.choice(alive) if alive else None

    def _log(self, kind: str, worker: Worker | None = None, **more: Any) -> dict[str, Any]:
        fault = {"kind": kind, "t": time.time(), "worker": worker and worker.label, **more}
        self.faults.append(fault)
        return fault

    def kill(self) -> bool:
        """SIGKILL a worker's whole process group (its pool too), start a new one."""
        victim = self._victim()
        if victim is None:
            return False
        self._log("kill", victim)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        if victim.proxy is not None:
            victim.proxy.close()
        self.start_worker()
        return True

    def stall(self) -> bool:
        """SIGSTOP a worker (its pool too) for 1.6 x the lease, then SIGCONT it."""
        victim = self._victim(working=True)
        if victim is None:
            return False
        victim.busy = True
        fault = self._log("stall", victim)
        os.killpg(victim.proc.pid, signal.SIGSTOP)

        def resume() -> None:
            fault["end"] = time.time()
            os.killpg(victim.proc.pid, signal.SIGCONT)
            victim.busy = False

        self.pending.append((time.monotonic() + self.lease * 1.6, resume))
        return True

    def partition(self) -> bool:
        """Cut one worker off from the database for 2.5 x the lease (its proxy stops
        forwarding both ways, sockets open), then heal."""
        victim = self._victim(proxied=True, working=True)
        if victim is None or victim.proxy is None:
            return False
        victim.busy = True
        proxy = victim.proxy
        proxy.stall()
        fault = self._log("partition", victim)

        def heal() -> None:
            fault["end"] = time.time()
            fault["held_bytes"] = proxy.held_to_server
            proxy.resume()
            victim.busy = False

        self.pending.append((time.monotonic() + self.lease * 2.5, heal))
        return True

    def tick(self) -> None:
        """End the stalls and partitions whose time has come."""
        now = time.monotonic()
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, action in due:
            action()

    def disconnect(self) -> bool:
        """Terminate every client connection to the run's own database (the workers', or
        PgBouncer's server connections), not this one."""
        import psycopg

        assert self.server is not None
        try:
            with psycopg.connect(self.server.url(), autocommit=True, connect_timeout=5) as conn:
                rows = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND backend_type = 'client backend'"
                ).fetchall()
        except psycopg.OperationalError:  # the server is restarting: next round
            return False
        self._log("disconnect", connections=len(rows))
        self.terminated += len(rows)
        return True

    def restart(self) -> bool:
        assert self.server is not None
        fault = self._log("restart")
        self.server.restart()
        fault["end"] = time.time()
        return True

    def stop_all(self) -> None:
        for _, action in self.pending:
            action()
        self.pending = []
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
            if worker.proxy is not None:
                worker.proxy.close()

    def teardown(self) -> None:
        if self.bouncer is not None:
            self.bouncer.stop()
        if self.server is not None:
            self.server.stop()
