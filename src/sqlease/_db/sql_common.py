"""The statements and fragments whose text is the same on both dialects.

Where a dialect's own fragment goes into the text (its clock ``now``, its ``greatest``), the
builder takes it as a parameter; each dialect's ``dialect.py`` holds its values.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db.tables import Tables

#: The message columns a claim or a take returns, in order.
SELECT_COLS = (
    "id, queue, payload, priority, available_at_ms, created_at_ms, run_id, task_id, state, "
    "reason, lease_owner, lease_expires_at_ms, attempt, max_attempts"
)
#: The columns of a new message, in the order of ``insert_values``.
INSERT_COLS = (
    "queue, payload, priority, available_at_ms, created_at_ms, run_id, task_id, "
    "state, attempt, max_attempts, task_name, gate_key, gate_limit"
)
EVENT_COLS = "id, task_id, message_id, attempt, kind, data, at_ms"
#: Delivery order.
ORDER = "ORDER BY m.priority DESC, m.available_at_ms, m.id"
#: One queue (a Celery worker's usual case): plain equality, so PostgreSQL reads the claim
#: index in delivery order and stops at LIMIT instead of sorting the backlog.
QUEUE_EQ = "m.queue = :queue"


#: The flow-control values of a new message, in the order of ``INSERT_COLS``' last three.
INSERT_FLOW = "CAST(:task_name AS TEXT), CAST(:gate_key AS TEXT), CAST(:gate_limit AS INTEGER)"


# ---- flow control ------------------------------------------------------------------------


def gate_joins(t: Tables) -> str:
    """The configured limits of a message ``m``: its key's (``kl``, rates), its task
    name's (``tl``) and its queue's (``ql``)."""
    fl = t.flow_limits.name
    return (
        f"LEFT JOIN {fl} kl ON kl.name = 'key:' || m.gate_key "
        f"LEFT JOIN {fl} tl ON tl.name = 'task:' || m.task_name "
        f"LEFT JOIN {fl} ql ON ql.name = 'queue:' || m.queue"
    )


#: The one concurrency gate a claim of ``m`` goes through (with ``gate_joins``): its own
#: concurrency key, else its task name's limit, else its queue's; NULL when none applies.
GATE = (
    "CASE WHEN m.gate_key IS NOT NULL THEN 'key:' || m.gate_key "
    "WHEN tl.concurrency IS NOT NULL THEN tl.name "
    "WHEN ql.concurrency IS NOT NULL THEN ql.name END"
)
GATE_LIMIT = (
    "CASE WHEN m.gate_key IS NOT NULL THEN m.gate_limit "
    "WHEN tl.concurrency IS NOT NULL THEN tl.concurrency ELSE ql.concurrency END"
)


def _rate_case(column: str) -> str:
    return (
        f"CASE WHEN kl.interval_ms IS NOT NULL THEN kl.{column} "
        f"WHEN tl.interval_ms IS NOT NULL THEN tl.{column} "
        f"WHEN ql.interval_ms IS NOT NULL THEN ql.{column} END"
    )


#: The one rate limit a claim of ``m`` goes through: its key's, else its task name's, else
#: its queue's; with its interval, burst tolerance and theoretical arrival time.
RATE = _rate_case("name")
RATE_INTERVAL = _rate_case("interval_ms")
RATE_TAU = _rate_case("tau_ms")
RATE_TAT = _rate_case("tat_ms")


def rate_open(now: str, prefix: str = "g.") -> str:
    """The candidate's rate limit lets one more delivery through now (GCRA: the next
    theoretical arrival, less the burst tolerance, is not in the future)."""
    return f"({prefix}rate IS NULL OR COALESCE({prefix}tat, 0) - {prefix}tau <= {now})"


def rate_allowed(now: str, prefix: str, greatest: str) -> str:
    """How many deliveries the rate limit lets through now, for a candidate whose
    ``rate_open`` holds (the numerator is then >= 0, so integer division floors)."""
    return (
        f"(({now} + {prefix}tau - {greatest}(COALESCE({prefix}tat, 0), {now})) / {prefix}ivl + 1)"
    )


def rate_due(t: Tables, now: str) -> str:
    """When the next rate limit lets a delivery through again, if any is closed now: an
    idle worker wakes then instead of waiting for its safety poll (at most one empty claim
    when nothing waits for that limit)."""
    return (
        f"(SELECT min(r.tat_ms - r.tau_ms) FROM {t.flow_limits.name} r "
        f"WHERE r.interval_ms IS NOT NULL AND r.tat_ms - r.tau_ms > {now})"
    )


def next_priority(t: Tables, queue: str, below: str | None = None) -> str:
    """A scalar subquery: the highest priority among the ready rows of ``queue`` (an SQL
    expression), below ``below`` if given; NULL when there is none. One probe of the claim
    index: the step of a skip scan over the priorities."""
    under = "" if below is None else f" AND m.priority < {below}"
    return (
        f"(SELECT m.priority FROM {t.messages.name} m WHERE m.state = 'ready' "
        f"AND m.queue = {queue}{under} ORDER BY m.priority DESC LIMIT 1)"
    )


def ready_priorities(t: Tables, queue: str) -> str:
    """The distinct priorities of the ready rows of ``queue`` (an SQL expression), highest
    first, as a parenthesized subquery of one column ``pr``: a skip scan of the claim index,
    one probe per priority."""
    return (
        f"(WITH RECURSIVE p(pr) AS (SELECT {next_priority(t, queue)} "
        f"UNION ALL SELECT {next_priority(t, queue, 'p.pr')} FROM p WHERE p.pr IS NOT NULL) "
        "SELECT pr FROM p WHERE pr IS NOT NULL)"
    )


def next_due_at(t: Tables, queue_names: str, now: str) -> str:
    """The soonest ``available_at_ms`` after ``now`` among the ready messages of the queues
    ``queue_names`` (a SELECT of distinct names as ``q``), as a scalar subquery, NULL if
    none. A skip scan of the claim index (queue, priority DESC, available_at_ms): per queue,
    one probe per distinct priority for the next one, one for its soonest due time. A
    range condition on ``available_at_ms`` behind the unbounded priority read every ready
    row of the queue instead: 128 ms with 100,000 delayed messages on PostgreSQL, and this
    runs on every idle look and every ack that leaves a worker idle."""
    m = t.messages.name
    return (
        "(WITH RECURSIVE p(q, pr) AS ("
        f"SELECT u.q, {next_priority(t, 'u.q')} FROM ({queue_names}) u "
        f"UNION ALL SELECT p.q, {next_priority(t, 'p.q', 'p.pr')} "
        "FROM p WHERE p.pr IS NOT NULL) "
        f"SELECT min((SELECT m.available_at_ms FROM {m} m WHERE m.state = 'ready' "
        f"AND m.queue = p.q AND m.priority = p.pr AND m.available_at_ms > {now} "
        "ORDER BY m.available_at_ms LIMIT 1)) FROM p WHERE p.pr IS NOT NULL)"
    )


def gate_open(running: str, prefix: str = "g.") -> str:
    """A candidate may be claimed as far as its gate goes: no gate, or fewer live leases
    under it than its limit (``running``: the dialect's count for the gate ``<prefix>gate``).
    Checked while the candidates are read, so a full gate is skipped and never blocks the
    rows behind it."""
    return f"({prefix}gate IS NULL OR {running} < {prefix}lim)"


# ---- fragments ---------------------------------------------------------------------------


def insert_values(now: str, state: str = "'ready'") -> str:
    """The values of ``INSERT_COLS``; ``state``: the new message's (an SQL expression)."""
    return (
        f":queue, :payload, :priority, {now} + :delay_ms, {now}, :run_id, :task_id, "
        f"{state}, 0, :max_attempts, {INSERT_FLOW}"
    )


def returning(prefix: str) -> str:
    """``RETURNING`` the ``SELECT_COLS``; ``prefix`` qualifies them (``"m."``; SQLite's
    RETURNING takes bare column names)."""
    return "RETURNING " + ", ".join(prefix + c for c in SELECT_COLS.split(", "))


def held(now: str) -> str:
    """A message is held while it is ready, leased to ``:owner`` and the lease has not expired
    by the database's clock (the attempt is checked by the caller's fence)."""
    return f"m.state = 'ready' AND m.lease_owner = :owner AND m.lease_expires_at_ms > {now}"


def fenced_join(now: str) -> str:
    """A message ``m`` matched to its fence ``f``, if still held.

    The fences drive the join: one primary-key probe per fence. (A further
    ``m.id = ANY(:ids)`` made PostgreSQL scan the index for all ids and then rescan the
    unnested fences for every row: 0.41 against 0.15 ms for an ack of 32.)"""
    return f"m.id = f.id AND m.attempt = f.attempt AND {held(now)}"


def ready(t: Tables, now: str, queue: str) -> str:
    """Claimable in ``queue`` (a predicate on ``m.queue``): available now, not leased (or the
    lease expired), and either without a run or the head of its run (its lowest unfinished
    message), which keeps a run in order."""
    return (
        f"m.state = 'ready' AND {queue} AND m.available_at_ms <= {now} "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {now}) "
        f"AND (m.run_id IS NULL OR m.id = (SELECT min(h.id) FROM {t.messages.name} h "
        "WHERE h.run_id = m.run_id AND h.state IN ('ready', 'parked')))"
    )


def run_free(t: Tables, now: str) -> str:
    """No other message of ``m``'s run holds the run's lease."""
    return (
        f"NOT EXISTS (SELECT 1 FROM {t.runs.name} r WHERE r.run_id = m.run_id "
        f"AND r.lease_expires_at_ms > {now} AND r.message_id <> m.id)"
    )


def take_ready(now: str, queue: str) -> str:
    """Takeable without an ack in ``queue``: due, unleased, outside any run."""
    return (
        f"m.state = 'ready' AND {queue} AND m.available_at_ms <= {now} "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {now}) "
        "AND m.run_id IS NULL"
    )


def unleased(now: str) -> str:
    return f"(lease_expires_at_ms IS NULL OR lease_expires_at_ms <= {now})"


def transition_set(now: str) -> str:
    """The SET list of a release, park or fail: lease cleared, optionally delayed;
    ``:refund`` gives the delivery back to the attempt budget (the message was never started,
    e.g. warm shutdown)."""
    return (
        "lease_owner = NULL, lease_expires_at_ms = NULL, "
        f"available_at_ms = CASE WHEN :delay_ms > 0 THEN {now} + :delay_ms "
        "ELSE available_at_ms END, "
        "max_attempts = max_attempts + :refund, "
        "state = CAST(:new_state AS TEXT), reason = CAST(:reason AS TEXT), "
        "last_error = COALESCE(CAST(:error AS TEXT), last_error)"
    )


# ---- messages ----------------------------------------------------------------------------


def take(t: Tables, taken: str) -> TextClause:
    """Delete and return the messages the predicate ``taken`` (on ``id``) selects."""
    return text(f"DELETE FROM {t.messages.name} WHERE {taken} RETURNING {SELECT_COLS}")


def size(t: Tables, now: str) -> TextClause:
    """The queued messages of ``:queue``: due and not leased, and those held back that count
    as queued (parked behind their run or at their gate, or given a rate's turn as their due
    time: sqlease._db.held_tables), as a broker's ready count has them."""
    m = t.messages.name
    return text(
        f"SELECT (SELECT count(*) FROM {m} WHERE state = 'ready' AND queue = :queue "
        f"AND (available_at_ms <= {now} OR reason = 'rate') AND {unleased(now)}) + "
        f"(SELECT count(*) FROM {m} WHERE state = 'parked' AND queue = :queue "
        "AND reason IN ('run', 'gate'))"
    )


def purge(t: Tables, now: str) -> TextClause:
    """Ready (due, unleased) messages only, as RabbitMQ purges its ready messages: a
    scheduled message (eta, countdown, retry) is, there, already held by a worker."""
    return text(
        f"DELETE FROM {t.messages.name} WHERE state = 'ready' AND queue = :queue "
        f"AND {unleased(now)} AND available_at_ms <= {now} "
        "RETURNING id, task_id, attempt, run_id"
    )


def requeue(t: Tables, now: str) -> TextClause:
    return text(
        f"UPDATE {t.messages.name} SET state = 'ready', reason = NULL, lease_owner = NULL, "
        f"lease_expires_at_ms = NULL, available_at_ms = {now} + :delay_ms, "
        "max_attempts = attempt + :budget "
        "WHERE id = :message_id AND state IN ('parked', 'dead') "
        "RETURNING id, task_id, attempt"
    )


def message_get(t: Tables) -> TextClause:
    return text(f"SELECT {SELECT_COLS}, last_error FROM {t.messages.name} WHERE id = :id")


def published_since(t: Tables, now: str) -> TextClause:
    """The id of a message of ``:task_id`` with ``:payload`` to ``:queue`` published in the last
    ``:window_ms`` (a publish whose commit answer was lost looks for its own first try
    before it tries again): still stored with that payload, or gone since (delivered and
    acked, purged) with its ``enqueued`` event left. Either way through a task id index."""
    since = f"{now} - :window_ms"
    return text(
        f"SELECT e.message_id AS id FROM {t.events.name} e "
        f"LEFT JOIN {t.messages.name} m ON m.id = e.message_id "
        f"WHERE e.task_id = :task_id AND e.kind = 'enqueued' AND e.at_ms >= {since} "
        "AND (m.id IS NULL OR (m.payload = :payload AND m.queue = :queue)) "
        f"UNION ALL SELECT id FROM {t.messages.name} WHERE task_id = :task_id "
        f"AND created_at_ms >= {since} AND payload = :payload AND queue = :queue "
        "LIMIT 1"
    )


def leased_to_owner(t: Tables) -> TextClause:
    return text(
        f"SELECT id, attempt FROM {t.messages.name} WHERE lease_owner = :owner AND state = 'ready'"
    )


def now_query(now: str) -> TextClause:
    return text(f"SELECT {now}")


# ---- leases ------------------------------------------------------------------------------


def lease_check(t: Tables, now: str, *, greatest: str, row_prefix: str) -> TextClause:
    """Locks and renews the message row of a fence (so no takeover can interleave) before a
    compare-and-set writes the task row. ``row_prefix`` as in ``returning``."""
    q = row_prefix
    return text(
        f"UPDATE {t.messages.name} AS m SET lease_expires_at_ms = "
        f"{greatest}(m.lease_expires_at_ms, {now} + :lease_ms) "
        f"WHERE m.id = :message_id AND m.attempt = :attempt AND {held(now)} "
        "AND (CAST(:task_id AS TEXT) IS NULL OR m.task_id IS NULL "
        "OR m.task_id = CAST(:task_id AS TEXT)) "
        f"RETURNING {q}id, {q}lease_expires_at_ms, {q}run_id"
    )


def run_lease(t: Tables) -> TextClause:
    """A run's lock follows its message's new lease expiry."""
    return text(
        f"UPDATE {t.runs.name} SET lease_expires_at_ms = :lease_expires_at_ms "
        "WHERE run_id = :run_id AND message_id = :message_id"
    )


def release_run(t: Tables) -> TextClause:
    return text(f"DELETE FROM {t.runs.name} WHERE run_id = :run_id AND message_id = :message_id")


# ---- tasks -------------------------------------------------------------------------------


def task_ensure(t: Tables, now: str) -> TextClause:
    return text(
        f"INSERT INTO {t.tasks.name} (task_id, state, checkpoint, revision, run_id, "
        f"created_at_ms, updated_at_ms) VALUES (:task_id, NULL, '{{}}', 0, :run_id, "
        f"{now}, {now}) ON CONFLICT (task_id) DO NOTHING"
    )


def task_cas(t: Tables, now: str) -> TextClause:
    """Writes the task row only at the expected revision."""
    return text(
        f"UPDATE {t.tasks.name} SET state = COALESCE(CAST(:state AS TEXT), state), "
        "reason = CASE WHEN CAST(:state AS TEXT) IS NULL THEN reason "
        "ELSE CAST(:reason AS TEXT) END, "
        "checkpoint = COALESCE(CAST(:checkpoint AS TEXT), checkpoint), "
        "revision = revision + 1, "
        f"updated_at_ms = {now} WHERE task_id = :task_id AND revision = :expected "
        "RETURNING revision"
    )


def task_get(t: Tables) -> TextClause:
    return text(
        f"SELECT task_id, state, reason, checkpoint, revision, run_id, created_at_ms, "
        f"updated_at_ms FROM {t.tasks.name} WHERE task_id = :task_id"
    )


# ---- events ------------------------------------------------------------------------------


def event_insert(t: Tables, now: str) -> TextClause:
    return text(
        f"INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"VALUES (:task_id, :message_id, :attempt, :kind, CAST(:data AS TEXT), {now})"
    )
