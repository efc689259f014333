"""The soak's once-a-minute start-latency spikes, reproduced in 100 seconds.

A stream of ``soak.work`` tasks at RATE/s (default 150) to one worker (prefork -c 2) on the
test PostgreSQL (its own table prefix, dropped at the end). At set times: a ``celery inspect
ping`` process killed after 3 s (as benchmarks/soak.py does every minute), a process that only
imports the same modules (its CPU, no broker), an ``inspect ping`` that completes, and a second
killed one. Prints when each ran, then each 0.5 s bucket's count, p50 and max of the stream's
publish-to-start lateness in ms.

Usage: python benchmarks/soak_stall.py   (RATE=150 SECONDS=100 in the environment)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

RATE = float(os.environ.get("RATE", "150"))
PREFIX = f"stall{os.getpid()}_"
BROKER = "sqlease+postgresql://postgres@127.0.0.1:5432/test"
HERE = str(Path(__file__).resolve().parent)

sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
env = dict(
    os.environ,
    SOAK_BROKER=BROKER,
    SOAK_UDP=str(port),
    SOAK_TRANSPORT_OPTIONS=json.dumps({"table_prefix": PREFIX}),
    PYTHONPATH=HERE,
)
os.environ.update(env)
sys.path.insert(0, HERE)
import soak_app  # noqa: E402

late: dict[int, list[float]] = defaultdict(list)
t0 = time.time()


def listen() -> None:
    while True:
        data, _ = sock.recvfrom(65536)
        parts = data.decode().split()
        if len(parts) == 3 and parts[1] == "m":
            late[int((time.time() - t0) * 2)].append(float(parts[2]) * 1000)


threading.Thread(target=listen, daemon=True).start()
worker = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "soak_app",
        "worker",
        "-c",
        "2",
        "-P",
        "prefork",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "warning",
    ],
    cwd=HERE,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=open(Path(tempfile.gettempdir()) / "soak_stall_worker.log", "w"),  # noqa: SIM115
)
time.sleep(6)
t0 = time.time()
events: list[tuple[float, str]] = []


def publish() -> None:
    n = 0
    while time.time() - t0 < float(os.environ.get("SECONDS", "100")):
        due = t0 + n / RATE
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        soak_app.work.delay(time.time())
        n += 1


pub = threading.Thread(target=publish)
pub.start()
cli = [sys.executable, "-m", "celery", "-A", "soak_app", "inspect", "ping", "-t", "10"]
plan = [
    (15, "killed-inspect", cli, 3.0),
    (35, "imports-only", [sys.executable, "-c", "import celery.bin.celery, soak_app"], None),
    (
        55,
        "inspect-done",
        [sys.executable, "-m", "celery", "-A", "soak_app", "inspect", "ping", "-t", "1"],
        None,
    ),
    (75, "killed-inspect", cli, 3.0),
]
for at, name, cmd, kill_after in plan:
    time.sleep(max(0, t0 + at - time.time()))
    events.append((time.time() - t0, name + " start"))
    p = subprocess.Popen(
        cmd, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    if kill_after:
        time.sleep(kill_after)
        p.kill()
    p.wait()
    events.append((time.time() - t0, name + " end"))
pub.join()
time.sleep(3)
worker.terminate()
worker.wait(30)
for t, e in events:
    print(f"{t:6.1f} {e}")
for b in sorted(late):
    v = sorted(late[b])
    print(f"{b / 2:6.1f}s n={len(v):4d} p50={v[len(v) // 2]:7.1f} max={v[-1]:8.1f}")
import psycopg  # noqa: E402

with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as c:
    for (t,) in c.execute(
        "select tablename from pg_tables where tablename like %s",
        (PREFIX.replace("_", "\\_") + "%",),
    ).fetchall():
        c.execute(f'drop table if exists "{t}" cascade')
