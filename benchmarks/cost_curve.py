"""The cost curve: claim+ack throughput, claim latency, enqueue-to-start latency and bytes per
task as the backlog grows from 10,000 to 1,000,000 ready tasks, on SQLite and PostgreSQL.

For each backend, round and backlog size N, on a fresh database (SQLite: a new WAL file in a
temporary directory; PostgreSQL: a new database, dropped afterwards):

1. **Fill** queue ``q``, in this order, with rows written exactly as ``Store.enqueue_many``
   writes them (the message, its ``enqueued`` event and its task row), through bulk
   ``INSERT ... SELECT`` statements (PostgreSQL: ``generate_series``; SQLite: a recursive
   CTE) instead of one statement per message:

   - ``--runs`` runs (default 10,000): run ``run-k`` has 1 + k % 3 messages (~2 on average).
     Then every run's first message is claimed through ``Store.claim`` by an owner
     ``runner`` with a 6-hour lease, as long tasks in progress: the runs table holds one row
     per run and the runs' later messages wait behind their leased head;
   - ``--eta`` scheduled messages (default 100,000), due 30 minutes to 6 hours from now;
   - N ready messages, due an hour ago: the backlog the workers claim from. They come first
     in delivery order (``priority DESC, available_at_ms, id``), so the claimers take them
     and the runs' waiting messages and the ETA rows stay in the tables behind them
     (``--runs-at-head`` puts the runs ahead of the backlog instead, due two hours ago: then
     every claim passes their leased heads and waiting messages first).
   - With ``--held H`` (default 0: none), between the runs and the ETA messages, H held
     messages on ``q`` too, due three hours ago: ahead of the backlog in delivery order, so
     that a claim would pass every one of them if they stayed in its way. The first half
     carry concurrency key ``hot`` with limit 1 (task ``bench.hot``, the key in their
     headers), whose one place a holder claimed (a 6-hour lease) before they were written;
     the rest are of task ``bench.rated``, under a task rate limit of 1/h
     (``Store.set_rate_limits``) whose one delivery was claimed and acked before they were
     written. Then **the sweep**: ``Store.park_held(["q"])``, what a worker's fetcher runs
     about once a second while it claims, called until it moves nothing (timed, in the
     JSON's ``sweep``). It parks the gated ones at their gate (out of the claim index) and
     gives the rated ones their turns under the rate as their due times (an hour apart,
     from an hour on).

   Payloads are real Celery messages (as the transport stores ``add.delay(2, 3)``: 932
   bytes, 962 with an ETA) with the task id in them. The fill is then checked: messages
   published through ``Store.enqueue_many`` (one plain, one with a delay, one waiting
   behind its run's head, one gated, one rate-limited) are compared column by column with
   bulk rows of the same kind in the messages, events and tasks tables (then deleted
   again), before the sweep. After it, one claim must return the backlog's first message,
   whose payload names its task id (it is acked), ``Store.size("q")`` must count the
   backlog, the runs' waiting messages and the held ones, the runs table must hold one row
   per run, and the held messages must all be parked at the gate or given a turn later
   than now, none claimable, with the gate's place still held. Then statistics, as a
   production database has them: PostgreSQL ``ANALYZE`` and a ``CHECKPOINT``; SQLite
   ``PRAGMA wal_checkpoint(TRUNCATE)``, ``ANALYZE`` and ``PRAGMA optimize``
   (``--no-analyze`` skips them). No ``VACUUM``: on PostgreSQL the rows the sweep moved
   leave their old entries in the claim index until vacuum.
2. **Bytes per task**, per table and per index: PostgreSQL ``pg_total_relation_size``
   (heap + TOAST + indexes), ``pg_relation_size``, ``pg_indexes_size``; SQLite the ``dbstat``
   virtual table (else the file size). Divided by the table's own rows ("bytes/row") and by
   all the messages in the database ("bytes/task").
3. **Claim+ack throughput**: ``--workers`` processes (default 2), after a warm-up on another
   queue, run ``--windows`` windows (default 4). In each they wait at a start line, then loop
   ``claim(["q"], owner, lease_ms=60000, limit=32)`` + ``ack`` until they have taken
   ``--deliveries`` messages together (default 5,000, the same at every size, at most half the
   backlog); the parent then tops the backlog up to N again (bulk, at its tail) before the
   next window. The processes live through all the windows, as a worker does. Every message
   a worker claims must be of the backlog (no held message, no run's, no ETA message: the
   run fails otherwise), and after the last window the held messages must still be as the
   sweep left them. Throughput of
   a window = deliveries / (last finish - first start); a size's throughput is the median of
   its windows. **Claim latency** is each ``Store.claim`` call on the big queue, timed in the
   workers (a batch of up to 32): p50 and p99 over all the calls of all windows.
4. **Enqueue-to-start latency** (probes), with the backlog still in the tables and nothing
   else running: one claimer process waits on queue ``probe`` as an idle worker does, with the
   store's own wake-up (PostgreSQL: LISTEN/NOTIFY on a connection of its own; SQLite: the
   ``data_version`` watch, checked every 5 ms), claiming as soon as it is woken (and every
   0.2 s anyway). The parent publishes ``--probes`` messages (default 200) with
   ``Store.enqueue("probe", ...)``, 10-30 ms apart (random). Probe latency = from just before
   the ``enqueue`` call in the publisher to just after ``claim`` returned the message in the
   claimer (``time.monotonic``: CLOCK_MONOTONIC, one clock for all processes on Linux). It
   includes the publish and its commit (PostgreSQL waits for the WAL flush of a publish), the
   wake-up, and the claim. A task on its own queue is next in line by construction; a probe
   with a higher priority on ``q`` would sit at the same place (the head of the claim index),
   so its claim would cost the same, plus the wait for a busy worker's current batch. The
   publish call alone is reported too ("enqueue p50/p99").
5. **Ratio**: each size's throughput / the smallest size's (10,000) throughput of the same
   backend and round; the median over ``--rounds`` (default 3; each round fills every size
   again on fresh databases, in an order that rotates from round to round). The goal: >= 0.8
   at 1,000,000.
6. **Held against none** (``--held-compare``, with ``--held H``): each size is measured
   twice in each round, with the H held messages and without, on fresh databases, the two
   in alternating order from round to round. Per round: the held run's throughput, claim
   p50 and claim p99 over the other's; reported with their medians over the rounds (the
   Markdown's last table, the JSON's ``held_compare``).

PostgreSQL also gets ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim statement as the workers run
it (a generic plan), right after the fill and after the throughput phase, in a transaction
that is rolled back; SQLite its ``EXPLAIN QUERY PLAN``. Both go in the JSON.

    .venv/bin/python benchmarks/cost_curve.py                 # both databases, 3 sizes
    .venv/bin/python benchmarks/cost_curve.py --sizes 2000,20000 --eta 5000 --runs 1000
    .venv/bin/python benchmarks/cost_curve.py --sizes 1000000 --held 100000 --held-compare

Writes a Markdown table to stdout (ready for docs/performance.md), progress to stderr, and
JSON to benchmarks/results/cost-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
from psycopg import sql as pgsql
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import sqlease
from sqlease import Message, NewMessage, Store
from sqlease._db.engine import dispose_all
from sqlease._db.migrations import run_migration
from sqlease.types import Fence

HERE = Path(__file__).resolve().parent
DEFAULT_PG_URL = os.environ.get(
    "SQLEASE_BENCH_PG_URL",
    os.environ.get("SQLEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"),
)
PREFIX = "sqlease_"
QUEUE = "q"
PROBE_QUEUE = "probe"
WARMUP_QUEUE = "warmup"
TASK_NAME = "bench.add"
LEASE_MS = 60_000
RUNNER_LEASE_MS = 6 * 3600_000
BACKLOG_AGE_MS = 3600_000  # the backlog became due an hour ago
ETA_FROM_MS, ETA_TO_MS = 30 * 60_000, 6 * 3600_000
MAX_ATTEMPTS = 3  # Store's default
ID = "@ID@"
# Held work (``--held``): due three hours ago, ahead of the backlog in delivery order.
HELD_AGE_MS = 3 * BACKLOG_AGE_MS
GATED_TASK = "bench.hot"  # its messages carry concurrency key GATE_KEY, limit 1
GATE_KEY = "hot"
RATED_TASK = "bench.rated"  # a task-name rate limit of HELD_RATE
HELD_RATE = "1/h"
HOLDER = "holder"

# ``add.delay(2, 3)`` as the transport stores it (the task id in place of ID).
_BODY = "W1syLCAzXSwge30sIHsiY2FsbGJhY2tzIjogbnVsbCwgImVycmJhY2tzIjogbnVsbCwgImNoYWluIjogbnVsbCwgImNob3JkIjogbnVsbH1d"  # noqa: E501


def celery_payload(
    eta: str | None = None, task: str = TASK_NAME, extra: dict[str, Any] | None = None
) -> str:
    headers = {
        "lang": "py",
        "task": task,
        "id": ID,
        "shadow": None,
        "eta": eta,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": ID,
        "parent_id": None,
        "argsrepr": "(2, 3)",
        "kwargsrepr": "{}",
        "origin": "gen10088@bench",
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    } | (extra or {})
    properties = {
        "correlation_id": ID,
        "reply_to": "0b9ebd8a-6107-38bf-ab08-c4a08433ba35",
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": QUEUE},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": ID,
    }
    message = {
        "body": _BODY,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": properties,
    }
    return json.dumps(message)


PLAIN_PAYLOAD = celery_payload()
ETA_PAYLOAD = celery_payload(eta="2026-12-03T05:46:03.897983+00:00")
GATED_PAYLOAD = celery_payload(
    task=GATED_TASK, extra={"concurrency_key": GATE_KEY, "concurrency_limit": 1}
)
RATED_PAYLOAD = celery_payload(task=RATED_TASK)


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pct(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest-rank method, or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(q * len(ordered) + 0.999999)))
    return ordered[rank - 1]


def _ms(values: Sequence[float]) -> dict[str, float | int | None]:
    p50, p99 = _pct(values, 0.50), _pct(values, 0.99)
    return {
        "n": len(values),
        "p50_ms": None if p50 is None else round(p50 * 1000, 3),
        "p99_ms": None if p99 is None else round(p99 * 1000, 3),
        "max_ms": round(max(values) * 1000, 3) if values else None,
    }


# ---- fill -------------------------------------------------------------------------------------

MSG_COLS = (
    "queue, payload, priority, available_at_ms, created_at_ms, run_id, task_id, state, "
    "attempt, max_attempts, task_name, gate_key, gate_limit"
)


def _pg_fill_sql(store: Store) -> dict[str, str]:
    """PostgreSQL: the bulk statements (each row as the publish statement writes it)."""
    t = store.tables
    m, e, k = t.messages.name, t.events.name, t.tasks.name

    def messages(source: str, run_id: str, available: str, payload: str) -> str:
        return (
            f"INSERT INTO {m} ({MSG_COLS}) SELECT CAST(:queue AS TEXT), "
            f"replace({payload}, '{ID}', s.tid), 0, {available}, CAST(:now AS BIGINT), "
            f"{run_id}, s.tid, 'ready', 0, :max_attempts, CAST(:task_name AS TEXT), "
            "CAST(:gate_key AS TEXT), CAST(:gate_limit AS INTEGER) "
            f"FROM ({source}) s"
        )

    uuid_of = "gen_random_uuid()::text AS tid"
    return {
        "runs": messages(
            f"SELECT g.k, {uuid_of} FROM generate_series(0, 2) j(j) "
            "CROSS JOIN generate_series(0, CAST(:n AS INTEGER) - 1) g(k) "
            "WHERE j.j <= g.k % 3 ORDER BY j.j, g.k",
            "'run-' || s.k",
            "CAST(:now AS BIGINT)",
            "CAST(:payload AS TEXT)",
        ),
        "eta": messages(
            f"SELECT {uuid_of} FROM generate_series(1, CAST(:n AS INTEGER))",
            "NULL",
            "CAST(:now AS BIGINT) + :eta_from + CAST(floor(random() * :eta_span) AS BIGINT)",
            "CAST(:payload AS TEXT)",
        ),
        "ready": messages(
            f"SELECT {uuid_of} FROM generate_series(1, CAST(:n AS INTEGER))",
            "NULL",
            "CAST(:now AS BIGINT)",
            "CAST(:payload AS TEXT)",
        ),
        "events": (
            f"INSERT INTO {e} (task_id, message_id, attempt, kind, data, at_ms) "
            f"SELECT task_id, id, 0, 'enqueued', NULL, created_at_ms FROM {m} "
            "WHERE id > :after ORDER BY id"
        ),
        "tasks": (
            f"INSERT INTO {k} (task_id, task_name, queue, attempt, run_id, state, checkpoint, "
            "revision, created_at_ms, updated_at_ms, group_id) "
            "SELECT task_id, task_name, queue, attempt, run_id, NULL, '{}', 0, created_at_ms, "
            f"created_at_ms, NULL FROM {m} WHERE id > :after ORDER BY id"
        ),
    }


_SQLITE_UUID = (
    "lower(hex(randomblob(4))) || '-' || lower(hex(randomblob(2))) || '-4' || "
    "substr(lower(hex(randomblob(2))), 2) || '-' || substr('89ab', 1 + abs(random()) % 4, 1) "
    "|| substr(lower(hex(randomblob(2))), 2) || '-' || lower(hex(randomblob(6)))"
)


def _sqlite_fill_sql(store: Store) -> dict[str, str]:
    """SQLite: the same bulk statements (a recursive CTE for the series; the task id is
    materialized once per row, so the payload carries the same one)."""
    t = store.tables
    m, e, k = t.messages.name, t.events.name, t.tasks.name
    series = "WITH RECURSIVE g(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM g WHERE k + 1 < :n)"

    def messages(source: str, run_id: str, available: str) -> str:
        return (
            f"{series}, s AS MATERIALIZED ({source}) "
            f"INSERT INTO {m} ({MSG_COLS}) SELECT :queue, replace(:payload, '{ID}', s.tid), 0, "
            f"{available}, :now, {run_id}, s.tid, 'ready', 0, :max_attempts, :task_name, "
            ":gate_key, :gate_limit FROM s ORDER BY s.rn"
        )

    return {
        "runs": messages(
            f"SELECT g.k, j.j * :n + g.k AS rn, {_SQLITE_UUID} AS tid FROM g "
            "CROSS JOIN (SELECT 0 AS j UNION ALL SELECT 1 UNION ALL SELECT 2) j "
            "WHERE j.j <= g.k % 3",
            "'run-' || s.k",
            ":now",
        ),
        "eta": messages(
            f"SELECT g.k AS rn, {_SQLITE_UUID} AS tid FROM g",
            "NULL",
            ":now + :eta_from + abs(random()) % :eta_span",
        ),
        "ready": messages(f"SELECT g.k AS rn, {_SQLITE_UUID} AS tid FROM g", "NULL", ":now"),
        "events": (
            f"INSERT INTO {e} (task_id, message_id, attempt, kind, data, at_ms) "
            f"SELECT task_id, id, 0, 'enqueued', NULL, created_at_ms FROM {m} "
            "WHERE id > :after ORDER BY id"
        ),
        "tasks": (
            f"INSERT INTO {k} (task_id, task_name, queue, attempt, run_id, state, checkpoint, "
            "revision, created_at_ms, updated_at_ms, group_id) "
            "SELECT task_id, task_name, queue, attempt, run_id, NULL, '{}', 0, created_at_ms, "
            f"created_at_ms, NULL FROM {m} WHERE id > :after ORDER BY id"
        ),
    }


def _max_id(conn: Any, store: Store) -> int:
    return int(
        conn.execute(
            text(f"SELECT COALESCE(max(id), 0) FROM {store.tables.messages.name}")
        ).scalar()
    )


# The held kinds: ready messages (the ``ready`` statement) of their own task name, the gated
# ones with their concurrency key and limit, as a publish writes them from the headers.
_HELD_KINDS: dict[str, tuple[str, str | None, int | None]] = {
    "gated": (GATED_TASK, GATE_KEY, 1),
    "rated": (RATED_TASK, None, None),
}


def _bulk(store: Store, kind: str, n: int, now: int, payload: str) -> list[int]:
    """Insert ``n`` messages of ``kind`` with their events and task rows, in one
    transaction; their first and last message ids."""
    if n <= 0:
        return [0, -1]
    statements = _pg_fill_sql(store) if store.is_postgresql else _sqlite_fill_sql(store)
    task_name, gate_key, gate_limit = _HELD_KINDS.get(kind, (TASK_NAME, None, None))
    params = {
        "n": n,
        "now": now,
        "queue": QUEUE,
        "payload": payload,
        "task_name": task_name,
        "gate_key": gate_key,
        "gate_limit": gate_limit,
        "max_attempts": MAX_ATTEMPTS,
        "eta_from": ETA_FROM_MS,
        "eta_span": ETA_TO_MS - ETA_FROM_MS,
    }
    with store.engine.begin() as conn:
        after = _max_id(conn, store)
        conn.execute(text(statements["ready" if kind in _HELD_KINDS else kind]), params)
        conn.execute(text(statements["events"]), {"after": after})
        conn.execute(text(statements["tasks"]), {"after": after})
        return [after + 1, _max_id(conn, store)]


def _park_behind_runs(store: Store) -> None:
    """The runs' later messages parked behind their heads, as a publish writes them (the
    bulk statements write every row ready; this is the migration's step that parks them)."""
    with store.driver.writing() as conn:
        run_migration(12, conn, store.tables)


def _lease_run_heads(store: Store, runs: int) -> int:
    """Claim every run's first message as ``runner`` (long tasks in progress)."""
    leased = 0
    while True:
        got = store.claim([QUEUE], "runner", lease_ms=RUNNER_LEASE_MS, limit=1000)
        leased += len(got)
        if not got:
            break
    if leased != runs:
        raise RuntimeError(f"leased {leased} run heads, expected {runs}")
    return leased


def _claim_one(store: Store, kind: str, lease_ms: int) -> Message:
    """The one message a claim on ``q`` finds (the only claimable one)."""
    got = store.claim([QUEUE], HOLDER, lease_ms=lease_ms, limit=2)
    if len(got) != 1:
        raise RuntimeError(f"the {kind} holder's claim returned {len(got)} messages, not 1")
    return got[0]


def _fill_held(store: Store, held: int, now: int) -> dict[str, Any]:
    """``held`` messages on ``q`` that may not run, due three hours ago (ahead of the
    backlog): the first half at concurrency key ``hot`` (limit 1), whose one place a holder
    has claimed for six hours; the rest of task ``bench.rated``, whose rate limit of 1/h has
    let its one delivery through (claimed and acked). Both as they stand before a worker's
    sweep: ready, in the claim index."""
    if held <= 0:
        return {"held": 0, "gated": 0, "rated": 0, "ids": {}}
    due = now - HELD_AGE_MS
    store.set_rate_limits({f"task:{RATED_TASK}": HELD_RATE})
    # The gate's place and the rate's delivery, taken while each is the only claimable
    # message (the runs' heads are leased, their later messages parked).
    place = _bulk(store, "gated", 1, due, GATED_PAYLOAD)
    holder = _claim_one(store, "gate", RUNNER_LEASE_MS)
    spent = _bulk(store, "rated", 1, due, RATED_PAYLOAD)
    delivery = _claim_one(store, "rate", LEASE_MS)
    if [holder.id, delivery.id] != [place[0], spent[0]]:
        raise RuntimeError(f"the holders took {holder.id}, {delivery.id}: not {place}, {spent}")
    if store.ack([delivery.fence]) != {delivery.id}:
        raise RuntimeError("the rate's delivery was not acked")
    gated = held // 2
    ids = {
        "gated": _bulk(store, "gated", gated, due, GATED_PAYLOAD),
        "rated": _bulk(store, "rated", held - gated, due, RATED_PAYLOAD),
    }
    return {
        "held": held,
        "gated": gated,
        "rated": held - gated,
        "holder_id": holder.id,
        "ids": ids,
    }


def fill(
    store: Store, ready: int, eta: int, runs: int, runs_at_head: bool = False, held: int = 0
) -> dict[str, Any]:
    started = time.perf_counter()
    now = store.now_ms()
    # Behind the backlog (due now), or ahead of it (due two hours ago: as runs whose later
    # messages have waited behind a long first task while newer work queued up).
    runs_due = now - 2 * BACKLOG_AGE_MS if runs_at_head else now
    ids = {"runs": _bulk(store, "runs", runs, runs_due, PLAIN_PAYLOAD)}
    _park_behind_runs(store)
    t_runs = time.perf_counter()
    leased = _lease_run_heads(store, runs) if runs else 0
    t_heads = time.perf_counter()
    held_fill = _fill_held(store, held, now)
    ids |= held_fill.pop("ids")
    t_held = time.perf_counter()
    ids["eta"] = _bulk(store, "eta", eta, now, ETA_PAYLOAD)
    t_eta = time.perf_counter()
    ids["ready"] = _bulk(store, "ready", ready, now - BACKLOG_AGE_MS, PLAIN_PAYLOAD)
    done = time.perf_counter()
    run_messages = sum(1 + k % 3 for k in range(runs))
    return {
        "seconds": round(done - started, 2),
        "runs_s": round(t_runs - started, 2),
        "run_heads_claim_s": round(t_heads - t_runs, 2),
        "held_s": round(t_held - t_heads, 2),
        "eta_s": round(t_eta - t_held, 2),
        "ready_s": round(done - t_eta, 2),
        "run_messages": run_messages,
        "run_heads_leased": leased,
        # the held messages and the gate's holder (the rate's spent delivery was acked)
        "held": held_fill,
        "messages": ready + eta + run_messages + (held + 1 if held > 0 else 0),
        "ids": ids,
    }


# ---- fill check -------------------------------------------------------------------------------

# Columns that differ between any two messages (identity, time, content), left out of the
# comparison of an API row with a bulk row of the same kind.
_VARYING = {
    "id",
    "payload",
    "task_id",
    "message_id",
    "run_id",
    "queue",
    "available_at_ms",
    "created_at_ms",
    "updated_at_ms",
    "at_ms",
}


def _rows(conn: Any, table: str, where: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    result = conn.execute(text(f"SELECT * FROM {table} WHERE {where}"), params)
    return [dict(r._mapping) for r in result]


def _shape(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in _VARYING}


def check_rows(store: Store, filled: dict[str, Any]) -> dict[str, Any]:
    """The bulk rows are what ``Store.enqueue_many`` writes: a message of each kind published
    through it is compared column by column with a bulk one (then deleted again). Before the
    sweep, which moves the held ones."""
    t = store.tables
    m, e, k = t.messages.name, t.events.name, t.tasks.name
    ranges = filled["ids"]

    def new(payload: str, task_name: str = TASK_NAME, **kw: Any) -> NewMessage:
        return NewMessage("verify", payload, task_id=str(uuid.uuid4()), task_name=task_name, **kw)

    # A run's head first: the run's message compared is one that waits behind it, as the
    # bulk runs' later messages wait behind their leased heads.
    head = store.enqueue_many([new(PLAIN_PAYLOAD, run_id="verify-run")])
    ids = store.enqueue_many(
        [
            new(PLAIN_PAYLOAD),
            new(ETA_PAYLOAD, delay_ms=ETA_FROM_MS),
            new(PLAIN_PAYLOAD, run_id="verify-run"),
            new(GATED_PAYLOAD, GATED_TASK, concurrency_key=GATE_KEY, concurrency_limit=1),
            new(RATED_PAYLOAD, RATED_TASK),
        ]
    )
    compared = 0
    with store.engine.begin() as conn:
        now = store.now_ms()
        # One bulk row of each kind, found by its id range: the last backlog message, the
        # first ETA message, the first waiting message of a run (the heads are leased), the
        # last held message of each kind.
        none = [0, -1]
        samples = [
            ("plain", "id = :hi", ranges["ready"]),
            ("eta", "id = :lo", ranges["eta"]),
            ("run", "id BETWEEN :lo AND :hi AND lease_owner IS NULL ORDER BY id", ranges["runs"]),
            ("gated", "id = :hi", ranges.get("gated", none)),
            ("rated", "id = :hi", ranges.get("rated", none)),
        ]
        for api_id, (kind, where, (lo, hi)) in zip(ids, samples, strict=True):
            if hi < lo:  # none of that kind
                continue
            bulk = _rows(conn, m, f"{where} LIMIT 1", {"lo": lo, "hi": hi})
            if not bulk:
                raise RuntimeError(f"no bulk {kind} message in ids {lo}..{hi}")
            mine = _rows(conn, m, "id = :v", {"v": api_id})
            pairs = [
                (m, "id", mine[0]["id"], bulk[0]["id"]),
                (e, "message_id", mine[0]["id"], bulk[0]["id"]),
                (k, "task_id", mine[0]["task_id"], bulk[0]["task_id"]),
            ]
            for table, key, value_api, value_bulk in pairs:
                a = _rows(conn, table, f"{key} = :v", {"v": value_api})
                b = _rows(conn, table, f"{key} = :v", {"v": value_bulk})
                if len(a) != 1 or len(b) != 1 or _shape(a[0]) != _shape(b[0]):
                    raise RuntimeError(
                        f"bulk {kind} row of {table} differs from the store's: {a} vs {b}"
                    )
                compared += 1
            headers = json.loads(bulk[0]["payload"])["headers"]
            if headers["id"] != bulk[0]["task_id"] or headers["task"] != bulk[0]["task_name"]:
                raise RuntimeError(f"bulk {kind} payload names another task: {bulk[0]}")
            if kind == "eta" and bulk[0]["available_at_ms"] < now + ETA_FROM_MS // 2:
                raise RuntimeError(f"ETA row due too early: {bulk[0]}")
        # Leave the tables as filled: the rows and their events and task rows go.
        for message_id in head + ids:
            (row,) = _rows(conn, m, "id = :v", {"v": message_id})
            conn.execute(text(f"DELETE FROM {e} WHERE message_id = :v"), {"v": message_id})
            conn.execute(text(f"DELETE FROM {m} WHERE id = :v"), {"v": message_id})
            conn.execute(text(f"DELETE FROM {k} WHERE task_id = :v"), {"v": row["task_id"]})
    return {"rows_compared": compared}


def sweep(store: Store, filled: dict[str, Any]) -> dict[str, Any] | None:
    """A worker's sweep (``Store.park_held(["q"])``), called until it moves nothing: the
    held messages out of the claim's way. None without held messages."""
    if not filled["held"]["held"]:
        return None
    ranges = filled["ids"]
    calls: list[float] = []
    moved: list[int] = []
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        ids = store.park_held([QUEUE])
        calls.append(round(time.perf_counter() - t0, 3))
        moved += ids
        if not ids:
            break
        if len(calls) >= 20:
            raise RuntimeError(f"the sweep still moves messages after {len(calls)} calls")
    seconds = time.perf_counter() - started

    def within(kind: str) -> int:
        lo, hi = ranges[kind]
        return sum(1 for i in moved if lo <= i <= hi)

    return {
        "seconds": round(seconds, 2),
        "calls_s": calls,
        "moved": len(moved),
        "parked_at_gate": within("gated"),
        "given_rate_turns": within("rated"),
    }


def held_state(store: Store, filled: dict[str, Any]) -> dict[str, Any] | None:
    """The held messages as the sweep left them: the gated ones parked at the gate, the
    rated ones ready with their turns (due an hour apart, from an hour on), none claimable
    now, the gate's place still held. Raises otherwise. None without held messages."""
    held = filled["held"]
    if not held["held"]:
        return None
    m = store.tables.messages.name
    (g_lo, g_hi), (r_lo, r_hi) = filled["ids"]["gated"], filled["ids"]["rated"]
    now = store.now_ms()
    with store.engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT "
                "sum(CASE WHEN id BETWEEN :g_lo AND :g_hi AND state = 'parked' "
                "AND reason = 'gate' THEN 1 ELSE 0 END), "
                "sum(CASE WHEN id BETWEEN :r_lo AND :r_hi AND state = 'ready' "
                "AND reason = 'rate' AND available_at_ms > :now THEN 1 ELSE 0 END), "
                "sum(CASE WHEN state = 'ready' AND available_at_ms <= :now "
                "AND (lease_expires_at_ms IS NULL OR lease_expires_at_ms <= :now) "
                "THEN 1 ELSE 0 END), "
                "min(CASE WHEN id BETWEEN :r_lo AND :r_hi THEN available_at_ms END), "
                "count(*) "
                f"FROM {m} WHERE id BETWEEN :g_lo AND :g_hi OR id BETWEEN :r_lo AND :r_hi"
            ),
            {"g_lo": g_lo, "g_hi": g_hi, "r_lo": r_lo, "r_hi": r_hi, "now": now},
        ).one()
        holder = conn.execute(
            text(f"SELECT lease_owner, lease_expires_at_ms FROM {m} WHERE id = :v"),
            {"v": held["holder_id"]},
        ).one()
        conn.rollback()
    state = {
        "at_gate": int(row[0] or 0),
        "rate_turns": int(row[1] or 0),
        "claimable": int(row[2] or 0),
        "first_turn_in_s": None if row[3] is None else round((int(row[3]) - now) / 1000, 1),
        "rows": int(row[4]),
        "holder_lease_left_s": round((int(holder[1] or 0) - now) / 1000),
    }
    if (
        state["at_gate"] != held["gated"]
        or state["rate_turns"] != held["rated"]
        or state["claimable"]
        or state["rows"] != held["held"]
        or holder[0] != HOLDER
        or state["holder_lease_left_s"] <= 0
    ):
        raise RuntimeError(f"held messages not as the sweep left them: {state}, {held}")
    return state


def check_fill(store: Store, filled: dict[str, Any], runs: int) -> dict[str, Any]:
    """After the sweep: the backlog is claimable (its first message first), ``size(q)``
    counts the backlog, the runs' waiting messages and the held ones, the runs table holds
    one row per run, the held messages are out of the claim's way."""
    t = store.tables
    ranges = filled["ids"]
    ready = ranges["ready"][1] - ranges["ready"][0] + 1
    run_messages = filled["run_messages"]
    held = filled["held"]["held"]
    claimed = store.claim([QUEUE], "verify", lease_ms=LEASE_MS, limit=1)
    if len(claimed) != 1:
        raise RuntimeError("the backlog is not claimable")
    got = claimed[0]
    body = json.loads(got.payload)
    if (
        got.id != ranges["ready"][0]
        or got.run_id is not None
        or got.attempt != 1
        or body["headers"]["id"] != got.task_id
        or got.available_at_ms > store.now_ms()
    ):
        raise RuntimeError(f"the first claim returned {got}")
    if store.ack([got.fence]) != {got.id}:
        raise RuntimeError("the check's ack failed")
    size = store.size(QUEUE)
    waiting = run_messages - runs
    if size != ready - 1 + waiting + held:
        raise RuntimeError(
            f"size(q) = {size}, expected {ready - 1} + {waiting} run messages + {held} held"
        )
    with store.engine.connect() as conn:
        run_rows = int(conn.execute(text(f"SELECT count(*) FROM {t.runs.name}")).scalar() or 0)
        conn.rollback()
    if run_rows != runs:
        raise RuntimeError(f"{run_rows} rows in the runs table, expected {runs}")
    return {"claimed_and_acked": 1, "size_q": size, "held": held_state(store, filled)}


def settle(store: Store, analyze: bool) -> dict[str, Any]:
    started = time.perf_counter()
    done: list[str] = []
    if store.is_postgresql:
        with store.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            if analyze:
                conn.exec_driver_sql("ANALYZE")
                done.append("ANALYZE")
            conn.exec_driver_sql("CHECKPOINT")
            done.append("CHECKPOINT")
    else:
        dispose_all(close=True)  # no pooled connection holds a snapshot
        raw = sqlite3.connect(str(store.engine.url.database), isolation_level=None, timeout=30)
        try:
            # The fill's log copied back and the file cut to nothing, so that neither a
            # checkpoint of it nor its size lands in the measurements. Busy while another
            # connection (the checkpoint thread) reads: tried again.
            # A 1,000,000-task fill's log takes the background checkpointer a while: wait up
            # to two minutes, then measure anyway and say so.
            for _ in range(1200):
                busy, _log, _done = raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if not busy:
                    done.append("PRAGMA wal_checkpoint(TRUNCATE)")
                    break
                time.sleep(0.1)
            else:
                done.append("PRAGMA wal_checkpoint(TRUNCATE) stayed busy for 120 s")
            if analyze:
                raw.execute("ANALYZE")
                raw.execute("PRAGMA optimize")
                done += ["ANALYZE", "PRAGMA optimize"]
        finally:
            raw.close()
    return {"statements": done, "seconds": round(time.perf_counter() - started, 2)}


# ---- bytes per task ---------------------------------------------------------------------------


def _row_counts(store: Store) -> dict[str, int]:
    counts: dict[str, int] = {}
    with store.engine.connect() as conn:
        for table in store.tables.metadata.sorted_tables:
            counts[table.name] = int(
                conn.execute(text(f"SELECT count(*) FROM {table.name}")).scalar() or 0
            )
        conn.rollback()
    return counts


def sizes(store: Store) -> dict[str, Any]:
    """Bytes per table and index, and per row and per message."""
    counts = _row_counts(store)
    messages = counts[store.tables.messages.name]
    tables: dict[str, Any] = {}
    method: str
    with store.engine.connect() as conn:
        if store.is_postgresql:
            method = "pg_total_relation_size / pg_relation_size / pg_indexes_size"
            for name in counts:
                row = conn.execute(
                    text(
                        "SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid), "
                        "pg_indexes_size(c.oid) FROM pg_class c WHERE c.relname = :n"
                    ),
                    {"n": name},
                ).one()
                indexes = conn.execute(
                    text(
                        "SELECT i.relname, pg_relation_size(i.oid) FROM pg_index x "
                        "JOIN pg_class c ON c.oid = x.indrelid "
                        "JOIN pg_class i ON i.oid = x.indexrelid WHERE c.relname = :n "
                        "ORDER BY i.relname"
                    ),
                    {"n": name},
                ).all()
                tables[name] = {
                    "total": int(row[0]),
                    "heap": int(row[1]),
                    "indexes": int(row[2]),
                    "toast": int(row[0]) - int(row[1]) - int(row[2]),
                    "index_bytes": {i[0]: int(i[1]) for i in indexes},
                }
        else:
            try:
                stat = conn.exec_driver_sql(
                    "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"
                ).all()
                master = conn.exec_driver_sql(
                    "SELECT name, tbl_name, type FROM sqlite_master"
                ).all()
                method = "dbstat"
            except sqlalchemy.exc.OperationalError:
                stat, master, method = [], [], "file size (no dbstat)"
            owner = {r[0]: (r[1], r[2]) for r in master}
            for name in counts:
                tables[name] = {"total": 0, "heap": 0, "indexes": 0, "index_bytes": {}}
            for name, pgsize in stat:
                table, kind = owner.get(name, (name, "table"))
                if table not in tables:
                    continue
                entry = tables[table]
                entry["total"] += int(pgsize)
                if kind == "index" or name.startswith("sqlite_autoindex"):
                    entry["indexes"] += int(pgsize)
                    entry["index_bytes"][name] = int(pgsize)
                else:
                    entry["heap"] += int(pgsize)
        conn.rollback()
    for name, entry in tables.items():
        rows = counts[name]
        entry["rows"] = rows
        entry["bytes_per_row"] = round(entry["total"] / rows, 1) if rows else None
        entry["bytes_per_task"] = round(entry["total"] / messages, 1) if messages else None
        entry["index_bytes_per_row"] = {
            i: (round(b / rows, 1) if rows else None) for i, b in entry["index_bytes"].items()
        }
    total = sum(e["total"] for e in tables.values())
    out: dict[str, Any] = {
        "method": method,
        "messages": messages,
        "total_bytes": total,
        "bytes_per_task": round(total / messages, 1) if messages else None,
        "tables": {n: e for n, e in tables.items() if e["rows"] or e["total"]},
    }
    if not store.is_postgresql:
        path = Path(str(store.engine.url.database))
        wal = Path(f"{path}-wal")
        out["file_bytes"] = path.stat().st_size
        out["wal_bytes"] = wal.stat().st_size if wal.exists() else 0
    return out


# ---- claim plans ------------------------------------------------------------------------------


def _pg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def explain_claim(store: Store, url: str) -> dict[str, Any]:
    """The claim statement's plan as the workers run it: PostgreSQL ``EXPLAIN (ANALYZE,
    BUFFERS)`` of the prepared statement under ``plan_cache_mode = force_generic_plan`` (the
    hot path's setting), rolled back; SQLite ``EXPLAIN QUERY PLAN``."""
    values = {"owner": "explain", "lease_ms": LEASE_MS, "limit": 32, "now": None, "queue": QUEUE}
    if not store.is_postgresql:
        raw = sqlite3.connect(str(store.engine.url.database))
        try:
            sql_text = str(store.sql.claim_single)
            plan = raw.execute(f"EXPLAIN QUERY PLAN {sql_text}", values).fetchall()
        finally:
            raw.close()
        return {"plan": [f"{r[0]} {r[1]} {r[3]}" for r in plan]}
    sql_text = str(store.sql.claim_single)
    order: list[str] = []

    def positional(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    prepared = re.sub(r"(?<!:):(\w+)", positional, sql_text)
    try:
        with psycopg.connect(_pg_dsn(url)) as conn:
            conn.execute("SET plan_cache_mode = force_generic_plan")
            conn.execute("SET jit = off")
            conn.execute(pgsql.SQL("PREPARE cost_claim AS ") + pgsql.SQL(prepared))  # type: ignore[arg-type]
            args = pgsql.SQL(", ").join(pgsql.Literal(values[n]) for n in order)
            started = time.perf_counter()
            rows = conn.execute(
                pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS) EXECUTE cost_claim(") + args + pgsql.SQL(")")
            ).fetchall()
            elapsed = time.perf_counter() - started
            conn.rollback()
    except psycopg.Error as exc:
        return {"error": repr(exc)}
    lines = [r[0] for r in rows]
    execution = next((ln for ln in lines if ln.startswith("Execution Time")), None)
    return {"execution": execution, "wall_ms": round(elapsed * 1000, 2), "plan": lines}


# ---- worker processes -------------------------------------------------------------------------


def _warm(store: Store, owner: str) -> None:
    """Open the connections and let psycopg prepare the claim and the ack (it prepares a
    statement run five times) before the start line."""
    for _ in range(6):
        store.claim([WARMUP_QUEUE], owner, lease_ms=LEASE_MS, limit=32)
        store.ack([Fence(0, owner, 0)])


def _worker(
    url: str,
    owner: str,
    quota: int,
    batch: int,
    windows: int,
    backlog_from: int,
    barrier: Any,
    out: Any,
) -> None:
    """Per window: wait at the start line, claim and ack ``quota`` messages of the big queue,
    report the window's times and each call's duration. The process (its connections and
    caches) lives through all the windows, as a worker does. Every message claimed must be
    of the backlog (ids from ``backlog_from`` on: the fill's backlog and the top-ups): no
    held message, no run's, no ETA message."""
    report: dict[str, Any] = {"owner": owner, "error": None}
    try:
        store = Store(url, table_prefix=PREFIX, auto_migrate=False)
        _warm(store, owner)
        for window in range(windows):
            claims: list[float] = []
            acks: list[float] = []
            done = 0
            report = {"owner": owner, "window": window, "error": None}
            barrier.wait()
            start = time.monotonic()
            while done < quota:
                t0 = time.perf_counter()
                got = store.claim([QUEUE], owner, lease_ms=LEASE_MS, limit=min(batch, quota - done))
                t1 = time.perf_counter()
                claims.append(t1 - t0)
                if not got:
                    break
                stray = [m.id for m in got if m.id < backlog_from or m.queue != QUEUE]
                if stray:
                    raise RuntimeError(f"claimed messages outside the backlog: {stray}")
                acked = store.ack([m.fence for m in got])
                acks.append(time.perf_counter() - t1)
                if len(acked) != len(got):
                    raise RuntimeError(f"acked {len(acked)} of {len(got)}")
                done += len(got)
            report |= {"start": start, "end": time.monotonic(), "done": done}
            out.put(report | {"claims": claims, "acks": acks})
    except BaseException as exc:  # reported to the parent, which fails the run
        barrier.abort()
        out.put(report | {"error": repr(exc)})
    finally:
        dispose_all(close=True)


def _claimer(url: str, expected: int, ready: Any, stop: Any, out: Any) -> None:
    """An idle worker of queue ``probe``: wait for the store's wake-up, claim, ack."""
    seen: dict[str, float] = {}
    wakes = claims = 0
    error = None
    try:
        store = Store(url, table_prefix=PREFIX, auto_migrate=False)
        waker = store.driver.waker(store.notify_channel)
        owner = f"probe-{uuid.uuid4().hex[:6]}"
        _warm(store, owner)
        for _ in range(6):
            store.claim([PROBE_QUEUE], owner, lease_ms=LEASE_MS, limit=8)
        waker.ready()  # connect (LISTEN) and take the current data_version
        ready.set()
        while len(seen) < expected and not stop.is_set():
            if waker.wait(0.2):
                wakes += 1
            while True:
                got = store.claim([PROBE_QUEUE], owner, lease_ms=LEASE_MS, limit=8)
                now = time.monotonic()
                claims += 1
                if not got:
                    break
                for m in got:
                    seen[m.task_id or ""] = now
                store.ack([m.fence for m in got])
        waker.close()
    except BaseException as exc:
        error = repr(exc)
        ready.set()
    finally:
        out.put({"seen": seen, "wakes": wakes, "claims": claims, "error": error})
        dispose_all(close=True)


def _gather(procs: Sequence[Any], out: Any, count: int, timeout: float = 900) -> list[Any]:
    """``count`` reports from the workers; fails fast when one dies or reports an error."""
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(reports) < count:
        try:
            reports.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker died or hung: exit codes {[p.exitcode for p in procs]}"
                ) from None
        errors = [r["error"] for r in reports if r.get("error")]
        if errors:
            raise RuntimeError("worker failed: " + "; ".join(errors))
    return reports


def throughput(
    store: Store, url: str, args: argparse.Namespace, deliveries: int, backlog_from: int
) -> dict[str, Any]:
    """``--windows`` windows of ``deliveries`` claimed and acked by ``--workers`` processes;
    after each, the backlog is topped up to N again (bulk, at its tail)."""
    workers, windows = args.workers, args.windows
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers + 1), ctx.Queue()
    quotas = [
        deliveries // workers + (1 if i < deliveries % workers else 0) for i in range(workers)
    ]
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                url,
                f"w{i}-{uuid.uuid4().hex[:6]}",
                q,
                args.batch,
                windows,
                backlog_from,
                barrier,
                out,
            ),
            daemon=True,
        )
        for i, q in enumerate(quotas)
    ]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    claims: list[float] = []
    acks: list[float] = []
    refill_s: list[float] = []
    try:
        for _ in range(windows):
            try:
                barrier.wait(timeout=300)
            except threading.BrokenBarrierError:
                _gather(procs, out, workers, timeout=30)  # raises the worker's error
                raise
            reports = _gather(procs, out, workers)
            done = sum(r["done"] for r in reports)
            if done != deliveries:
                raise RuntimeError(f"delivered {done} of {deliveries}")
            seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
            claims += [c for r in reports for c in r["claims"]]
            acks += [a for r in reports for a in r["acks"]]
            results.append(
                {
                    "deliveries": done,
                    "seconds": round(seconds, 4),
                    "tasks_per_s": round(done / seconds, 1),
                    "per_worker": sorted((r["done"] for r in reports), reverse=True),
                    "claims": sum(len(r["claims"]) for r in reports),
                }
            )
            t0 = time.perf_counter()
            _bulk(store, "ready", deliveries, store.now_ms() - BACKLOG_AGE_MS, PLAIN_PAYLOAD)
            refill_s.append(round(time.perf_counter() - t0, 3))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    rates = [w["tasks_per_s"] for w in results]
    return {
        "deliveries_per_window": deliveries,
        "windows": results,
        "tasks_per_s": round(statistics.median(rates), 1),
        "tasks_per_s_min_max": [min(rates), max(rates)],
        "refill_s": refill_s,
        "claim": _ms(claims),
        "ack": _ms(acks),
    }


def probes(store: Store, url: str, count: int, seed: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_claimer, args=(url, count, ready, stop, out), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise RuntimeError("the probe claimer did not start")
    # The publisher's statement prepared too (psycopg prepares it at the fifth run).
    for _ in range(6):
        store.enqueue("warmup-publish", PLAIN_PAYLOAD, task_id=str(uuid.uuid4()))
    store.purge("warmup-publish")
    rng = random.Random(seed)
    published: dict[str, float] = {}
    publish_s: list[float] = []
    for _ in range(count):
        time.sleep(rng.uniform(0.010, 0.030))
        task_id = str(uuid.uuid4())
        payload = PLAIN_PAYLOAD.replace(ID, task_id)
        t0 = time.monotonic()
        store.enqueue(PROBE_QUEUE, payload, task_id=task_id, task_name=TASK_NAME)
        publish_s.append(time.monotonic() - t0)
        published[task_id] = t0
    deadline = time.monotonic() + 30
    try:
        reports = []
        while not reports:
            try:
                reports.append(out.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline:
                    stop.set()
                    deadline = time.monotonic() + 30
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"probe claimer died: {proc.exitcode}") from None
    finally:
        stop.set()
        proc.join(30)
    report = reports[0]
    if report["error"]:
        raise RuntimeError(f"probe claimer failed: {report['error']}")
    seen = report["seen"]
    latencies = [seen[t] - t0 for t, t0 in published.items() if t in seen]
    return {
        "probes": count,
        "received": len(latencies),
        "latency": _ms(latencies),
        "enqueue": _ms(publish_s),
        "claimer_wakes": report["wakes"],
        "claimer_claims": report["claims"],
    }


# ---- one measurement --------------------------------------------------------------------------


@contextmanager
def database(backend: str, admin_url: str, tmp: Path) -> Iterator[str]:
    """A fresh database: a new SQLite file, or a new PostgreSQL database dropped after."""
    if backend == "sqlite":
        path = tmp / f"cost-{uuid.uuid4().hex[:8]}.db"
        try:
            yield f"sqlite:///{path}"
        finally:
            dispose_all(close=True)
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    base = make_url(admin_url).set(drivername="postgresql+psycopg")
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"sqlease_cost_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield base.set(drivername="postgresql", database=name).render_as_string(hide_password=False)
    finally:
        dispose_all(close=True)
        for attempt in range(5):
            try:
                with admin.connect() as conn:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                break
            except sqlalchemy.exc.OperationalError:
                if attempt == 4:
                    raise
                time.sleep(2)
        admin.dispose()


def run_one(
    backend: str, size: int, rnd: int, args: argparse.Namespace, tmp: Path, held: int = 0
) -> dict[str, Any]:
    with database(backend, args.pg, tmp) as url:
        store = Store(url, table_prefix=PREFIX)
        filled = fill(store, size, args.eta, args.runs, args.runs_at_head, held)
        _note(
            f"  {backend} N={size:,} held={held:,}: filled {filled['messages']:,} messages in "
            f"{filled['seconds']:.1f} s"
        )
        compared = check_rows(store, filled)
        swept = sweep(store, filled)
        if swept:
            _note(
                f"  {backend} N={size:,} held={held:,}: the sweep moved {swept['moved']:,} in "
                f"{swept['seconds']:.1f} s ({len(swept['calls_s'])} calls)"
            )
        checked = compared | check_fill(store, filled, args.runs)
        settled = settle(store, not args.no_analyze)
        store = Store(url, table_prefix=PREFIX, auto_migrate=False)  # settle closed the pools
        measured_sizes = sizes(store)
        plan_before = explain_claim(store, url)
        deliveries = min(args.deliveries, max(1, size // 2))
        thr = throughput(store, url, args, deliveries, filled["ids"]["ready"][0])
        # The top-ups and the workers' acks left the held messages as they were.
        thr["held_after"] = held_state(store, filled)
        _note(
            f"  {backend} N={size:,} held={held:,}: {thr['tasks_per_s']:,.0f} tasks/s, claim "
            f"p50 {thr['claim']['p50_ms']} ms p99 {thr['claim']['p99_ms']} ms"
        )
        plan_after = explain_claim(store, url)
        probe = probes(store, url, args.probes, seed=size * 31 + rnd)
        _note(
            f"  {backend} N={size:,}: probe p50 {probe['latency']['p50_ms']} ms "
            f"p99 {probe['latency']['p99_ms']} ms ({probe['received']}/{probe['probes']})"
        )
        return {
            "backend": backend,
            "size": size,
            "held": held,
            "round": rnd,
            "fill": filled,
            "sweep": swept,
            "check": checked,
            "settle": settled,
            "bytes": measured_sizes,
            "throughput": thr,
            "probes": probe,
            "explain_after_fill": plan_before,
            "explain_after_throughput": plan_after,
        }


# ---- report -----------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def summarize(
    runs: list[dict[str, Any]], backends: list[str], sizes_: list[int], helds: list[int]
) -> list[dict[str, Any]]:
    base = min(sizes_)
    for r in runs:
        ref = next(
            (
                x
                for x in runs
                if (x["backend"], x["round"], x["size"], x["held"])
                == (r["backend"], r["round"], base, r["held"])
            ),
            None,
        )
        r["ratio_to_smallest"] = (
            round(r["throughput"]["tasks_per_s"] / ref["throughput"]["tasks_per_s"], 3)
            if ref
            else None
        )
    rows = []
    for backend, size, held in ((b, s, h) for b in backends for s in sizes_ for h in helds):
        mine = [r for r in runs if (r["backend"], r["size"], r["held"]) == (backend, size, held)]
        if mine:
            t = mine[0]["bytes"]["tables"]
            sweeps = [r["sweep"]["seconds"] for r in mine if r["sweep"]]
            rows.append(
                {
                    "backend": backend,
                    "size": size,
                    "held": held,
                    "sweep_s": _median(sweeps),
                    "rounds": len(mine),
                    "messages": mine[0]["fill"]["messages"],
                    "fill_s": _median([r["fill"]["seconds"] for r in mine]),
                    "tasks_per_s": _median([r["throughput"]["tasks_per_s"] for r in mine]),
                    "ratio": _median([r["ratio_to_smallest"] for r in mine]),
                    "claim_p50_ms": _median([r["throughput"]["claim"]["p50_ms"] for r in mine]),
                    "claim_p99_ms": _median([r["throughput"]["claim"]["p99_ms"] for r in mine]),
                    "probe_p50_ms": _median([r["probes"]["latency"]["p50_ms"] for r in mine]),
                    "probe_p99_ms": _median([r["probes"]["latency"]["p99_ms"] for r in mine]),
                    "enqueue_p50_ms": _median([r["probes"]["enqueue"]["p50_ms"] for r in mine]),
                    "enqueue_p99_ms": _median([r["probes"]["enqueue"]["p99_ms"] for r in mine]),
                    "bytes_per_task": mine[0]["bytes"]["bytes_per_task"],
                    "bytes_per_row": {
                        n.removeprefix(PREFIX): e["bytes_per_row"]
                        for n, e in t.items()
                        if e["rows"]
                    },
                    "table_rows": {n.removeprefix(PREFIX): e["rows"] for n, e in t.items()},
                }
            )
    return rows


def _ratio(held: float | None, none: float | None) -> float | None:
    return None if held is None or not none else round(held / none, 3)


def held_compare(runs: list[dict[str, Any]], held: int) -> list[dict[str, Any]]:
    """Per database and size, each round's figures with ``held`` held messages over those
    without (the two measured in the same round), and the medians of those ratios."""
    out = []
    keys = dict.fromkeys((r["backend"], r["size"]) for r in runs)
    for backend, size in keys:
        rounds = []
        for rnd in sorted({r["round"] for r in runs}):
            pair = {
                r["held"]: r
                for r in runs
                if (r["backend"], r["size"], r["round"]) == (backend, size, rnd)
            }
            if 0 not in pair or held not in pair:
                continue
            none, some = pair[0]["throughput"], pair[held]["throughput"]
            rounds.append(
                {
                    "round": rnd,
                    "first": "none" if pair[0]["order"] < pair[held]["order"] else "held",
                    "tasks_per_s": [none["tasks_per_s"], some["tasks_per_s"]],
                    "claim_p50_ms": [none["claim"]["p50_ms"], some["claim"]["p50_ms"]],
                    "claim_p99_ms": [none["claim"]["p99_ms"], some["claim"]["p99_ms"]],
                    "ratio_tasks_per_s": _ratio(some["tasks_per_s"], none["tasks_per_s"]),
                    "ratio_claim_p50": _ratio(some["claim"]["p50_ms"], none["claim"]["p50_ms"]),
                    "ratio_claim_p99": _ratio(some["claim"]["p99_ms"], none["claim"]["p99_ms"]),
                    "sweep_s": pair[held]["sweep"]["seconds"],
                }
            )
        if rounds:
            out.append(
                {
                    "backend": backend,
                    "size": size,
                    "held": held,
                    "rounds": rounds,
                    "median": {
                        name: _median([r[name] for r in rounds])
                        for name in ("ratio_tasks_per_s", "ratio_claim_p50", "ratio_claim_p99")
                    },
                }
            )
    return out


def markdown_compare(compared: list[dict[str, Any]]) -> str:
    out = [
        "Held against none, each round on fresh databases (the two in alternating order): "
        "figures with the held messages / without; medians, and each round's ratio.",
        "",
        "| database | ready backlog | held | claim+ack tasks/s, none / held | ratio "
        "(rounds) | claim p50 ms, none / held | ratio (rounds) | claim p99 ms, none / held "
        "| ratio (rounds) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in compared:
        cells = [c["backend"], f"{c['size']:,}", f"{c['held']:,}"]
        for name, spec in (
            ("tasks_per_s", ",.0f"),
            ("claim_p50_ms", ".2f"),
            ("claim_p99_ms", ".2f"),
        ):
            none = _median([r[name][0] for r in c["rounds"]])
            some = _median([r[name][1] for r in c["rounds"]])
            ratio = "ratio_" + name.removesuffix("_ms")
            each = ", ".join(_fmt(r[ratio], ".2f") for r in c["rounds"])
            cells += [
                f"{_fmt(none, spec)} / {_fmt(some, spec)}",
                f"{_fmt(c['median'][ratio], '.2f')} ({each})",
            ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, base: int) -> str:
    held = (
        f" {args.held:,} held messages ahead of the backlog (half at a full concurrency gate, "
        "half behind a spent rate limit of 1/h; moved by one sweep after the fill)"
        + (" or none (`--held-compare`);" if args.held_compare else ";")
        if args.held
        else ""
    )
    with_held = any(r["held"] for r in rows)
    out = [
        f"Ready backlog N on queue `q`, plus {args.eta:,} ETA messages and {args.runs:,} runs "
        f"(heads leased; {'ahead of' if args.runs_at_head else 'behind'} the backlog) on the "
        f"same queue;{held} {args.workers} worker processes, claim batch "
        f"{args.batch}, {args.windows} windows of {args.deliveries:,} deliveries "
        "(at most N/2; median of the windows); "
        f"{'ANALYZE after the fill' if not args.no_analyze else 'no ANALYZE'}.",
        "",
        "Medians over the rounds (the ratio: the median of each round's ratio).",
        "",
        f"| database | ready backlog | {'held | sweep s | ' if with_held else ''}messages | "
        f"fill s | claim+ack tasks/s | ratio to {base:,} | claim p50 / p99 ms | "
        "probe publish→claim p50 / p99 ms | enqueue p50 / p99 ms | bytes/task |",
        "|---|---:|"
        + ("---:|---:|" if with_held else "")
        + "---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        held_cells = f"{r['held']:,} | {_fmt(r['sweep_s'], '.2f')} | " if with_held else ""
        out.append(
            f"| {r['backend']} | {r['size']:,} | {held_cells}{r['messages']:,} "
            f"| {_fmt(r['fill_s'], '.1f')} "
            f"| {_fmt(r['tasks_per_s'])} | {_fmt(r['ratio'], '.2f')} "
            f"| {_fmt(r['claim_p50_ms'], '.2f')} / {_fmt(r['claim_p99_ms'], '.2f')} "
            f"| {_fmt(r['probe_p50_ms'], '.2f')} / {_fmt(r['probe_p99_ms'], '.2f')} "
            f"| {_fmt(r['enqueue_p50_ms'], '.2f')} / {_fmt(r['enqueue_p99_ms'], '.2f')} "
            f"| {_fmt(r['bytes_per_task'])} |"
        )
    out += [
        "",
        "claim: one `Store.claim` call (up to the batch) on `q` during the claim+ack windows. "
        "probe: from just before `Store.enqueue` to just after `Store.claim` returned the "
        "message, on queue `probe` served by an idle claimer woken by the store's wake-up "
        "(PostgreSQL LISTEN/NOTIFY, SQLite data_version every 5 ms), the backlog in the same "
        "tables. enqueue: that publish call alone. bytes/task: all sqlease tables and "
        "indexes / messages in the database.",
    ]
    # The tables the fill writes (the schema's own one-row table and empty ones left out).
    names = sorted({n for r in rows for n, count in r["table_rows"].items() if count >= 10})
    out += [
        "",
        "Bytes per row of each table (table + its indexes + TOAST / the table's rows):",
        "",
        "| database | ready backlog | "
        + ("held | " if with_held else "")
        + " | ".join(names)
        + " |",
        "|---|---:|" + ("---:|" if with_held else "") + "---:|" * len(names),
    ]
    for r in rows:
        cells = " | ".join(_fmt(r["bytes_per_row"].get(n)) for n in names)
        held_cell = f"{r['held']:,} | " if with_held else ""
        out.append(f"| {r['backend']} | {r['size']:,} | {held_cell}{cells} |")
    return "\n".join(out)


def _git_head() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def _pg_settings(url: str) -> dict[str, str]:
    names = (
        "server_version",
        "shared_buffers",
        "autovacuum",
        "synchronous_commit",
        "fsync",
        "max_wal_size",
        "work_mem",
        "effective_cache_size",
        "random_page_cost",
    )
    try:
        with psycopg.connect(_pg_dsn(url)) as conn:
            return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]
    except psycopg.Error as exc:
        return {"error": repr(exc)}


def _ints(value: str) -> list[int]:
    return [int(v.replace("_", "")) for v in value.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        type=_ints,
        default=[10_000, 100_000, 1_000_000],
        help="ready backlog sizes, comma-separated",
    )
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    parser.add_argument("--workers", type=int, default=2, help="claim+ack processes")
    parser.add_argument(
        "--deliveries",
        type=int,
        default=5_000,
        help="messages claimed and acked per window, the same at every size (at most N/2)",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=4,
        help="measurement windows per size (the backlog is topped up to N after each)",
    )
    parser.add_argument("--batch", type=int, default=32, help="claim limit")
    parser.add_argument("--eta", type=int, default=100_000, help="scheduled (ETA) messages")
    parser.add_argument("--runs", type=int, default=10_000, help="runs (1-3 messages each)")
    parser.add_argument("--probes", type=int, default=200, help="enqueue-to-start probes")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="fresh databases per size (sizes interleaved within a round)",
    )
    parser.add_argument(
        "--runs-at-head",
        action="store_true",
        help="put the runs' messages ahead of the backlog in delivery order (due two hours "
        "ago), so that every claim passes their leased heads and waiting messages",
    )
    parser.add_argument(
        "--held",
        type=lambda v: int(v.replace("_", "")),
        default=0,
        help="held messages on q ahead of the backlog: half at a full concurrency gate, half "
        "behind a spent rate limit (0: none)",
    )
    parser.add_argument(
        "--held-compare",
        action="store_true",
        help="measure each size with --held held messages and with none, in the same round "
        "on fresh databases, and report the ratios",
    )
    parser.add_argument(
        "--no-analyze", action="store_true", help="skip ANALYZE / PRAGMA optimize after the fill"
    )
    parser.add_argument(
        "--pg", default=DEFAULT_PG_URL, help="server to create the benchmark databases on"
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--label", default=None, help="free text recorded in the JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.held_compare and args.held <= 0:
        raise SystemExit("--held-compare needs --held N")
    helds = [0, args.held] if args.held_compare else [args.held]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"sqlite", "postgresql"}
    if unknown:
        raise SystemExit(f"unknown backends: {sorted(unknown)}")
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "sqlite": sqlite3.sqlite_version,
        "sqlite_settings": {"journal_mode": "WAL", "synchronous": "NORMAL"},
        "sqlease": sqlease.__version__,
        "repo": _git_head(),
        "label": args.label,
        "loadavg_start": os.getloadavg(),
    }
    if "postgresql" in backends:
        env["postgresql"] = _pg_settings(args.pg)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sqlease-cost-") as tmp:
        for backend in backends:
            for rnd in range(args.rounds):
                # The sizes' order rotates from round to round, so that no size is always
                # first (on a cold server, say) or last.
                shift = rnd % len(args.sizes)
                for size in args.sizes[shift:] + args.sizes[:shift]:
                    # With --held-compare, held and none alternate which goes first.
                    for held in helds if rnd % 2 == 0 else helds[::-1]:
                        _note(f"[{rnd + 1}/{args.rounds}] {backend} N={size:,} held={held:,}")
                        one = run_one(backend, size, rnd, args, Path(tmp), held)
                        runs.append(one | {"order": len(runs)})
    env["loadavg_end"] = os.getloadavg()
    env["elapsed_s"] = round(time.monotonic() - started, 1)
    rows = summarize(runs, backends, args.sizes, helds)
    print(markdown(rows, args, min(args.sizes)))
    compared = held_compare(runs, args.held) if args.held_compare else None
    if compared:
        print("\n" + markdown_compare(compared))
    output = args.output or HERE / "results" / f"cost-{dt.date.today().isoformat()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "sqlease cost curve: claim+ack throughput, latencies and bytes per task "
        "against the backlog size",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {
            "output": str(output),
            "lease_ms": LEASE_MS,
            "runner_lease_ms": RUNNER_LEASE_MS,
            "backlog_due_ms_ago": BACKLOG_AGE_MS,
            "eta_due_in_ms": [ETA_FROM_MS, ETA_TO_MS],
            "held_due_ms_ago": HELD_AGE_MS,
            "held_gate": {"concurrency_key": GATE_KEY, "limit": 1, "task": GATED_TASK},
            "held_rate": {"limit": f"task:{RATED_TASK}", "rate": HELD_RATE},
            "payload_bytes": {
                "plain": len(PLAIN_PAYLOAD.replace(ID, str(uuid.uuid4()))),
                "eta": len(ETA_PAYLOAD.replace(ID, str(uuid.uuid4()))),
                "gated": len(GATED_PAYLOAD.replace(ID, str(uuid.uuid4()))),
                "rated": len(RATED_PAYLOAD.replace(ID, str(uuid.uuid4()))),
            },
            "table_prefix": PREFIX,
            "statistics": "none"
            if args.no_analyze
            else "ANALYZE (PostgreSQL); ANALYZE and PRAGMA optimize (SQLite), after the fill",
        },
        "latency_definitions": {
            "claim": "one Store.claim call on queue q (limit up to --batch) in a worker during "
            "the throughput phase, wall time in that process",
            "ack": "one Store.ack call of the batch just claimed",
            "probe": "from just before Store.enqueue('probe', ...) in the publisher to just after "
            "Store.claim returned the message in a claimer waiting on the store's wake-up "
            "(LISTEN/NOTIFY; SQLite data_version polled every 5 ms); backlog in the tables, "
            "no other load",
            "enqueue": "the Store.enqueue call of a probe alone (publish + commit)",
        },
        "environment": env,
        "summary": rows,
        "held_compare": compared,
        "runs": runs,
    }
    output.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
