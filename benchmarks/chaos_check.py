"""The checks of benchmarks/chaos.py, made once the workers are gone, from two sources that do
not depend on each other: the database (results, fenced timeline events, what is left of the
messages) and the records the tasks wrote to local files (benchmarks/chaos_app.py), compared
with the faults' times (benchmarks/chaos_faults.py).

The record checks are sound against a loaded machine's scheduling: a record's ``t0`` (taken
before its call was sent) and ``t`` (after it returned) bound when the call ran, and a check
fails only on what the bounds prove (a write sent after another holder's execution had begun,
which began after its claim, is two live holders at once)."""

from __future__ import annotations

import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

#: Record kinds that report a fenced write the database accepted.
WRITES = ("start", "checkpoint", "end")


def load_records(folder: Path) -> tuple[dict[tuple[str, int], dict[str, Any]], int]:
    """Executions by (task, attempt): worker, begin time, records by kind; and the number of
    torn lines (none expected: one short ``write`` per line)."""
    executions: dict[tuple[str, int], dict[str, Any]] = {}
    torn = 0
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                torn += 1
                continue
            ex = executions.setdefault(
                (r["task"], r["attempt"]),
                {"task": r["task"], "attempt": r["attempt"], "run": r["run"], "rows": []},
            )
            ex["worker"] = r["worker"]
            ex["rows"].append(r)
    for ex in executions.values():
        rows = ex["rows"]
        begin = [r["t"] for r in rows if r["kind"] == "begin"]
        ex["begin"] = min(begin) if begin else min(r.get("t0", r["t"]) for r in rows)
        ex["writes"] = [r["t0"] for r in rows if r["kind"] in WRITES]
        ex["end_t0"] = next((r["t0"] for r in rows if r["kind"] == "end"), None)
        ex["lost_at"] = next((r["t"] for r in rows if r["kind"] == "lease_lost"), None)
        ex["lost_detail"] = next((r["detail"] for r in rows if r["kind"] == "lease_lost"), "")
    return executions, torn


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "min": round(ordered[0], 3),
        "median": round(statistics.median(ordered), 3),
        "p95": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 3),
        "max": round(ordered[-1], 3),
    }


def holder_overlaps(executions: list[dict[str, Any]], same_group: str) -> list[str]:
    """Pairs of executions of one task (or one run) that held at once, by the records: one
    sent a write that the database accepted after the other had begun (and so been claimed)."""
    found = []
    ordered = sorted(executions, key=lambda e: e["begin"])
    latest: dict[str, Any] | None = None  # the earlier execution with the latest write
    for ex in ordered:
        if latest is not None and latest["writes"] and max(latest["writes"]) > ex["begin"]:
            found.append(
                f"{same_group}: {latest['task']}#{latest['attempt']} wrote at "
                f"{max(latest['writes']):.3f} after {ex['task']}#{ex['attempt']} began at "
                f"{ex['begin']:.3f}"
            )
        if ex["writes"] and (latest is None or max(ex["writes"]) > max(latest["writes"] or [0])):
            latest = ex
    return found


def active_at(ex: dict[str, Any], t: float) -> bool:
    """Was this execution holding, at ``t``, a delivery it had not finished with?"""
    return (
        ex["begin"] < t
        and (ex["end_t0"] is None or ex["end_t0"] >= t)
        and (ex["lost_at"] is None or ex["lost_at"] >= t)
    )


def check_records(
    executions: dict[tuple[str, int], dict[str, Any]],
    faults: list[dict[str, Any]],
    claims: dict[tuple[str, int], float],
    fenced: dict[tuple[str, int], list[float]],
    lease: float,
    margin: float,
) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ex in executions.values():
        by_task[ex["task"]].append(ex)
        if ex["run"]:
            by_run[ex["run"]].append(ex)
    for group in by_task.values():
        problems += holder_overlaps(group, "task")
    for group in by_run.values():
        problems += holder_overlaps(group, "run")
    # Checkpoints never regress: an execution starts from at least every checkpoint that the
    # database had confirmed before it began.
    regressions = 0
    for group in by_task.values():
        confirmed = sorted(
            (r["t"], r["value"]) for ex in group for r in ex["rows"] if r["kind"] == "checkpoint"
        )
        for ex in group:
            start = next((r for r in ex["rows"] if r["kind"] == "start"), None)
            if start is None:
                continue
            before = [v for t, v in confirmed if t < ex["begin"]]
            if before and start["value"] < max(before):
                regressions += 1
                problems.append(f"{ex['task']}#{ex['attempt']} started from {start['value']}")
    takeovers: dict[str, list[float]] = defaultdict(list)
    learned: dict[str, list[float]] = defaultdict(list)
    cut_off = late = late_writes = 0
    slow: list[str] = []
    for fault in faults:
        if fault["kind"] not in ("kill", "stall", "partition"):
            continue
        t = fault["t"]
        victims = [
            ex for ex in executions.values() if ex["worker"] == fault["worker"] and active_at(ex, t)
        ]
        if fault["kind"] == "partition":
            # Also what the worker had claimed before the cut and began during it.
            victims += [
                ex
                for ex in executions.values()
                if ex["worker"] == fault["worker"] and t <= ex["begin"] < fault["end"]
            ]
        for ex in victims:
            taken = claims.get((ex["task"], ex["attempt"] + 1))
            if taken is not None and taken > t:
                takeovers[fault["kind"]].append(taken - t)
                if taken - t > 2 * lease:  # what else happened meanwhile
                    others = [
                        f"{f['kind']} +{f['t'] - t:.1f}s"
                        for f in faults
                        if f is not fault and t - lease <= f["t"] <= taken
                    ]
                    slow.append(f"{fault['kind']}: {taken - t:.2f} s, {', '.join(others)}")
            if fault["kind"] == "stall":
                # Stopped past its lease: on waking, its clock has run out; its next call
                # raises LeaseLost without asking the database.
                # A worker killed within the margin after its SIGCONT had no time to run (the
                # schedule may pick the worker it just woke: 3 ms apart, seen once in CI).
                killed_on_waking = any(
                    f["kind"] == "kill"
                    and f["worker"] == fault["worker"]
                    and fault["end"] <= f["t"] <= fault["end"] + margin
                    for f in faults
                )
                if ex["lost_at"] is None and not killed_on_waking:
                    problems.append(f"stalled {ex['task']}#{ex['attempt']} never learned")
                elif ex["lost_at"] is not None:
                    learned["after_sigcont"].append(ex["lost_at"] - fault["end"])
            if fault["kind"] == "partition":
                cut_off += 1
                # Its writes held by the partition reached the database when it healed: none
                # was accepted (on the database's clock, none after the lease of the cut).
                accepted = [s for s in fenced.get((ex["task"], ex["attempt"]), []) if s > t + lease]
                if accepted:
                    late_writes += len(accepted)
                    problems.append(f"cut-off {ex['task']}#{ex['attempt']} wrote at {accepted}")
                if ex["lost_at"] is None:
                    problems.append(f"cut-off {ex['task']}#{ex['attempt']} never learned")
                    continue
                after = ex["lost_at"] - t
                learned["after_cut"].append(after)
                if after > lease + margin or ex["lost_at"] >= fault["end"]:
                    late += 1
                    problems.append(
                        f"cut-off {ex['task']}#{ex['attempt']} learned LeaseLost {after:.3f} s "
                        f"after the cut (lease {lease} + margin {margin}): {ex['lost_detail']}"
                    )
    figures = {
        "executions_recorded": len(executions),
        "record_holder_overlaps": sum(1 for p in problems if p.startswith(("task:", "run:"))),
        "record_checkpoint_regressions": regressions,
        "partition_cut_off_executions": cut_off,
        "lease_lost_later_than_lease_plus_margin": late,
        "cut_off_writes_accepted_after_the_lease": late_writes,
        "takeover_seconds_after_fault": {k: stats(v) for k, v in sorted(takeovers.items())},
        "lease_lost_seconds": {k: stats(v) for k, v in sorted(learned.items())},
        "takeovers_longer_than_two_leases": slow,
    }
    return figures, problems


def _timeline(events: list[Any]) -> str:
    """A task's events, for a problem's message: what happened, when (the database's clock)."""
    return "; ".join(
        f"{e.at_ms} {e.kind} attempt {e.attempt} message {e.message_id}"
        + (f" {e.data}" if e.kind in ("claimed", "released", "lease_lost") and e.data else "")
        for e in events
    )


def check_database(
    store: Any, steps: int, task_ids: dict[str, tuple[str | None, int, bool]]
) -> tuple[
    dict[str, Any],
    list[str],
    dict[tuple[str, int], float],
    dict[tuple[str, int], list[float]],
]:
    """Every task's result and timeline, from the database alone; and, for the record checks,
    when each delivery was claimed and when its fenced writes ran (the database's clock)."""
    from sqlalchemy import select

    from sqlease._core import exhausted_results
    from sqlease.store import expand_event_rows

    # A worker killed between marking a task exhausted and writing its FAILURE leaves the
    # result to the next maintenance pass; run that repair now rather than wait a pass.
    exhausted_results.write_missing(store)
    t = store.tables
    problems: list[str] = []
    finished = exhausted = reexecuted = from_stored = 0
    with store.driver.reading() as conn:
        results: dict[str, list[Any]] = defaultdict(list)
        result_cols = (t.results.c.task_id, t.results.c.state, t.results.c.value)
        for r in conn.execute(select(*result_cols, t.results.c.updated_at_ms)):
            results[r.task_id].append(r)
        leftovers = conn.execute(
            select(t.messages.c.task_id, t.messages.c.state, t.messages.c.reason)
        ).fetchall()
        rows = conn.execute(select(t.events).order_by(t.events.c.id))
        events = [SimpleNamespace(**e) for e in expand_event_rows(r._mapping for r in rows)]
    by_task: dict[str, list[Any]] = defaultdict(list)
    claims: dict[tuple[str, int], float] = {}
    for event in events:
        by_task[event.task_id].append(event)
        if event.kind == "claimed" and event.attempt:
            key = (event.task_id, event.attempt)
            claims[key] = min(claims.get(key, float("inf")), event.at_ms / 1000)
    duplicates = sum(1 for rs in results.values() if len(rs) > 1)
    if duplicates:
        problems.append(f"{duplicates} tasks with more than one result row")
    for task_id, (_run_id, _seq, poison) in task_ids.items():
        found = results.get(task_id)
        row = found[0] if found else None
        if poison:
            if row is None or row.state != "FAILURE":
                problems.append(f"poisoned {task_id}: result {row and row.state}")
            if "attempts_exhausted" not in [e.kind for e in by_task[task_id]]:
                problems.append(f"poisoned {task_id} did not end attempts_exhausted")
            exhausted += 1
            continue
        if row is None or row.state != "SUCCESS":
            problems.append(f"task {task_id} has no SUCCESS result ({row and row.state})")
            continue
        value = json.loads(bytes(row.value))["result"]
        if value["i"] != steps:
            problems.append(f"task {task_id} finished at step {value['i']}")
        finished += 1
        checkpoints = [
            json.loads(e.data)["checkpoint"]["i"]
            for e in by_task[task_id]
            if e.kind == "checkpoint"
        ]
        if checkpoints != sorted(checkpoints):
            problems.append(f"task {task_id}: checkpoints went backwards {checkpoints}")
        attempts = max((e.attempt or 0) for e in by_task[task_id])
        if attempts > store.max_attempts:
            problems.append(f"task {task_id} exceeded its budget: attempt {attempts}")
        # The delivery that stored the result completed under its lease. A delivery that
        # completed and then died before storing its result is re-run (at-least-once) and
        # resumes from its last checkpoint: counted, not a failure.
        ends = [e.attempt for e in by_task[task_id] if e.kind == "exec_end"]
        if value["attempt"] not in ends:
            problems.append(f"task {task_id}: its result's delivery recorded no completion")
        if any(a > value["attempt"] for a in ends):
            problems.append(
                f"task {task_id}: a delivery completed after the result was stored "
                f"(at {row.updated_at_ms}): {_timeline(by_task[task_id])}"
            )
        reexecuted += len(ends) - 1
        from_stored += [e.kind for e in by_task[task_id]].count("completed_from_stored_outcome")
    # No two live holders, on the database's clock: every fenced write of a delivery comes
    # before any later delivery of its task was claimed, and the fenced activity intervals
    # (first fenced write .. last) of different tasks of one run never overlap.
    intervals: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    claimed: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (tid, a), c in claims.items():
        claimed[tid].append((a, c))
    holders = 0
    fenced: dict[tuple[str, int], list[float]] = {}
    for task_id, (run_id, _, _poison) in task_ids.items():
        per_attempt: dict[int, list[float]] = defaultdict(list)
        for e in by_task[task_id]:
            if e.kind in ("exec_start", "checkpoint", "exec_end") and e.attempt:
                per_attempt[e.attempt].append(e.at_ms / 1000)
        for attempt, stamps in per_attempt.items():
            fenced[(task_id, attempt)] = stamps
            later = [c for a, c in claimed[task_id] if a > attempt]
            if later and max(stamps) > min(later):
                holders += 1
                problems.append(f"task {task_id}#{attempt} wrote after a later claim")
            if run_id is not None:
                intervals[run_id].append((min(stamps), max(stamps), task_id))
    overlaps = 0
    for run_id, spans in intervals.items():
        spans.sort()
        for (_s1, e1, t1), (s2, _e2, t2) in itertools.pairwise(spans):
            if t1 != t2 and s2 < e1:
                overlaps += 1
                problems.append(f"run {run_id}: {t1} and {t2} overlapped")
    # Each task was published once (no task here is retried by Celery): a publish whose
    # commit answer a fault lost is not stored again by its retry.
    published_twice = [
        tid for tid in task_ids if [e.kind for e in by_task[tid]].count("enqueued") > 1
    ]
    for tid in published_twice[:5]:
        problems.append(f"task {tid} was stored by more than one publish")
    left = [r for r in leftovers if not (r.state == "dead" and r.reason == "attempts_exhausted")]
    if left:
        problems.append(f"{len(left)} messages left leased or ready: {left[:5]}")
    figures = {
        "finished_once": finished,
        "duplicate_results": duplicates,
        "reexecuted_after_crash_before_result": reexecuted,
        # Stored, then the worker died before its ack: acked by the next holder, not run.
        "completed_from_the_stored_result": from_stored,
        "poisoned_exhausted": exhausted,
        "task_holder_overlaps": holders,
        "run_overlaps": overlaps,
        "left_leased_or_ready": len(left),
        "published_twice": len(published_twice),
        "lost": sum(1 for tid, v in task_ids.items() if not v[2] and tid not in results),
    }
    return figures, problems, claims, fenced
