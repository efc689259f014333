"""Guard: only the dialect packages (``sqlease._db.postgresql``, ``sqlease._db.sqlite``) know
a dialect; ``sqlease._db.dialects`` is the one place that chooses between them.

By imports, as Python sees them: every module's ``ast`` is walked (module level, inside
functions and under ``TYPE_CHECKING`` alike), and no module outside a dialect package may
import one, or a dialect's own driver (psycopg, sqlite3) or SQLAlchemy constructs, except the
registry. Also by text, for what an import does not show: a dialect's name compared or read
off a URL outside ``sqlease._db``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sqlease

ROOT = Path(sqlease.__file__).parent

#: What only a dialect package may import, and the package it belongs to.
DIALECT_ONLY = {
    "sqlease._db.postgresql": "_db/postgresql/",
    "sqlease._db.sqlite": "_db/sqlite/",
    "psycopg": "_db/postgresql/",
    "sqlalchemy.dialects.postgresql": "_db/postgresql/",
    "sqlite3": "_db/sqlite/",
    "sqlalchemy.dialects.sqlite": "_db/sqlite/",
}
#: The registry imports each dialect's entry.
REGISTRY = "_db/dialects.py"

NAME_PATTERNS = {
    "a dialect's name compared": re.compile(r"""[=!]=\s*["'](postgresql|sqlite)["']"""),
    "get_backend_name()": re.compile(r"\.get_backend_name\(\)"),
}
#: Where a module outside ``sqlease._db`` must know a dialect's name, and why.
ALLOWED_NAMES = {
    # parsing a URL: which schemes exist is what it checks, before any driver exists
    ("urls.py", "get_backend_name()"),
    ("urls.py", "a dialect's name compared"),
    # the facade's documented property (Store.is_postgresql), answered from the driver
    ("_core/store.py", "a dialect's name compared"),
}


def _imported(tree: ast.AST, package: list[str]) -> set[str]:
    """Every module name an import names (relative ones resolved against ``package``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _dialect_imports(relative: str, path: Path) -> list[str]:
    parts = ["sqlease", *Path(relative).with_suffix("").parts]
    package = parts if path.name == "__init__.py" else parts[:-1]
    wrong = []
    for name in sorted(_imported(ast.parse(path.read_text()), package)):
        for forbidden, home in DIALECT_ONLY.items():
            named = name == forbidden or name.startswith(forbidden + ".")
            if named and not relative.startswith(home) and relative != REGISTRY:
                wrong.append(f"{relative} imports {name}")
    return wrong


def test_only_the_dialect_packages_import_a_dialect() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        wrong += _dialect_imports(path.relative_to(ROOT).as_posix(), path)
    assert not wrong, "\n".join(wrong)


def test_no_module_above_the_database_layer_names_a_dialect() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("_db/"):
            continue
        text = path.read_text()
        for what, pattern in NAME_PATTERNS.items():
            if pattern.search(text) and (relative, what) not in ALLOWED_NAMES:
                found.append(f"{relative}: {what}")
    assert not found, "\n".join(found)


def test_the_guard_sees_every_kind_of_import(tmp_path: Path) -> None:
    # A lazy import, one under TYPE_CHECKING, a relative one and a plain one are all seen.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import sqlite3\n"
        "if TYPE_CHECKING:\n"
        "    from sqlease._db.postgresql.direct import DirectLane\n"
        "def f():\n"
        "    from .._db.sqlite import direct\n"
        "    from sqlalchemy.dialects.postgresql import insert\n"
    )
    wrong = _dialect_imports("transport/sample.py", sample)
    assert wrong == [
        "transport/sample.py imports sqlalchemy.dialects.postgresql",
        "transport/sample.py imports sqlalchemy.dialects.postgresql.insert",
        "transport/sample.py imports sqlease._db.postgresql.direct",
        "transport/sample.py imports sqlease._db.postgresql.direct.DirectLane",
        "transport/sample.py imports sqlease._db.sqlite",
        "transport/sample.py imports sqlease._db.sqlite.direct",
        "transport/sample.py imports sqlite3",
    ]
    # A dialect's own package may.
    assert _dialect_imports("_db/sqlite/sample.py", sample) != []  # not PostgreSQL's
    sample.write_text("import sqlite3\nfrom . import direct\n")
    assert _dialect_imports("_db/sqlite/sample.py", sample) == []
