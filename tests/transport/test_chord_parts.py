"""Recognising a chord part in a message as sqlease stores it (sqlease._core.chord_parts)."""

from __future__ import annotations

import json
from pathlib import Path

from celery import Celery, chord, group
from sqlalchemy import select

import sqlease  # noqa: F401  (registers the transport)
from sqlease import Store
from sqlease._core.chord_parts import chord_count_of


def published(tmp_path: Path, build: str) -> list[str]:
    """The payloads Celery publishes through sqlease (SQLite, no worker) for a canvas."""
    url = f"sqlite:///{tmp_path / 'parts.db'}"
    app = Celery("parts", broker=f"sqlease+{url}", backend=f"sqlease+{url}", set_as_current=False)

    @app.task(name="p.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="p.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    if build == "chord":
        chord([add.s(1, 1), add.s(2, 2)], tsum.s()).apply_async()
    elif build == "group":
        group([add.s(1, 1), add.s(2, 2)]).apply_async()
    else:
        add.delay(1, 1)
    store = Store(url)
    messages = store.tables.messages
    with store.engine.connect() as conn:
        return list(conn.execute(select(messages.c.payload).order_by(messages.c.id)).scalars())


def test_a_chord_part_names_its_chords_counter_and_its_task(tmp_path: Path) -> None:
    payloads = published(tmp_path, "chord")
    assert len(payloads) == 2
    found = [chord_count_of(p) for p in payloads]
    headers = [json.loads(p)["headers"] for p in payloads]
    assert found == [(f"chord-unlock-{h['group']}", h["id"]) for h in headers]


def test_a_plain_group_member_or_task_is_not_a_chord_part(tmp_path: Path) -> None:
    assert [chord_count_of(p) for p in published(tmp_path, "group")] == [None, None]
    (tmp_path / "task").mkdir()
    assert [chord_count_of(p) for p in published(tmp_path / "task", "task")] == [None]


def test_unreadable_payloads_are_not_chord_parts() -> None:
    envelope = {
        "headers": {"group": "g", "id": "t"},
        "content-type": "application/json",
        "properties": {"body_encoding": "base64"},
    }
    for body in ("not base64 !", "bm90IGpzb24=", None):
        assert chord_count_of(json.dumps({**envelope, "body": body})) is None
    assert chord_count_of("{") is None
    assert chord_count_of(json.dumps({**envelope, "content-type": "application/x-pickle"})) is None
