"""Remote control and monitoring across processes: ``celery inspect ping`` and
``app.control`` broadcasts reach a running worker and its replies come back; a worker run with
``-E`` sends task events that an ``app.events.Receiver`` in another process receives, its last
ones and ``worker-offline`` included when it stops."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_inspect_ping_control_broadcast_and_task_events(e2e: E2E) -> None:
    worker = e2e.start_worker(events=True)
    app = e2e.app()
    node = worker.nodename

    # ---- remote control, from this (another) process ----------------------------------
    assert app.control.inspect(timeout=5, limit=1).ping() == {node: {"ok": "pong"}}
    assert app.control.ping(destination=[node], timeout=3) == [{node: {"ok": "pong"}}]
    replies = app.control.rate_limit("e2e.add", "600/m", destination=[node], reply=True, timeout=3)
    assert replies and node in replies[0] and "ok" in replies[0][node], replies
    stats = app.control.inspect([node], timeout=3).stats()
    assert stats is not None and stats[node]["broker"]["transport"] == "sqlease", stats
    # ... and through the command line.
    output = e2e.celery("inspect", "ping", "-d", node, "--timeout", "5")
    assert f"{node}: OK" in output and "pong" in output and "1 node online" in output, output

    # ---- task events ----------------------------------------------------------------
    events: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": events.append})

        def capture() -> None:
            try:
                # wakeup=True broadcasts 'heartbeat': the worker answers once we listen.
                receiver.capture(limit=None, timeout=30, wakeup=True)
            except BaseException as exc:  # reported by the test, not lost in the thread
                if not receiver.should_stop:
                    errors.append(exc)

        thread = threading.Thread(target=capture, name="e2e-events", daemon=True)
        thread.start()
        try:
            wait_for(
                lambda: any(
                    e["type"] == "worker-heartbeat" and e["hostname"] == node for e in events
                ),
                15,
                "a worker-heartbeat event (the receiver is listening)",
            )
            result = app.tasks["e2e.add"].delay(2, 3)

            def task_types() -> list[str]:
                return [e["type"] for e in list(events) if e.get("uuid") == result.id]

            wait_for(lambda: "task-succeeded" in task_types(), 20, "task-succeeded")
        finally:
            receiver.should_stop = True
            thread.join(10)
        assert not thread.is_alive()
    assert not errors, errors
    types = task_types()
    assert types.index("task-received") < types.index("task-started")
    assert types.index("task-started") < types.index("task-succeeded")
    succeeded = next(e for e in events if e["type"] == "task-succeeded" and e["uuid"] == result.id)
    assert succeeded["hostname"] == node and succeeded["result"] == "5"
    assert len(e2e.finished(task_id=result.id)) == 1


@pytest.mark.timeout(120)
def test_a_warm_shutdown_publishes_its_last_events(e2e: E2E) -> None:
    """The events a worker sends from its event loop are published on a thread of their own;
    the last ``task-succeeded`` events and ``worker-offline`` of a warm shutdown were left
    there when the channel closed, and lost (monitors kept showing the worker online)."""
    worker = e2e.start_worker(pool="threads", concurrency=1, events=True)
    app = e2e.app()
    node = worker.nodename
    events: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": events.append})
        thread = threading.Thread(
            target=lambda: receiver.capture(limit=None, timeout=60, wakeup=True), daemon=True
        )
        thread.start()
        try:
            wait_for(
                lambda: any(e["type"] == "worker-heartbeat" for e in events),
                15,
                "a worker-heartbeat event (the receiver is listening)",
            )
            results = [app.tasks["e2e.add"].delay(i, i) for i in range(20)]
            wait_for(lambda: all(e2e.finished(task_id=r.id) for r in results), 30, "the 20 tasks")
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.warm_shutdown(30) == 0

            def succeeded() -> set[str]:
                return {e["uuid"] for e in list(events) if e["type"] == "task-succeeded"}

            wait_for(
                lambda: (
                    {r.id for r in results} <= succeeded()
                    and any(e["type"] == "worker-offline" for e in events)
                ),
                15,
                "every task-succeeded event and worker-offline",
            )
        finally:
            receiver.should_stop = True
            thread.join(10)
    offline = [e for e in events if e["type"] == "worker-offline"]
    assert offline[-1]["hostname"] == node
    assert "an event was not published" not in worker.log()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["killed", "stopped"])
def test_commands_sent_while_a_worker_was_down_do_not_stop_it_when_it_comes_back(
    e2e: E2E, stop: str
) -> None:
    """A worker killed (or stopped) and started again under the same name: a ``shutdown``
    and a ``cancel_consumer`` broadcast while it was down do not reach it, as on RabbitMQ and
    Redis. It runs tasks from its queue and answers commands sent once it is up."""
    fixed = f"same-{e2e.prefix.strip('_')}@e2e"
    backend = e2e.broker
    first = e2e.start_worker(args=["-n", fixed], wait=False, E2E_BACKEND=backend)
    first.wait_log(f"{fixed} ready.", 60)
    app = e2e.app(backend=backend)
    assert app.control.ping(destination=[fixed], timeout=5) == [{fixed: {"ok": "pong"}}]
    if stop == "killed":
        first.kill()
    else:
        assert first.warm_shutdown() == 0
    app.control.broadcast("shutdown")
    app.control.cancel_consumer("celery")
    again = e2e.start_worker(args=["-n", fixed], wait=False, E2E_BACKEND=backend)
    again.wait_log(f"{fixed} ready.", 60)
    assert app.tasks["e2e.add"].delay(2, 3).get(timeout=30) == 5
    assert app.control.ping(destination=[fixed], timeout=5) == [{fixed: {"ok": "pong"}}]
    queues = app.control.inspect([fixed], timeout=5).active_queues()
    assert queues is not None and [q["name"] for q in queues[fixed]] == ["celery"], queues
    assert again.alive(), again.log()[-2000:]
    assert "remote-control command(s) sent to" in again.log()
