"""Guard: every statement's SQL text, per dialect, equals the reviewed snapshot.

Moving or splitting the statement builders must not change one character of SQL. A change
that means to change SQL regenerates the snapshot (``python tests/unit/sql_snapshot.py
--write``) and shows the difference in its diff.
"""

from __future__ import annotations

import json

import pytest

from .sql_snapshot import DIALECTS, SNAPSHOT, render


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, dict[str, str | None]]]:
    return render()


@pytest.fixture(scope="module")
def snapshot() -> dict[str, dict[str, dict[str, str | None]]]:
    return json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("part", ["statements", "schema"])
def test_sql_text_is_unchanged(dialect: str, part: str, rendered, snapshot) -> None:
    now, then = rendered[dialect][part], snapshot[dialect][part]
    assert sorted(now) == sorted(then), "statements added or removed"
    changed = [name for name in now if now[name] != then[name]]
    assert not changed, f"{dialect} SQL changed: {changed}"


def test_the_snapshot_covers_the_hot_statements(snapshot) -> None:
    # A snapshot that lost its statements would pass vacuously.
    pg = snapshot["postgresql"]["statements"]
    for name in ("claim", "claim_single", "ack", "renew", "enqueue", "ack_claim", "transition"):
        assert pg[name], name
    assert len(pg) > 40
