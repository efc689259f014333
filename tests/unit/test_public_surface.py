"""Guard: the public surface is exactly the documented one.

``sqlease.__all__`` is made from one list in ``sqlease/__init__.py`` (``_EXPORTS``); this test
pins it, checks that each name resolves to the module the list says, and that the typing-only
imports name the same things. (That every public name is documented is checked by
``test_docs.py``.)
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import sqlease

INIT = Path(sqlease.__file__)

PUBLIC = [
    "Admin",
    "AttemptsExhausted",
    "CasResult",
    "ConfigurationError",
    "ContextUnavailable",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "DuplicateSchedule",
    "Event",
    "Fence",
    "InvalidAnswer",
    "InvalidSchedule",
    "InvalidTransition",
    "LeadershipLost",
    "LeaseLost",
    "Message",
    "NewMessage",
    "Outcome",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "PermissionDenied",
    "SchemaError",
    "SchemaMissing",
    "SchemaVersionMismatch",
    "SqleaseError",
    "Store",
    "TaskContext",
    "TaskRecord",
    "TaskSnapshot",
    "UnknownSchedule",
    "UnknownTask",
    "WaitingForPerson",
    "__version__",
    "batch",
    "context",
    "transaction",
]


def test_all_is_exactly_the_public_names() -> None:
    assert sqlease.__all__ == PUBLIC


def test_each_name_resolves_to_the_module_that_defines_it() -> None:
    for module, names in sqlease._EXPORTS.items():
        defining = importlib.import_module(f"sqlease.{module}")
        for name in names:
            value = getattr(sqlease, name)
            assert value is getattr(defining, name), name
            assert getattr(value, "__module__", None) == f"sqlease.{module}", name


def test_star_import_gives_the_public_names() -> None:
    namespace: dict[str, object] = {}
    exec("from sqlease import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(PUBLIC)


def test_unknown_names_raise_attribute_error() -> None:
    try:
        sqlease.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("sqlease.NoSuchThing resolved")


def _typing_imports() -> dict[str, set[str]]:
    tree = ast.parse(INIT.read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
                assert stmt.module is not None
                names = found.setdefault(stmt.module.removeprefix("sqlease."), set())
                for alias in stmt.names:
                    assert alias.asname == alias.name, "re-export as the same name"
                    names.add(alias.name)
    return found


def test_typing_imports_match_the_list() -> None:
    assert _typing_imports() == {m: set(n) for m, n in sqlease._EXPORTS.items()}
