"""A task whose delivery budget ran out has a FAILURE result, even if the worker that marked
it dead was killed before writing it: the claim that marks a message dead and the result
write are two steps, so a maintenance pass writes the results such a kill left out."""

from __future__ import annotations

from sqlalchemy import exists, select

from sqlease._core.results import ResultStore
from sqlease._core.store import Store

#: Dead messages looked at per pass; the rest at the next one.
BATCH = 500


def write_missing(store: Store) -> int:
    """FAILURE results (``AttemptsExhausted``) for exhausted messages that have none."""
    m, r = store.tables.messages, store.tables.results
    has_result = exists().where(r.c.key == "celery-task-meta-" + m.c.task_id)
    with store.driver.reading() as conn:
        rows = conn.execute(
            select(m.c.task_id, m.c.attempt)
            .where(
                m.c.state == "dead",
                m.c.reason == "attempts_exhausted",
                m.c.task_id.isnot(None),
                ~has_result,
            )
            .order_by(m.c.id)
            .limit(BATCH)
        ).all()
    results = ResultStore(store)
    return sum(
        1
        for row in rows
        if results.record_final(
            row.task_id, "FAILURE", "AttemptsExhausted", [row.task_id, int(row.attempt)]
        )
    )
