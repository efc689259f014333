"""Renders every statement the lease store runs, per dialect, as plain text.

The snapshot in ``sql_snapshot.json`` beside this file is what the code produced when it was
last reviewed; ``test_sql_snapshot.py`` compares the two, so a change that moves or splits the
statements provably leaves their SQL alone. Regenerate on purpose with
``python tests/unit/sql_snapshot.py --write`` and review the diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import TextClause
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

SNAPSHOT = Path(__file__).with_name("sql_snapshot.json")
DIALECTS = {"postgresql": postgresql.dialect(), "sqlite": sqlite.dialect()}
PREFIX = "sqlease_"


def _statements(name: str) -> dict[str, str | None]:
    from sqlease._db.dialects import statements_for
    from sqlease._db.tables import build_tables

    sql = statements_for(name, build_tables(PREFIX))
    rendered: dict[str, str | None] = {}
    for attr, value in sorted(vars(sql).items()):
        if isinstance(value, TextClause):
            rendered[attr] = value.text
        elif isinstance(value, str):  # a fragment other statements are built from
            rendered[f"fragment {attr}"] = value
        elif value is None:
            rendered[attr] = None
    for attr, value in sorted(vars(sql.leaders).items()):
        rendered[f"leader {attr}"] = value.text
    for attr, value in sorted(vars(sql.unique).items()):
        rendered[f"unique {attr}"] = value.text
    from sqlease._db.schedules import schedule_statements

    for attr, value in sorted(vars(schedule_statements(build_tables(PREFIX))).items()):
        rendered[f"schedule {attr}"] = value.text
    from sqlease._db.dialects import schedule_fires_for

    fires = schedule_fires_for(name, build_tables(PREFIX), "schedule:", f"{PREFIX}wakeup")
    for attr, value in sorted(fires.statements().items()):
        rendered[f"schedule fires {attr}"] = value.text
    return rendered


def _ddl(name: str) -> dict[str, str]:
    from sqlease._db.tables import build_tables

    tables = build_tables(PREFIX)
    dialect = DIALECTS[name]
    out: dict[str, str] = {}
    for table in tables.metadata.sorted_tables:
        out[f"table {table.name}"] = str(CreateTable(table).compile(dialect=dialect)).strip()
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            out[f"index {index.name}"] = str(CreateIndex(index).compile(dialect=dialect)).strip()
    return out


def render() -> dict[str, Any]:
    return {name: {"statements": _statements(name), "schema": _ddl(name)} for name in DIALECTS}


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SNAPSHOT.write_text(json.dumps(render(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
    else:
        print(json.dumps(render(), indent=1, sort_keys=True))
