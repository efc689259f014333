"""How the transport's event-loop callbacks treat an error (sqlease.transport._wakeups): a
connection error goes up to Celery, which reconnects; any other error is logged and the loop
goes on; what is not an error (an interrupt) is never swallowed."""

from __future__ import annotations

import pytest

from sqlease.transport._wakeups import _ErrorsLogged


class Disconnected(Exception):
    pass


def logged(doing: str = "fetching messages") -> _ErrorsLogged:
    return _ErrorsLogged(doing, (Disconnected,))


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
