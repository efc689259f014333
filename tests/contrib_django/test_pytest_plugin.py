"""The pytest plugin, as a user's suite meets it: in a pytest run of its own (pytester), its
fixtures give an app on a SQLite broker and a worker that runs tasks with checkpoints and
results; the same with pytest-django loaded and a Django project configured."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
import pytest

import sqlease

def test_a_task_runs_with_a_checkpoint_and_a_result(sqlease_celery_app):
    app = sqlease_celery_app

    @app.task(name="count")
    def count(n):
        ctx = sqlease.context()
        ctx.checkpoint({"done": n})
        return n * 2

    from celery.contrib.testing.worker import start_worker
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = count.delay(21)
        assert result.get(timeout=30) == 42
    snapshot = sqlease.Admin(app.conf.broker_url).task(result.id)
    assert (snapshot.state, snapshot.checkpoint) == ("succeeded", {"done": 21})

def test_the_worker_fixture(sqlease_celery_app, sqlease_worker):
    assert sqlease_celery_app.send_task("celery.ping").get(timeout=30) == "pong"
"""


@pytest.mark.timeout(120)
def test_a_users_suite_uses_the_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


@pytest.mark.timeout(120)
def test_beside_pytest_django(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        settings="""
SECRET_KEY = "x"
INSTALLED_APPS = ["sqlease.contrib.django"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3",
                         "TEST": {"NAME": "test_db.sqlite3"}}}
USE_TZ = True
""",
        test_user=USER_TESTS
        + """
@pytest.mark.django_db(transaction=True)
def test_with_django_db(sqlease_celery_app, sqlease_worker):
    from django.db import connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert sqlease_celery_app.send_task("celery.ping").get(timeout=30) == "pong"
""",
    )
    result = pytester.runpytest_subprocess(
        "-p", "pytest_django", "--ds", "settings", "-p", "no:randomly", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=3)
