"""sqlease: durable Celery on SQL leases (SQLite embedded, PostgreSQL for many machines)."""

from __future__ import annotations

from .errors import (
    ConfigurationError,
    ContextUnavailable,
    DatabaseUnavailable,
    LeaseLost,
    OutcomeUnknown,
    PayloadTooLarge,
    SchemaError,
    SchemaMissing,
    SchemaVersionMismatch,
    SqleaseError,
)
from .store import CasResult, Event, Fence, Message, NewMessage, Outcome, Store, TaskRecord

__version__ = "0.1.0"

__all__ = [
    "CasResult",
    "ConfigurationError",
    "ContextUnavailable",
    "DatabaseUnavailable",
    "Event",
    "Fence",
    "LeaseLost",
    "Message",
    "NewMessage",
    "Outcome",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "SchemaError",
    "SchemaMissing",
    "SchemaVersionMismatch",
    "SqleaseError",
    "Store",
    "TaskRecord",
    "__version__",
]
