"""Bad input and hostile conditions: each gets a clear, specific error and loses nothing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy import create_engine, text, update
from sqlalchemy.engine import make_url

import sqlease
from conftest import PG_URL, unique_prefix
from sqlease import (
    ConfigurationError,
    DatabaseReadOnly,
    PermissionDenied,
    SchemaMissing,
    SchemaVersionMismatch,
    Store,
)
from sqlease._db.migrations import CURRENT_VERSION
from sqlease._db.roles import worker_grants


def test_newer_schema_is_refused(make_store: Any) -> None:
    store = make_store()
    with store.engine.begin() as conn:
        conn.execute(update(store.tables.schema_version).values(version=CURRENT_VERSION + 1))
    with pytest.raises(SchemaVersionMismatch, match="newer than this sqlease"):
        make_store()
    with pytest.raises(SchemaVersionMismatch):
        make_store(auto_migrate=False)


def test_missing_schema_without_auto_migrate_names_the_command(db_url: str) -> None:
    with pytest.raises(SchemaMissing, match="sqlease migrate"):
        Store(db_url, table_prefix=unique_prefix(), auto_migrate=False)


@pytest.mark.parametrize(
    "url, match",
    [
        ("sqlease+mysql://u@h/db", "unsupported database 'mysql'"),
        ("sqlease+sqlite://", "in-memory SQLite"),
        ("sqlease+sqlite:///:memory:", "in-memory SQLite"),
        ("sqlease+postgresql+psycopg2://u@h/db", "psycopg 3"),
        ("sqlease://somewhere/else", "takes no host or path"),
        ("sqlease+nosuchdb://x/y", "not a database URL|unsupported database"),
    ],
)
def test_wrong_urls_are_named(url: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Connection(url).connect()


def test_wrong_url_never_shows_the_password() -> None:
    with pytest.raises(ConfigurationError) as caught:
        Connection("sqlease+mysql://alice:s3cret@h/db").connect()
    assert "s3cret" not in str(caught.value)


def test_read_only_sqlite_is_a_clear_error_and_nothing_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    Store(f"sqlite:///{path}").enqueue("q", '{"kept": true}', task_id="t")
    read_only = Store(f"sqlite:///file:{path}?mode=ro&uri=true", auto_migrate=False)
    assert read_only.size("q") == 1  # reads work
    with pytest.raises(DatabaseReadOnly, match="refuses writes"):
        read_only.enqueue("q", "{}")
    with pytest.raises(DatabaseReadOnly):
        read_only.claim(["q"], "w", lease_ms=1000)
    assert Store(f"sqlite:///{path}").size("q") == 1


# ---- PostgreSQL roles ----------------------------------------------------------------------


@pytest.fixture
def pg_role(pg_database_url: str) -> Iterator[tuple[str, str]]:
    """A fresh login role (trust auth) and its URL on the session database; dropped after."""
    role = f"sqlease_r_{uuid.uuid4().hex[:8]}"
    admin = create_engine(
        make_url(pg_database_url).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
    try:
        yield role, make_url(pg_database_url).set(username=role).render_as_string(False)
    finally:
        from sqlease._db.engine import dispose_all

        dispose_all(close=True)
        with admin.connect() as conn:
            conn.execute(text(f'DROP OWNED BY "{role}"'))
            conn.execute(text(f'DROP ROLE "{role}"'))
        admin.dispose()


@pytest.mark.pg
def test_least_privilege_worker_role_runs_everything_but_ddl(
    pg_database_url: str, pg_role: tuple[str, str]
) -> None:
    role, role_url = pg_role
    prefix = unique_prefix()
    owner = Store(pg_database_url, table_prefix=prefix)  # the owner migrates
    with owner.engine.begin() as conn:
        for statement in worker_grants(owner.tables, role):
            conn.execute(text(statement))
    worker = Store(role_url, table_prefix=prefix, auto_migrate=False)
    worker.enqueue("q", "{}", task_id="t", run_id="R")
    [message] = worker.claim(["q"], "w", lease_ms=60_000)
    assert worker.renew([message.fence], lease_ms=60_000)
    assert worker.compare_and_set(message.fence, "t", 0, checkpoint={"a": 1}).revision == 1
    assert worker.ack([message.fence]) == {message.id}
    # …but it cannot create tables: a new prefix with auto_migrate is refused clearly.
    with pytest.raises(PermissionDenied, match="lacks a privilege"):
        Store(role_url, table_prefix=unique_prefix(), auto_migrate=True)


@pytest.mark.pg
def test_role_without_grants_gets_a_clear_error(
    pg_database_url: str, pg_role: tuple[str, str]
) -> None:
    _, role_url = pg_role
    prefix = unique_prefix()
    Store(pg_database_url, table_prefix=prefix).enqueue("q", "{}")
    with pytest.raises(PermissionDenied, match=r"docs/explanation/reliability\.md"):
        Store(role_url, table_prefix=prefix, auto_migrate=False).claim(["q"], "w", lease_ms=1000)
    assert Store(pg_database_url, table_prefix=prefix).size("q") == 1


# ---- security basics -----------------------------------------------------------------------


def test_password_never_in_logs_or_report(caplog: pytest.LogCaptureFixture) -> None:
    url = "sqlease+postgresql://alice:s3cret-pw@127.0.0.1:1/nowhere"
    app = Celery("secure", broker=url, backend=url, set_as_current=False)
    with caplog.at_level(logging.DEBUG):
        conn = app.connection_for_write()
        assert "s3cret-pw" not in conn.as_uri()
        assert "s3cret-pw" not in repr(conn)
        assert "s3cret-pw" not in app.backend.as_uri()
        assert "s3cret-pw" not in app.bugreport()
        with pytest.raises(Exception) as caught:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
        assert "s3cret-pw" not in str(caught.value)
    assert "s3cret-pw" not in caplog.text
    app.close()


def test_celery_report_masks_the_password(tmp_path: Path) -> None:
    (tmp_path / "reportapp.py").write_text(
        "import sqlease\nfrom celery import Celery\n"
        "app = Celery('r', broker='sqlease+postgresql://bob:hunter2-pw@127.0.0.1:1/x',\n"
        "             backend='sqlease+postgresql://bob:hunter2-pw@127.0.0.1:1/x')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "reportapp", "report"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr
    assert "hunter2-pw" not in done.stdout + done.stderr
    assert "sqlease+postgresql://bob:**@127.0.0.1:1/x" in done.stdout


def test_json_is_the_default_and_pickle_is_not_accepted(db_url: str) -> None:
    app = Celery("ser", broker=f"sqlease+{db_url}", set_as_current=False)
    assert app.conf.task_serializer == "json"
    assert "application/x-python-serialize" not in app.conf.accept_content
    assert "pickle" not in app.conf.accept_content
    assert PG_URL  # the PostgreSQL URL comes from the environment, never from code
    assert sqlease.__version__


@pytest.mark.parametrize("field", ["task_id", "run_id", "group_id", "task_name"])
def test_an_identifier_over_1000_bytes_is_refused_and_nothing_enqueued(
    store: Store, field: str
) -> None:
    """Task ids, run ids, group ids and task names are index keys: up to 1000 bytes of UTF-8
    they are stored on both databases; past that, an error names the field, at once (it is
    not a transient error to retry), and nothing is enqueued."""
    names = {"task_id": "task id", "run_id": "run id", "group_id": "group id"}
    fitting = "é" * 500  # 1000 bytes
    store.enqueue("q", "{}", **{field: fitting})
    with pytest.raises(ConfigurationError, match=rf"{names.get(field, 'task name')} .* 1002 bytes"):
        store.enqueue("q", "{}", **{field: fitting + "é"})
    assert store.size("q") == 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("task_id", "t\x00", "task id 't\\\\x00' contains a NUL character"),
        ("queue", "q\x00", "queue name 'q\\\\x00' contains a NUL character"),
        ("run_id", "r\x00", "run id 'r\\\\x00' contains a NUL character"),
        ("concurrency_key", "tenant:\x00", "concurrency_key .* contains a NUL character"),
        ("unique_key", "u\x00", "unique_key .* contains a NUL character"),
        ("task_id", "file-\udcff", r"task id .* a lone surrogate '\\udcff' at 5"),
        ("group_id", "\ud800", "group id .* a lone surrogate"),
        ("max_attempts", 2**31, "'max_attempts' must be an integer from 1 to 2147483647"),
        ("concurrency_limit", 2**31, "must be at most 2147483647"),
    ],
)
def test_what_postgresql_cannot_store_is_refused_on_both_databases(
    store: Store, field: str, value: Any, match: str
) -> None:
    """A NUL character (PostgreSQL's text holds none), a lone surrogate (not UTF-8) and a count
    past PostgreSQL's integer: refused at publish on both databases, with the field named, so
    that what works on SQLite works on PostgreSQL; nothing is enqueued."""
    from sqlease.types import NewMessage

    fields: dict[str, Any] = {"queue": "q", "payload": "{}", field: value}
    if field == "concurrency_key":
        fields["concurrency_limit"] = 1
    if field == "concurrency_limit":
        fields["concurrency_key"] = "tenant:1"
    with pytest.raises(ConfigurationError, match=match):
        store.enqueue_many([NewMessage(**fields)])
    assert store.size("q") == 0


def test_a_requeue_budget_past_postgresqls_integer_is_refused(store: Store) -> None:
    store.enqueue("q", "{}", task_id="t")
    [message] = store.claim(["q"], "w", lease_ms=1000)
    store.fail(message.fence, "boom")
    with pytest.raises(ConfigurationError, match="max_attempts must be an integer from 1 to"):
        store.requeue(message.id, max_attempts=2**31)
    assert store.requeue(message.id, max_attempts=2)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a: a.task(b"5"), "task_id must be a string, a uuid.UUID or an integer, not bytes"),
        (lambda a: a.pause(5.0), "task_id must be .* not float 5.0"),
        (lambda a: a.cancel(run_id=[7]), "run_id must be .* not list"),
        (lambda a: a.requeue(b"t"), "task_id must be .* not bytes b't'"),
        (lambda a: a.approve(None), "task_id must be .* not NoneType None"),
        (lambda a: a.tasks(run_id=b"7"), "run_id must be .* not bytes"),
        (lambda a: a.tasks(queue=5), "queue must be a string, not int 5"),
        (lambda a: a.group(3), "group_id must be a string, not int 3"),
        (lambda a: a.original_of(True), "task_id must be .* not bool True"),
        (lambda a: a.unique(2.5), "key must be a string, not float 2.5"),
    ],
)
def test_an_admin_id_of_another_type_is_named(store: Store, call: Any, match: str) -> None:
    """On PostgreSQL a value of another type compared with a text column is the database's own
    error, and on SQLite it silently matches nothing: both get the same ``TypeError`` naming
    the argument, and the task it might have meant is untouched."""
    store.enqueue("q", "{}", task_id="5", run_id="7")
    admin = sqlease.Admin("unused", store=store)
    with pytest.raises(TypeError, match=match):
        call(admin)
    assert admin.task("5").state == "queued"


def test_ids_given_as_integers_or_uuids_find_what_a_publish_stored(store: Store) -> None:
    """A publish stores an integer or UUID task id or run id as its string; ``Admin`` takes
    them the same way, so the value the caller has finds its task on both databases."""
    from sqlease.transport._codec import new_message

    tid = uuid.UUID(int=9)
    for task_id, run_id in ((5, 7), (tid, None)):
        headers = {"id": task_id, "run_id": run_id}
        message = new_message("q", {"headers": headers, "properties": {}, "body": ""})
        store.enqueue_many([message])
    admin = sqlease.Admin("unused", store=store)
    assert admin.task(5).task_id == "5"
    assert admin.task(tid).task_id == str(tid)
    assert [t.task_id for t in admin.tasks(run_id=7)] == ["5"]
    assert admin.pause(run_id=7) == 1
    assert admin.resume(5) == 1
    assert admin.cancel(tid) == 1


@pytest.mark.parametrize("field", ["task_id", "run_id"])
@pytest.mark.parametrize("value", [b"t-1", 1.5, True, ["t"]])
def test_an_id_of_another_type_is_refused_at_publish(db_url: str, field: str, value: Any) -> None:
    """Bytes would be stored as their repr (``"b't-1'"``), and the task kept under an id the
    caller never gave: refused by name instead, and nothing is enqueued."""
    prefix = unique_prefix()
    app = Celery("ids", broker=f"sqlease+{db_url}", set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}
    name = field.replace("_", " ")
    refused = f"{name} must be a string, a uuid.UUID or an integer, not {type(value).__name__}"
    options: dict[str, Any] = (
        {"task_id": value} if field == "task_id" else {"headers": {"run_id": value}}
    )
    with pytest.raises(ConfigurationError, match=refused):
        app.send_task("t", **options)
    app.send_task("t", task_id="fine")
    assert Store(db_url, table_prefix=prefix).size("celery") == 1
    app.close()
