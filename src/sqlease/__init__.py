"""sqlease: durable Celery on SQL leases (SQLite embedded, PostgreSQL for many machines).

``import sqlease`` registers the ``sqlease`` Kombu transport, so ``broker_url =
"sqlease+postgresql://…"`` (or ``"sqlease+sqlite:///app.db"``, or ``"sqlease://"``) works, and
makes sqlease apps durable by default (late acks). Heavier names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kombu.transport import TRANSPORT_ALIASES

from .aliases import ALIASES as _ALIASES
from .aliases import TARGET as _TARGET
from .errors import (
    ConfigurationError,
    ContextUnavailable,
    DatabaseReadOnly,
    DatabaseUnavailable,
    LeaseLost,
    OutcomeUnknown,
    PayloadTooLarge,
    PermissionDenied,
    SchemaError,
    SchemaMissing,
    SchemaVersionMismatch,
    SqleaseError,
)

for _alias in _ALIASES:  # "sqlease", and the full schemes for failover (see sqlease.aliases)
    TRANSPORT_ALIASES[_alias] = _TARGET

try:
    from . import celery_defaults as _celery_defaults  # noqa: F401  (registers the hooks)
except ImportError:  # pragma: no cover - kombu without celery
    pass

if TYPE_CHECKING:
    from .admin import Admin, InvalidTransition, TaskSnapshot, UnknownTask
    from .store import CasResult, Event, Fence, Message, NewMessage, Outcome, Store, TaskRecord
    from .task_context import TaskContext, context
    from .transactions import transaction
    from .waiting import InvalidAnswer, WaitingForPerson

__version__ = "0.1.0"

_LAZY = {
    "Admin": "admin",
    "TaskSnapshot": "admin",
    "UnknownTask": "admin",
    "InvalidTransition": "admin",
    "WaitingForPerson": "waiting",
    "InvalidAnswer": "waiting",
    "CasResult": "store",
    "Event": "store",
    "Fence": "store",
    "Message": "store",
    "NewMessage": "store",
    "Outcome": "store",
    "Store": "store",
    "TaskRecord": "store",
    "transaction": "transactions",
    "context": "task_context",
    "TaskContext": "task_context",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sqlease' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Admin",
    "CasResult",
    "ConfigurationError",
    "ContextUnavailable",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "Event",
    "Fence",
    "InvalidAnswer",
    "InvalidTransition",
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
    "UnknownTask",
    "WaitingForPerson",
    "__version__",
    "context",
    "transaction",
]
