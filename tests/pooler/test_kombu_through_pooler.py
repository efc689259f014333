"""Kombu's own integration cases (tests/transport/test_kombu.py, modelled on Kombu's
``t/integration``) through the real PgBouncer in transaction mode: the same test functions,
with the database URL pointing at the pooler (``?pooler=transaction``, wake-ups by polling)."""

from __future__ import annotations

import pytest

from transport import test_kombu
from transport.conftest import (  # noqa: F401  (the cases' fixtures)
    broker_url,
    conn,
    connect,
    db_store,
    table_prefix,
    transport_options,
)

from .conftest import Bouncer

pytestmark = [pytest.mark.pg, pytest.mark.slow]

#: The cases that mirror Kombu's own integration suite (``t/integration/common.py``): the
#: rest of test_kombu.py is about URLs, options, decoding and LISTEN wake-ups, which a pooler
#: does not change or cannot have (wake-ups poll behind it). Kept short: the pooler tests'
#: budget is about a minute.
KOMBU_CASES = (
    "test_connect_close_and_reconnect",
    "test_publish_consume_ack",
    "test_consuming_an_empty_queue_times_out",
    "test_simple_queue_put_get_qsize_clear",
    "test_simple_buffer_is_no_ack",
    "test_basic_get_leases_until_ack",
    "test_basic_get_no_ack_deletes_on_fetch",
    "test_requeued_message_is_redelivered_with_the_next_attempt",
    "test_reject_without_requeue_keeps_the_row_dead",
    "test_closing_a_connection_releases_unacked_messages_at_once",
    "test_a_stale_ack_changes_nothing",
    "test_higher_priority_first_then_fifo",
    "test_one_consumer_several_queues",
    "test_direct_exchange_routes_by_routing_key",
    "test_topic_exchange_with_bindings_from_another_connection",
    "test_fanout_delivers_one_copy_to_each_bound_queue",
    "test_unbinding_stops_delivery",
    "test_queue_delete_removes_queue_bindings_and_ready_messages",
    "test_purge_removes_ready_messages_and_leaves_leased_ones",
    "test_no_ack_consumer_deletes_on_fetch",
    "test_eta_in_the_past_is_delivered_at_once",
    "test_messages_of_one_run_are_never_delivered_concurrently",
)


@pytest.fixture
def db_url(bouncer: Bouncer) -> str:
    return bouncer.url()


for _name in KOMBU_CASES:
    globals()[_name] = getattr(test_kombu, _name)
