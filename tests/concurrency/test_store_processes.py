"""The store's concurrency claims (guarantees.md, invariants 1, 2 and 7), shown with real
processes racing on PostgreSQL: real time, the database's clock, short leases, no fake clock.

Every worker is a process started with the ``spawn`` method, so it builds its own engine and
``Store``; the worker bodies live in ``workers.py``. Every child is killed when its test ends,
whatever happened.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from sqlalchemy import select

from sqlease import Fence, NewMessage, Outcome, Store
from sqlease.store import expand_event_rows

from . import workers

pytestmark = [pytest.mark.pg, pytest.mark.concurrency]

_prefixes = itertools.count()


def fresh_store(url: str) -> Store:
    """A store on its own table prefix (this also creates the tables before any child runs)."""
    return Store(url, table_prefix=f"c{os.getpid()}_{next(_prefixes)}_")


@dataclass
class Child:
    name: str
    process: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid


@dataclass
class Pack:
    members: list[Child]
    go: Event


@dataclass
class Children:
    """Starts worker processes and talks to them; ``kill_all`` leaves nothing running."""

    ctx: Any = field(default_factory=lambda: multiprocessing.get_context("spawn"))
    started: list[Child] = field(default_factory=list)

    def event(self) -> Event:
        event: Event = self.ctx.Event()
        return event

    def start(self, name: str, **kwargs: Any) -> Child:
        reader, writer = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(
            target=workers.main, args=(writer, name, kwargs), name=name, daemon=True
        )
        try:
            process.start()
        finally:
            writer.close()  # the child holds the only writer: its exit is seen as EOF
        child = Child(name, process, reader)
        self.started.append(child)
        return child

    def expect(self, child: Child, tag: str, timeout: float) -> Any:
        """The next report from ``child``, which must be ``tag``."""
        if not child.conn.poll(timeout):
            pytest.fail(
                f"{child.name} (pid {child.pid}) sent nothing within {timeout}s "
                f"(exitcode {child.process.exitcode})"
            )
        try:
            got, data = child.conn.recv()
        except EOFError:
            child.process.join(5)
            pytest.fail(
                f"{child.name} (pid {child.pid}) exited without a word "
                f"(exitcode {child.process.exitcode})"
            )
        if got == "error":
            pytest.fail(f"{child.name} (pid {child.pid}) failed:\n{data}")
        assert got == tag, f"{child.name} sent {got!r}, expected {tag!r}"
        return data

    def start_many(self, n: int, name: str, **kwargs: Any) -> Pack:
        """Start ``n`` workers that wait for ``release`` (they load while the test sets up)."""
        go = self.event()
        return Pack([self.start(name, go=go, **kwargs) for _ in range(n)], go)

    def release(self, pack: Pack) -> None:
        """Wait until every worker of ``pack`` is ready, then let them all go at once."""
        for child in pack.members:
            self.expect(child, "ready", 60)
        pack.go.set()

    def finish(self, child: Child, timeout: float = 30) -> None:
        child.process.join(timeout)
        assert child.process.exitcode == 0, f"{child.name} exitcode {child.process.exitcode}"

    def kill_all(self) -> None:
        for child in self.started:
            if child.process.exitcode is None:
                child.process.kill()  # SIGKILL: works on a stopped process too
        for child in self.started:
            child.process.join(10)
            child.conn.close()
            if child.process.exitcode is not None:
                child.process.close()


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.kill_all()


def messages_left(store: Store) -> int:
    return workers.messages_left(store)


def event_counts(store: Store, kind: str) -> Counter[tuple[int, int]]:
    """How many ``kind`` events each ``(message_id, attempt)`` has (the database's record)."""
    ev = store.tables.events
    stmt = select(ev).where(ev.c.kind == kind)
    with store.engine.connect() as conn:
        rows = expand_event_rows(r._mapping for r in conn.execute(stmt))
        conn.rollback()
    return Counter((int(r["message_id"]), int(r["attempt"])) for r in rows)


def bulk_enqueue(store: Store, queue: str, n: int) -> list[int]:
    """Insert ``n`` ready messages in one multi-row INSERT through the store's own table
    definition: ``enqueue_many`` takes one round trip per message, which for 10,000 messages
    would be most of the test's time (enqueueing is tested elsewhere; claiming is tested here).
    """
    now = store.now_ms()
    messages = store.tables.messages
    rows = [
        {
            "queue": queue,
            "payload": f"p{i}",
            "priority": 0,
            "available_at_ms": now,
            "created_at_ms": now,
            "state": "ready",
            "attempt": 0,
            "max_attempts": store.max_attempts,
        }
        for i in range(n)
    ]
    stmt = messages.insert().returning(messages.c.id, sort_by_parameter_order=True)
    with store.engine.begin() as conn:
        return [int(r[0]) for r in conn.execute(stmt, rows)]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# ---- 1. atomic claim: 8 processes, 10,000 tasks, each delivered exactly once ----------------

BULK_PROCESSES = 8
BULK_TASKS = 10_000


@pytest.mark.timeout(120)
def test_8_processes_batch_claim_10000_tasks_each_delivered_exactly_once(
    pg_database_url: str, children: Children
) -> None:
    store = fresh_store(pg_database_url)
    drainers = children.start_many(
        BULK_PROCESSES,
        "batch_drainer",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="bulk",
        limit=32,
        lease_ms=60_000,  # no lease expires during the test
    )
    enqueued = bulk_enqueue(store, "bulk", BULK_TASKS)
    children.release(drainers)
    results = [children.expect(d, "result", 90) for d in drainers.members]
    for d in drainers.members:
        children.finish(d)

    assert len(enqueued) == len(set(enqueued)) == BULK_TASKS
    deliveries = [tuple(d) for r in results for d in r["deliveries"]]
    delivered = Counter(d[0] for d in deliveries)
    twice = {mid: n for mid, n in delivered.items() if n != 1}
    assert not twice, f"delivered more than once: {sorted(twice.items())[:20]}"
    assert set(delivered) == set(enqueued)
    assert {d[1] for d in deliveries} == {1}, "a lease expired or a claim skipped an attempt"
    assert all(owner == f"drainer-{pid}" for _, _, owner, pid in deliveries)
    acked = Counter(mid for r in results for mid in r["acked"])
    assert set(acked) == set(enqueued) and set(acked.values()) == {1}
    assert messages_left(store) == 0
    # The database's own record agrees: one claim and one ack per message, all at attempt 1.
    expected = {(mid, 1): 1 for mid in enqueued}
    assert dict(event_counts(store, "claimed")) == expected
    assert dict(event_counts(store, "acked")) == expected
    pids = {d[3] for d in deliveries}
    assert len(pids) >= 2, f"only {pids} claimed anything: there was no race"


# ---- 1. per-run exclusion: 100 runs x 20 tasks, 8 processes --------------------------------

RUNS = 100
PER_RUN = 20
RUN_PROCESSES = 8
RUN_BATCH = 4


@pytest.mark.timeout(120)
def test_tasks_of_a_run_never_overlap_and_keep_their_order(
    pg_database_url: str, children: Children
) -> None:
    store = fresh_store(pg_database_url)
    executors = children.start_many(
        RUN_PROCESSES,
        "run_executor",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="runs",
        limit=RUN_BATCH,
        lease_ms=60_000,
        max_sleep_s=0.002,
    )
    # Round robin across runs, so every claim batch sees the heads of many runs at once.
    ids = store.enqueue_many(
        [
            NewMessage("runs", f"{r}:{i}", run_id=f"run-{r}", record=False)
            for i in range(PER_RUN)
            for r in range(RUNS)
        ]
    )
    expected: dict[str, list[int]] = defaultdict(list)
    for n, mid in enumerate(ids):
        expected[f"run-{n % RUNS}"].append(mid)
    children.release(executors)
    results = [children.expect(e, "result", 90) for e in executors.members]
    for e in executors.members:
        children.finish(e)

    executions = sorted((tuple(x) for r in results for x in r), key=lambda x: x[3])
    assert len(executions) == RUNS * PER_RUN
    assert Counter(x[1] for x in executions) == Counter(ids), "a task ran twice or never"
    assert all(x[2] == 1 and x[5] for x in executions), "a lease expired or an ack was refused"

    per_run: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for x in executions:
        per_run[x[0]].append(x)
    for run_id, runs in per_run.items():
        assert [x[1] for x in runs] == expected[run_id], f"{run_id} ran out of order"
        for before, after in itertools.pairwise(runs):
            assert before[4] < after[3], (
                f"{run_id}: message {after[1]} started {(before[4] - after[3]) / 1e6:.3f} ms "
                f"before message {before[1]} ended"
            )
    assert messages_left(store) == 0

    # The check is only meaningful if executions of different runs did overlap.
    overlapping = sum(1 for a, b in itertools.pairwise(executions) if b[3] < a[4])
    assert overlapping > 0, "no two executions ever overlapped: the workers did not race"


# ---- 7. takeover after SIGKILL; the dead holder's fence is stale ----------------------------

SHORT_LEASE_MS = 2_000


@pytest.mark.timeout(120)
def test_sigkilled_holder_is_taken_over_after_expiry_and_its_fence_is_dead(
    pg_database_url: str, children: Children
) -> None:
    store = fresh_store(pg_database_url)
    mid = store.enqueue("doomed", "work", task_id="task-k")
    holder = children.start(
        "killed_holder",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="doomed",
        lease_ms=SHORT_LEASE_MS,
        task_id="task-k",
    )
    report = children.expect(holder, "holding", 60)
    assert (report["message_id"], report["attempt"], report["cas_outcome"]) == (mid, 1, "updated")
    os.kill(holder.pid, signal.SIGKILL)
    holder.process.join(10)
    assert holder.process.exitcode == -signal.SIGKILL
    expires = report["lease_expires_at_ms"]

    # The lease outlives its holder: nobody gets the message before it expires.
    assert store.now_ms() < expires, "the machine was too slow to test before expiry"
    assert store.claim(["doomed"], "heir", lease_ms=60_000) == []
    row = store.get_message(mid)
    assert row is not None and (row.lease_owner, row.attempt) == (report["owner"], 1)

    heir_lease = 60_000
    got: list[Any] = []

    def claimed() -> bool:
        got.extend(store.claim(["doomed"], "heir", lease_ms=heir_lease))
        return bool(got)

    wait_for(claimed, 15, "the takeover", every=0.05)
    [heir] = got
    assert (heir.id, heir.lease_owner, heir.attempt) == (mid, "heir", 2)
    assert heir.lease_expires_at_ms - heir_lease >= expires, "taken over before expiry"
    task = store.get_task("task-k")
    assert task is not None and (task.checkpoint, task.revision) == ({"step": 1}, 1)

    # The dead holder's fence, rebuilt from its report, is stale: nothing it does lands.
    stale = Fence(report["message_id"], report["owner"], report["attempt"])
    assert store.ack([stale]) == set()
    assert store.renew([stale], lease_ms=60_000) == {}
    cas = store.compare_and_set(stale, "task-k", 1, checkpoint={"step": 99}, lease_ms=60_000)
    assert cas.outcome is Outcome.LEASE_LOST
    assert not store.is_held(stale)
    row = store.get_message(mid)
    assert row is not None
    assert (row.state, row.lease_owner, row.attempt, row.lease_expires_at_ms) == (
        "ready",
        "heir",
        2,
        heir.lease_expires_at_ms,
    )
    task = store.get_task("task-k")
    assert task is not None and (task.checkpoint, task.revision) == ({"step": 1}, 1)

    # The heir carries on from the checkpoint and finishes.
    assert store.compare_and_set(heir.fence, "task-k", 1, checkpoint={"step": 2}).outcome is (
        Outcome.UPDATED
    )
    assert store.ack([heir.fence]) == {mid}
    assert messages_left(store) == 0


# ---- 2. a stopped (live) worker's late ack and checkpoint are refused -----------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("taken_over", [True, False], ids=["taken_over", "expired_only"])
def test_stopped_worker_resumed_after_expiry_cannot_ack_renew_or_checkpoint(
    pg_database_url: str, children: Children, taken_over: bool
) -> None:
    store = fresh_store(pg_database_url)
    lease_ms = 1_500
    mid = store.enqueue("sleepy", "work", task_id="task-s")
    worker = children.start(
        "stopped_holder",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="sleepy",
        lease_ms=lease_ms,
        task_id="task-s",
    )
    report = children.expect(worker, "holding", 60)
    assert (report["message_id"], report["attempt"], report["cas_outcome"]) == (mid, 1, "updated")
    wait_for(lambda: process_state(worker.pid) in ("T", "t"), 10, "the worker to stop")
    expires = report["lease_expires_at_ms"]
    wait_for(lambda: store.now_ms() > expires, 15, "the lease to expire", every=0.05)

    heir = None
    if taken_over:
        [heir] = store.claim(["sleepy"], "heir", lease_ms=60_000)
        assert (heir.id, heir.attempt) == (mid, 2)
    os.kill(worker.pid, signal.SIGCONT)
    outcome = children.expect(worker, "result", 30)
    children.finish(worker)

    assert outcome == {"cas_outcome": "lease_lost", "acked": [], "renewed": {}, "held": False}
    row = store.get_message(mid)
    assert row is not None and row.state == "ready"
    if heir is not None:
        assert (row.lease_owner, row.attempt, row.lease_expires_at_ms) == (
            "heir",
            2,
            heir.lease_expires_at_ms,
        )
    else:  # untouched: still the expired lease, not renewed by the stale writes
        assert (row.lease_owner, row.attempt, row.lease_expires_at_ms) == (
            report["owner"],
            1,
            expires,
        )
        [heir] = store.claim(["sleepy"], "heir", lease_ms=60_000)
        assert (heir.id, heir.attempt) == (mid, 2)
    task = store.get_task("task-s")
    assert task is not None and (task.checkpoint, task.revision) == ({"step": 1}, 1)
    kinds = [(e.kind, e.attempt) for e in store.events(message_id=mid)]
    assert ("stale_checkpoint", 1) not in kinds and not any(k == "acked" for k, _ in kinds)
    assert store.ack([heir.fence]) == {mid}


# ---- 1. racing on one hot row ---------------------------------------------------------------

HOT_RACERS = 4
HOT_MESSAGES = 200
HOT_LEASE_MS = 500
ABANDON_EVERY = 10


@pytest.mark.timeout(120)
def test_racers_on_a_hot_row_never_share_a_live_lease(
    pg_database_url: str, children: Children
) -> None:
    store = fresh_store(pg_database_url)
    stop = children.event()
    claimed = children.ctx.Semaphore(0)  # released by the racer that wins a first delivery
    racers = children.start_many(
        HOT_RACERS,
        "hot_racer",
        url=pg_database_url,
        prefix=store.tables.prefix,
        queue="hot",
        lease_ms=HOT_LEASE_MS,
        abandon_every=ABANDON_EVERY,
        stop=stop,
        claimed=claimed,
    )
    children.release(racers)
    ids: list[int] = []
    for i in range(HOT_MESSAGES):
        # One message at a time: the next is enqueued once a racer has won this one.
        ids.append(store.enqueue("hot", f"hot-{i}"))
        if not claimed.acquire(timeout=30):
            pytest.fail(f"message {ids[-1]} was not claimed within 30 s")
    wait_for(lambda: messages_left(store) == 0, 30, "every message to be acked", every=0.05)
    stop.set()
    results = [children.expect(r, "result", 30) for r in racers.members]
    for r in racers.members:
        children.finish(r)

    by_id: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for r in results:
        for d in r["deliveries"]:
            by_id[d[0]].append(tuple(d))
    assert set(by_id) == set(ids)
    for mid, ds in by_id.items():
        ds.sort(key=lambda d: d[1])
        attempts = [d[1] for d in ds]
        assert attempts == list(range(1, len(ds) + 1)), f"message {mid}: attempts {attempts}"
        for before, after in itertools.pairwise(ds):
            # A redelivery's lease starts (database clock) no earlier than the last one ended.
            assert after[3] - HOT_LEASE_MS >= before[3], (
                f"message {mid}: attempt {after[1]} claimed while attempt {before[1]} was live"
            )
            if before[4] is not None:  # not abandoned: only a refused (late) ack allows this
                assert before[4] is False, f"message {mid}: acked, then delivered again"
        assert ds[-1][4] is True, f"message {mid}: its last delivery was not acked"
        if mid % ABANDON_EVERY == 0:
            assert ds[0][4] is None and len(ds) >= 2
    abandoned = [mid for mid in ids if mid % ABANDON_EVERY == 0]
    assert abandoned, "no message was abandoned: expiry was never raced"
    assert messages_left(store) == 0
    assert all(n == 1 for n in event_counts(store, "claimed").values())
    assert all(n == 1 for n in event_counts(store, "acked").values())
    # Every message was raced for: more claims than deliveries, and more than one winner.
    deliveries = sum(len(ds) for ds in by_id.values())
    assert sum(r["claims"] for r in results) > deliveries
    assert len({d[2] for ds in by_id.values() for d in ds}) >= 2
