"""A real PgBouncer in transaction mode in front of the test PostgreSQL.

Started once per session on a free port (Debian's ``pgbouncer``, run as the ``postgres`` user
when the tests run as root, since PgBouncer refuses to run as root), with small server pools so
that clients share server connections and any session state would leak between them. Outside
CI a missing ``pgbouncer`` skips these tests; in CI it fails them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from conftest import REQUIRE_PG

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Bouncer:
    port: int
    direct_url: str
    folder: Path
    proc: subprocess.Popen[bytes] | None = None
    _out: Any = None

    @property
    def direct_port(self) -> int:
        return int(make_url(self.direct_url).port or 5432)

    def url(self, **query: str) -> str:
        """The test database through the pooler (transaction mode), with ``query``."""
        direct = make_url(self.direct_url)
        return direct.set(
            port=self.port, query={"pooler": "transaction", **query}
        ).render_as_string(hide_password=False)

    def start(self) -> None:
        command = [BINARY, str(self.folder / "pgbouncer.ini")]
        if os.geteuid() == 0:
            command[1:1] = ["-u", "postgres"]
        self._out = open(self.folder / "pgbouncer.out", "ab")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen: {self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        if self._out is not None:
            self._out.close()
            self._out = None

    def log(self) -> str:
        try:
            return (self.folder / "pgbouncer.log").read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""


@pytest.fixture(scope="session")
def bouncer(pg_database_url: str) -> Iterator[Bouncer]:
    if not os.path.exists(BINARY):
        message = "pgbouncer is not installed (apt-get install pgbouncer)"
        if REQUIRE_PG:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    folder = Path(tempfile.mkdtemp(prefix="sqlease-pgbouncer-"))
    direct = make_url(pg_database_url)
    port = _free_port()
    (folder / "users.txt").write_text(f'"{direct.username or "postgres"}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={direct.host or '127.0.0.1'} port={direct.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"unix_socket_dir =\nauth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\ndefault_pool_size = 3\nmax_client_conn = 400\n"
        "server_reset_query =\n"
        f"logfile = {folder / 'pgbouncer.log'}\npidfile = {folder / 'pgbouncer.pid'}\n"
    )
    if os.geteuid() == 0:
        uid = pwd.getpwnam("postgres").pw_uid
        for path in [folder, *folder.iterdir()]:
            os.chown(path, uid, -1)
    found = Bouncer(port, pg_database_url, folder)
    found.start()
    try:
        yield found
    finally:
        found.stop()
        shutil.rmtree(folder, ignore_errors=True)
