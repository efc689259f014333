"""PostgreSQL's statements: one module per aggregate, its constants in ``dialect.py``."""

from __future__ import annotations

from sqlease._db import sql_common as c
from sqlease._db.postgresql import events, leases, messages, offers, results
from sqlease._db.postgresql.dialect import CAPABILITIES, NOW
from sqlease._db.statements import Statements
from sqlease._db.tables import Tables

__all__ = ["CAPABILITIES", "statements"]


def statements(t: Tables) -> Statements:
    """Every statement for the tables ``t``, built once."""
    return Statements(
        enqueue=messages.enqueue(t),
        enqueue_plain=messages.enqueue_plain(t),
        take=messages.take(t),
        size=c.size(t, NOW),
        purge=c.purge(t, NOW),
        requeue=c.requeue(t, NOW),
        next_due=messages.next_due(t),
        message_get=c.message_get(t),
        now=c.now_query(NOW),
        claim=leases.claim(t, single_queue=False),
        claim_single=leases.claim(t, single_queue=True),
        claim_runs=None,
        rate_take=None,
        ack_claim=leases.ack_claim(t, single_queue=False),
        ack_claim_single=leases.ack_claim(t, single_queue=True),
        renew=leases.renew(t),
        renew_runs=None,
        ack=leases.ack(t),
        release_run=c.release_run(t),
        transition=leases.transition(t),
        hold=leases.hold(t),
        hold_run=c.run_lease(t),
        held_predicate=c.held(NOW),
        offer_and_next_due=offers.offer_and_next_due(t),
        ack_offer=offers.ack_offer(t),
        offer_withdraw=offers.offer_withdraw(t),
        offer_withdraw_all=offers.offer_withdraw_all(t),
        leased_to_owner=offers.leased_to_owner(t),
        task_ensure=c.task_ensure(t, NOW),
        task_cas=c.task_cas(t, NOW),
        task_get=c.task_get(t),
        task_publish=None,
        task_attempts=None,
        event_insert=c.event_insert(t, NOW),
        events_for_task=events.events_for_task(t),
        events_for_message=events.events_for_message(t),
        result_put=results.result_put(t, offer=False),
        result_put_offer=results.result_put(t, offer=True),
        bind=c.bind(t),
        unbind=c.unbind(t),
        bindings_for=c.bindings_for(t),
        declare_queue=c.declare_queue(t, NOW),
        has_queue=c.has_queue(t),
        delete_queue=c.delete_queue(t),
        delete_queue_bindings=c.delete_queue_bindings(t),
        delete_queue_messages=c.delete_queue_messages(t, NOW),
    )
