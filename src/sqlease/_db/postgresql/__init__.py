"""PostgreSQL: its statements (one module per aggregate, its constants in ``dialect.py``), its
driver (``driver.py``, the operations, and ``lease_ops.py``, the lease operations it inherits)
and what the driver runs on (``direct.py``, the lanes; ``engine.py``; ``listener.py``;
``pooler.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause

from sqlease._db import sql_common as c
from sqlease._db import topology_sql
from sqlease._db.held_tables import parked_gates, stuck_runs
from sqlease._db.leaders import leader_statements
from sqlease._db.postgresql import (
    events,
    gates,
    held,
    leases,
    lost_claims,
    messages,
    offers,
    plain_claims,
    results,
)
from sqlease._db.postgresql.dialect import GREATEST, NOW
from sqlease._db.statements import Statements
from sqlease._db.tables import Tables
from sqlease._db.unique_sql import unique_statements

__all__ = ["PgStatements", "statements"]


@dataclass(frozen=True)
class PgStatements(Statements):
    """Every statement of the PostgreSQL driver: the hot operations are one statement each."""

    #: Publish one message, handing it to an idle worker's offer when one stands.
    enqueue: TextClause
    #: Publish without the handoff lookup: inside a caller's transaction (the offer's row
    #: would stay locked until it ends), and for a message no offer could take.
    enqueue_plain: TextClause
    #: Publish a batch's plain messages in one statement (``message_publish_batch``).
    enqueue_batch: TextClause
    #: Delete and return ready messages (consumers that never ack).
    take: TextClause
    claim: TextClause
    claim_single: TextClause
    #: The acks and the refill claim in one statement.
    ack_claim: TextClause
    ack_claim_single: TextClause
    #: The same for queues whose messages nothing holds back (sqlease._db.postgresql.plain_claims).
    claim_plain: TextClause
    claim_plain_single: TextClause
    ack_claim_plain: TextClause
    ack_claim_plain_single: TextClause
    #: Acks of deliveries outside any run: without the runs' promotion in the plan.
    ack_outside_runs: TextClause
    ack_outside_runs_claim: TextClause
    ack_outside_runs_claim_single: TextClause
    ack_outside_runs_claim_plain: TextClause
    ack_outside_runs_claim_plain_single: TextClause
    renew: TextClause
    ack: TextClause
    #: Release, park or fail fenced deliveries.
    transition: TextClause
    #: Release what claims whose answers were lost leased (sqlease._db.postgresql.lost_claims).
    release_lost: TextClause
    offer_and_next_due: TextClause
    ack_offer: TextClause
    #: The same when every ack is of a delivery outside any run.
    ack_outside_runs_offer: TextClause
    offer_withdraw: TextClause
    offer_withdraw_all: TextClause
    result_put: TextClause
    result_put_offer: TextClause
    #: The runs' order rows, then their heads made ready if parked (``run_promote``).
    bump_runs: TextClause
    promote_runs: TextClause
    #: A sweep's park of the messages at a full gate, and a gate's promotion.
    park_gates: TextClause
    promote_gates: TextClause
    #: A sweep's due times for the messages a rate limit holds, and their release.
    project_rates: TextClause
    release_rates: TextClause


def statements(t: Tables) -> PgStatements:
    """Every statement for the tables ``t``, built once."""
    return PgStatements(
        size=c.size(t, NOW),
        purge=c.purge(t, NOW),
        requeue=c.requeue(t, NOW),
        next_due=messages.next_due(t),
        message_get=c.message_get(t),
        published_since=c.published_since(t, NOW),
        leased_to_owner=c.leased_to_owner(t),
        now=c.now_query(NOW),
        lease_check=leases.lease_check(t),
        run_lease=c.run_lease(t),
        release_run=c.release_run(t),
        held_predicate=c.held(NOW),
        task_ensure=c.task_ensure(t, NOW),
        task_cas=c.task_cas(t, NOW),
        task_get=c.task_get(t),
        event_insert=c.event_insert(t, NOW),
        events_for_task=events.events_for_task(t),
        events_for_message=events.events_for_message(t),
        deliveries_of_tasks=events.deliveries_of_tasks(t),
        bind=topology_sql.bind(t),
        unbind=topology_sql.unbind(t),
        bindings_for=topology_sql.bindings_for(t),
        declare_exchange=topology_sql.declare_exchange(t),
        exchange_type=topology_sql.exchange_type(t),
        delete_exchange=topology_sql.delete_exchange(t),
        delete_exchange_bindings=topology_sql.delete_exchange_bindings(t),
        declare_queue=topology_sql.declare_queue(t, NOW),
        has_queue=topology_sql.has_queue(t),
        delete_queue=topology_sql.delete_queue(t),
        delete_queue_bindings=topology_sql.delete_queue_bindings(t),
        delete_queue_messages=topology_sql.delete_queue_messages(t, NOW),
        stuck_runs=stuck_runs(t.messages.name),
        parked_gates=parked_gates(t.messages.name),
        gates_of=gates.gates_of(t),
        # Two publishes of one new key both insert; the key's row lock decides.
        unique=unique_statements(t, row_locks=True),
        leaders=leader_statements(t, NOW, GREATEST),
        enqueue=messages.enqueue(t),
        enqueue_plain=messages.enqueue_plain(t),
        enqueue_batch=messages.enqueue_batch(t),
        take=messages.take(t),
        claim=leases.claim(t, single_queue=False),
        claim_single=leases.claim(t, single_queue=True),
        ack_claim=leases.ack_claim(t, single_queue=False),
        ack_claim_single=leases.ack_claim(t, single_queue=True),
        claim_plain=plain_claims.claim(t, single_queue=False),
        claim_plain_single=plain_claims.claim(t, single_queue=True),
        ack_claim_plain=plain_claims.ack_claim(t, single_queue=False),
        ack_claim_plain_single=plain_claims.ack_claim(t, single_queue=True),
        ack_outside_runs=leases.ack_outside_runs(t),
        ack_outside_runs_claim=leases.ack_outside_runs_claim(t, single_queue=False),
        ack_outside_runs_claim_single=leases.ack_outside_runs_claim(t, single_queue=True),
        ack_outside_runs_claim_plain=plain_claims.ack_outside_runs_claim(t, single_queue=False),
        ack_outside_runs_claim_plain_single=plain_claims.ack_outside_runs_claim(
            t, single_queue=True
        ),
        renew=leases.renew(t),
        ack=leases.ack(t),
        transition=leases.transition(t),
        release_lost=lost_claims.release_lost(t),
        offer_and_next_due=offers.offer_and_next_due(t),
        ack_offer=offers.ack_offer(t),
        ack_outside_runs_offer=offers.ack_outside_runs_offer(t),
        offer_withdraw=offers.offer_withdraw(t),
        offer_withdraw_all=offers.offer_withdraw_all(t),
        result_put=results.result_put(t, offer=False),
        result_put_offer=results.result_put(t, offer=True),
        bump_runs=held.bump_runs(t),
        promote_runs=held.promote_runs(t),
        park_gates=gates.park(t),
        promote_gates=gates.promote(t),
        project_rates=gates.project_rates(t),
        release_rates=gates.release_rates(t),
    )
