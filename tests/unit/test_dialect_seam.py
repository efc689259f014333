"""Guard: only the database layer (``sqlease._db``) tells the dialects apart.

Everything above it asks the driver (``store.driver``) or a dialect's capabilities
(``sqlease._db.dialects.capabilities_of``). This reads every module outside ``_db`` for the
ways code tests a dialect: a dialect's name compared, ``get_backend_name()``, ``is_postgresql``
read, or a dialect's own SQLAlchemy constructs imported.
"""

from __future__ import annotations

import re
from pathlib import Path

import sqlease

ROOT = Path(sqlease.__file__).parent

PATTERNS = {
    "a dialect's name compared": re.compile(r"""[=!]=\s*["'](postgresql|sqlite)["']"""),
    "get_backend_name()": re.compile(r"\.get_backend_name\(\)"),
    "is_postgresql read": re.compile(r"\.is_postgresql\b"),
    "a dialect's constructs imported": re.compile(r"sqlalchemy\.dialects\.(postgresql|sqlite)"),
    "a dialect's waker built": re.compile(r"\b(PostgresListener|SqliteWatcher)\("),
}
#: Where a module must know the dialects, and why.
ALLOWED = {
    # parsing a URL: which schemes exist is what it checks, before any driver exists
    ("urls.py", "get_backend_name()"),
    ("urls.py", "a dialect's name compared"),
    # the facade's documented property, answered by the driver
    ("_core/store.py", "is_postgresql read"),
}


def test_no_module_above_the_database_layer_tests_the_dialect() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("_db/"):
            continue
        text = path.read_text()
        for what, pattern in PATTERNS.items():
            if pattern.search(text) and (relative, what) not in ALLOWED:
                found.append(f"{relative}: {what}")
    assert not found, "\n".join(found)


def test_the_guard_finds_what_it_looks_for() -> None:
    sample = 'if url.get_backend_name() == "sqlite" or store.is_postgresql: PostgresListener(u)'
    hits = [what for what, pattern in PATTERNS.items() if pattern.search(sample)]
    assert len(hits) == 4
