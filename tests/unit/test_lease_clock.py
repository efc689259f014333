"""The local lease clock (guarantees.md, invariant 14): the margin, a delivery's deadline as its
task sees it, the database's time for handoffs, the shared slots a pool child reads (across a
real fork), and the watch that tells a task its lease is lost. Time is injected."""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sqlease._core import clock_slots
from sqlease._core.clock_slots import SLOT, ClockSlots, delivery_clock, parse_ref, read
from sqlease._core.lease_clock import (
    LOST,
    DatabaseTime,
    DeliveryClock,
    deadline_after,
    margin_seconds,
)
from sqlease._core.lease_watch import LeaseWatch
from sqlease.types import Fence


class Monotonic:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_margin_is_a_hundredth_of_the_lease_plus_a_fixed_part() -> None:
    assert margin_seconds(60.0) == pytest.approx(0.85)
    assert margin_seconds(10.0) == pytest.approx(0.35)
    # The fixed part is at most a tenth of a short lease: a 3 s lease keeps 0.28 s, a 0.1 s
    # lease 0.011 s.
    assert margin_seconds(3.0) == pytest.approx(0.28)
    assert margin_seconds(0.1) == pytest.approx(0.011)
    assert deadline_after(100.0, 3.0) == pytest.approx(102.72)


def test_a_deadline_counts_from_the_send_time_of_the_last_confirmation() -> None:
    now = Monotonic()
    clock = DeliveryClock(3.0, monotonic=now)
    assert clock.deadline() is None and clock.remaining() is None and not clock.lost()
    clock.confirmed(1000.0)
    assert clock.deadline() == pytest.approx(1002.72)
    now.now = 1002.0
    assert clock.remaining() == pytest.approx(0.72)
    clock.confirmed(1001.5)  # a later renewal moves it
    assert clock.deadline() == pytest.approx(1004.22)
    clock.confirmed(1000.5)  # an earlier one (answered late) never moves it back
    assert clock.deadline() == pytest.approx(1004.22)


def test_once_passed_the_lease_is_lost_for_good() -> None:
    now = Monotonic()
    clock = DeliveryClock(3.0, monotonic=now)
    clock.confirmed(1000.0)
    now.now = 1002.73
    assert clock.lost() and clock.deadline() == LOST and clock.remaining() == 0.0
    clock.confirmed(1002.5)  # confirmed after it ran out: the task may have stopped
    assert clock.lost()


def test_the_worker_published_deadline_and_the_tasks_own_confirmations() -> None:
    now = Monotonic()
    published = [1002.0]
    clock = DeliveryClock(3.0, shared=lambda: published[0], monotonic=now)
    assert clock.deadline() == 1002.0
    clock.confirmed(1000.5)  # the task's checkpoint: later than the heartbeat's
    assert clock.deadline() == pytest.approx(1003.22)
    published[0] = 1004.0
    assert clock.deadline() == 1004.0
    published[0] = LOST  # the worker's renewal was refused: lost, whatever the task saw
    assert clock.lost()
    published[0] = 1010.0
    assert clock.lost()


def test_a_refused_write_marks_the_lease_lost() -> None:
    clock = DeliveryClock(3.0, monotonic=Monotonic())
    clock.confirmed(1000.0)
    clock.mark_lost()
    assert clock.lost() and clock.remaining() == 0.0


def test_database_time_bounds_a_handoffs_lease_from_below() -> None:
    db_time = DatabaseTime()
    assert db_time.sent_equivalent(5_000, 3_000, now=10.0) is None  # nothing told yet
    # A statement sent at local 10.0 ran at database time 1_000_000 ms (local - db >= -990).
    db_time.note(10.0, 1_000_000)
    # A lease from database time 1_000_500 (expiring at 1_003_500) started, locally, no
    # earlier than 10.5: counted from there, its deadline is never late.
    assert db_time.sent_equivalent(1_003_500, 3_000, now=10.0) == pytest.approx(10.5)
    # The bound ages by the rate margin: 100 s later it is a second more conservative.
    assert db_time.sent_equivalent(1_003_500, 3_000, now=110.0) == pytest.approx(9.5)
    # A fresher statement tightens it again; an older, looser one does not loosen it.
    db_time.note(110.0, 1_100_000)
    assert db_time.sent_equivalent(1_103_000, 3_000, now=110.0) == pytest.approx(110.0)
    db_time.note(110.0, 1_100_500)  # a statement that took longer: a looser bound
    assert db_time.sent_equivalent(1_103_000, 3_000, now=110.0) == pytest.approx(110.0)


# ---- the shared slots -----------------------------------------------------------------


@pytest.fixture
def slots(tmp_path: Path) -> ClockSlots:
    table = ClockSlots(folder=str(tmp_path))
    yield table
    table.close()


def test_a_slot_holds_its_deliverys_deadline(slots: ClockSlots) -> None:
    fence = Fence(7, "w1", 2)
    ref = slots.take(fence, 123.5)
    where = parse_ref(ref)
    assert where is not None
    assert read(*where, fence) == 123.5
    slots.write(ref, fence, 130.0)
    assert read(*where, fence) == 130.0
    # Another delivery of the same message (or another message) reads it as lost.
    assert read(*where, Fence(7, "w1", 3)) == LOST
    assert read(*where, Fence(8, "w1", 2)) == LOST
    slots.free(ref)
    assert read(*where, fence) == LOST


def test_freed_slots_are_reused_oldest_first_and_the_table_grows(slots: ClockSlots) -> None:
    refs = [slots.take(Fence(i, "w", 1), 1.0) for i in range(1, clock_slots.SLOTS_PER_FILE + 1)]
    assert len(set(refs)) == clock_slots.SLOTS_PER_FILE
    slots.free(refs[5])
    slots.free(refs[3])
    assert slots.take(Fence(5000, "w", 1), 2.0) == refs[5]  # the one freed first
    assert slots.take(Fence(5001, "w", 1), 2.0) == refs[3]
    grown = slots.take(Fence(5002, "w", 1), 2.0)  # none free: a second file
    assert grown.rsplit("#", 1)[0] != refs[0].rsplit("#", 1)[0]
    where = parse_ref(grown)
    assert where is not None and read(*where, Fence(5002, "w", 1)) == 2.0


def test_a_batch_takes_slots_in_order_and_grows_the_table_mid_batch(slots: ClockSlots) -> None:
    first = [Fence(i, "w", 1) for i in range(1, clock_slots.SLOTS_PER_FILE)]
    slots.take_all(first, 1.0)  # one slot of the first file left
    batch = [Fence(9000, "w", 1), Fence(9001, "w", 2), Fence(9002, "w", 1)]
    refs = slots.take_all(batch, 4.5)
    assert len(set(refs)) == 3
    files = [ref.rsplit("#", 1)[0] for ref in refs]
    assert files[0] != files[1] == files[2]  # the last of the first file, then a second one
    for fence, ref in zip(batch, refs, strict=True):
        where = parse_ref(ref)
        assert where is not None and read(*where, fence) == 4.5
    slots.free(refs[1])
    where = parse_ref(refs[1])
    assert where is not None and read(*where, batch[1]) == LOST
    assert slots.take_all([], 1.0) == []


def test_a_reference_of_another_table_is_refused(slots: ClockSlots, tmp_path: Path) -> None:
    other = ClockSlots(folder=str(tmp_path))
    try:
        ref = other.take(Fence(1, "w", 1), 1.0)
        with pytest.raises(KeyError, match="not a slot of this process"):
            slots.free(ref)
        with pytest.raises(KeyError, match="not a slot of this process"):
            slots.write(f"{ref}x", Fence(1, "w", 1), 2.0)
    finally:
        other.close()


def test_bad_references_and_a_missing_file_read_as_lost(tmp_path: Path) -> None:
    assert parse_ref("no-slot") is None
    assert parse_ref(f"{tmp_path}/x#{clock_slots.SLOTS_PER_FILE}") is None
    assert read(str(tmp_path / "gone"), 0, Fence(1, "w", 1)) == LOST


def test_a_slot_mid_write_is_not_read(slots: ClockSlots, monkeypatch: pytest.MonkeyPatch) -> None:
    fence = Fence(1, "w", 1)
    ref = slots.take(fence, 50.0)
    path, slot = parse_ref(ref) or ("", 0)
    mapped = clock_slots._mapped[path]
    (sequence,) = struct.unpack_from("<Q", mapped, slot * SLOT.size)
    struct.pack_into("<Q", mapped, slot * SLOT.size, sequence + 1)  # a writer that never ends
    monkeypatch.setattr(clock_slots, "_READ_TRIES", 50)
    assert read(path, slot, fence) == LOST
    struct.pack_into("<Q", mapped, slot * SLOT.size, sequence + 2)
    assert read(path, slot, fence) == 50.0


def test_a_child_forked_before_the_table_existed_reads_what_the_parent_writes(
    tmp_path: Path,
) -> None:
    """The prefork case: pool processes are forked before the worker connects to the broker,
    so before its clock table exists; they open the file by the reference in delivery_info."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the pool child
        try:
            os.close(to_child_w)
            os.close(to_parent_r)
            with os.fdopen(to_child_r) as incoming, os.fdopen(to_parent_w, "w") as outgoing:
                ref = incoming.readline().strip()
                fence = Fence(11, "w", 1)
                clock = delivery_clock(fence, 3_000, ref)
                for line in incoming:  # one read per request from the parent
                    outgoing.write(f"{clock.deadline()} {read(*parse_ref(ref), fence)}\n")
                    outgoing.flush()
                    if line.strip() == "last":
                        break
        finally:
            os._exit(0)
    os.close(to_child_r)
    os.close(to_parent_w)
    table = ClockSlots(folder=str(tmp_path))
    try:
        fence = Fence(11, "w", 1)
        far = 10.0**9  # monotonic seconds far ahead: the child's clock reads it as it is
        ref = table.take(fence, far)
        with os.fdopen(to_child_w, "w") as outgoing, os.fdopen(to_parent_r) as incoming:
            outgoing.write(ref + "\n")

            def ask(last: bool = False) -> list[float]:
                outgoing.write("last\n" if last else "read\n")
                outgoing.flush()
                assert select.select([incoming], [], [], 10)[0], "the child did not answer"
                return [float(x) for x in incoming.readline().split()]

            assert ask() == [far, far]
            table.write(ref, fence, far + 5)  # the heartbeat confirmed a renewal
            assert ask() == [far + 5, far + 5]
            table.write(ref, fence, LOST)  # the renewal was refused
            assert ask(last=True) == [LOST, LOST]
    finally:
        os.waitpid(pid, 0)
        table.close()


def test_another_process_reads_a_slot_by_its_reference(slots: ClockSlots) -> None:
    fence = Fence(21, "w", 4)
    ref = slots.take(fence, 777.25)
    code = (
        "import sys\n"
        "from sqlease._core.clock_slots import parse_ref, read\n"
        "from sqlease.types import Fence\n"
        "print(read(*parse_ref(sys.argv[1]), Fence(21, 'w', 4)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ref], capture_output=True, text=True, check=True
    )
    assert float(out.stdout) == 777.25


def test_files_of_dead_workers_are_removed_and_ours_at_close(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    stale = tmp_path / f"{clock_slots.PREFIX}{int(dead.stdout)}-abcd1234-0"
    stale.write_bytes(b"\0" * SLOT.size)
    table = ClockSlots(folder=str(tmp_path))
    ref = table.take(Fence(1, "w", 1), 1.0)
    path = Path(ref.rsplit("#", 1)[0])
    assert not stale.exists() and path.exists()
    table.close()
    assert not path.exists()


# ---- the watch ---------------------------------------------------------------------------


def test_the_watch_calls_back_once_when_the_clock_reads_lost() -> None:
    now = Monotonic()
    clock = DeliveryClock(3.0, monotonic=now)
    clock.confirmed(1000.0)
    watch = LeaseWatch()
    called: list[str] = []
    handle = watch.watch(clock, lambda: called.append("lost"))
    other = DeliveryClock(3.0, monotonic=now)
    other.confirmed(1000.0)
    watch.unwatch(watch.watch(other, lambda: called.append("unwatched")))
    # It sleeps until the deadline, or a tenth of the lease to notice a published loss.
    assert watch.check() == pytest.approx(0.3)
    now.now = 1002.6
    assert watch.check() == pytest.approx(0.12)
    assert called == []
    now.now = 1003.0
    watch.check()
    watch.check()
    assert called == ["lost"] and watch.watching() == 0
    watch.unwatch(handle)  # harmless after it fired
