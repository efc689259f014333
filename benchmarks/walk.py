"""Which of sqlease's modules one task crosses, from ``delay()`` to its result.

A Celery app on sqlease (PostgreSQL by default, SQLite with ``--sqlite``) publishes one task,
an in-process worker (Celery's ``start_worker``, solo pool) runs it, and the client reads its
result; a profile hook records every sqlease function that runs, by phase: the publish (in the
client), the worker's delivery (claim, decode, the task, the result write, the ack), and the
client's ``get()``. Printed: per phase, the modules in the order first entered, and how many;
then the distinct modules of the whole walk, the calls that cross from one module to another,
and the pairs of modules that call each other both ways (a mesh, rather than layers). Run it on
two versions to compare their seams:

    .venv/bin/python benchmarks/walk.py                  # this tree, PostgreSQL
    PYTHONPATH=../other/src .venv/bin/python benchmarks/walk.py --sqlite
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker

import sqlease

WORKER = "worker: claim, task, result, ack"
PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
ROOT = os.path.dirname(sqlease.__file__)


class Walk:
    """The sqlease modules whose functions run, in first-entry order: the client's (the main
    thread's, by phase) and the worker's (every other thread)."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.seen: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._client = threading.get_ident()
        #: Off while the app and the worker warm up (connections, tables, a first task).
        self.recording = False
        #: (caller's module, callee's module) of the calls that cross from one to another.
        self.calls: set[tuple[str, str]] = set()
        #: Per phase, how many times each module was entered from another one.
        self.entries: collections.defaultdict[str, collections.Counter[str]] = (
            collections.defaultdict(collections.Counter)
        )

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.recording:
            return
        module = _module_of(frame)
        if module is None:
            return
        phase = self.phase if threading.get_ident() == self._client else WORKER
        caller = _module_of(frame.f_back) if frame.f_back is not None else None
        with self._lock:
            found = self.seen.setdefault(phase, [])
            if module not in found:
                found.append(module)
            if caller is not None and caller != module:
                self.calls.add((caller, module))
                self.entries[phase][module] += 1

    def during(self, phase: str, call: Callable[[], Any]) -> Any:
        self.phase = phase
        return call()


def _module_of(frame: Any) -> str | None:
    path = frame.f_code.co_filename
    if not path.startswith(ROOT):
        return None
    module = "sqlease." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return module.removesuffix(".__init__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite", action="store_true", help="SQLite instead of PostgreSQL")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    url = f"sqlite:///{folder}/walk.db" if args.sqlite else PG
    prefix = f"walk{uuid.uuid4().hex[:8]}_"
    app = Celery("walk", broker=f"sqlease+{url}", backend=f"sqlease+{url}", set_as_current=False)
    app.conf.update(
        broker_transport_options={"table_prefix": prefix},
        result_backend_transport_options={"table_prefix": prefix},
    )

    @app.task(name="walk.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    walk = Walk()
    # Threads started from now on (the worker's) report to the hook too.
    sys.setprofile(walk.hook)
    threading.setprofile(walk.hook)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            add.delay(0, 0).get(timeout=30)  # warm: connections, tables, the first claim
            time.sleep(0.5)
            walk.recording = True
            result = walk.during("client: delay()", lambda: add.delay(2, 2))
            value = walk.during("client: get()", lambda: result.get(timeout=30))
            time.sleep(0.5)  # the worker's ack, after the result
            walk.recording = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert value == 4
    print(f"sqlease {sqlease.__file__}  ({'SQLite' if args.sqlite else 'PostgreSQL'})")
    every: list[str] = []
    for phase, modules in walk.seen.items():
        entered = walk.entries[phase]
        print(
            f"\n{phase}: {len(modules)} modules, entered {sum(entered.values())} times from "
            "another module"
        )
        for module in modules:
            print(f"  {module} ({entered[module]})")
            if module not in every:
                every.append(module)
    print(f"\nthe whole walk: {len(every)} distinct modules")
    both_ways = sorted({tuple(sorted(pair)) for pair in walk.calls if pair[::-1] in walk.calls})
    print(f"calls from one module to another: {len(walk.calls)} distinct pairs; {len(both_ways)}")
    print("pairs of modules that call each other both ways:")
    for first, second in both_ways:
        print(f"  {first} <-> {second}")


if __name__ == "__main__":
    main()
