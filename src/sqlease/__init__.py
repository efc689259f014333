"""sqlease: durable Celery on SQL leases (SQLite embedded, PostgreSQL for many machines).

``import sqlease`` registers the ``sqlease`` Kombu transport, so ``broker_url =
"sqlease+postgresql://…"`` (or ``"sqlease+sqlite:///app.db"``, or ``"sqlease://"``) works, and
makes sqlease apps durable by default (late acks). The public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kombu.transport import TRANSPORT_ALIASES

from .aliases import ALIASES as _ALIASES
from .aliases import TARGET as _TARGET

for _alias in _ALIASES:  # "sqlease", and the full schemes for failover (see sqlease.aliases)
    TRANSPORT_ALIASES[_alias] = _TARGET

try:
    from . import celery_defaults as _celery_defaults  # noqa: F401  (registers the hooks)
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
        "InvalidAnswer",
        "InvalidTransition",
        "LeaseLost",
        "OutcomeUnknown",
        "PayloadTooLarge",
        "PermissionDenied",
        "SchemaError",
        "SchemaMissing",
        "SchemaVersionMismatch",
        "SqleaseError",
        "UnknownTask",
        "WaitingForPerson",
    ),
    "types": ("CasResult", "Event", "Fence", "Message", "NewMessage", "Outcome", "TaskRecord"),
    "store": ("Store",),
    "admin": ("Admin", "TaskSnapshot"),
    "task_context": ("TaskContext", "context"),
    "transactions": ("transaction",),
}

_LAZY = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(["__version__", *_LAZY])

if TYPE_CHECKING:  # what type checkers see; the same names as _EXPORTS (pinned by a test)
    from .admin import (
        Admin as Admin,
    )
    from .admin import (
        TaskSnapshot as TaskSnapshot,
    )
    from .errors import (
        AttemptsExhausted as AttemptsExhausted,
    )
    from .errors import (
        ConfigurationError as ConfigurationError,
    )
    from .errors import (
        ContextUnavailable as ContextUnavailable,
    )
    from .errors import (
        DatabaseReadOnly as DatabaseReadOnly,
    )
    from .errors import (
        DatabaseUnavailable as DatabaseUnavailable,
    )
    from .errors import (
        InvalidAnswer as InvalidAnswer,
    )
    from .errors import (
        InvalidTransition as InvalidTransition,
    )
    from .errors import (
        LeaseLost as LeaseLost,
    )
    from .errors import (
        OutcomeUnknown as OutcomeUnknown,
    )
    from .errors import (
        PayloadTooLarge as PayloadTooLarge,
    )
    from .errors import (
        PermissionDenied as PermissionDenied,
    )
    from .errors import (
        SchemaError as SchemaError,
    )
    from .errors import (
        SchemaMissing as SchemaMissing,
    )
    from .errors import (
        SchemaVersionMismatch as SchemaVersionMismatch,
    )
    from .errors import (
        SqleaseError as SqleaseError,
    )
    from .errors import (
        UnknownTask as UnknownTask,
    )
    from .errors import (
        WaitingForPerson as WaitingForPerson,
    )
    from .store import (
        Store as Store,
    )
    from .task_context import (
        TaskContext as TaskContext,
    )
    from .task_context import (
        context as context,
    )
    from .transactions import (
        transaction as transaction,
    )
    from .types import (
        CasResult as CasResult,
    )
    from .types import (
        Event as Event,
    )
    from .types import (
        Fence as Fence,
    )
    from .types import (
        Message as Message,
    )
    from .types import (
        NewMessage as NewMessage,
    )
    from .types import (
        Outcome as Outcome,
    )
    from .types import (
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
