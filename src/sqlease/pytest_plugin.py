"""A pytest plugin for your own tests (entry point ``pytest11``: loaded once sqlease is
installed): a Celery app on a temporary SQLite broker and a real worker in a thread, so a
suite tests its tasks with leases, checkpoints and results, and no server.

Fixtures:

- ``sqlease_broker_url``: ``sqlease+sqlite:///…/broker.db`` in the test's ``tmp_path``;
- ``sqlease_celery_app``: a Celery app with that broker and result backend (short leases,
  fast polling); add tasks to it, or override the fixture to return your own app configured
  with ``sqlease_broker_url``;
- ``sqlease_worker``: a worker thread consuming ``sqlease_celery_app``'s queues (Celery's
  ``celery.contrib.testing.worker``), stopped after the test.

With pytest-django, a task that reads the database needs ``@pytest.mark.django_db
(transaction=True)``: Django's ``TestCase`` (and ``django_db`` without ``transaction``) keeps
each test in a transaction that is rolled back, so a worker never sees its rows, nor the tasks
published inside it (they join that transaction).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: The transport options of the test app: short leases, a quick safety poll.
TEST_TRANSPORT_OPTIONS = {"lease_seconds": 5.0, "polling_interval": 0.1}


@pytest.fixture
def sqlease_broker_url(tmp_path: Path) -> str:
    """A SQLite broker (and result backend) URL in the test's temporary folder."""
    return f"sqlease+sqlite:///{tmp_path / 'broker.db'}"


@pytest.fixture
def sqlease_celery_app(sqlease_broker_url: str) -> Iterator[Any]:
    """A Celery app on ``sqlease_broker_url`` (broker and results)."""
    from celery import Celery

    import sqlease  # noqa: F401  (registers the transport)

    app = Celery("sqlease_tests", broker=sqlease_broker_url, backend=sqlease_broker_url)
    app.conf.broker_transport_options = dict(TEST_TRANSPORT_OPTIONS)
    app.conf.worker_prefetch_multiplier = 1
    app.conf.worker_hijack_root_logger = False
    yield app
    app.close()


@pytest.fixture
def sqlease_worker(sqlease_celery_app: Any) -> Iterator[Any]:
    """A real worker for ``sqlease_celery_app`` in a thread (threads pool, 2 at once),
    started before the test and stopped after it."""
    from celery.contrib.testing.worker import start_worker

    sqlease_celery_app.loader.import_module("celery.contrib.testing.tasks")  # its ping task
    with start_worker(
        sqlease_celery_app, pool="threads", concurrency=2, perform_ping_check=False
    ) as worker:
        yield worker
