"""``interrupt_on_lease_lost``: how a task whose lease is lost is interrupted. In the main
thread (prefork pool processes, the solo pool) a signal cuts a blocking call short; in any
other thread (the threads pool) an asynchronous exception is raised at its next Python
instruction. The ``LeaseLost`` names the delivery; only tasks that opted in are armed."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sqlease import LeaseLost
from sqlease._celery import lease_interrupt
from sqlease._celery.lease_interrupt import LeaseInterrupted
from sqlease._core.delivery_lease import DeliveryLease
from sqlease._core.lease_clock import DeliveryClock
from sqlease.delivery import ATTEMPT_KEY, ID_KEY, LEASE_KEY, OWNER_KEY
from sqlease.types import Fence

FENCE = Fence(41, "w1", 3)


@pytest.fixture
def restore_signal() -> Iterator[None]:
    before = signal.getsignal(signal.SIGUSR2)
    installed = lease_interrupt._handler_installed
    yield
    signal.signal(signal.SIGUSR2, before)
    lease_interrupt._handler_installed = installed
    lease_interrupt._armed.clear()


def _arm_here() -> None:
    lease = DeliveryLease(FENCE, DeliveryClock(3.0))
    lease_interrupt._armed[threading.get_ident()] = lease_interrupt._Armed(FENCE, lease)


def test_a_blocking_call_in_the_main_thread_is_cut_short(restore_signal: None) -> None:
    assert lease_interrupt._install_handler()
    _arm_here()
    main = threading.get_ident()
    threading.Timer(0.05, lease_interrupt._interrupt, args=(main,)).start()
    started = time.monotonic()
    with pytest.raises(LeaseLost) as caught:
        time.sleep(10)  # only the signal ends it early
    assert time.monotonic() - started < 5
    assert isinstance(caught.value, LeaseInterrupted)
    assert (caught.value.message_id, caught.value.attempt) == (41, 3)
    lease_interrupt.disarm()


def _spin(seconds: float) -> None:
    """Pure Python for ``seconds``: interruptible at its next instruction. (Called, not inlined
    in the ``try``: Python 3.13 may raise an asynchronous exception at a loop's jump back as
    if outside the ``try`` of the loop's own function, CPython issue 139622.)"""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def test_another_thread_gets_it_at_its_next_instruction(restore_signal: None) -> None:
    caught: list[BaseException] = []
    armed = threading.Event()

    def task() -> None:
        _arm_here()
        armed.set()
        try:
            _spin(10)
        except LeaseLost as exc:
            caught.append(exc)
        finally:
            lease_interrupt.disarm()

    thread = threading.Thread(target=task)
    thread.start()
    armed.wait(5)
    lease_interrupt._interrupt(thread.ident or 0)
    thread.join(10)
    assert not thread.is_alive()
    [error] = caught
    assert isinstance(error, LeaseInterrupted) and error.message_id == 41


def test_only_tasks_that_opted_in_are_armed(restore_signal: None) -> None:
    info = {ID_KEY: 41, ATTEMPT_KEY: 3, OWNER_KEY: "w1", LEASE_KEY: 3000}

    def task(option: Any = None, transport: Any = None) -> SimpleNamespace:
        app = SimpleNamespace(
            conf={"broker_transport_options": {"interrupt_on_lease_lost": transport}}
        )
        request = SimpleNamespace(properties={"delivery_info": dict(info)})
        found = SimpleNamespace(app=app, request=request)
        if option is not None:
            found.interrupt_on_lease_lost = option
        return found

    for found, armed in (
        (task(), False),
        (task(transport="yes"), True),
        (task(option=False, transport=True), False),  # the task's own option wins
        (task(option=True), True),
    ):
        lease_interrupt.arm(found)
        assert (threading.get_ident() in lease_interrupt._armed) is armed
        lease_interrupt.disarm()


class _Task:
    """A Celery task as the prerun receiver sees it (hashable: a signal's sender)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


def _lost_at_start(monkeypatch: pytest.MonkeyPatch, run: Any) -> Any:
    """A task whose delivery's lease is already lost when Celery starts it (its claim's answer
    came late, or it waited in the pool while the database was out of reach)."""
    clock = DeliveryClock(3.0)
    clock.mark_lost()
    monkeypatch.setattr(
        lease_interrupt.DeliveryLease,
        "of",
        classmethod(lambda cls, f, ms, ref: DeliveryLease(f, clock)),
    )
    info = {ID_KEY: 41, ATTEMPT_KEY: 3, OWNER_KEY: "w1", LEASE_KEY: 3000}
    request = SimpleNamespace(properties={"delivery_info": info})
    return _Task(app=None, request=request, run=run, interrupt_on_lease_lost=True)


def test_a_lease_lost_before_the_body_starts_is_raised_in_the_body(
    restore_signal: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Celery sends task_prerun robustly: what a receiver raises is logged and the body runs
    # all the same. The interruption must wait for the body.
    from celery import signals

    assert lease_interrupt._install_handler()
    ran: list[str] = []

    def body(seconds: float) -> None:
        ran.append("started")
        time.sleep(seconds)
        ran.append("finished")

    task = _lost_at_start(monkeypatch, body)
    signals.task_prerun.send(sender=task, task_id="t1", task=task, args=(), kwargs={})
    started = time.monotonic()
    with pytest.raises(LeaseInterrupted) as caught:
        task.run(10)
    assert time.monotonic() - started < 5
    assert ran == ["started"] and caught.value.message_id == 41
    assert "could not watch" not in caplog.text
    lease_interrupt.disarm()


def test_in_another_thread_too(restore_signal: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import signals

    caught: list[BaseException] = []

    def body() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # pure Python: interruptible
            pass

    task = _lost_at_start(monkeypatch, body)

    def run() -> None:
        signals.task_prerun.send(sender=task, task_id="t2", task=task, args=(), kwargs={})
        try:
            task.run()
        except LeaseLost as exc:
            caught.append(exc)
        finally:
            lease_interrupt.disarm()

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    [error] = caught
    assert isinstance(error, LeaseInterrupted)


def test_after_the_body_returned_nothing_is_raised(restore_signal: None) -> None:
    # The body returned; the result is being written: an interruption sent now is held
    # back (outside the body) and withdrawn by disarm.
    assert lease_interrupt._install_handler()

    def body() -> None:
        pass

    lease = DeliveryLease(FENCE, DeliveryClock(3.0))
    ident = threading.get_ident()
    lease_interrupt._armed[ident] = lease_interrupt._Armed(
        FENCE, lease, body=lease_interrupt._body_of(SimpleNamespace(run=body))
    )
    body()
    lease_interrupt._interrupt(ident)  # lands here, outside the body
    time.sleep(0.05)  # resent meanwhile: still outside
    lease_interrupt.disarm()
    time.sleep(0.05)
