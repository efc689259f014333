"""What every example's run.py shares: workers in their own process group, the folder for the
databases, waiting, and the exit status. (Not part of sqlease; examples only.)"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def say(text: str = "") -> None:
    print(text, flush=True)


class Worker:
    """``celery -A tasks worker`` in its own session: it and its pool child form one process
    group, so ``os.killpg`` kills both at once, like a crash or an OOM kill of the machine."""

    def __init__(self, name: str, folder: Path, code: Path) -> None:
        self.name = name
        self.log = folder / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool", "prefork"]
        command += ["-c", "1", "-l", "warning", "-n", f"{name}@%h"]
        command += ["--without-mingle", "--without-gossip"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=code,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def kill(self) -> None:
        """SIGKILL the whole process group: no cleanup, no ack, no goodbye."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Celery's warm shutdown (SIGTERM), or SIGKILL if it takes too long."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def folder_from_args(name: str, stale: Sequence[str], doc: str | None) -> Path:
    """The folder for databases and logs (``--dir``, ``$SQLEASE_EXAMPLE_DIR`` or a new
    temporary one), cleared of an earlier run's files and exported for tasks.py."""
    parser = argparse.ArgumentParser(description=(doc or name).splitlines()[0])
    parser.add_argument(
        "--dir",
        default=os.environ.get("SQLEASE_EXAMPLE_DIR"),
        help="folder for the databases and worker logs (default: a new temporary folder)",
    )
    folder = Path(parser.parse_args().dir or tempfile.mkdtemp(prefix=f"sqlease-{name}-"))
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for file in stale:
        for suffix in ("", "-wal", "-shm"):
            (folder / (file + suffix)).unlink(missing_ok=True)
    os.environ["SQLEASE_EXAMPLE_DIR"] = str(folder)  # tasks.py (and the workers) read it
    return folder


def wait_for(what: str, predicate: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return value


def run(folder: Path, scenario: Callable[[Path, list[Worker]], list[str]]) -> int:
    """Run a scenario, stop its workers whatever happens, report; the exit status."""
    workers: list[Worker] = []
    try:
        failures = scenario(folder, workers)
    except Exception as exc:
        failures = [f"{type(exc).__name__}: {exc}"]
    finally:
        for worker in workers:
            worker.stop()
    if failures:
        for failure in failures:
            say(f"FAILED: {failure}")
        for worker in workers:
            say(f"\n--- last lines of {worker.log} ---\n{worker.tail()}")
        return 1
    return 0
