"""PostgreSQL's engines: psycopg 3 through SQLAlchemy's pool (a restarted server is survived
by discarding the pool on the first disconnect error), sessions set up for short lease
transactions (``idle_in_transaction_session_timeout`` as a backstop: no stalled worker can
hold a row lock that blocks a takeover), connections whose waits end with the lease of the
call (sqlease._db.postgresql.bounded) and whose TCP settings notice a dead network within the
lease (``keepalive_args``), and a connection left in an unknown state by a terminated server
connection behind a pooler taken as lost (``desynced``)."""

from __future__ import annotations

import logging
import os
import selectors
import sys
from typing import Any

import psycopg
import psycopg.waiting
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine

from sqlease._db.postgresql import bounded, pooler
from sqlease.errors import ConfigurationError

logger = logging.getLogger("sqlease")

#: How long a session of sqlease's may sit idle inside a transaction: the lease, within these
#: bounds (milliseconds; see session_options).
IDLE_IN_TRANSACTION_MS = (1_000, 60_000)


def session_options(lease_ms: int) -> str:
    """Startup settings of sqlease's PostgreSQL sessions for a store whose leases last
    ``lease_ms`` (see connect_args for why)."""
    low, high = IDLE_IN_TRANSACTION_MS
    idle = min(high, max(low, int(lease_ms)))
    return f"-c idle_in_transaction_session_timeout={idle} -c jit=off"


#: Added for the hot path's engine (generic_plans=True).
GENERIC_PLANS_OPTION = "-c plan_cache_mode=force_generic_plan"
#: Added for the lease traffic's engine (wait_for_flush=False).
NO_FLUSH_WAIT_OPTION = "-c synchronous_commit=off"

#: Seconds a connection attempt may take (libpq's connect_timeout) unless the URL says.
CONNECT_TIMEOUT_S = 10


#: The lease the engines' TCP settings follow, in milliseconds, unless a store says (the default
#: ``lease_seconds``).
DEFAULT_LEASE_MS = 60_000
#: The startup settings at the default lease.
SESSION_OPTIONS = session_options(DEFAULT_LEASE_MS)
#: libpq's TCP settings that sqlease sets from the lease, unless the URL sets them itself.
KEEPALIVE_PARAMS = (
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)


def green_waits() -> None:
    """psycopg chooses how to wait on its sockets when it is imported: its C function unless
    gevent had patched ``select`` by then. Under eventlet's patching (Celery's eventlet pool),
    or gevent's made after psycopg's import, that wait blocks every green thread of the
    process, so an eventlet worker hung at its first query. Its own ``select`` wait, which the
    patch makes green, is taken there instead (and the selector its connects wait on), unless
    ``PSYCOPG_WAIT_FUNC`` chose the wait. Called at import and at each engine's creation."""
    if "PSYCOPG_WAIT_FUNC" in os.environ or not _select_patched():
        return
    waiting: Any = psycopg.waiting
    if getattr(waiting, "wait_c", None) is not None and waiting.wait is waiting.wait_c:
        waiting.wait = waiting.wait_select
    if getattr(waiting, "DefaultSelector", None) is not selectors.DefaultSelector:
        waiting.DefaultSelector = selectors.DefaultSelector


def _select_patched() -> bool:
    """Whether gevent or eventlet has monkey-patched ``select``."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("select"):
        return True
    patcher = sys.modules.get("eventlet.patcher")
    return patcher is not None and bool(patcher.is_monkey_patched("select"))


green_waits()

#: pg_stat_activity's application_name of sqlease's connections, unless the URL names one.
APPLICATION_NAME = "sqlease"


def application_name(url: URL) -> str:
    """The URL's ``application_name``, else sqlease's."""
    value = url.query.get("application_name")
    if isinstance(value, tuple):
        value = value[-1]
    return value or APPLICATION_NAME


#: Linux's largest values of the TCP socket options libpq sets from these parameters.
KERNEL_MOST = {
    "keepalives_idle": 32_767,
    "keepalives_interval": 32_767,
    "keepalives_count": 127,
    "tcp_user_timeout": 2**31 - 1,
}


def keepalive_args(url: URL, lease_ms: int = DEFAULT_LEASE_MS) -> dict[str, Any]:
    """libpq's TCP settings for a connection of a store whose leases last ``lease_ms``: the
    kernel gives up on a connection whose peer stopped answering within about a lease, rather
    than after its own timeout (about 15 minutes of retransmissions on Linux), so a worker cut
    off from its database reconnects instead of waiting. Each one the URL sets itself is left
    to it (checked: a whole number of at least 0)."""
    lease_s = max(1, lease_ms // 1000)
    wanted: dict[str, Any] = {
        "keepalives": 1,
        # Probes start after a third of the lease without traffic, and three unanswered ones
        # a ninth of the lease apart end it: about two thirds of a lease of silence.
        "keepalives_idle": max(1, lease_s // 3),
        "keepalives_interval": max(1, lease_s // 9),
        "keepalives_count": 3,
        # Data sent and not acknowledged for a whole lease ends the connection (Linux; it
        # also caps the probes above). Milliseconds.
        "tcp_user_timeout": max(1, int(lease_ms)),
    }
    # Past the kernel's largest, the socket option fails and so does every connection (a
    # lease over 27 hours): the largest is used then, and a URL's own value is checked.
    for name, most in KERNEL_MOST.items():
        wanted[name] = min(wanted[name], most)
    for name in KEEPALIVE_PARAMS:
        given = url.query.get(name)
        if given is None:
            continue
        value = given[-1] if isinstance(given, tuple) else given
        if not str(value).strip().isdigit():
            raise ConfigurationError(
                f"URL parameter {name!r} must be a whole number of at least 0, not {value!r}"
            )
        if name in KERNEL_MOST and int(str(value).strip()) > KERNEL_MOST[name]:
            raise ConfigurationError(
                f"URL parameter {name!r} must be at most {KERNEL_MOST[name]} (the kernel's "
                f"largest), not {value!r}"
            )
        del wanted[name]
    return wanted


def connect_args(
    url: URL,
    *,
    generic_plans: bool = False,
    wait_for_flush: bool = True,
    lease_ms: int = DEFAULT_LEASE_MS,
) -> dict[str, Any]:
    """What sqlease adds to a PostgreSQL URL's connection parameters. The URL's own
    ``options`` (say ``-c search_path=app``) are kept, after sqlease's so that they win;
    its ``connect_timeout`` and TCP settings are kept too."""
    clean, pooling = pooler.split(url)
    query = clean.query
    own = query.get("options")
    if isinstance(own, tuple):  # given more than once
        own = " ".join(own)
    # A worker stopped (SIGSTOP) or cut off mid-transaction must not hold locks for long: a
    # row it locked (a message it was checkpointing, say) is skipped by every other
    # worker's claim until the server ends that transaction, whatever its lease says. So a
    # transaction left idle for a lease ends (at most 60 s): none of sqlease's waits between
    # its statements, and a worker stalled that long has lost its leases by its own clock
    # (a checkpoint's renewal in such a transaction would have expired before its commit).
    # No JIT: the claim is a short OLTP statement whose estimated cost can cross
    # jit_above_cost on a large backlog, and compiling it costs more than running it.
    session = session_options(lease_ms)
    if generic_plans:
        # The hot path's engine (direct lanes: enqueue, claim, ack, result writes). psycopg
        # prepares a statement a connection runs five times, but on `auto` PostgreSQL kept
        # re-planning the claim and ack for each call (their generic plan's estimate looks
        # dearer than the custom one), and planning cost as much server time as running
        # them: one process claiming and acking batches of 32 went from 5,400 to 10,600
        # tasks/s, server CPU per task from 112 to 57 us. Those statements are written so
        # that their plan does not depend on the values. The mode applies to every
        # statement with parameters, so the rest of sqlease (admin, maintenance, reads, the
        # idle worker's offer) keeps `auto` on its own engine: a generic plan for, say,
        # "the next due time after now" scanned the whole table.
        session = f"{session} {GENERIC_PLANS_OPTION}"
    if not wait_for_flush:
        # The lease traffic's engine (claims and acks, see Store): a commit that returns
        # before its WAL is flushed can only be lost with the server itself (a crash of
        # PostgreSQL or of its machine), never with a worker. A lost claim leaves its message
        # ready again, a lost ack leaves it leased until its lease expires: redelivered
        # either way, never lost (the task, under its new attempt, finds any result it
        # stored: guarantees.md, invariant 9). Any later commit that waits for the flush
        # (every publish, result, checkpoint and step) makes the earlier ones durable with
        # it, since the WAL is flushed in order. Publishes, results and the task context
        # keep waiting.
        session = f"{session} {NO_FLUSH_WAIT_OPTION}"
    # Behind a pooler in transaction mode no startup options go out (see pooler.py); the
    # URL's own options are the user's business and go out as given.
    args: dict[str, Any] = {
        # The URL's own application_name wins (psycopg would otherwise get ours over it):
        # pg_stat_activity then tells one deployment's connections from another's.
        "application_name": application_name(clean),
        **pooler.connect_args(pooling, session if not own else f"{session} {own}"),
    }
    if pooling.transaction and own:
        args["options"] = own
    if "connect_timeout" not in query:
        # Without it, a host that drops packets holds each attempt for the kernel's TCP
        # timeout (minutes), and Kombu's connect_timeout and failover never get their turn.
        args["connect_timeout"] = CONNECT_TIMEOUT_S
    args.update(keepalive_args(clean, lease_ms))
    return args


def desynced(error: BaseException) -> bool:
    """psycopg got more than one result for a command it sent on its own (``BEGIN``,
    ``COMMIT``): the other belongs to nothing sent, typically the server's FATAL message as
    its connection was terminated, passed on by a pooler (PgBouncer, ``pg_terminate_backend``
    of the server connection a transaction runs on). The connection's state is unknown: it is
    dropped as after a disconnect, and the operation, safe to repeat, is retried."""
    return isinstance(error, psycopg.InternalError) and "results from command" in str(error)


def create(url: URL, options: dict[str, Any]) -> Engine:
    green_waits()  # again: eventlet may have patched since this module was imported
    clean, pooling = pooler.split(url)
    # ?pool_size= / ?max_overflow= cap every engine of the URL (docs/howto/operations.md,
    # "Connections").
    pool_size, max_overflow = pooler.pool_limits(url)
    engine = create_engine(
        clean,
        poolclass=bounded.BoundedQueuePool,
        pool_size=pool_size,
        max_overflow=max_overflow,
        # No pre-ping: it costs a round trip per operation. A connection broken by a server
        # restart raises a disconnect error once, SQLAlchemy then drops the whole pool, and
        # Kombu/Celery retry the operation as a connection error.
        pool_pre_ping=False,
        pool_recycle=3600,
        connect_args=connect_args(
            url,
            generic_plans=options["generic_plans"],
            wait_for_flush=options["wait_for_flush"],
            lease_ms=int(options.get("lease_ms") or DEFAULT_LEASE_MS),
        ),
    )

    @event.listens_for(engine, "handle_error")
    def _desynced(context: Any) -> None:
        if desynced(context.original_exception):
            context.is_disconnect = True  # dropped, and the operation retried (_db.retry)

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        # Every connection of the pool is a BoundedConnection (see bounded.py).
        return bounded.connect(*cargs, **cparams)

    if pooling.transaction:
        where = clean.render_as_string(hide_password=True)

        @event.listens_for(engine, "first_connect")
        def _check(dbapi_connection: Any, _record: Any) -> None:
            pooler.check_settings(dbapi_connection, where)

    return engine


def warn_if_jit(engine: Engine) -> None:
    """An engine passed in (not made by sqlease, so without ``jit=off`` in its sessions):
    a warning if its sessions compile queries (JIT), saying how to turn it off.
    On a large backlog the claim's estimated cost crosses ``jit_above_cost`` and compiling it
    takes longer than running it (90 ms against 0.6 ms for a claim of 32 over 20,000 queued,
    measured)."""
    try:
        with engine.connect() as conn:
            value = str(conn.exec_driver_sql("SHOW jit").scalar())
    except Exception:  # unreachable now: the first statement will say so
        return
    if value != "on":
        return
    logger.warning(
        "sqlease: the engine passed in (%s) runs its sessions with jit = on: a claim over a "
        "large backlog then costs tens of milliseconds of JIT compilation. Connect with "
        "connect_args={'options': '-c jit=off'}, or ALTER ROLE <role> SET jit = off",
        engine.url.render_as_string(hide_password=True),
    )


def forget(engine: Engine) -> None:
    """Nothing of PostgreSQL's outlives its engine's pool."""
