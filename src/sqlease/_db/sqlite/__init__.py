"""SQLite's statements: one module per aggregate, its constants in ``dialect.py``.

SQLite has no offers, no ack-and-claim statement and no one-statement result write
(``Capabilities``): those fields are None. It has ``claim_runs`` and ``renew_runs``, the run
locks its caller writes after a claim or a renewal."""

from __future__ import annotations

from sqlease._db import sql_common as c
from sqlease._db import task_rows
from sqlease._db.sqlite import events, leases, messages
from sqlease._db.sqlite.dialect import CAPABILITIES, GREATEST, NOW, ROW_PREFIX
from sqlease._db.statements import Statements
from sqlease._db.tables import Tables

__all__ = ["CAPABILITIES", "statements"]


def statements(t: Tables) -> Statements:
    """Every statement for the tables ``t``, built once."""
    enqueue = messages.enqueue(t)
    return Statements(
        enqueue=enqueue,
        enqueue_plain=enqueue,
        take=messages.take(t),
        size=c.size(t, NOW),
        purge=c.purge(t, NOW),
        requeue=c.requeue(t, NOW),
        next_due=messages.next_due(t),
        message_get=c.message_get(t),
        now=c.now_query(NOW),
        claim=leases.claim(t, single_queue=False),
        claim_single=leases.claim(t, single_queue=True),
        claim_runs=leases.claim_runs(t),
        rate_take=leases.rate_take(t),
        ack_claim=None,
        ack_claim_single=None,
        renew=leases.renew(t),
        renew_runs=c.run_lease(t),
        ack=leases.ack(t),
        release_run=c.release_run(t),
        transition=leases.transition(t),
        hold=c.hold(t, NOW, greatest=GREATEST, row_prefix=ROW_PREFIX),
        hold_run=c.run_lease(t),
        held_predicate=c.held(NOW),
        offer_and_next_due=None,
        ack_offer=None,
        offer_withdraw=None,
        offer_withdraw_all=None,
        leased_to_owner=None,
        task_ensure=c.task_ensure(t, NOW),
        task_cas=c.task_cas(t, NOW),
        task_get=c.task_get(t),
        task_publish=task_rows.publish(t, NOW),
        task_attempts=task_rows.attempts(t),
        event_insert=c.event_insert(t, NOW),
        events_for_task=events.events_for_task(t),
        events_for_message=events.events_for_message(t),
        result_put=None,
        result_put_offer=None,
        bind=c.bind(t),
        unbind=c.unbind(t),
        bindings_for=c.bindings_for(t),
        declare_queue=c.declare_queue(t, NOW),
        has_queue=c.has_queue(t),
        delete_queue=c.delete_queue(t),
        delete_queue_bindings=c.delete_queue_bindings(t),
        delete_queue_messages=c.delete_queue_messages(t, NOW),
    )
