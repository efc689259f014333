"""The event loop's background thread: jobs are done in order, the jobs waiting are prepared
together (one op for several), errors come back as outcomes, and the loop is woken for each
batch. The ops here carry their answer (``Op.answer``): what is tested is the thread, not a
statement."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from sqlease._db.driver import Op
from sqlease.transport._background import BackgroundCalls, Done, Job


class Executes:
    """A driver's ``execute``, as far as the runner uses it: the op's answer, after ``call``."""

    def __init__(self, call: Callable[[Job], Any] = lambda job: None) -> None:
        self.call = call

    def execute(self, op: Op[Any]) -> Any:
        return op.finish(None) if op.finish is not None else None


def one_at_a_time(call: Callable[[Job], Any]) -> Callable[[list[Job]], Any]:
    """Prepares the first waiting job alone; its outcome's value is ``call(job)``."""

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]

        def answer(_none: None) -> list[Done]:
            return [Done(job.key, value=call(job), context=job.context)]

        return Op.answer(None).then(answer), [job]

    return prepare


@pytest.mark.timeout(10)
def test_jobs_are_done_in_order_and_their_outcomes_collected() -> None:
    woken = threading.Semaphore(0)
    order: list[int] = []
    prepare = one_at_a_time(lambda job: order.append(job.key) or job.key * 10)
    calls = BackgroundCalls(Executes(), prepare, woken.release)  # type: ignore[arg-type]
    for i in range(5):
        calls.submit(i, n=i)
    assert calls.wait_idle(5)
    outcomes = calls.collect()
    assert order == [0, 1, 2, 3, 4]
    assert [(o.key, o.value, o.context["n"]) for o in outcomes] == [
        (i, i * 10, i) for i in range(5)
    ]
    assert woken.acquire(timeout=1)
    assert not calls.pending and calls.collect() == []
    calls.stop()


@pytest.mark.timeout(10)
def test_an_error_is_the_outcome_of_the_jobs_its_op_covered_and_the_thread_goes_on() -> None:
    def call(job: Job) -> str:
        if job.key == "a":
            raise RuntimeError("database said no")
        return "fine"

    calls = BackgroundCalls(Executes(), one_at_a_time(call), lambda: None)  # type: ignore[arg-type]
    calls.submit("a")
    calls.submit("b")
    assert calls.wait_idle(5)
    first, second = calls.collect()
    assert isinstance(first.error, RuntimeError) and first.value is None
    assert (second.key, second.error, second.value) == ("b", None, "fine")
    calls.stop()


@pytest.mark.timeout(10)
def test_jobs_waiting_together_are_prepared_together() -> None:
    """While one op runs, the next jobs wait; they reach ``prepare`` as one batch, which
    may answer them all with one op."""
    gate, running = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        batches.append([job.key for job in jobs])

        def answer(_none: None) -> list[Done]:
            if jobs[0].key == "first":
                running.set()
                gate.wait(5)
            return [Done(job.key, value=job.key, context=job.context) for job in jobs]

        return Op.answer(None).then(answer), list(jobs)

    calls = BackgroundCalls(Executes(), prepare, lambda: None)  # type: ignore[arg-type]
    calls.submit("first")
    assert running.wait(5)
    for key in ("second", "third"):
        calls.submit(key)
    assert calls.pending
    gate.set()
    assert calls.wait_idle(5)
    assert [o.key for o in calls.collect()] == ["first", "second", "third"]
    assert batches == [["first"], ["second", "third"]]
    calls.stop()


@pytest.mark.timeout(10)
def test_a_failing_prepare_fails_every_job_waiting() -> None:
    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        raise ConnectionError("gone")

    calls = BackgroundCalls(Executes(), prepare, lambda: None)  # type: ignore[arg-type]
    calls.submit("a")
    assert calls.wait_idle(5)
    [outcome] = calls.collect()
    assert isinstance(outcome.error, ConnectionError)
    calls.stop()


def test_wait_idle_times_out_while_a_job_runs() -> None:
    gate = threading.Event()
    calls = BackgroundCalls(Executes(), one_at_a_time(lambda job: gate.wait()), lambda: None)  # type: ignore[arg-type]
    calls.submit("slow")
    assert not calls.wait_idle(0.05)
    gate.set()
    assert calls.wait_idle(5)
    calls.stop()


@pytest.mark.timeout(10)
def test_start_and_exit_hooks_run_on_the_thread_itself() -> None:
    # The transport pins the hot path's connection to this thread (and gives it back).
    seen: list[tuple[str, int]] = []
    calls = BackgroundCalls(
        Executes(),  # type: ignore[arg-type]
        one_at_a_time(lambda job: threading.get_ident()),
        lambda: None,
        on_start=lambda: seen.append(("start", threading.get_ident())),
        on_exit=lambda: seen.append(("exit", threading.get_ident())),
    )
    calls.submit("a")
    assert calls.wait_idle(5)
    [outcome] = calls.collect()
    calls.stop()
    assert seen == [("start", outcome.value), ("exit", outcome.value)]
    assert outcome.value != threading.get_ident()
