"""Lease deadlines a worker's process shares with its pool processes.

The heartbeat that renews a delivery's lease runs in the worker's main process; the task runs
in a pool child that was forked before the delivery existed (often before the broker
connection itself). The main process keeps one slot per held delivery in a small file in
shared memory (``/dev/shm`` where there is one), writes the delivery's deadline there each
time a renewal is confirmed, and puts the slot's reference (``file#index``) in the delivery's
``delivery_info`` (``sqlease.delivery.CLOCK_KEY``). The child maps the file on first use and
reads the deadline with a memory read: no pipe, no round trip, whenever the task asks.

A slot holds ``(sequence, message id, attempt, deadline)``. The writer makes the sequence odd,
writes, and makes it even again; a reader retries until it reads one even sequence on both
sides of its read (a sequence lock: one writer, any number of readers, no lock they share).
A slot that no longer names the reader's delivery (the worker dropped it, and gave the slot
to another) reads as lost: the worker drops a delivery only once it is settled or lost.
Freed slots are reused oldest first, so a slot changes hands as late as possible.

A file belongs to the process that made it: removed at its exit, and, for a worker that was
killed, by the next worker that starts on the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import re
import secrets
import struct
import tempfile
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from sqlease._core.lease_clock import LOST, DeliveryClock
from sqlease.types import Fence

logger = logging.getLogger(__name__)

#: sequence (even: stable), message id, attempt, deadline (monotonic seconds; -inf: lost)
SLOT = struct.Struct("<Qqqd")
SEQUENCE = struct.Struct("<Q")
BODY = struct.Struct("<qqd")
SLOTS_PER_FILE = 1024
PREFIX = "sqlease-clock-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-\d+$")
#: What a freed slot names: no delivery.
_NOBODY = Fence(0, "", 0)
#: Reads retried while a writer is mid-write (it holds a slot for microseconds).
_READ_TRIES = 10_000


def _folder() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(folder: str) -> None:
    """Files of workers that died without removing theirs (SIGKILL, OOM)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


class ClockSlots:
    """The writer's side: the worker's process, one slot per delivery it holds. Thread-safe."""

    def __init__(self, folder: str | None = None) -> None:
        self._folder = folder
        self._lock = threading.Lock()
        self._files: list[tuple[str, mmap.mmap]] = []
        #: Free slots, oldest freed first: (file, slot, its reference).
        self._free: deque[tuple[int, int, str]] = deque()
        #: Where each reference points (a dict lookup: the worker frees a slot per ack).
        self._places: dict[str, tuple[int, int]] = {}
        self._token = secrets.token_hex(4)
        self._pid = os.getpid()

    def _grow(self) -> None:
        folder = self._folder or _folder()
        if not self._files:
            _remove_stale(folder)
        path = os.path.join(folder, f"{PREFIX}{self._pid}-{self._token}-{len(self._files)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SLOT.size * SLOTS_PER_FILE)
            mapped = mmap.mmap(fd, SLOT.size * SLOTS_PER_FILE, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        index = len(self._files)
        self._files.append((path, mapped))
        _mapped[path] = mapped  # this process reads its own slots through the same mapping
        if index == 0:
            atexit.register(self.close)
        for slot in range(SLOTS_PER_FILE):
            ref = f"{path}#{slot}"
            self._places[ref] = (index, slot)
            self._free.append((index, slot, ref))

    def take(self, fence: Fence, deadline: float) -> str:
        """A slot for ``fence``, holding ``deadline``; its reference for ``delivery_info``."""
        return self.take_all([fence], deadline)[0]

    def take_all(self, fences: Sequence[Fence], deadline: float) -> list[str]:
        """A slot for each of ``fences``, all holding ``deadline`` (a claim's messages share
        their send time); their references, in order."""
        refs: list[str] = []
        with self._lock:
            for fence in fences:
                if not self._free:
                    self._grow()
                file, slot, ref = self._free.popleft()
                self._write(file, slot, fence, deadline)
                refs.append(ref)
        return refs

    def write(self, ref: str, fence: Fence, deadline: float) -> None:
        """A new deadline for ``fence`` (``LOST``: the lease is known gone)."""
        file, slot = self._locate(ref)
        with self._lock:
            self._write(file, slot, fence, deadline)

    def free(self, ref: str) -> None:
        """The delivery is settled or lost: the slot reads as lost, and goes to the back of the
        free list."""
        file, slot = self._locate(ref)
        with self._lock:
            self._write(file, slot, _NOBODY, LOST)
            self._free.append((file, slot, ref))

    def _locate(self, ref: str) -> tuple[int, int]:
        place = self._places.get(ref)
        if place is None:
            raise KeyError(f"not a slot of this process: {ref!r}")
        return place

    def _write(self, file: int, slot: int, fence: Fence, deadline: float) -> None:
        mapped = self._files[file][1]
        at = slot * SLOT.size
        (sequence,) = SEQUENCE.unpack_from(mapped, at)
        SEQUENCE.pack_into(mapped, at, sequence + 1)  # odd: a write is under way
        BODY.pack_into(mapped, at + SEQUENCE.size, fence.message_id, fence.attempt, deadline)
        SEQUENCE.pack_into(mapped, at, sequence + 2)

    def close(self) -> None:
        """Remove the files (at exit, in the process that made them)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            for path, mapped in self._files:
                _mapped.pop(path, None)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                with contextlib.suppress(BufferError, ValueError):
                    mapped.close()
            self._files = []
            self._free.clear()
            self._places.clear()


#: Files mapped by this process, for reading (its own slots included).
_mapped: dict[str, mmap.mmap] = {}
_mapped_lock = threading.Lock()


def _mapping(path: str) -> mmap.mmap | None:
    found = _mapped.get(path)
    if found is not None:
        return found
    with _mapped_lock:
        found = _mapped.get(path)
        if found is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None  # the worker is gone (or removed it): nothing is held
            try:
                found = mmap.mmap(fd, SLOT.size * SLOTS_PER_FILE, mmap.MAP_SHARED, mmap.PROT_READ)
            except (OSError, ValueError):
                return None
            finally:
                os.close(fd)
            _mapped[path] = found
        return found


def parse_ref(ref: str) -> tuple[str, int] | None:
    """Where ``ref`` points, checked (None: not a slot reference)."""
    path, sep, slot = ref.rpartition("#")
    if not sep or not path or not slot.isdigit() or int(slot) >= SLOTS_PER_FILE:
        return None
    return path, int(slot)


def read(path: str, slot: int, fence: Fence) -> float:
    """The deadline the worker published for ``fence`` in ``slot`` of ``path``; ``LOST`` if
    the slot names another delivery (the worker no longer holds this one) or the file is
    gone."""
    mapped = _mapping(path)
    if mapped is None:
        return LOST
    at = slot * SLOT.size
    for _ in range(_READ_TRIES):
        before, message_id, attempt, deadline = SLOT.unpack_from(mapped, at)
        (after,) = SEQUENCE.unpack_from(mapped, at)
        if before == after and not before & 1:
            if message_id != fence.message_id or attempt != fence.attempt:
                return LOST
            return float(deadline)
    logger.warning("sqlease: lease clock slot %s#%d kept changing; taken as lost", path, slot)
    return LOST


#: The clocks of the deliveries this process runs tasks for, by fence and slot: a task's
#: context and the result backend share one (the confirmations of the task's own writes count
#: for both).
_clocks: OrderedDict[tuple[Fence, str | None], DeliveryClock] = OrderedDict()
_clocks_lock = threading.Lock()
#: Deliveries remembered (a pool process runs one task at a time; a thread pool a few).
_CLOCKS_KEPT = 256


def _after_fork_in_child() -> None:
    # A thread of the parent may have held a lock at fork time. The mappings stay: a forked
    # pool process reads its parent's slots through them.
    global _mapped_lock, _clocks_lock
    _mapped_lock = threading.Lock()
    _clocks_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def delivery_clock(fence: Fence, lease_ms: int, ref: str | None) -> DeliveryClock:
    """The lease clock of ``fence`` in this process, reading the deadline its worker
    publishes at ``ref`` (``delivery_info[CLOCK_KEY]``; None: the worker published none)."""
    key = (fence, ref if isinstance(ref, str) else None)
    with _clocks_lock:
        clock = _clocks.get(key)
        if clock is not None:
            _clocks.move_to_end(key)
            return clock
        where = parse_ref(ref) if isinstance(ref, str) else None
        shared = None
        if where is not None:
            path, slot = where

            def shared() -> float:
                return read(path, slot, fence)

        clock = DeliveryClock(lease_ms / 1000.0, shared=shared)
        _clocks[key] = clock
        while len(_clocks) > _CLOCKS_KEPT:
            _clocks.popitem(last=False)
        return clock
