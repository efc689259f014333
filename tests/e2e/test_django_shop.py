"""The Django example on PostgreSQL, with a real worker (its SQLite run is in
test_examples.py): ``manage.py migrate`` makes both schemas, a declined order leaves no task,
committed ones run once, through Celery and through the Django tasks backend."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from conftest import PG_URL, _admin_engine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django_shop" / "run.py"


@pytest.fixture
def shop_database(pg_database_url: str) -> Iterator[str]:
    """A database of its own (the shop's tables have fixed names)."""
    name = f"sqlease_shop_{uuid.uuid4().hex[:8]}"
    admin = _admin_engine()
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.pg
@pytest.mark.timeout(120)
def test_the_shop_on_postgresql(shop_database: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dir", str(tmp_path), "--postgresql", shop_database],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "orders: 0, tasks known to sqlease: 0" in out
    assert out.count("(Django task SUCCESSFUL)") == 5
    assert "OK: the declined order left no task" in out
