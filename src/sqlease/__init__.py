"""sqlease: durable Celery on SQL leases (SQLite embedded, PostgreSQL for many machines).

``import sqlease`` registers the ``sqlease`` Kombu transport, so ``broker_url =
"sqlease+postgresql://…"`` (or ``"sqlease+sqlite:///app.db"``, or ``"sqlease://"``) works, and
makes sqlease apps durable by default (late acks). The public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kombu.transport import TRANSPORT_ALIASES

from sqlease._aliases import ALIASES as _ALIASES
from sqlease._aliases import TARGET as _TARGET

for _alias in _ALIASES:  # "sqlease", and the full schemes for failover (see sqlease._aliases)
    TRANSPORT_ALIASES[_alias] = _TARGET

try:
    from sqlease._celery import defaults as _celery_defaults  # noqa: F401 (connects signals)
    from sqlease._celery import groups as _celery_groups  # noqa: F401 (groups as batches)
except ImportError:  # pragma: no cover - kombu without celery
    pass

__version__ = "0.1.0"

#: The public names, by the module that defines them: the one list. ``__all__`` and the lazy
#: loader are made from it; ``tests/unit/test_public_surface.py`` pins it and checks that the
#: typing imports below name the same things and that docs/reference/python-api.md documents
#: each one. Every name loads on first use, so that importing the package for its transport
#: does not load Admin, the store or the task context.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "errors": (
        "AttemptsExhausted",
        "ConfigurationError",
        "ContextUnavailable",
        "DatabaseReadOnly",
        "DatabaseUnavailable",
        "DuplicateSchedule",
        "InvalidAnswer",
        "InvalidSchedule",
        "InvalidTransition",
        "LeadershipLost",
        "LeaseLost",
        "OutcomeUnknown",
        "PayloadTooLarge",
        "PermissionDenied",
        "SchemaError",
        "SchemaMissing",
        "SchemaVersionMismatch",
        "SqleaseError",
        "UnknownSchedule",
        "UnknownTask",
        "WaitingForPerson",
    ),
    "types": ("CasResult", "Event", "Fence", "Message", "NewMessage", "Outcome", "TaskRecord"),
    "store": ("Store",),
    "admin": ("Admin", "TaskSnapshot"),
    "task_context": ("TaskContext", "context"),
    "transactions": ("transaction",),
    "batches": ("batch",),
}

_LAZY = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(["__version__", *_LAZY])

if TYPE_CHECKING:  # what type checkers see; the same names as _EXPORTS (pinned by a test)
    from sqlease.admin import (
        Admin as Admin,
    )
    from sqlease.admin import (
        TaskSnapshot as TaskSnapshot,
    )
    from sqlease.batches import (
        batch as batch,
    )
    from sqlease.errors import (
        AttemptsExhausted as AttemptsExhausted,
    )
    from sqlease.errors import (
        ConfigurationError as ConfigurationError,
    )
    from sqlease.errors import (
        ContextUnavailable as ContextUnavailable,
    )
    from sqlease.errors import (
        DatabaseReadOnly as DatabaseReadOnly,
    )
    from sqlease.errors import (
        DatabaseUnavailable as DatabaseUnavailable,
    )
    from sqlease.errors import (
        DuplicateSchedule as DuplicateSchedule,
    )
    from sqlease.errors import (
        InvalidAnswer as InvalidAnswer,
    )
    from sqlease.errors import (
        InvalidSchedule as InvalidSchedule,
    )
    from sqlease.errors import (
        InvalidTransition as InvalidTransition,
    )
    from sqlease.errors import (
        LeadershipLost as LeadershipLost,
    )
    from sqlease.errors import (
        LeaseLost as LeaseLost,
    )
    from sqlease.errors import (
        OutcomeUnknown as OutcomeUnknown,
    )
    from sqlease.errors import (
        PayloadTooLarge as PayloadTooLarge,
    )
    from sqlease.errors import (
        PermissionDenied as PermissionDenied,
    )
    from sqlease.errors import (
        SchemaError as SchemaError,
    )
    from sqlease.errors import (
        SchemaMissing as SchemaMissing,
    )
    from sqlease.errors import (
        SchemaVersionMismatch as SchemaVersionMismatch,
    )
    from sqlease.errors import (
        SqleaseError as SqleaseError,
    )
    from sqlease.errors import (
        UnknownSchedule as UnknownSchedule,
    )
    from sqlease.errors import (
        UnknownTask as UnknownTask,
    )
    from sqlease.errors import (
        WaitingForPerson as WaitingForPerson,
    )
    from sqlease.store import (
        Store as Store,
    )
    from sqlease.task_context import (
        TaskContext as TaskContext,
    )
    from sqlease.task_context import (
        context as context,
    )
    from sqlease.transactions import (
        transaction as transaction,
    )
    from sqlease.types import (
        CasResult as CasResult,
    )
    from sqlease.types import (
        Event as Event,
    )
    from sqlease.types import (
        Fence as Fence,
    )
    from sqlease.types import (
        Message as Message,
    )
    from sqlease.types import (
        NewMessage as NewMessage,
    )
    from sqlease.types import (
        Outcome as Outcome,
    )
    from sqlease.types import (
        TaskRecord as TaskRecord,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sqlease' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
