"""Throwaway PostgreSQL clusters: for the failover test a primary and its streaming standby
(``Clusters``), for the chaos benchmark one server it may restart and stop (``Server``), made
with ``initdb`` (and ``pg_basebackup``) in a temporary folder, on ports of their own, started
and stopped with ``pg_ctl`` (by their own data folder: nothing else is touched, least of all the
machine's shared server, which other test sessions use).

Run as root (CI), the server programs run as the ``postgres`` user, who owns the folder.
Standard library only: ``benchmarks/chaos.py`` imports this file too."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def bindir() -> Path | None:
    """The newest installed PostgreSQL's programs (Debian's layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    return Path(found[-1]).parent if found else None


def _version(path: str) -> float:
    try:
        return float(Path(path).parent.parent.name)
    except ValueError:
        return 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _programs(root: Path) -> tuple[Path, bool]:
    """The server programs, and whether to run them as ``postgres`` (``root`` then its)."""
    found = bindir()
    if found is None:
        raise RuntimeError("no PostgreSQL server programs under /usr/lib/postgresql")
    as_root = os.geteuid() == 0
    if as_root:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    return found, as_root


def _run(
    bin_: Path, as_root: bool, root: Path, *args: str, check: bool = True, timeout: float = 60
) -> str:
    command = [str(bin_ / args[0]), *args[1:]]
    if as_root:
        command = ["runuser", "-u", "postgres", "--", *command]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, cwd=root
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


#: Settings of a throwaway server: its segments in the data folder, removed with it (an
#: immediate stop leaves POSIX ones behind in /dev/shm); no fsync (a test's data, not a
#: machine's: a crash of the server process is what the tests make, not of the machine).
THROWAWAY = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "dynamic_shared_memory_type": "mmap",
    "fsync": "off",
    "full_page_writes": "off",
}


class Server:
    """One throwaway PostgreSQL server on a port of its own, database ``postgres``, trust
    authentication: started, restarted (``restart``) and stopped by its own data folder."""

    def __init__(self, *, max_connections: int = 100) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sqlease-pg-"))
        self.bin, self._as_root = _programs(self.root)
        self.port = free_port()
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._max_connections = max_connections
        self._running = False

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        return _run(self.bin, self._as_root, self.root, *args, check=check, timeout=timeout)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self.run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "-E", "UTF8")
        settings = {
            **THROWAWAY,
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_connections": str(self._max_connections),
        }
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self._pg_ctl("start")
        self._running = True

    def restart(self) -> None:
        """A fast restart: every connection is closed, the server is back on the same port."""
        self._pg_ctl("restart", "-m", "fast")

    def _pg_ctl(self, action: str, *more: str) -> None:
        self.run("pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-w", *more)

    def stop(self) -> None:
        if self._running:
            self.run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", check=False)
            self._running = False
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Node:
    name: str
    data: Path
    port: int
    log: Path


class Clusters:
    """A primary (``primary``) and a standby streaming from it (``standby``)."""

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.root = Path(tempfile.mkdtemp(prefix="sqlease-failover-"))
        self.bin, self._as_root = _programs(self.root)
        self.primary = Node("primary", self.root / "primary", free_port(), self.root / "p.log")
        self.standby = Node("standby", self.root / "standby", free_port(), self.root / "s.log")
        self._started: list[Node] = []

    def _run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        return _run(self.bin, self._as_root, self.root, *args, check=check, timeout=timeout)

    def url(self, database: str = "postgres") -> str:
        """The multi-host URL: whichever of the two accepts writes."""
        return (
            f"postgresql://postgres@/{database}?host=127.0.0.1,127.0.0.1"
            f"&port={self.primary.port},{self.standby.port}&target_session_attrs=read-write"
            "&connect_timeout=2"
        )

    def direct(self, node: Node, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{node.port}/{database}"

    def start(self) -> None:
        p = self.primary
        self._run("initdb", "-D", str(p.data), "--auth=trust", "-U", "postgres", "-E", "UTF8")
        settings = {
            # A primary killed by the test, not the machine: the standby holds what counts.
            **THROWAWAY,
            "port": str(p.port),
            "unix_socket_directories": f"'{self.root}'",
            "wal_level": "replica",
            "max_wal_senders": "5",
            "hot_standby": "on",
            "synchronous_standby_names": "'*'" if self.synchronous else "''",
        }
        with open(p.data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self._pg_ctl(p, "start")
        self._run(
            "pg_basebackup",
            "-h", "127.0.0.1", "-p", str(p.port), "-U", "postgres",
            "-D", str(self.standby.data), "-R", "-X", "stream",
        )  # fmt: skip
        with open(self.standby.data / "postgresql.conf", "a") as conf:
            conf.write(f"port = {self.standby.port}\n")
        self._pg_ctl(self.standby, "start")
        self._wait_streaming()

    def _pg_ctl(self, node: Node, action: str, *more: str) -> None:
        self._run("pg_ctl", action, "-D", str(node.data), "-l", str(node.log), "-w", *more)
        if action == "start":
            self._started.append(node)

    def _wait_streaming(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        query = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        while time.monotonic() < deadline:
            out = self._run(
                "psql", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
                "-Atc", query, check=False,
            )  # fmt: skip
            if out.strip() == "1":
                return
            time.sleep(0.1)
        raise RuntimeError("the standby never streamed")

    def crash_primary(self) -> None:
        """The primary dies at once: every connection drops, no checkpoint (``immediate``)."""
        self._run("pg_ctl", "stop", "-D", str(self.primary.data), "-m", "immediate", "-w")

    def promote_standby(self) -> None:
        """The standby becomes the primary. It has no standby of its own, so it no longer
        waits for one (as Patroni does when the last synchronous standby is gone, unless
        ``synchronous_mode_strict``): with ``synchronous_standby_names`` copied from the old
        primary, every commit would wait forever."""
        self._run("pg_ctl", "promote", "-D", str(self.standby.data), "-w")
        for statement in (
            "ALTER SYSTEM SET synchronous_standby_names = ''",
            "SELECT pg_reload_conf()",
        ):
            self._run(
                "psql", "-h", "127.0.0.1", "-p", str(self.standby.port), "-U", "postgres",
                "-Atc", statement,
            )  # fmt: skip

    def stop(self) -> None:
        for node in self._started:
            self._run("pg_ctl", "stop", "-D", str(node.data), "-m", "immediate", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
