"""How the transport's event-loop callbacks treat an error (sqlease.transport._wakeups): a
connection error goes up to Celery, which reconnects, unless deliveries held here can still
hold their leases (sqlease.transport._outage: it is logged, at most every 10 s, and the loop
goes on); any other error is logged and the loop goes on; what is not an error (an interrupt)
is never swallowed."""

from __future__ import annotations

import pytest

from sqlease.transport._outage import LOG_EVERY_S, Outage
from sqlease.transport._wakeups import _ErrorsLogged


class Disconnected(Exception):
    pass


def logged(doing: str = "fetching messages", outage: Outage | None = None) -> _ErrorsLogged:
    return _ErrorsLogged(doing, (Disconnected,), outage or Outage(lambda: 0))


def test_an_error_is_logged_with_its_traceback_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("ERROR", logger="sqlease.transport._wakeups"), logged():
        raise ValueError("a bad row")
    [record] = caplog.records
    assert record.getMessage() == "sqlease: error while fetching messages"
    assert record.exc_info is not None and record.exc_info[0] is ValueError


def test_a_connection_error_and_an_interrupt_go_up_unlogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("ERROR"):
        with pytest.raises(Disconnected), logged():
            raise Disconnected()
        with pytest.raises(KeyboardInterrupt), logged():
            raise KeyboardInterrupt()
        with logged():
            pass
    assert caplog.records == []


def test_a_connection_error_stays_in_the_loop_while_leases_held_here_can_be_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Celery's reconnect would give back every delivery the channels hold, running tasks
    included: while any lease can still be held, the loop goes on (and tries again)."""
    alive = [2]
    now = [100.0]
    outage = Outage(lambda: alive[0], monotonic=lambda: now[0])
    with caplog.at_level("WARNING", logger="sqlease.transport._outage"):
        with logged(outage=outage):
            raise Disconnected("connection refused\nmore detail")
        now[0] += LOG_EVERY_S / 2
        with logged(outage=outage):
            raise Disconnected("connection refused")
        assert len(caplog.records) == 1  # once per LOG_EVERY_S
        message = caplog.records[0].getMessage()
        assert "(Disconnected: connection refused);" in message and "more detail" not in message
        assert "2 deliveries held here can still hold their leases" in message
        now[0] += LOG_EVERY_S
        with logged(outage=outage):
            raise Disconnected("connection refused")
        assert len(caplog.records) == 2
        # Every lease ran out (or was acked): the error goes to Celery, which reconnects.
        alive[0] = 0
        with pytest.raises(Disconnected), logged(outage=outage):
            raise Disconnected("connection refused")
        # Any other error is logged as before, whatever the leases.
        alive[0] = 1
        with logged(outage=outage):
            raise ValueError("a bad row")
    assert caplog.records[-1].levelname == "ERROR"


def test_an_ack_on_its_way_counts_until_it_is_answered_or_its_lease_clock_runs_out() -> None:
    """An ack leaves the heartbeat (its lease is no longer renewed) but the database holds the
    lease until the ack is written: a reconnect would drop the unwritten ack, and the message
    would run again at the lease's expiry. So it holds the error back like a running task."""
    from sqlease.store import Fence

    now = [100.0]
    outage = Outage(lambda: 0, monotonic=lambda: now[0])
    first, second = Fence(1, "w", 1), Fence(2, "w", 1)
    outage.leaving([(first, 130.0), (second, 110.0)])
    assert outage.alive() == 2
    with logged(outage=outage):
        raise Disconnected("connection refused")
    now[0] = 120.0  # the second's lease clock ran out: it no longer counts
    assert outage.alive() == 1
    outage.answered([first])  # written (or refused) once the database answered
    assert outage.alive() == 0
    with pytest.raises(Disconnected), logged(outage=outage):
        raise Disconnected("connection refused")
    # A running delivery and an ack on its way add up; answering an unknown ack is harmless.
    outage = Outage(lambda: 1, monotonic=lambda: now[0])
    outage.leaving([(first, 130.0)])
    outage.answered([second])
    assert outage.alive() == 2


def test_acks_never_answered_are_forgotten_once_their_lease_clocks_ran_out() -> None:
    """A path that loses an ack's answer leaves no lasting entry: past ``PRUNE_ABOVE`` those
    whose clock ran out are dropped as the next one leaves."""
    from sqlease.store import Fence
    from sqlease.transport._outage import PRUNE_ABOVE

    now = [100.0]
    outage = Outage(lambda: 0, monotonic=lambda: now[0])
    outage.leaving([(Fence(n, "w", 1), 110.0) for n in range(PRUNE_ABOVE)])
    now[0] = 120.0
    outage.leaving([(Fence(-1, "w", 1), 130.0)])
    assert len(outage._leaving) == 1 and outage.alive() == 1
