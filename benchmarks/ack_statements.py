"""What the acks of deliveries outside any run cost on PostgreSQL, against the full ack: the
round trip of a draining worker's ack + claim, and the size of each statement's plan.

A worker that drains a backlog sends one statement per batch: the acks of the tasks that
finished and the claim that refills its prefetch. When every ack is of a delivery outside any
run, the driver sends a statement without the runs' promotion (``ack_outside_runs*``,
sqlease._db.postgresql.leases and plain_claims). Both statements are run here on the same
tables, through the driver's own ``execute`` (the prepared-statement path a worker uses), in
``--blocks`` alternating blocks of ``--per`` statements (each acks the ``--batch``
deliveries the previous one claimed and claims as many again), so that the machine's drift
and the backlog's growing dead index entries weigh on both alike. Three times: with the plain
claim (a queue nothing holds back), with the full claim (a limit on another task in the
database), and as an idle worker's ack of its one task with its next handoff offer
(``ack_offer`` against ``ack_outside_runs_offer``; the task claimed before each, untimed).

Also each statement's plan size (nodes) and the buffers it touches, from ``EXPLAIN (ANALYZE,
BUFFERS, TIMING OFF)`` in a transaction rolled back: counts, steady whatever the load.

    .venv/bin/python benchmarks/ack_statements.py [--backlog 20000] [--blocks 20] [--per 100]

The tables get a prefix of their own and are dropped at the end. Prints a Markdown table;
writes JSON to benchmarks/results/ack-statements-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from celery_bench import PG, drop_tables
from sqlalchemy import create_engine, text

from sqlease import Store
from sqlease._db.driver import Lane, Offer, Op
from sqlease._db.postgresql.dialect import fence_params
from sqlease._db.rows import acked_ids_of, messages_of
from sqlease.store import Fence, NewMessage

HERE = Path(__file__).resolve().parent
PAIRS = {
    "plain claim": ("ack_claim_plain_single", "ack_outside_runs_claim_plain_single"),
    "full claim": ("ack_claim_single", "ack_outside_runs_claim_single"),
    "offer": ("ack_offer", "ack_outside_runs_offer"),
}
#: The idle worker's ack of its one task with its next offer (no claim in the statement).
OFFER = Offer(["q"], [0], "w", 60_000, 12345, 10_000, None)


def params(store: Store, held: list[Fence], batch: int, offer: bool = False) -> dict[str, Any]:
    if offer:
        channel = store.driver.wakeup_channel  # type: ignore[attr-defined]
        return {**fence_params(held), **OFFER.params(), "channel": channel}
    return {
        "owner": "w",
        "lease_ms": 60_000,
        "limit": batch,
        "now": None,
        "queue": "q",
        "channel": store.driver.wakeup_channel,  # type: ignore[attr-defined]
        **fence_params(held),
    }


def round_trips(store: Store, names: tuple[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Median round trip (us) of each statement over the alternating blocks."""
    offer = names[0] == "ack_offer"
    batch = 1 if offer else args.batch
    held = [m.fence for m in store.claim(["q"], "w", lease_ms=60_000, limit=batch)]
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(args.blocks):
        for name in names if block % 2 else names[::-1]:
            statement = getattr(store.sql, name)
            for _ in range(args.per):
                if offer and not held:  # the idle worker's next task, claimed untimed
                    held = [m.fence for m in store.claim(["q"], "w", lease_ms=60_000, limit=1)]
                op = Op(
                    Lane.LEASES,
                    statement,
                    params(store, held, batch, offer),
                    lambda rows: (
                        acked_ids_of(rows),
                        [] if offer else messages_of([r for r in rows if r["id"] is not None]),
                    ),
                )
                started = time.perf_counter()
                acked, claimed = store.driver.execute(op)
                times[name].append(time.perf_counter() - started)
                if len(acked) != len(held):
                    raise SystemExit(f"{name} acked {len(acked)} of {len(held)}")
                held = [m.fence for m in claimed]
                if not held and not offer:
                    raise SystemExit("the backlog ran out: raise --backlog")
    return {name: round(statistics.median(v) * 1e6) for name, v in times.items()}


def plans(store: Store, names: tuple[str, str], batch: int) -> dict[str, dict[str, int]]:
    def nodes(plan: dict[str, Any]) -> int:
        return 1 + sum(nodes(p) for p in plan.get("Plans", []))

    offer = names[0] == "ack_offer"
    batch = 1 if offer else batch
    held = [m.fence for m in store.claim(["q"], "w", lease_ms=60_000, limit=batch)]
    engine = create_engine(store.engine.url)
    found = {}
    try:
        for name in names:
            with engine.connect() as conn, conn.begin() as tx:
                explain = "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) "
                statement = getattr(store.sql, name).text
                plan = conn.execute(text(explain + statement), params(store, held, batch, offer))
                top = plan.scalar()[0]["Plan"]
                tx.rollback()
            found[name] = {"nodes": nodes(top), "shared_hit": int(top["Shared Hit Blocks"])}
    finally:
        engine.dispose()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--per", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4, help="acks and claims per statement")
    args = parser.parse_args()
    needed = args.batch * args.blocks * args.per * 2 + 4 * args.batch
    if args.backlog < needed:
        parser.error(f"--backlog must be at least {needed} for these blocks")
    report: dict[str, Any] = {"args": vars(args), "cases": {}}
    for case, names in PAIRS.items():
        prefix = f"acks{uuid.uuid4().hex[:6]}_"
        store = Store(f"postgresql+psycopg://{PG.split('://', 1)[1]}", table_prefix=prefix)
        try:
            if case == "full claim":
                store.set_limits({"task:another": 2})
            store.enqueue_many(
                [
                    NewMessage("q", json.dumps({"body": "x" * 300}), task_id=str(uuid.uuid4()))
                    for _ in range(args.backlog)
                ]
            )
            report["cases"][case] = {
                "round_trip_us": round_trips(store, names, args),
                "plans": plans(store, names, args.batch),
            }
        finally:
            store.engine.dispose()
            drop_tables(prefix, kombu=False)
    print("| claim | statement | round trip p50 (us) | plan nodes | shared buffers hit |")
    print("|---|---|---:|---:|---:|")
    for case, got in report["cases"].items():
        for name in PAIRS[case]:
            plan = got["plans"][name]
            print(
                f"| {case} | `{name}` | {got['round_trip_us'][name]:,} | {plan['nodes']} "
                f"| {plan['shared_hit']} |"
            )
    out = HERE / "results" / f"ack-statements-{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
