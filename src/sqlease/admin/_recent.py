"""The recent tasks, finished ones included, newest first, from the task records: what
``sqlease tasks`` lists with no filter, a page at a time.

A page is a keyset read on ``tasks_created_ix`` (``created_at_ms`` descending, the task id
breaking ties), never an OFFSET: the page after a cursor costs the same at the millionth task
as at the first. Each page then reads, in one statement each, its tasks' latest messages,
their results, and the deliveries the events of the tasks without a message record. A task
with neither message nor result was delivered and acked (its events count a delivery:
without a result backend the ack is all that is known, as ``Admin.task`` says), or purged
(its latest end), or purged before any delivery (no attempt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import or_, select

from sqlease._db.rows import row_to_message
from sqlease.errors import ConfigurationError
from sqlease.types import Message

if TYPE_CHECKING:
    from sqlease._core.timeline import Delivered
    from sqlease._db.tables import Tables
    from sqlease.store import Store


def parse_cursor(cursor: str) -> tuple[int, str]:
    """``CREATED_MS:TASK_ID`` (what a page's ``next_cursor`` says)."""
    created, _, task_id = cursor.partition(":")
    if not created.isdigit() or not task_id:
        raise ConfigurationError(
            f"not a page cursor: {cursor!r}; pass the one a page printed (CREATED_MS:TASK_ID)"
        )
    return int(created), task_id


@dataclass
class Page:
    """One page of task records, and what their states are derived from."""

    rows: list[Any] = field(default_factory=list)
    #: each task's latest message
    messages: dict[str, Message] = field(default_factory=dict)
    #: each task's result row (task_id, state, updated_at_ms)
    results: dict[str, Any] = field(default_factory=dict)
    #: what the events of each task without a message say of its deliveries
    delivered: dict[str, Delivered] = field(default_factory=dict)


def read_page(
    store: Store,
    tables: Tables,
    limit: int,
    before: str | None,
    *,
    queue: str | None = None,
    name: str | None = None,
    run_id: str | None = None,
    task_id: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> Page:
    """Up to ``limit`` task records older than the cursor ``before``, newest first.

    The filters are columns of the task record. A time range narrows the index range itself;
    queue, name and run id are checked on the records the range walks, so a rare value costs
    the records walked past to find a page (docs/performance.md has the figures)."""
    k, m, r = tables.tasks, tables.messages, tables.results
    query = select(k).order_by(k.c.created_at_ms.desc(), k.c.task_id.desc()).limit(limit)
    for column, value in (("queue", queue), ("task_name", name), ("run_id", run_id)):
        if value is not None:
            query = query.where(k.c[column] == value)
    if task_id is not None:
        query = query.where(k.c.task_id == task_id)
    if since_ms is not None:
        query = query.where(k.c.created_at_ms >= since_ms)
    if until_ms is not None:
        query = query.where(k.c.created_at_ms < until_ms)
    if before is not None:
        created, task_id = parse_cursor(before)
        # ``created <= c`` first: a range on the index the planner takes (an OR alone made
        # it scan from the newest row, 113 ms for the last page of a million on PostgreSQL).
        query = query.where(
            k.c.created_at_ms <= created,
            or_(k.c.created_at_ms < created, k.c.task_id < task_id),
        )
    page = Page()
    with store.driver.reading() as conn:
        page.rows = list(conn.execute(query).fetchall())
        ids = [row.task_id for row in page.rows]
        if not ids:
            return page
        page.messages = {
            row.task_id: row_to_message(row)
            for row in conn.execute(select(m).where(m.c.task_id.in_(ids)).order_by(m.c.id))
        }  # the latest message of each task wins
        page.results = {
            row.task_id: row
            for row in conn.execute(
                select(r.c.task_id, r.c.state, r.c.updated_at_ms).where(r.c.task_id.in_(ids))
            )
        }
        # A finished task's deliveries are in its events (the claims write no task row).
        gone = [task_id for task_id in ids if task_id not in page.messages]
        page.delivered = store.timeline.delivered_on(conn, gone)
    return page
