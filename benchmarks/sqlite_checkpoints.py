"""SQLite commit cost with checkpoints inside the commits (SQLite's default) and with them on
sqlease's checkpoint thread (sqlease._db.sqlite.checkpoints), in one run.

Each mode: N single-row write transactions (BEGIN IMMEDIATE, INSERT of about 900 bytes,
COMMIT) on a fresh WAL file with synchronous=NORMAL, as sqlease's engine sets it; reports
transactions/s, CPU per transaction and the commit's mean, p50, p99.9 and max.

Usage: python benchmarks/sqlite_checkpoints.py [--transactions 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlease._db.sqlite.checkpoints import Checkpointer


def run(path: Path, transactions: int, *, thread: bool) -> dict[str, Any]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    checkpointer = None
    if thread:
        conn.execute("PRAGMA wal_autocheckpoint=0")
        checkpointer = Checkpointer()
        checkpointer.watch(str(path))
    conn.execute("CREATE TABLE m (id INTEGER PRIMARY KEY AUTOINCREMENT, payload TEXT, state TEXT)")
    conn.execute("CREATE INDEX m_state ON m (state, id)")
    payload = "x" * 900
    commits: list[float] = []
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(transactions):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO m (payload, state) VALUES (?, 'ready')", (payload,))
        t = time.perf_counter()
        conn.execute("COMMIT")
        commits.append(time.perf_counter() - t)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    if checkpointer is not None:
        checkpointer.stop()
    conn.close()
    commits.sort()
    return {
        "mode": "checkpoint thread" if thread else "checkpoints in commits (SQLite default)",
        "transactions_per_s": round(transactions / elapsed),
        "cpu_per_transaction_us": round(1e6 * cpu / transactions),
        "commit_mean_us": round(1e6 * statistics.mean(commits)),
        "commit_p50_us": round(1e6 * commits[len(commits) // 2]),
        "commit_p999_us": round(1e6 * commits[int(len(commits) * 0.999)]),
        "commit_max_ms": round(1e3 * commits[-1], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transactions", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sqlease-ckpt-") as tmp:
        for thread in (False, True, False, True):
            path = Path(tmp) / f"bench-{thread}-{time.monotonic_ns()}.db"
            print(json.dumps(run(path, args.transactions, thread=thread)), flush=True)
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(f"{path}{suffix}"):
                    os.remove(f"{path}{suffix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
