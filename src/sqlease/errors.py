"""The errors sqlease raises, as one tree so callers can catch everything with one class.

::

    SqleaseError
    ├── ConfigurationError (also ValueError)   bad URL or option, raised at construction
    ├── SchemaError
    │   ├── SchemaMissing                      tables absent and auto_migrate is off
    │   └── SchemaVersionMismatch              the database was migrated by a newer sqlease
    ├── DatabaseUnavailable                    the database cannot be reached (transient)
    ├── DatabaseReadOnly                       the database refuses writes (read-only file)
    ├── PermissionDenied                       the database role lacks a privilege
    ├── PayloadTooLarge (also ValueError)      a message body over the configured limit
    ├── LeaseLost (also celery Ignore)         a fenced write found the lease gone
    ├── WaitingForPerson (also celery Ignore)  the task parked itself until a person answers
    ├── OutcomeUnknown                         a durable step started but never recorded finishing
    ├── AttemptsExhausted                      the result of a task failed attempts_exhausted
    ├── ContextUnavailable (also RuntimeError) sqlease.context() outside a sqlease delivery
    ├── UnknownTask (also LookupError)         Admin: no task with that id
    ├── InvalidTransition (also ValueError)    Admin: the task's state does not allow the action
    ├── InvalidAnswer (also ValueError)        an answer does not match what the task asked for
    ├── InvalidSchedule (also ValueError)      a periodic task entry is wrong (``field`` says where)
    │   └── DuplicateSchedule                  an entry with that name exists already
    ├── UnknownSchedule (also LookupError)     no periodic task entry with that name
    └── LeadershipLost                         a beat's leader lease is gone: its write was refused

``LeaseLost`` and ``WaitingForPerson`` are control signals, not failures: a task lets them
propagate and Celery records nothing. Every class keeps its constructor's arguments as
``args``, so it survives pickling (prefork pool) and Celery's JSON exception round trip, and
stored results name it as ``sqlease.errors.<Name>``.
"""

from __future__ import annotations

from celery.exceptions import Ignore


class SqleaseError(Exception):
    """Base class of every error sqlease raises on purpose."""


class ConfigurationError(SqleaseError, ValueError):
    """A URL or an option is wrong. The message names the option and what was expected."""


class SchemaError(SqleaseError):
    """The database schema is not the one this version of sqlease works with."""


class SchemaMissing(SchemaError):
    """sqlease's tables are absent and ``auto_migrate`` is off."""


class SchemaVersionMismatch(SchemaError):
    """The database schema is newer than this code: upgrade sqlease before using it."""

    def __init__(self, found: int, expected: int) -> None:
        # args are the constructor's arguments, so the error survives pickling (prefork
        # pool) and Celery's JSON exception round trip.
        super().__init__(found, expected)
        self.found = found
        self.expected = expected

    def __str__(self) -> str:
        return (
            f"database schema version {self.found} is newer than this sqlease understands "
            f"(version {self.expected}); upgrade the sqlease package on this machine"
        )


class DatabaseUnavailable(SqleaseError):
    """The database could not be reached; the operation may be retried."""


class DatabaseReadOnly(SqleaseError):
    """The database refuses writes (a read-only SQLite file or mount, a read-only replica).
    Not retried: nothing can be delivered or acked until it is writable again."""


class PermissionDenied(SqleaseError):
    """The database role lacks a privilege sqlease needs (docs/explanation/reliability.md lists
    the grants a worker role needs)."""


class PayloadTooLarge(SqleaseError, ValueError):
    """A message body is larger than ``max_payload_bytes``; it was not enqueued."""


class LeaseLost(SqleaseError, Ignore):  # type: ignore[misc]
    """This delivery no longer holds its lease: another worker took the task over, or it
    was paused or cancelled. A control signal, not a task failure: stop work, write nothing.

    It is a Celery ``Ignore``, so a task that lets it propagate is neither recorded as failed
    nor retried; its (stale) ack is refused, and the delivery that holds the lease carries on.
    """

    def __init__(self, message_id: int, attempt: int, detail: str = "") -> None:
        super().__init__(message_id, attempt, detail)
        self.message_id = message_id
        self.attempt = attempt
        self.detail = detail

    def __str__(self) -> str:
        text = f"lease lost for message {self.message_id} attempt {self.attempt}"
        return f"{text}: {self.detail}" if self.detail else text


class OutcomeUnknown(SqleaseError):
    """A durable step started in an earlier delivery and never recorded an outcome, so it
    may or may not have had its side effect. Declare the step idempotent to run it again."""

    def __init__(self, task_id: str, step: str) -> None:
        super().__init__(task_id, step)
        self.task_id = task_id
        self.step = step

    def __str__(self) -> str:
        return (
            f"step {self.step!r} of task {self.task_id} started in an earlier attempt and its "
            "outcome is unknown; resolve it by hand or declare the step idempotent"
        )


class AttemptsExhausted(SqleaseError):
    """The task was delivered ``max_attempts`` times without finishing (each time its worker
    died or lost the lease); it is kept as failed and can be requeued."""

    def __init__(self, task_id: str, attempts: int) -> None:
        super().__init__(task_id, attempts)
        self.task_id = task_id
        self.attempts = attempts

    def __str__(self) -> str:
        return (
            f"task {self.task_id} was delivered {self.attempts} times without finishing "
            "(attempts_exhausted); requeue it with 'sqlease requeue'"
        )


class ContextUnavailable(SqleaseError, RuntimeError):
    """``sqlease.context()`` was called outside a task delivered by sqlease."""


class WaitingForPerson(SqleaseError, Ignore):  # type: ignore[misc]
    """The task parked itself until a person answers; this delivery ends here (not a
    failure). Let it propagate."""

    def __init__(self, task_id: str, kind: str, key: str) -> None:
        super().__init__(task_id, kind, key)
        self.task_id = task_id
        self.kind = kind
        self.key = key

    def __str__(self) -> str:
        return f"task {self.task_id} is waiting for {self.kind} ({self.key!r})"


class UnknownTask(SqleaseError, LookupError):
    """No task with that id is known to the store."""


class InvalidTransition(SqleaseError, ValueError):
    """The task is not in a state that allows the operation (the message says which)."""


class InvalidAnswer(SqleaseError, ValueError):
    """An answer does not match what the task asked for."""


class InvalidSchedule(SqleaseError, ValueError):
    """A periodic task entry is wrong; ``field`` names what (``schedule``, ``task``, ...)."""

    def __init__(self, name: str, field: str, problem: str) -> None:
        super().__init__(name, field, problem)
        self.name = name
        self.field = field
        self.problem = problem

    def __str__(self) -> str:
        return f"periodic task {self.name!r}: {self.field}: {self.problem}"


class DuplicateSchedule(InvalidSchedule):
    """An entry with that name exists already."""

    def __init__(self, name: str, field: str = "name", problem: str = "") -> None:
        super().__init__(name, field, problem or "an entry with this name exists already")


class UnknownSchedule(SqleaseError, LookupError):
    """No periodic task entry with that name."""


class LeadershipLost(SqleaseError):
    """A beat's leader lease expired or was taken over: the write it fenced was refused."""
