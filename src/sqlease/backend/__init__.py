"""Celery result backend ``sqlease+<SQLAlchemy URL>`` (loaded through the
``celery.result_backends`` entry point: no import needed).

Results live in ``<prefix>results`` as Celery's key/value records, so Celery's own logic gives
``result_extended``, groups, custom states and ``update_state``; chords are native (an atomic
SQL counter, no ``chord_unlock`` polling). When broker and backend share one database, a result
written from inside a sqlease delivery is fenced by that delivery's lease in the same
transaction: a worker that lost its lease can neither store a result nor advance a chord, and
the new holder's result stands. ``AsyncResult.get()`` wakes on NOTIFY on PostgreSQL and watches
the file on SQLite, instead of sleeping between polls.
"""

from __future__ import annotations

from sqlease.backend._backend import SqleaseBackend

__all__ = ["SqleaseBackend"]

# Documented, shown and pickled under its public path.
SqleaseBackend.__module__ = __name__
