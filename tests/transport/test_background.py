"""The event loop's background thread: calls run in order, waiting calls are handed to the
combiner together, errors come back as outcomes, and the loop is woken for each batch."""

from __future__ import annotations

import threading

import pytest

from sqlease.transport._background import BackgroundCalls, Done, Job, run_each


@pytest.mark.timeout(10)
def test_calls_run_in_order_and_their_outcomes_are_collected() -> None:
    woken = threading.Semaphore(0)
    calls = BackgroundCalls(woken.release)
    order: list[int] = []
    for i in range(5):
        calls.submit(i, lambda i=i: order.append(i) or i * 10, n=i)
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
def test_an_error_is_an_outcome_and_the_thread_goes_on() -> None:
    calls = BackgroundCalls(lambda: None)

    def fail() -> None:
        raise RuntimeError("database said no")

    calls.submit("a", fail)
    calls.submit("b", lambda: "fine")
    assert calls.wait_idle(5)
    first, second = calls.collect()
    assert isinstance(first.error, RuntimeError) and first.value is None
    assert (second.error, second.value) == (None, "fine")
    calls.stop()


@pytest.mark.timeout(10)
def test_calls_waiting_together_are_combined() -> None:
    """While one call runs, the next ones wait; they reach the combiner as one batch."""
    gate = threading.Event()
    batches: list[list[str]] = []

    def combine(jobs: list[Job]) -> list[Done]:
        batches.append([job.key for job in jobs])
        return run_each(jobs)

    calls = BackgroundCalls(lambda: None, combine)
    running = threading.Event()

    def first() -> None:
        running.set()
        gate.wait(5)

    calls.submit("first", first)
    assert running.wait(5)
    for key in ("second", "third"):
        calls.submit(key, lambda key=key: key)
    assert calls.pending
    gate.set()
    assert calls.wait_idle(5)
    assert [o.key for o in calls.collect()] == ["first", "second", "third"]
    assert batches == [["first"], ["second", "third"]]
    calls.stop()


@pytest.mark.timeout(10)
def test_a_failing_combiner_fails_every_call_of_its_batch() -> None:
    def combine(jobs: list[Job]) -> list[Done]:
        raise ConnectionError("gone")

    calls = BackgroundCalls(lambda: None, combine)
    calls.submit("a", lambda: 1)
    assert calls.wait_idle(5)
    [outcome] = calls.collect()
    assert isinstance(outcome.error, ConnectionError)
    calls.stop()


def test_wait_idle_times_out_while_a_call_runs() -> None:
    gate = threading.Event()
    calls = BackgroundCalls(lambda: None)
    calls.submit("slow", gate.wait)
    assert not calls.wait_idle(0.05)
    gate.set()
    assert calls.wait_idle(5)
    calls.stop()


@pytest.mark.timeout(10)
def test_start_and_exit_hooks_run_on_the_thread_itself() -> None:
    # The transport pins the hot path's connection to this thread (and gives it back).
    seen: list[tuple[str, int]] = []
    calls = BackgroundCalls(
        lambda: None,
        on_start=lambda: seen.append(("start", threading.get_ident())),
        on_exit=lambda: seen.append(("exit", threading.get_ident())),
    )
    calls.submit("a", threading.get_ident)
    assert calls.wait_idle(5)
    [outcome] = calls.collect()
    calls.stop()
    assert seen == [("start", outcome.value), ("exit", outcome.value)]
    assert outcome.value != threading.get_ident()
